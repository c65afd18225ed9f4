"""A new speculative algorithm is a worker plus one registry line: a toy drafter, defined and
registered here without touching any engine file, serves through the scheduler, eagerly and
through emulated CUDA graphs, and is lossless.

The toy ("repeat the last token") proposes ``N - 1`` copies of the seed token and verifies them
with the shared chain verify (:mod:`sglang.srt.rounds.chain_verify`). Its drafts are
deterministic, so sampled rows are verified against a one-hot draft distribution; greedy output
must equal plain decoding token for token. On the bundled code model repeated tokens (indents,
closing brackets) are accepted often enough that rounds commit more than one token.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import pytest
import torch

from engine_test_utils import make_scheduler, request, submit_staggered, take_token_ids
from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.rounds import registry
from sglang.srt.rounds.chain_verify import chain_pending_round, verify_chain
from sglang.srt.rounds.contract import BaseSpecWorker, SpecRequirements
from sglang.srt.rounds.plain import GenerationBatchResult, TpModelWorker
from sglang.srt.rounds.relay import PendingRound
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

MODEL = str(BUNDLED_MODEL_DIR)
WIDTH = 3  # chain positions per round: the seed and two copies of it
KW = dict(max_total_tokens=4096, max_running_requests=4)

pytestmark = pytest.mark.usefixtures("two_torch_threads")


class RepeatWorker(BaseSpecWorker):
    """Drafts ``WIDTH - 1`` copies of the last committed token; shares the target's relay."""

    @classmethod
    def requirements(cls, server_args: Any, target_config: Any) -> SpecRequirements:
        # One round in flight past a request's end, as NEXTN: two chains of slack.
        return SpecRequirements(kda_scratch_depth=WIDTH, position_headroom=2 * WIDTH,
                                token_headroom=2 * WIDTH, draft_extra_mla_layers=False)

    def __init__(self, server_args: Any, target_worker: TpModelWorker,
                 requirements: SpecRequirements):
        self.target = target_worker
        self.runner = target_worker.model_runner
        self.device = target_worker.device
        self.future_map = target_worker.future_map  # tokens = seed, seq_lens = committed

    round_tokens = WIDTH
    proposed_per_round = WIDTH - 1

    def prefill(self, forward_batch: ForwardBatch, sampling_info: Optional[SamplingBatchInfo],
                sample_rows: Optional[Sequence[int]] = None, return_logprob: bool = False,
                top_logprobs_nums: Optional[Sequence[int]] = None,
                next_prompt_tokens: Optional[Sequence[int]] = None) -> GenerationBatchResult:
        """Nothing to draft from the prompt: the target's prefill fills the shared relay."""
        return self.target.prefill(forward_batch, sampling_info, sample_rows, return_logprob,
                                   top_logprobs_nums)

    def graph_setup(self) -> dict:
        return dict(tokens_per_request=WIDTH, backends=[self.runner.attn_backend],
                    runners=[self.runner])

    def round_phases(self) -> List[Any]:
        return [self._verify_phase]

    def _verify_phase(self, prev: Dict[str, torch.Tensor], slots: torch.Tensor,
                      loc: torch.Tensor, info: SamplingBatchInfo, bound: int,
                      return_logprob: bool) -> Dict[str, torch.Tensor]:
        prefix, seed = self.future_map.assign_round(self.runner.req_to_token_pool.req_to_token,
                                                    slots, loc, with_tokens=True)
        chain = seed.unsqueeze(1).repeat(1, WIDTH)
        v = verify_chain(self.runner, self.future_map, chain, prefix, slots, loc, info, bound,
                         return_logprob)
        out = {"accept_len": v.verdict.accept_len, "tokens": v.verdict.accepted_tokens}
        if v.lp_source is not None:
            out["lp_source"] = v.lp_source
        return out

    def pending_round(self, out: Dict[str, torch.Tensor], loc: torch.Tensor,
                      return_logprob: bool, top_logprobs_num: int,
                      on_current_stream: bool = False) -> PendingRound:
        return chain_pending_round(out, loc, return_logprob, top_logprobs_num,
                                   self.runner.model_config.vocab_size, on_current_stream)


@pytest.fixture(scope="module", autouse=True)
def repeat_algorithm():
    """Register the toy for this module only."""
    registry.register_algorithm(registry.Algorithm("REPEAT", f"{__name__}:RepeatWorker"))
    yield
    del registry.ALGORITHMS["REPEAT"]


def _prompts(tokenizer) -> List[List[int]]:
    texts = ["def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n",
             "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
             "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
             "import os\nimport sys\n\n\ndef main():\n    args = sys.argv[1:]\n"]
    return [tokenizer.encode(t) for t in texts]


def _run(sched, prompts: List[List[int]], n: int, stagger: int = 0, **sp: Any):
    reqs = [request(f"r{i}", p, max_new_tokens=n, ignore_eos=True, **sp)
            for i, p in enumerate(prompts)]
    submit_staggered(sched, reqs, stagger)
    return take_token_ids(sched)


def test_registered_toy_is_lossless_eager_and_in_emulated_graphs():
    plain = make_scheduler(MODEL, **KW)
    prompts = _prompts(plain.tokenizer)
    want = _run(plain, prompts, 40, stagger=2, temperature=0)
    eager = make_scheduler(MODEL, speculative_algorithm="repeat", **KW)
    assert type(eager.round_worker) is RepeatWorker and eager.spec_enabled
    assert _run(eager, prompts, 40, stagger=2, temperature=0) == want
    assert eager.avg_spec_accept_length() > 1.0  # the copies are accepted sometimes
    graphed = make_scheduler(MODEL, speculative_algorithm="REPEAT", **KW)
    runner = graphed.round_worker.init_cuda_graphs([1, 2, 4], emulate=True)
    assert _run(graphed, prompts, 40, stagger=2, temperature=0) == want
    assert runner.num_replays > 0  # the rounds ran as graph replays, not eagerly


def test_toy_sampled_rounds_are_reproducible_with_seeds():
    """Seeded sampling through the one-hot rejection path gives the same tokens twice, and
    greedy requests beside it still equal plain decoding."""
    sched = make_scheduler(MODEL, speculative_algorithm="REPEAT", **KW)
    prompts = _prompts(sched.tokenizer)[:2]
    first = _run(sched, prompts, 24, temperature=0.8, sampling_seed=7)
    again = _run(sched, prompts, 24, temperature=0.8, sampling_seed=7)
    assert first == again and all(len(v) == 24 for v in first.values())


def test_unknown_and_taken_names_are_refused():
    with pytest.raises(ValueError, match="(?i)'medusa' is not supported; supported: NEXTN.*REPEAT"):
        make_scheduler(MODEL, speculative_algorithm="medusa", **KW)
    with pytest.raises(ValueError, match="taken"):
        registry.register_algorithm(registry.Algorithm("NEXTN", f"{__name__}:RepeatWorker"))
