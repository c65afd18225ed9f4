"""Smoke test of ``python -m sglang.bench_one_batch`` on a tiny checkpoint (CPU)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from engine_test_utils import write_checkpoint
from sglang import bench_one_batch


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("bench_ckpt")))


def test_bench_one_batch_in_process(ckpt, tmp_path):
    out = tmp_path / "res.jsonl"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = bench_one_batch.main([
            "--model-path", ckpt, "--device", "cpu", "--batch-size", "1", "2",
            "--input-len", "16", "--output-len", "4", "--result-filename", str(out),
            "--skip-warmup", "--kernel-choices", "moe_grouped_mm=1",
        ])
    finally:
        torch.set_num_threads(n)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["batch_size"] for r in rows] == [1, 2] == [r["batch_size"] for r in results]
    for r in rows:
        assert r["input_len"] == 16 and r["output_len"] == 4
        assert r["prefill_latency"] > 0 and r["median_decode_latency"] > 0
        assert r["overall_throughput"] > 0
        # the A/B choice reached the runner; the rest kept the CPU defaults (torch paths)
        assert "moe_grouped_mm=1" in r["kernel_choices"] and "rmsnorm=0" in r["kernel_choices"]


def test_bench_one_batch_refuses_an_unknown_kernel_choice(ckpt, capsys):
    with pytest.raises(SystemExit) as e:
        bench_one_batch.main(["--model-path", ckpt, "--device", "cpu",
                              "--kernel-choices", "rms_norm=0"])
    assert e.value.code == 2 and "rms_norm" in capsys.readouterr().err


def test_bench_one_batch_cli(ckpt, tmp_path):
    out = tmp_path / "cli.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.bench_one_batch", "--model-path", ckpt, "--device", "cpu",
         "--input-len", "8", "--output-len", "3", "--result-filename", str(out)],
        capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Prefill. latency" in proc.stdout and "median latency" in proc.stdout
    assert json.loads(out.read_text())["input_len"] == 8


def test_bench_one_batch_rejects_too_long_input(ckpt):
    with pytest.raises(ValueError, match="context length"):
        bench_one_batch.main(["--model-path", ckpt, "--device", "cpu", "--input-len", "600",
                              "--output-len", "4", "--skip-warmup", "--max-total-tokens", "1024"])


def test_warm_up_runs_each_prompt_length_before_the_timed_runs(ckpt, monkeypatch):
    calls = []
    real = bench_one_batch.run_once

    def logged(worker, bs, il, ol, seed):
        calls.append((bs, il))
        return real(worker, bs, il, ol, seed)

    monkeypatch.setattr(bench_one_batch, "run_once", logged)
    bench_one_batch.main(["--model-path", ckpt, "--device", "cpu", "--batch-size", "1",
                          "--input-len", "12", "6", "12", "--output-len", "2"])
    # Warm-ups at every distinct length (compiles keyed by the token count happen there).
    assert calls == [(1, 12), (1, 6), (1, 12), (1, 6), (1, 12)]


@pytest.mark.parametrize("spec,window", [
    (["--speculative-algorithm", "DSPARK", "--speculative-dspark-block-size", "3"], 4),
    (["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2"], 3)],
    ids=["dspark", "nextn"])
def test_bench_one_batch_times_speculative_rounds(tmp_path, spec, window):
    """The bundled model (its MTP layer, its ``dspark/`` draft): the decode steps are the
    algorithm's rounds, each request reaches ``--output-len`` tokens, the slots a round did
    not keep are freed (the same pools serve both batch sizes) and the row says so."""
    out = tmp_path / "spec.jsonl"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = bench_one_batch.main([
            "--device", "cpu", "--dtype", "float32", *spec, "--batch-size", "1", "2",
            "--input-len", "16", "--output-len", "6", "--result-filename", str(out),
            "--skip-warmup"])
    finally:
        torch.set_num_threads(n)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["batch_size"] for r in rows] == [1, 2] == [r["batch_size"] for r in results]
    for r in rows:
        assert r["speculative_algorithm"] == spec[1] and r["round_tokens"] == window
        assert 1.0 <= r["accept_length"] <= window and 1 <= r["decode_rounds"] <= 5
        assert r["median_decode_latency"] > 0 and r["draft_weight_gb"] > 0
