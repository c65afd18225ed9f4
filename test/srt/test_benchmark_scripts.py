"""The measurement scripts under benchmark/ still run (CPU smoke runs: the bundled model, tiny
shapes in Triton's interpreter, gloo ranks)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str, **env: str) -> str:
    """Run ``benchmark/<script>`` with the repository's packages on the path; its stdout."""
    path = os.pathsep.join([str(ROOT / "python"), str(ROOT / "sgl-kernel/python"),
                            os.environ.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, str(ROOT / "benchmark" / script), *args],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": path, **env})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.slow
def test_round_census_attributes_a_nextn_round_to_its_phases():
    stdout = _run("batch1/round_census.py", "--device", "cpu", "--dtype", "float32",
                  "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2",
                  "--prompt-len", "16", "--steps", "2", "--warmup", "1", "--by", "phase")
    ops = {m.group(1): float(m.group(2))
           for m in re.finditer(r"^\| ([^|*]+?) \| (\d+) \|", stdout, re.MULTILINE)}
    for phase in ("target forward", "KDA verify (in target)", "MTP forward", "acceptance"):
        assert ops.get(phase, 0) > 0, (phase, stdout)
    assert "unprofiled" in stdout


@pytest.mark.slow  # the interpreter
def test_grouped_gemv_sweep_runs_and_ranks_configs():
    """benchmark/kernels/tune_grouped_gemv.py on tiny shapes in the interpreter: every config is
    checked against the reference and both projections get a ranked table with the default."""
    stdout = _run("kernels/tune_grouped_gemv.py", "--experts", "8", "--hidden", "64",
                  "--intermediate", "32", "--topk", "2", "--block-n", "8", "16", "--block-k", "32",
                  "--num-warps", "4", "--num-stages", "1", "--iters", "2", "--check-tokens", "2",
                  TRITON_INTERPRET="1")
    for name in ("up+SwiGLU", "down"):
        table = stdout.split(f"### {name}")[1].split("###")[0]
        labels = re.findall(r"^\| ([\w/]+) \| [\d.]+ \|", table, re.MULTILINE)
        assert sorted(labels) == ["16/32/4/1", "8/32/4/1", "default"], table
        assert "2 tokens (4 pairs" in table, table


@pytest.mark.slow  # every tile in Triton's interpreter
def test_moe_grouped_gemm_sweep_runs_and_writes_its_table(tmp_path):
    """benchmark/kernels/tune_moe_grouped_gemm.py on tiny shapes in the interpreter (about 10 s):
    every config checked against the fp32 reference, a winner per format, projection and pair
    bucket merged into the --output table in the format moe_grouped_gemm_configs.launch_config reads."""
    out = tmp_path / "table.json"
    out.write_text(json.dumps({"Other GPU": {"kept": {}}}))
    stdout = _run("kernels/tune_moe_grouped_gemm.py", "--experts", "6", "--hidden", "64",
                  "--intermediate", "48", "--topk", "2", "--tokens", "8", "--block-m", "16",
                  "--block-n", "32", "--block-k", "32", "--group-m", "1", "4", "--num-warps",
                  "4", "--num-stages", "1", "--iters", "1", "--output", str(out),
                  TRITON_INTERPRET="1")
    table = json.loads(out.read_text())
    assert table["Other GPU"] == {"kept": {}}
    shapes = table["CPU (Triton interpreter)"]
    assert sorted(shapes) == sorted(f"E=6,N={n},K={k},dtype={d}" for n, k in ((96, 64), (64, 48))
                                    for d in ("bf16", "fp8"))
    for key, buckets in shapes.items():
        assert list(buckets) == ["16"]
        fp8 = key.endswith("dtype=fp8")  # fp8 records also name their inner loop
        up = key.startswith("E=6,N=96,")  # up-projection records also their SwiGLU layout
        assert set(buckets["16"]) == {"block_m", "block_n", "block_k", "group_m", "num_warps",
                                      "num_stages"} | ({"fp8_prescale"} if fp8 else set()) | (
                                          {"swiglu_interleave"} if up else set())
    assert len(re.findall(r"^\| (bf16|fp8) \| (up|down) \| ", stdout, re.MULTILINE)) == 4
    # Both fp8 inner loops were timed (--fp8-prescale defaults to 0 1).
    assert len(re.findall(r"^\| fp8 \| (up|down) \| .* \| [\d.]+ / [\d.]+ \|$", stdout,
                          re.MULTILINE)) == 2, stdout
    # w8a8 (fp8 activations): its own keys beside the others, one inner loop.
    stdout = _run("kernels/tune_moe_grouped_gemm.py", "--experts", "6", "--hidden", "64",
                  "--intermediate", "48", "--topk", "2", "--tokens", "8", "--block-m", "16",
                  "--block-n", "32", "--block-k", "32", "--group-m", "1", "--num-warps", "4",
                  "--num-stages", "1", "--iters", "1", "--dtype", "w8a8", "--weight-tma", "0",
                  "1", "--shared-expert", "--output", str(out), TRITON_INTERPRET="1")
    shapes = json.loads(out.read_text())["CPU (Triton interpreter)"]
    assert sum(key.endswith("dtype=w8a8") for key in shapes) == 2 and len(shapes) == 6
    # --shared-expert: one more pair a token (8 x (2 + 1)), checked against the reference
    assert all(list(b) == ["24"] for key, b in shapes.items() if key.endswith("dtype=w8a8"))
    # TMA weight tiles only where they apply: not on the up-projection's 48 output columns
    # (no 32-column tile fits them)
    up_lines = re.findall(r"^\s+w8a8 up .*$", stdout, re.MULTILINE)
    assert up_lines and not any("/tma" in line for line in up_lines), up_lines
    assert len(re.findall(r"^\| w8a8 \| (up|down) \| .* \|  \|$", stdout, re.MULTILINE)) == 2


@pytest.mark.slow  # the interpreter
def test_small_m_gemm_sweep_runs_and_compares_with_the_library():
    """benchmark/kernels/tune_small_m_gemm.py on one scaled-down shape in the interpreter: the
    configs are checked against the reference and the summary row has every row count."""
    stdout = _run("kernels/tune_small_m_gemm.py", "--rows", "1", "3", "--shapes", "mla kv_a",
                  "--scale", "16", "--block-n", "16", "32", "--block-k", "256", "--num-stages",
                  "3", "--iters", "1", TRITON_INTERPRET="1")
    row = re.findall(r"^\| mla kv_a \| 36x2560 \| (\d+/256/4/3/1/False) \(current [\w/]+\) \| (.*) \|$",
                     stdout, re.MULTILINE)
    assert row and "M=1: best" in row[-1][1] and "M=3: best" in row[-1][1], stdout
    assert "F.linear" in row[-1][1]


@pytest.mark.slow  # the all-reduce itself: the TP tests; a fast script smoke: test_mla_decode
def test_allreduce_benchmark_smoke_run_on_gloo():
    """benchmark/kernels/bench_allreduce.py --device cpu: 2 gloo ranks check the sum through the
    engine's all-reduce and a plain one and print a row per message size."""
    stdout = _run("kernels/bench_allreduce.py", "--device", "cpu", "--tp", "2",
                  "--bytes", "64", "20480", "--iters", "3")
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| - \| ([\d.]+) \| - \|$", stdout, re.MULTILINE)
    assert [r[0] for r in rows] == ["64", "20480"], stdout


@pytest.mark.slow  # four engines
def test_router_numerics_ab_reports_agreement_and_accept_length(tmp_path):
    """benchmark/batch1/numerics_ab.py on the bundled model: the first variant agrees with itself,
    NEXTN stays lossless under both router dtypes, and the JSON rows carry the figures."""
    out = tmp_path / "n.jsonl"
    stdout = _run("batch1/numerics_ab.py", "--prompts", "1", "--gen", "12", "--steps", "2",
                  "--result-filename", str(out))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["fp32", "bf16"], stdout
    assert rows[0]["identical"] == 1 and rows[0]["mean_first_difference"] == 12
    assert all(r["nextn_lossless"] == 1 and 1.0 <= r["accept_length"] <= 3 for r in rows)
    assert "| bf16 | " in stdout


def test_graph_ab_exits_with_the_reason_when_the_request_cannot_fit():
    """A prompt plus round budget beyond the context is refused by the scheduler: the script
    says so and exits instead of waiting for a prefill that never comes."""
    path = os.pathsep.join([str(ROOT / "python"), str(ROOT / "sgl-kernel/python"),
                            os.environ.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, str(ROOT / "benchmark/batch1/graph_ab.py"),
                          "--device", "cpu", "--context-length", "96", "--prompt-len", "64",
                          "--steps", "8"], capture_output=True, text=True, timeout=300,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": path})
    assert out.returncode != 0
    assert "refused the request" in out.stderr and "context 96" in out.stderr, out.stderr[-2000:]


@pytest.mark.slow  # a profiled decode step of the bundled model
def test_top_kernels_lists_the_step_by_device_time():
    stdout = _run("batch1/top_kernels.py", "--device", "cpu", "--prompt-len", "16", "--steps",
                  "1", "--warmup", "1", "--top", "3")
    rows = re.findall(r"^\| (\S[^|]*) \| ([\d.]+) \| (\d+) \|", stdout, re.MULTILINE)
    assert len(rows) == 4 and rows[-1][0] == "all", stdout
    assert float(rows[0][1]) >= float(rows[1][1]) >= float(rows[2][1]) > 0


def test_top_kernels_names_the_shaped_kernels_by_weight(monkeypatch):
    """``top_kernels.py --by-shape``: after ``name_calls_by_shape`` a small-M GEMM call is a
    profiler range named by its weight (shape, dtype, norm prologue) that owns its kernel time;
    the entry points are restored after the test."""
    import importlib.util

    import torch
    from torch.profiler import ProfilerActivity, profile

    import sgl_kernel.grouped_gemv as gg
    import sgl_kernel.small_m_gemm as sm

    spec = importlib.util.spec_from_file_location("top_kernels",
                                                  ROOT / "benchmark/batch1/top_kernels.py")
    top = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(top)
    monkeypatch.setattr(sm, "small_m_gemm", sm.small_m_gemm)  # undone at teardown
    monkeypatch.setattr(gg, "grouped_gemv", gg.grouped_gemv)
    top.name_calls_by_shape()
    x, w = torch.randn(3, 32), torch.randn(16, 32)
    norm = sm.GatedNormPrologue(torch.randn(3, 32), torch.ones(16), 1e-6, 16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        plain = sm.small_m_gemm(x, w)
        normed = sm.small_m_gemm(x, w, gated_norm=norm)
    keys = {e.key for e in prof.key_averages()}
    assert {"small_m_gemm[16x32 float32]", "small_m_gemm[16x32 float32, norm]"} <= keys, keys
    assert torch.allclose(plain, sm.small_m_gemm_reference(x, w), atol=1e-5)
    assert torch.allclose(normed, sm.small_m_gemm_reference(x, w, gated_norm=norm), atol=1e-5)


def test_top_kernels_charges_a_range_the_kernels_inside_its_gpu_span():
    """A GPU range of an eager step spans host gaps: ``kernel_time_by_range`` charges it the
    kernels that start inside it (not its span), per call, and ignores other ranges."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("top_kernels",
                                                  ROOT / "benchmark/batch1/top_kernels.py")
    top = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(top)
    ann, ker = "gpu_user_annotation", "kernel"
    trace = [{"cat": ann, "name": "small_m_gemm[8x4 float32]", "ts": 0.0, "dur": 50.0},
             {"cat": ker, "name": "k", "ts": 1.0, "dur": 3.0},
             {"cat": ker, "name": "k", "ts": 40.0, "dur": 2.0},
             {"cat": ker, "name": "other", "ts": 60.0, "dur": 7.0},
             {"cat": ann, "name": "small_m_gemm[8x4 float32]", "ts": 100.0, "dur": 10.0},
             {"cat": ker, "name": "k", "ts": 105.0, "dur": 4.0},
             {"cat": ann, "name": "unrelated", "ts": 55.0, "dur": 20.0}]
    got = top.kernel_time_by_range(trace, ("small_m_gemm[",))
    assert got == {"small_m_gemm[8x4 float32]": (9.0, 2)}


def test_kda_recurrent_sweep_checks_bits_across_value_tiles():
    """benchmark/kernels/tune_kda_recurrent.py in the interpreter (2 heads of 16): every tile is
    checked against the reference and the bit-equality column is filled in."""
    stdout = _run("kernels/tune_kda_recurrent.py", "--chain", "1", "3", "--block-v", "8", "16",
                  "--num-warps", "4", "--heads", "2", "--head-dim", "16", "--iters", "1",
                  TRITON_INTERPRET="1")
    rows = re.findall(r"^\| (\d+) \| (\d+)/4 [\d.]+ µs .*\| (True|False) \|", stdout, re.MULTILINE)
    assert [(c, eq) for c, _, eq in rows[-2:]] == [("1", "True"), ("3", "True")], stdout


def test_kda_prefill_conv_sweep_times_the_default_and_checks_bits():
    """benchmark/kernels/tune_kda_prefill_conv.py in the interpreter (48 channels as a view of
    rows of 80): the default tile is always timed, every tile is compared bit for bit with it,
    and the summary row names the best tile."""
    stdout = _run("kernels/tune_kda_prefill_conv.py", "--tokens", "40", "--block-t", "8",
                  "--block-c", "16", "--num-warps", "4", "--channels", "48", "--row-width", "80",
                  "--iters", "1", TRITON_INTERPRET="1")
    rows = re.findall(r"^\| 40 \| (\d+)/(\d+)/(\d+) [\d.]+ µs .*\| [\d.]+ µs \([\d.]+x\) \| "
                      r"(True|False) \| (.*) \|$", stdout, re.MULTILINE)
    assert rows and rows[-1][3] == "True", stdout
    timed = rows[-1][4]
    # the default (its channel block narrowed to the interpreter's) and the sweep's tile
    assert "16/64/8" in timed and "8/16/4" in timed, stdout
    # With the heads' L2 norm: the default is one head per block over 4 warps, and a tile of
    # two heads per block is checked against it too.
    stdout = _run("kernels/tune_kda_prefill_conv.py", "--tokens", "40", "--block-t", "8",
                  "--block-c", "32", "--num-warps", "4", "--channels", "48", "--row-width", "80",
                  "--iters", "1", "--l2norm-head-dim", "16", TRITON_INTERPRET="1")
    assert "heads' L2 norm 16" in stdout, stdout
    rows = re.findall(r"^\| 40 \| (\d+)/(\d+)/(\d+) [\d.]+ µs .*\| [\d.]+ µs \([\d.]+x\) \| "
                      r"(True|False) \| (.*) \|$", stdout, re.MULTILINE)
    assert rows and "16/16/4" in rows[-1][4] and "8/32/4" in rows[-1][4], stdout


def test_fp8_act_quant_sweep_checks_bits_and_names_the_fastest():
    """benchmark/kernels/tune_fp8_act_quant.py on one tiny shape in the interpreter: every tile
    is checked against the default tile's bits and timed, and the summary names the fastest."""
    stdout = _run("kernels/tune_fp8_act_quant.py", "--rows", "24", "--cols", "256",
                  "--block-m", "16", "32", "--num-warps", "4", "--iters", "1",
                  TRITON_INTERPRET="1")
    rows = re.findall(r"^\| (16|32) \| 4 \| [\d.]+", stdout, re.MULTILINE)
    assert rows == ["16", "32"], stdout
    assert re.search(r"\[24, 256\]: block_m (16|32), 4 warps, [\d.]+ us", stdout), stdout


def test_moe_router_sweep_checks_ids_and_marks_the_default():
    """benchmark/kernels/tune_moe_router.py in the interpreter at Flash's router (512 experts,
    8 groups): each warp count's ids checked against the default's, one row per setting."""
    stdout = _run("kernels/tune_moe_router.py", "--tokens", "2", "--num-warps", "1", "4",
                  "--launches", "1", "--iters", "1", TRITON_INTERPRET="1")
    rows = re.findall(r"^\| 2 \| (\d) \| [\d.]+( \(default\))? \|$", stdout, re.MULTILINE)
    assert rows == [("1", " (default)"), ("4", "")], stdout


@pytest.mark.slow  # the GEMMs in Triton's interpreter
def test_fp8_gemm_benchmark_smoke_run():
    """benchmark/kernels/bench_fp8_gemm.py on two scaled-down shapes in the interpreter: the
    kernel (weight-only and w8a8) is checked against the reference, each shape gets a row with
    every column (the w8a8 ones and the library's included) and the model total
    is printed (the fused MLA projection counts, the shared expert does not)."""
    stdout = _run("kernels/bench_fp8_gemm.py", "--rows", "96", "--shapes", "mla qkv_a_g",
                  "shared gate_up", "--scale", "16", "--iters", "1", TRITON_INTERPRET="1")
    rows = re.findall(r"^\| (mla qkv_a_g|shared gate_up) \| (\d+)x2560 \| 6 \| .* \| ([\d.]+) \|$",
                      stdout, re.MULTILINE)
    assert [(r[0], r[1]) for r in rows] == [("mla qkv_a_g", "422"), ("shared gate_up", "96")], \
        stdout
    header = next(line for line in stdout.splitlines() if line.startswith("| shape |"))
    assert "w8a8: quant + gemm" in header and "w8a8: quant alone" in header, header
    assert "library scaled_mm" in header, header
    for line in stdout.splitlines():
        if line.startswith(("| mla qkv_a_g |", "| shared gate_up |")):
            assert line.count(" | ") == header.count(" | "), line
    total = re.search(r"^\| 6 \| ([\d.]+) ms \|", stdout, re.MULTILINE)
    assert total and float(total.group(1)) > 0, stdout


def test_graph_ab_times_a_dspark_round(tmp_path):
    """graph_ab.py takes the DSPARK flags (the bundled model's ``dspark/`` draft, block 3): its
    rows carry the default label ``dspark3`` and the verify window. Each of the 2 + 3 timed
    iterations consumes a round of at least one token, except the first with overlap (it only
    launches), so a row has at least 4 tokens (the prompt is random ids: the seed fixes it)."""
    out = tmp_path / "ab.jsonl"
    stdout = _run("batch1/graph_ab.py", "--device", "cpu", "--dtype", "float32",
                  "--speculative-algorithm", "DSPARK", "--speculative-dspark-block-size", "3",
                  "--prompt-len", "16", "--steps", "2", "--random-seed", "0",
                  "--result-filename", str(out))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["mode"], r["overlap"]) for r in rows] == [("eager", True), ("eager", False)]
    assert all(r["label"] == "dspark3" and r["round_tokens"] == 4 and r["tokens"] >= 4
               for r in rows), stdout


def test_graph_ab_patches_the_small_m_fp8_tile_only(monkeypatch):
    """``graph_ab.py --small-m-fp8-tile N/K/STAGES``: block-fp8 weights get the tile and the
    kernel's K split for it; other weights keep their launch config; the kernel takes it."""
    import importlib.util

    import torch
    import sgl_kernel.small_m_gemm as smg
    from sgl_kernel.fp8_blocks import block_quantize

    monkeypatch.setattr(smg, "launch_config", smg.launch_config)  # restored after the test
    spec = importlib.util.spec_from_file_location("graph_ab", ROOT / "benchmark/batch1/graph_ab.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    bf16 = smg.launch_config(2560, 4096, torch.bfloat16)
    mod.patch_small_m_fp8_tile(32, 512, 3)
    cfg = smg.launch_config(2560, 4096, torch.float8_e4m3fn)
    want = smg._split_for(2560, 4096, 32, 512, smg.split_target_programs(smg.sm_count(None)))
    assert (cfg.block_n, cfg.block_k, cfg.num_stages, cfg.split_k) == (32, 512, 3, want)
    assert smg.launch_config(2560, 4096, torch.bfloat16) == bf16
    w, scale = block_quantize(torch.randn(40, 640) / 25)
    x = torch.randn(2, 640)
    assert (smg.small_m_gemm(x, w, w_scale=scale) - smg.small_m_gemm_reference(
        x, w, w_scale=scale)).abs().max() < 1e-4


def test_ablation_summary_groups_seeds_by_loss(tmp_path):
    """summarize_ablation.py --by-loss: runs that differ only in their seed form one row with
    the mean, sample standard deviation and range of their accept lengths."""
    runs = {"default-s0": (0.1, 0.9, 0.5, 1.70, [0.5, 0.2]),
            "default-s1": (0.1, 0.9, 0.5, 1.80, [0.7, 0.2]),
            "plain-ce-s0": (1.0, 0.0, 0.0, 1.75, [0.6, 0.3])}
    for name, (ce, tv, acc, length, slots) in runs.items():
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"block_size": 7}))
        (d / "train_log.json").write_text(json.dumps({
            "args": {"alpha_ce": ce, "alpha_tv": tv, "alpha_accept": acc},
            "train": {"num_steps": 800, "seconds": 1.0},
            "eval": {"accept_length": length, "slot_accept": slots, "mean_ece": 0.01}}))
    out = _run("dspark/summarize_ablation.py", "--by-loss",
               *(str(tmp_path / n) for n in runs), "--json", str(tmp_path / "rows.jsonl"))
    rows = {line.split()[0]: line.split() for line in out.splitlines()[-2:]}
    # 0.1/0.9/0.5, block 7, 2 runs: mean 1.75, stdev 0.0707, range 1.70..1.80, slot means
    assert rows["0.1/0.9/0.5"][1:7] == ["7", "2", "1.750", "0.071", "1.700", "1.800"]
    assert rows["0.1/0.9/0.5"][7:] == ["0.600,", "0.200"]
    assert rows["1.0/0.0/0.0"][2:5] == ["1", "1.750", "0.000"]


def test_server_trace_counts_the_waits_between_graph_launches(tmp_path):
    """benchmark/batch1/server_trace.py on a synthetic trace of 5 graph launches 2 ms apart,
    with one cudaStreamSynchronize of 300 µs and one cudaMemcpyAsync between each pair and
    1.5 ms of kernels per step (two, overlapping in the first trace): per step one blocking call
    (the async copy is not one), the launch interval, the GPU's busy time and the graphs' inner
    shape; a second trace without the syncs (and without the overlap) shows none."""
    import gzip

    def trace(with_sync: bool) -> Path:
        ev = []
        for i in range(5):
            t = 1000.0 + 2000.0 * i
            ev.append(dict(ph="X", cat="cuda_runtime", name="cudaGraphLaunch", ts=t, dur=20,
                           args={"correlation": i}))
            # two kernels of the graph: overlapping by 10 µs or 10 µs apart
            second = t + 50 + 700 + (-10 if with_sync else 10)
            ev.append(dict(ph="X", cat="kernel", name="k", ts=t + 50, dur=700,
                           args={"correlation": i}))
            ev.append(dict(ph="X", cat="kernel", name="k2", ts=second, dur=800,
                           args={"correlation": i}))
            ev.append(dict(ph="X", cat="cuda_runtime", name="cudaMemcpyAsync", ts=t + 100,
                           dur=5))
            if with_sync:
                ev.append(dict(ph="X", cat="cuda_runtime", name="cudaStreamSynchronize",
                               ts=t + 200, dur=300))
        ev.append(dict(ph="i", name="marker", ts=0))  # not a complete event: ignored
        path = tmp_path / f"t{int(with_sync)}.json.gz"
        with gzip.open(path, "wt") as f:
            json.dump({"traceEvents": ev}, f)
        return path

    out = tmp_path / "rows.jsonl"
    stdout = _run("batch1/server_trace.py", str(trace(True)), str(trace(False)), "--labels",
                  "synced", "plain", "--result-filename", str(out))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    synced, plain = rows
    assert synced["steps"] == 5 and synced["launch_interval_ms"] == pytest.approx(2.0)
    assert synced["gpu_busy_ms_per_step"] == pytest.approx(1.5)
    assert synced["blocking"] == {"cudaStreamSynchronize": {"per_step": 1.0, "mean_us": 300.0}}
    assert plain["blocking"] == {}
    assert synced["runtime_us_per_step"] == pytest.approx(20 + 5 + 300)
    assert "cudaStreamSynchronize 1.00/step x 300.0 µs" in stdout and "| plain | 5 |" in stdout
    # Inside the graphs: the overlapping pair and the gap, the span, the idle between graphs.
    assert (synced["overlapping_pairs"], synced["inner_gaps_us"]) == (1, -10)
    assert (plain["overlapping_pairs"], plain["inner_gaps_us"]) == (0, 10)
    assert (synced["kernel_gap_median_us"], plain["kernel_gap_median_us"]) == (-10, 10)
    assert synced["graph_span_us"] == 1490 and plain["graph_span_us"] == 1510
    assert plain["idle_between_us"] == pytest.approx(2000 - 1510)
    assert plain["launch_lead_us"] == pytest.approx(50 + 1510 - 2000)


def test_graph_node_kinds_reads_a_debug_dump():
    """graph_gap_probe.node_kinds on a DOT text shaped as ``cudaGraphDebugDotPrint`` writes it:
    one count per node type named first in a node's label (escaped quotes inside a label do
    not end it), ``other`` for a label that names none, with that label kept to read."""
    sys.path.insert(0, str(ROOT / "benchmark" / "batch1"))
    try:
        from graph_gap_probe import node_kinds
    finally:
        sys.path.pop(0)
    dot = "\n".join([
        'digraph dot {',
        '"graph_0_node_0"[style="solid" shape="record" label="{KERNEL\\n| {ID | 0 | '
        'void at::native::vectorized_elementwise_kernel<4, \\"fill\\">}}"];',
        '"graph_0_node_1"[style="solid" shape="record" label="{MEMSET\\n| {dst | 0x7f}}"];',
        '"graph_0_node_2"[style="solid" shape="record" label="{KERNEL\\n| {ID | 2}}"];',
        '"graph_0_node_3"[style="solid" shape="record" label="{MEMCPY\\n| {kind | D2D}}"];',
        '"graph_0_node_4"[label="7\\n_Z3fooPf"];',
        '"graph_0_node_0" -> "graph_0_node_1";',
        '}'])
    kinds = node_kinds(dot)
    assert {k: v for k, v in kinds.items() if k != "other_label"} == {
        "KERNEL": 2, "MEMSET": 1, "MEMCPY": 1, "other": 1}
    assert kinds["other_label"] == "7\\n_Z3fooPf"


def test_launch_overhead_benchmark_names_what_it_needs_without_cuda(monkeypatch):
    """The launch-path timing is GPU-only: on CPU it exits with the reason, not a traceback."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_launch_overhead", ROOT / "benchmark/kernels/bench_launch_overhead.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        bench.main(["--launches", "10"])
