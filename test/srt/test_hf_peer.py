"""benchmark/batch1/hf_peer.py end to end on the CPU: transformers' bailing_hybrid in tiny shapes,
fp32, a short prompt and 2 decode steps; the table and the JSON line. Skipped when the installed
transformers has no bailing_hybrid (it arrived in 5.24)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers.models.bailing_hybrid",
                    reason="this transformers has no bailing_hybrid (needs >= 5.24)")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmark" / "batch1" / "hf_peer.py"


@pytest.mark.slow  # transformers' model run as a script
def test_hf_peer_tiny_cpu_run_writes_a_finite_row(tmp_path):
    result = tmp_path / "peer.jsonl"
    path = os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--prompt-len", "16",
         "--decode-steps", "2", "--warmup-decode", "1", "--prefill-repeats", "1",
         "--result-filename", str(result)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        # One thread: tiny shapes are fastest so and the shared CI cores stay free.
        env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    import transformers

    assert f"transformers {transformers.__version__}" in out.stdout
    (line,) = result.read_text().splitlines()
    row = json.loads(line)
    assert row["transformers"] == transformers.__version__
    assert (row["layers"], row["prompt_len"], row["decode_steps"]) == (3, 16, 2)
    assert row["prefill_ms"] > 0 and row["decode_median_ms"] > 0
    assert row["finite"] is True
    assert row["attn_implementation"] == "sdpa"
    assert row["experts_implementation"] == "grouped_mm"
    # Which KDA kernel ran is reported: fla-core where importable, else the torch reference.
    assert row["kda_kernel"] == "torch fallback" or row["kda_kernel"].startswith("fla.")
    # The tiny model keeps both layer kinds: KDA layers 0, 1 and MLA layer 2.
    assert "MLA at [2]" in out.stdout
    assert f"| {transformers.__version__} | 3 | 16 |" in out.stdout  # the markdown row


def test_hf_peer_layer_kinds_follow_our_config():
    """An incomplete tail group is MLA in our config, KDA in transformers' default: the peer
    passes our layer kinds explicitly."""
    sys.path.insert(0, str(ROOT / "python"))
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import hf_peer
    finally:
        sys.path.remove(str(SCRIPT.parent))
    from sglang.srt.configs.model_config import ModelConfig

    ours = ModelConfig.from_path("ling-3.0-flash", {"num_hidden_layers": 8}).hf_config
    kwargs, notes = hf_peer.hf_config_kwargs(ours)
    assert kwargs["layer_types"] == ["linear_attention"] * 5 + ["full_attention"] * 3
    assert kwargs["mlp_layer_types"] == ["dense"] * 2 + ["sparse"] * 6
    assert kwargs["num_local_experts"] == 512 and kwargs["n_shared_experts"] == 1
    assert notes == []  # the first 8 layers have no SwiGLU clamp
    full = ModelConfig.from_path("ling-3.0-flash", None).hf_config
    assert any("swiglu" in n for n in hf_peer.hf_config_kwargs(full)[1])
