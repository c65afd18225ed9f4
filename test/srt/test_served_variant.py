"""benchmark/batch1/served_variant.py on CPU (emulated prefill graphs of the bundled model):
each mode captures, warms up, replays or releases what its docstring says and nothing more,
prefills stay correct (eager where the mode says so), every patch is undone, an unknown mode is
refused naming the modes, and the script starts a server's argument parsing as
``launch_server`` does."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR, ModelConfig
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_executor.prefill_graph_runner import PrefillGraphRunner

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmark/batch1/served_variant.py"
pytestmark = pytest.mark.usefixtures("one_thread")  # test/srt/conftest.py


@pytest.fixture(scope="module")
def variant():
    spec = importlib.util.spec_from_file_location("served_variant", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _runner() -> ModelRunner:
    return ModelRunner(ModelConfig.from_path(str(BUNDLED_MODEL_DIR)), device="cpu",
                       dtype="float32", max_running_requests=2, max_total_tokens=128)


def _batch(runner: ModelRunner, n: int) -> ForwardBatch:
    ids = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n))
    req = runner.req_to_token_pool.alloc(1)[0]
    runner.kda_state_pool.clear_slots([req])
    loc = runner.token_to_kv_pool_allocator.alloc(n)
    runner.req_to_token_pool.write(req, 0, loc)
    return ForwardBatch.for_extend(ids, [req], [0], [n], loc)


# mode -> (graphs captured at start-up, held after it, padded warm-up forwards, unpadded ones,
# replays of a request)
EXPECT = {
    "side_stream": (1, 1, 2, 0, 1),
    "no_replay": (1, 1, 2, 0, 0),
    "release": (1, 0, 2, 0, 0),
    "warmup": (0, 0, 2, 0, 0),
    "warmup_keep": (0, 0, 2, 0, 0),
    "unpadded": (0, 0, 0, 2, 0),
    "empty": (0, 0, 0, 0, 0),
    "tiny_capture": (0, 0, 0, 0, 0),
    "shared_pool": (1, 1, 2, 0, 1),
    "tiny_shared_pool": (0, 0, 0, 0, 0),
    "recapture_decode": (1, 1, 2, 0, 1),
}


@pytest.mark.parametrize("mode", list(EXPECT))
def test_each_mode_does_what_it_says(variant, monkeypatch, mode):
    assert set(EXPECT) == set(variant.VARIANTS)
    saved = {n: PrefillGraphRunner.__dict__[n] for n in ("__init__", "_capture", "run")}
    forwards = []
    original_forward = ModelRunner.forward_eager

    def counting_forward(self, forward_batch, **kw):
        forwards.append("padded" if forward_batch.padding is not None else "unpadded")
        return original_forward(self, forward_batch, **kw)

    monkeypatch.setattr(ModelRunner, "forward_eager", counting_forward)
    undo = variant.apply(mode)
    try:
        runner = _runner()
        pg = runner.init_prefill_graphs([8])
        captured, held, padded, unpadded, replays = EXPECT[mode]
        # An emulated capture runs the body once more: 3 forwards where one was captured.
        assert len(forwards) == padded + unpadded + captured
        warmups = forwards[:2] if captured else forwards
        assert len(pg.graphs) == held and not pg.failed
        assert warmups.count("padded") == padded and warmups.count("unpadded") == unpadded
        fb = _batch(runner, 5)
        out = pg.run(fb)
        assert pg.num_replays == replays
        assert (out is not None) == bool(replays)  # None: the caller prefills eagerly
        assert len(pg.graphs) == held  # no capture at a request
        assert len(getattr(pg, "tiny_graphs", [])) == (mode in variant.TINY)
        if out is not None:
            eager = _runner()
            want = eager.forward(_batch(eager, 5)).next_token_logits
            torch.testing.assert_close(out.next_token_logits, want, rtol=1e-4, atol=1e-4)
    finally:
        undo()
    assert {n: PrefillGraphRunner.__dict__[n] for n in saved} == saved


@pytest.mark.parametrize("mode", ["shared_pool", "tiny_shared_pool"])
def test_shared_pool_modes_capture_in_the_decode_graphs_pool(variant, monkeypatch, mode):
    """A decode graph runner built after ``apply`` has its pool recorded, and every prefill
    capture of the mode then asks for that pool; the undo forgets it and restores the class."""
    from sglang.srt.model_executor import cuda_graph_runner, prefill_graph_runner
    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner

    asked = []
    for module in (cuda_graph_runner, prefill_graph_runner):
        def recording(emulate, pool=None, _new=module.new_graph):
            asked.append(pool)
            return _new(emulate, pool)
        monkeypatch.setattr(module, "new_graph", recording)
    init = CudaGraphRunner.__dict__["__init__"]
    undo = variant.apply(mode)
    try:
        decode = CudaGraphRunner(lambda *args: {}, device="cpu", vocab_size=8, round_tokens=1,
                                 tokens_per_request=1, batch_sizes=[], max_width=8)
        assert variant.DECODE_RUNNERS == [decode]
        decode_pool = object()  # what a CUDA runner's pool handle stands for
        decode._pool = decode_pool
        pg = _runner().init_prefill_graphs([8])
        assert asked == [decode_pool] and pg._pool is decode_pool
    finally:
        undo()
    assert variant.DECODE_RUNNERS == [] and CudaGraphRunner.__dict__["__init__"] is init


def test_shared_pool_without_decode_graphs_keeps_its_own_pool(variant, capsys):
    undo = variant.apply("tiny_shared_pool")
    try:
        pg = _runner().init_prefill_graphs([8])
        assert pg._pool is None and len(pg.tiny_graphs) == 1  # emulated: no pool handle
        assert "no decode graphs were captured" in capsys.readouterr().err
    finally:
        undo()


def test_recapture_decode_captures_the_decode_graphs_again_after_the_prefill_graphs(variant):
    """Every decode graph key is captured again, in its first order, after the prefill graphs;
    the prefill graphs stay and replay."""
    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner

    events = []

    def body(slots, loc, info, bound, return_logprob):
        events.append(("decode", int(slots.shape[0])))
        return {"x": slots * 2}

    undo = variant.apply("recapture_decode")
    try:
        decode = CudaGraphRunner(body, device="cpu", vocab_size=8, round_tokens=1,
                                 tokens_per_request=1, batch_sizes=[1, 2], max_width=8)
        first = dict(decode.graphs)
        assert list(first) and not decode.failed
        events.clear()
        runner = _runner()
        pg = runner.init_prefill_graphs([8])
        assert list(decode.graphs) == list(first)  # the same keys, in the same order
        assert all(decode.graphs[k] is not first[k] for k in first)  # captured anew
        # Largest first as at start-up: each capture runs the body twice, then once captured.
        assert events == [("decode", 2)] * 3 + [("decode", 1)] * 3
        assert len(pg.graphs) == 1 and pg.run(_batch(runner, 5)) is not None
    finally:
        undo()


def test_unknown_mode_is_refused_by_name(variant):
    with pytest.raises(SystemExit, match="choose one of side_stream, no_replay"):
        variant.apply("nope")


def test_the_script_is_launch_server_with_the_patch():
    """``--help`` through the script: launch_server's parser answers, after the script's own
    line naming the variant; a bad variant stops before any server starts."""
    env = dict(os.environ, PREFILL_CAPTURE_VARIANT="warmup",
               PYTHONPATH=os.pathsep.join([str(ROOT / "python"), str(ROOT / "sgl-kernel/python"),
                                           os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "PREFILL_CAPTURE_VARIANT='warmup'" in out.stdout and "--model-path" in out.stdout
    env["PREFILL_CAPTURE_VARIANT"] = "nope"
    bad = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True,
                         text=True, env=env, timeout=300)
    assert bad.returncode != 0 and "choose one of" in bad.stderr
