"""Host run-ahead: the future map, the round interface of plain decode, the speculative-worker
registry, and overlap schedule on == off byte for byte on the bundled model.

With overlap the scheduler launches round ``k + 1`` before it consumes round ``k``; a request that
finished in round ``k`` has already been given round ``k + 1``, whose tokens are dropped and
whose KV slots are freed. Greedy and seeded requests must produce the same bytes either way
(unseeded sampling draws from a generator whose consumption depends on the batch shapes).
"""
from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch

from engine_test_utils import make_scheduler, refuse_host_reads, sampling, submit_staggered
from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR, ModelConfig
from sglang.srt.managers.io_struct import AbortReq, BatchTokenIDOutput, TokenizedGenerateReqInput
from sglang.srt.rounds.relay import FutureMap, PendingRound, host_to_device
from sglang.srt.rounds.contract import BaseSpecWorker
from sglang.srt.rounds.registry import ALGORITHMS, get_spec_worker_class

MODEL = str(BUNDLED_MODEL_DIR)
VOCAB = ModelConfig.from_path(MODEL).vocab_size
KW = dict(max_total_tokens=4096, max_running_requests=8)


pytestmark = pytest.mark.usefixtures("two_torch_threads")


def _request(rid: str, ids: List[int], **kw: Any) -> TokenizedGenerateReqInput:
    lp = {k: kw.pop(k) for k in ("return_logprob", "top_logprobs_num") if k in kw}
    return TokenizedGenerateReqInput(rid, None, list(ids), sampling(VOCAB, **kw), **lp)


def _run(sched, reqs, stagger: int = 0, abort_after: int = -1) -> Dict[str, Any]:
    def abort(i: int) -> None:
        if i == abort_after:
            sched.submit(AbortReq(rid=reqs[0].rid))

    submit_staggered(sched, reqs, stagger, after_each=abort)
    ids: Dict[str, List[int]] = {}
    finish: Dict[str, Any] = {}
    lps: Dict[str, List[float]] = {}
    for msg in sched.outbox:
        if not isinstance(msg, BatchTokenIDOutput):
            continue
        for i, rid in enumerate(msg.rids):
            ids.setdefault(rid, []).extend(msg.decode_ids[i])
            lps.setdefault(rid, []).extend(msg.output_token_logprobs_val[i])
            if msg.finished_reasons[i] is not None:
                finish[rid] = msg.finished_reasons[i]
    sched.outbox.clear()
    return {"ids": ids, "finish": finish, "logprobs": lps}


def _mix(tok) -> List[TokenizedGenerateReqInput]:
    text = "import os\n\ndef walk(path):\n    for name in os.listdir(path):\n"
    base = tok.encode(text)
    stop_tok = tok.encode("\n")[-1]
    return [
        _request("g0", base, max_new_tokens=48, temperature=0, ignore_eos=True),
        _request("s1", base[:-3], max_new_tokens=30, temperature=0.9, top_p=0.8, sampling_seed=7,
                 ignore_eos=True),
        _request("e2", base[:-1], max_new_tokens=40, temperature=0, stop_token_ids=[stop_tok]),
        _request("l3", base[:-2], max_new_tokens=12, temperature=0, ignore_eos=True,
                 return_logprob=True, top_logprobs_num=3),
        _request("p4", base[:-4], max_new_tokens=20, temperature=0.7, repetition_penalty=1.3,
                 sampling_seed=9, ignore_eos=True),
    ]


@pytest.mark.parametrize("spec", [{}, dict(speculative_algorithm="NEXTN", speculative_num_steps=3)],
                         ids=["plain", "nextn3"])
def test_overlap_on_equals_off(spec):
    on = make_scheduler(MODEL, **KW, **spec)
    off = make_scheduler(MODEL, disable_overlap_schedule=True, **KW, **spec)
    assert on.enable_overlap and not off.enable_overlap
    got_on = _run(on, _mix(on.tokenizer), stagger=2, abort_after=3)
    got_off = _run(off, _mix(off.tokenizer), stagger=2, abort_after=3)
    # g0 is aborted mid-generation: with overlap the host has consumed one round fewer when the
    # abort lands, so only its prefix agrees; every other request is byte-identical.
    a, b = got_on["ids"].pop("g0"), got_off["ids"].pop("g0")
    assert a == b[:len(a)] or b == a[:len(b)]
    assert got_on["finish"].pop("g0")["type"] == got_off["finish"].pop("g0")["type"] == "abort"
    assert got_on["ids"] == got_off["ids"] and got_on["finish"] == got_off["finish"]
    assert got_on["logprobs"]["l3"] == pytest.approx(got_off["logprobs"]["l3"], rel=1e-5, abs=1e-6)
    assert len(got_on["ids"]["l3"]) == 12 and len(got_on["logprobs"]["l3"]) == 12


def test_plain_decode_round_never_reads_device_values(monkeypatch):
    """Launching a plain decode round (future-map gather, req->token write, forward, sampling,
    future-map scatter, the async result copy) converts no tensor into a host value."""
    sched = make_scheduler(MODEL, **KW)
    rounds: List[Any] = []
    refuse_host_reads(monkeypatch, sched.round_worker, "forward_round", rounds)
    prompt = sched.tokenizer.encode("def main():\n")
    reqs = [_request("a", prompt, max_new_tokens=8, temperature=0, ignore_eos=True),
            _request("b", prompt, max_new_tokens=8, temperature=0.8, sampling_seed=1,
                     ignore_eos=True, return_logprob=True, top_logprobs_num=2)]
    got = _run(sched, reqs)
    assert len(rounds) >= 7 and all(len(got["ids"][r]) == 8 for r in "ab")


def test_future_map_fields_and_padding_slot():
    fm = FutureMap(4, "cpu", payload={"hidden": ((3,), torch.float32),
                                      "probs": ((5,), torch.float32)}, lazy={"probs": 0.2})
    slots = torch.tensor([2, 0, 4])
    fm.scatter(slots, tokens=torch.tensor([7, 8, 9]), seq_lens=torch.tensor([10, 11, 12]),
               hidden=torch.ones(3, 3))
    tokens, lens, hidden = fm.gather(slots, "tokens", "seq_lens", "hidden")
    assert tokens.tolist() == [7, 8, 9] and lens.tolist() == [10, 0, 12]  # slot 0 pinned to 0
    assert hidden.sum().item() == 9
    assert torch.equal(fm.gather(torch.tensor([1]), "probs")[0], torch.full((1, 5), 0.2))  # lazy
    with pytest.raises(KeyError, match="no field"):
        fm.gather(slots, "nope")
    with pytest.raises(ValueError, match="shadows"):
        FutureMap(2, "cpu", payload={"tokens": ((), torch.int64)})
    assert host_to_device([1, 2], torch.device("cpu")).tolist() == [1, 2]
    done = PendingRound({"accept_len": torch.tensor([2, 1]),
                         "tokens": torch.tensor([[5, 6], [7, -1]]),
                         "loc": torch.tensor([[3, 4], [5, 6]])}).wait()
    assert done.accept_lens == [2, 1] and done.tokens == [[5, 6], [7]]


def test_spec_worker_registry():
    assert get_spec_worker_class(None) is None and get_spec_worker_class("none") is None
    cls = get_spec_worker_class("eagle")
    assert issubclass(cls, BaseSpecWorker) and cls.__name__ == "NEXTNWorker"
    assert set(ALGORITHMS) == {"NEXTN", "DSPARK"}
    dspark = get_spec_worker_class("dspark")
    assert issubclass(dspark, BaseSpecWorker) and dspark.__name__ == "DSparkWorker"
    with pytest.raises(ValueError, match="'medusa' is not supported; supported: NEXTN"):
        get_spec_worker_class("medusa")


def test_generic_layers_name_no_algorithm():
    """The server arguments, the CLI, the scheduler, the round contract, the plain worker, the
    relay, the model runner and the graph runner reach speculative algorithms through the
    registry only: none of them names one (the checkpoint field ``num_nextn_predict_layers`` is
    the model's, not an algorithm's)."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2] / "python" / "sglang" / "srt"
    generic = [root / "server_args.py", root / "server_args_cli.py",
               *sorted((root / "managers").glob("scheduler*.py")),
               root / "rounds" / "contract.py", root / "rounds" / "plain.py",
               root / "rounds" / "relay.py", root / "model_executor" / "model_runner.py",
               root / "model_executor" / "cuda_graph_runner.py",
               root / "model_executor" / "graph_refill.py",
               root / "model_executor" / "prefill_warmup.py"]
    for path in generic:
        text = path.read_text().replace("num_nextn_predict_layers", "")
        found = re.findall(r"(?i)\w*(?:nextn|dspark|eagle)\w*", text)
        assert not found, f"{path.relative_to(root)} names {sorted(set(found))}"
