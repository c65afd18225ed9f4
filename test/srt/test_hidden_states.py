"""``return_hidden_states``: the final-normed hidden states that feed the LM head.

On the bundled model in fp32: the returned rows (the prompt's, from every prefill chunk, then
one per decode step: ``prompt_len + output_len - 1`` in all) equal the plain-PyTorch reference
model's final-normed states of the same sequence; a batch mixing requests with and without the
flag gives the same tokens as one without it; rounds that return hidden states run eagerly and
every other round keeps its (emulated) CUDA graph; a speculative server refuses the field with a
400 naming it and the algorithm; ``Engine.generate`` and ``/generate`` (a real server process)
return upstream's ``meta_info["hidden_states"]`` layout, cumulative when streaming, and a
non-boolean value is a 400 in the one error shape.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

import pytest
import requests
import torch

from engine_test_utils import make_scheduler, refuse_host_reads, sampling
from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR, ModelConfig
from sglang.srt.managers.io_struct import (
    BatchTokenIDOutput,
    GenerateReqInput,
    TokenizedGenerateReqInput,
)
from sglang.test.test_utils import (
    DEFAULT_PORT_FOR_SRT_TEST_RUNNER,
    find_available_port,
    kill_process_tree,
    popen_launch_server,
)
from sglang.train.reference import ReferenceBailingMoeV3

MODEL = str(BUNDLED_MODEL_DIR)
CONFIG = ModelConfig.from_path(MODEL)
VOCAB = CONFIG.vocab_size
HIDDEN = CONFIG.hf_config.hidden_size
RTOL = 1e-5
KW = dict(max_total_tokens=4096, max_running_requests=8)
PROMPT = list(range(30, 50))  # 20 tokens: three chunks at chunked_prefill_size 8

pytestmark = [
    pytest.mark.skipif(not (BUNDLED_MODEL_DIR / "config.json").exists(),
                       reason="bundled checkpoint not present"),
    pytest.mark.usefixtures("two_torch_threads"),
]


@pytest.fixture(scope="module")
def ref() -> ReferenceBailingMoeV3:
    return ReferenceBailingMoeV3.from_pretrained(MODEL, dtype=torch.float32).eval()


def reference_hidden(ref: ReferenceBailingMoeV3, prompt: List[int],
                     output: List[int]) -> torch.Tensor:
    """``[len(prompt) + len(output) - 1, H]``: the final-normed states of every token that was
    fed to the model (the last output token never is)."""
    with torch.no_grad():
        _, hidden = ref(torch.tensor([prompt + output[:-1]]))
    return hidden[0]


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = float((got.float() - want.float()).abs().max())
    scale = float(want.abs().max())
    assert err <= RTOL * scale, f"{name}: max abs err {err:.3e} > {RTOL:g} * {scale:.3e}"


def stack_meta(hidden_states: List[Any]) -> torch.Tensor:
    """Upstream's layout (first entry: the prompt's rows; then one row per step) as one matrix,
    the way upstream's own test concatenates it."""
    first, rest = hidden_states[0], hidden_states[1:]
    assert isinstance(first, list) and all(isinstance(row, list) for row in first)
    assert all(isinstance(row, list) and isinstance(row[0], float) for row in rest)
    return torch.tensor(first + rest)


# ------------------------------------------------------------------------------ request field
def test_request_field_is_a_boolean_per_prompt():
    single = GenerateReqInput(text="hi", return_hidden_states=True)
    single.normalize_batch_and_arguments()
    assert single.return_hidden_states is True
    batch = GenerateReqInput(text=["a", "b", "c"], return_hidden_states=[True, None, False])
    batch.normalize_batch_and_arguments()
    assert [batch[i].return_hidden_states for i in range(3)] == [True, False, False]
    everyone = GenerateReqInput(text=["a", "b"], return_hidden_states=True)
    everyone.normalize_batch_and_arguments()
    assert everyone.return_hidden_states == [True, True]
    for bad, match in [(dict(text="hi", return_hidden_states="yes"), "must be a boolean"),
                       (dict(text="hi", return_hidden_states=1), "must be a boolean"),
                       (dict(text="hi", return_hidden_states=[True]), "must not be a list"),
                       (dict(text=["a", "b"], return_hidden_states=[True]), "has 1 entries"),
                       (dict(text=["a", "b"], return_hidden_states=[True, "x"]), "boolean")]:
        with pytest.raises(ValueError, match=match) as info:
            GenerateReqInput(**bad).normalize_batch_and_arguments()
        assert "return_hidden_states" in str(info.value)


# ------------------------------------------------------------------------------ in-process
def _req(rid: str, ids: List[int], n: int, hidden: bool) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(
        rid, None, list(ids), sampling(VOCAB, temperature=0, max_new_tokens=n, ignore_eos=True),
        return_hidden_states=hidden)


def _mixed(hidden: bool) -> List[TokenizedGenerateReqInput]:
    """Two requests with hidden states (one ending at its first token) and one without."""
    return [_req("a", PROMPT, 6, hidden), _req("b", PROMPT[:7], 9, False),
            _req("c", PROMPT[3:8], 1, hidden)]


def _run(sched, reqs) -> Tuple[Dict[str, List[int]], Dict[str, List[torch.Tensor]]]:
    """Submit together, run until idle; tokens and hidden-state entries per rid."""
    for r in reqs:
        sched.submit(r)
    sched.run_until_idle()
    ids: Dict[str, List[int]] = {}
    hidden: Dict[str, List[torch.Tensor]] = {}
    for msg in sched.outbox:
        if not isinstance(msg, BatchTokenIDOutput):
            continue
        for i, rid in enumerate(msg.rids):
            ids.setdefault(rid, []).extend(msg.decode_ids[i])
            hidden.setdefault(rid, []).extend(msg.output_hidden_states[i])
    sched.outbox.clear()
    return ids, hidden


def _check_rows(ref, entries: List[torch.Tensor], prompt: List[int], output: List[int],
                chunk: Optional[int]) -> None:
    """Prompt chunks ``[n, H]`` first (as many as the prefill ran), then rows ``[H]``."""
    chunks = [e for e in entries if e.dim() == 2]
    assert entries[:len(chunks)] == chunks, "prompt rows must come first"
    assert [c.shape[0] for c in chunks] == (
        [len(prompt)] if chunk is None else
        [min(chunk, len(prompt) - s) for s in range(0, len(prompt), chunk)])
    assert all(e.shape == (HIDDEN,) for e in entries[len(chunks):])
    got = torch.cat([e if e.dim() == 2 else e[None] for e in entries])
    assert_close("hidden states", got, reference_hidden(ref, prompt, output))


@pytest.mark.parametrize("args", [{}, dict(chunked_prefill_size=8, disable_overlap_schedule=True)],
                         ids=["overlap", "chunked-no-overlap"])
def test_rows_match_reference_and_tokens_are_unchanged(ref, args):
    sched = make_scheduler(MODEL, **KW, **args)
    want_ids, none = _run(sched, _mixed(hidden=False))
    assert all(not v for v in none.values())
    ids, hidden = _run(sched, _mixed(hidden=True))
    assert ids == want_ids
    assert hidden["b"] == []  # the request that did not ask gets nothing
    chunk = args.get("chunked_prefill_size")
    _check_rows(ref, hidden["a"], PROMPT, ids["a"], chunk)
    _check_rows(ref, hidden["c"], PROMPT[3:8], ids["c"], None)
    assert len(hidden["a"]) == (3 if chunk else 1) + 6 - 1 and len(hidden["c"]) == 1


def test_hidden_state_rounds_run_eagerly_beside_graphs(ref):
    """With (emulated) graphs: a round returning hidden states is never replayed or captured;
    the other rounds are; tokens and rows equal the graph-free run."""
    plain = make_scheduler(MODEL, **KW)
    want_ids, want_hidden = _run(plain, _mixed(hidden=True))
    graphed = make_scheduler(MODEL, **KW)
    worker = graphed.round_worker
    runner = worker.graph_runner or worker.init_cuda_graphs([1, 2, 4], emulate=True)
    seen = {"graph_with_hidden": 0, "eager_with_hidden": 0}
    replay, capture, phase = runner.replay, runner._capture, worker._decode_phase

    def spy_graph(fn):
        def inner(*a, **k):
            seen["graph_with_hidden"] += worker._hidden_rows is not None
            return fn(*a, **k)
        return inner

    def spy_phase(*a, hidden_rows=None, **k):
        seen["eager_with_hidden"] += hidden_rows is not None
        return phase(*a, hidden_rows=hidden_rows, **k)

    runner.replay, runner._capture, worker._decode_phase = \
        spy_graph(replay), spy_graph(capture), spy_phase
    before = runner.num_replays
    ids, hidden = _run(graphed, _mixed(hidden=True))
    assert ids == want_ids
    assert seen["graph_with_hidden"] == 0 and seen["eager_with_hidden"] >= 5
    assert runner.num_replays > before  # "b" alone after "a" finished: replayed
    for rid in ("a", "c"):
        assert len(hidden[rid]) == len(want_hidden[rid])
        for got, want in zip(hidden[rid], want_hidden[rid]):
            assert torch.equal(got, want)


def test_launching_a_hidden_state_round_reads_no_device_value(monkeypatch):
    """The run-ahead invariant holds for those rounds too: the rows reach the device without a
    host read, and the hidden states come back through the round's asynchronous copy."""
    sched = make_scheduler(MODEL, **KW)
    rounds: List[Any] = []
    refuse_host_reads(monkeypatch, sched.round_worker, "forward_round", rounds)
    ids, hidden = _run(sched, _mixed(hidden=True))
    assert len(rounds) >= 8 and len(hidden["a"]) == 6 and len(ids["b"]) == 9


def test_speculative_server_refuses_with_400_naming_field_and_algorithm():
    sched = make_scheduler(MODEL, **KW, speculative_algorithm="NEXTN", speculative_num_steps=2)
    for r in (_req("h", PROMPT, 4, True), _req("p", PROMPT, 4, False)):
        sched.submit(r)
    sched.run_until_idle()
    finish = {rid: m.finished_reasons[i] for m in sched.outbox
              if isinstance(m, BatchTokenIDOutput) for i, rid in enumerate(m.rids)
              if m.finished_reasons[i] is not None}
    assert finish["p"]["type"] == "length"  # the request without the flag is served
    assert finish["h"]["type"] == "abort" and finish["h"]["status_code"] == 400, finish["h"]
    assert "return_hidden_states" in finish["h"]["message"]
    assert "NEXTN" in finish["h"]["message"]


# ------------------------------------------------------------------------------ Engine and HTTP
ENGINE_ARGS = dict(device="cpu", dtype="float32", random_seed=0, max_total_tokens=2048,
                   max_running_requests=4, log_level="warning")
GREEDY = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}


@pytest.mark.usefixtures("one_thread_children")
def test_engine_generate_batch_and_stream(ref):
    from sglang.srt.entrypoints.engine import Engine

    with Engine(model_path=MODEL, **ENGINE_ARGS) as engine:
        outs = engine.generate(input_ids=[PROMPT, PROMPT[:9]], sampling_params=GREEDY,
                               return_hidden_states=[True, False])
        plain = engine.generate(input_ids=[PROMPT, PROMPT[:9]], sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]
        assert "hidden_states" not in outs[1]["meta_info"]
        meta = outs[0]["meta_info"]["hidden_states"]
        assert len(meta) == GREEDY["max_new_tokens"]  # the prompt entry + one per step
        assert_close("engine", stack_meta(meta),
                     reference_hidden(ref, PROMPT, outs[0]["output_ids"]))
        chunks = list(engine.generate(input_ids=PROMPT, sampling_params=GREEDY, stream=True,
                                      return_hidden_states=True))
        for chunk in chunks:  # cumulative, as upstream: every entry so far, in every chunk
            m = chunk["meta_info"]
            assert len(m["hidden_states"]) == m["completion_tokens"]
        last = chunks[-1]
        assert last["output_ids"] == outs[0]["output_ids"]
        # Not bit-equal to the batch's rows: a decode of one request, not of two, computed them.
        assert_close("stream", stack_meta(last["meta_info"]["hidden_states"]), stack_meta(meta))
        with pytest.raises(ValueError, match="return_hidden_states"):
            engine.generate(input_ids=PROMPT, sampling_params=GREEDY, return_hidden_states="on")


@pytest.mark.slow  # its own server (~16 s); test_server_refusals serves hidden states over HTTP
def test_generate_over_http(tmp_path, ref):
    base_url = f"http://127.0.0.1:{find_available_port(DEFAULT_PORT_FOR_SRT_TEST_RUNNER + 300)}"
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = popen_launch_server(MODEL, base_url, return_stdout_stderr=(log, log), other_args=[
            "--device", "cpu", "--dtype", "float32", "--max-total-tokens", "2048",
            "--max-running-requests", "4"])
    try:
        body = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_hidden_states": True}
        r = requests.post(f"{base_url}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text[:500]
        out = r.json()
        meta = out["meta_info"]["hidden_states"]
        assert len(meta) == GREEDY["max_new_tokens"]
        assert_close("http", stack_meta(meta), reference_hidden(ref, PROMPT, out["output_ids"]))
        r = requests.post(f"{base_url}/generate", json={**body, "return_hidden_states": False},
                          timeout=120)
        assert r.status_code == 200 and "hidden_states" not in r.json()["meta_info"]
        assert r.json()["output_ids"] == out["output_ids"]
        r = requests.post(f"{base_url}/generate", json={**body, "return_hidden_states": "yes"},
                          timeout=120)
        assert r.status_code == 400, r.text[:500]
        err = json.loads(r.text)["error"]
        assert err["code"] == 400 and "return_hidden_states" in err["message"], err
    finally:
        kill_process_tree(proc.pid)


# ------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_cuda_graph_server_returns_hidden_states_eagerly():
    """bf16 on the GPU with real CUDA graphs and overlap: a batch mixing a request with hidden
    states and one without gives the tokens of a run without the flag, the rows of the
    graph-free run, and the request without them is still replayed once alone."""
    kw = dict(device="cuda", dtype="bfloat16", max_total_tokens=8192, max_running_requests=8)
    eager = make_scheduler(MODEL, disable_cuda_graph=True, **kw)
    want_ids, want_hidden = _run(eager, _mixed(hidden=True))
    del eager
    torch.cuda.empty_cache()
    graphed = make_scheduler(MODEL, **kw)
    runner = graphed.round_worker.graph_runner
    assert runner is not None, "no CUDA graph runner"
    plain_ids, _ = _run(graphed, _mixed(hidden=False))
    ids, hidden = _run(graphed, _mixed(hidden=True))
    assert ids == plain_ids == want_ids
    assert runner.num_replays > 0 and not runner.failed
    for rid in ("a", "c"):
        got = torch.cat([e if e.dim() == 2 else e[None] for e in hidden[rid]]).float()
        want = torch.cat([e if e.dim() == 2 else e[None] for e in want_hidden[rid]]).float()
        assert got.shape == want.shape and got.shape[1] == HIDDEN
        assert float((got - want).abs().max()) <= 1e-2 * float(want.abs().max())
