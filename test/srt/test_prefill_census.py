"""benchmark/batch1/prefill_census.py, host_attribution.py and plot_prefill_census.py: the
module -> category table on
the bundled model, a CPU census of one prefill (every top-level aten op in exactly one category,
the JSON line's fields, the timed prefill-graph replays of ``--prefill-graphs``), the CUDA attribution and the name fallback on synthetic profiler
events, the figure of the census line, and ``--sync-sites``: the attribution of a synchronising
call to its site on synthetic stacks, the recording around a prefill (the sync debug mode
stubbed: this host has no CUDA) and the option's no-op on CPU; ``--host-profile``: the timed
and cProfiled prefill, the function labels and the own time per package."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import traceback
import warnings
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from sglang.test.script_loader import load_script

ROOT = Path(__file__).resolve().parents[2]
BATCH1 = ROOT / "benchmark" / "batch1"
TINY = ROOT / "python" / "sglang" / "assets" / "tiny-bailing-v3"
PROMPT = 32


def _load(name: str) -> ModuleType:
    """A script under benchmark/batch1 imported by its path (the folder is no package)."""
    return load_script(BATCH1 / f"{name}.py", f"batch1_{name}")


pc = _load("prefill_census")
ha = _load("host_attribution")
plot = _load("plot_prefill_census")


def _run_census(*args: str) -> subprocess.CompletedProcess:
    """``prefill_census.py`` on the bundled model on CPU in float32, with ``args``."""
    env_path = os.pathsep.join([str(ROOT / "python"), str(ROOT / "sgl-kernel/python"),
                                os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(BATCH1 / "prefill_census.py"), "--device", "cpu",
                           "--dtype", "float32", *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": env_path})


@pytest.fixture(scope="module")
def census(tmp_path_factory):
    """The JSON line and stdout of a census of one 32-token prefill of the bundled model."""
    path = tmp_path_factory.mktemp("prefill") / "prefill.jsonl"
    out = _run_census("--prompt-len", str(PROMPT), str(PROMPT // 2), "--label", "tiny",
                      "--result-filename", str(path), "--prefill-graphs")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    # One model load, one line per prompt length, in the order given.
    assert [(r["label"], r["prompt_len"]) for r in lines] == [
        (f"tiny {PROMPT}", PROMPT), (f"tiny {PROMPT // 2}", PROMPT // 2)]
    assert lines[1]["total"]["kernels"] > 0
    return {"rec": lines[0], "stdout": out.stdout, "path": path}


def _tiny_config():
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig.from_path(str(TINY), None).hf_config


def test_category_table_maps_the_bundled_model_modules():
    """Attention modules nest their linears (dense projections) and norms; MoE blocks, dense
    MLPs, norms and the logits processor are single ranges (nothing inside opens its own)."""
    from sglang.srt.models.bailing_moe_v3 import BailingMoeV3ForCausalLM

    cfg = _tiny_config()
    with torch.device("meta"):
        model = BailingMoeV3ForCausalLM(cfg, torch.float32)
    got = {name: cat for name, _, cat in pc.prefill_categorised_modules(model)}
    want = {"model.norm": "norms", "logits_processor": "lm_head"}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        want[p + "input_layernorm"] = want[p + "post_attention_layernorm"] = "norms"
        a = p + "attention."
        if cfg.is_kda_layer(i):
            want[p + "attention"] = "KDA"
            want.update({a + "fused_qkvbfg_proj": "dense projections",
                         a + "o_proj": "dense projections", a + "o_norm": "norms"})
        else:
            want[p + "attention"] = "MLA attention"
            want.update({a + "fused_qkv_a_g_proj": "dense projections",
                         a + "kv_a_layernorm": "norms", a + "dense": "dense projections"})
            if cfg.q_lora_rank:
                want.update({a + "q_a_layernorm": "norms", a + "q_b_proj": "dense projections"})
        want[p + "mlp"] = "MoE" if cfg.is_moe_layer(i) else "dense projections"
    assert got == want
    assert set(want.values()) == set(pc.CATEGORIES) - {"other"}  # the tiny model has them all


def test_cpu_census_json_line(census):
    rec, cats = census["rec"], census["rec"]["categories"]
    assert list(cats) == list(pc.CATEGORIES)
    for name, row in cats.items():
        assert row["kernels"] > 0 and row["ms"] >= 0 and 0 <= row["share"] <= 1, (name, row)
        assert row["top"] and all(ms >= 0 and k > 0 for _, ms, k in row["top"]), (name, row)
        # The same names ranked by launches: where a host-bound prefill's launches come from.
        counts = [k for _, _, k in row["most_launched"]]
        assert counts and counts == sorted(counts, reverse=True), (name, row)
        assert counts[0] == max(k for _, _, k in row["top"] + row["most_launched"])
    moe = cats["MoE"]
    assert moe["ms"] > 0 and moe["share"] > 0
    assert any("index_add" in n or "matmul" in n or "mm" in n for n, _, _ in moe["top"]), moe
    # The attribution partitions the independently counted top-level ops of the prefill.
    assert sum(r["kernels"] for r in cats.values()) == rec["total"]["kernels"]
    assert sum(r["ms"] for r in cats.values()) == pytest.approx(rec["total"]["ms"], rel=1e-9)
    assert sum(r["share"] for r in cats.values()) == pytest.approx(1.0)
    assert rec["label"] == f"tiny {PROMPT}" and rec["device"] == "cpu" and rec["counts"] == "aten ops"
    assert rec["prompt_len"] == PROMPT and rec["layers"] == _tiny_config().num_hidden_layers
    assert rec["dtype"] == "float32" and rec["quantization"] is None
    assert re.fullmatch(r"[0-9a-f]{40}|unknown", rec["commit"])
    assert rec["wall_ms"] > 0 and rec["unprofiled_wall_ms"] > 0
    # --prefill-graphs: a warm replay and a timed one per length (emulated graphs on CPU).
    assert rec["graph_replays"] == 2 and rec["graph_capture_failed"] is None
    assert rec["graph_memory_gib"] is None  # CPU
    assert rec["graph_unprofiled_wall_ms"] > 0 and "prefill graph: " in census["stdout"]
    assert 0 < rec["busy_ms"] <= rec["wall_ms"]
    assert rec["host_gap_ms"] == pytest.approx(rec["wall_ms"] - rec["busy_ms"])
    table = census["stdout"]
    # Two tables (one per prompt length), each with its header and total row.
    assert table.count("\n| ") == 2 * (len(pc.CATEGORIES) + 2)
    assert f"| **total** | {rec['total']['kernels']} |" in table
    assert "the device is the CPU" in table and "host gaps" in table
    assert "MoE, most launched: " in table


def _time(start: float, end: float) -> SimpleNamespace:
    return SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)


def _host(name, parent=None, kernels=(), span=(0.0, 0.0)):
    return SimpleNamespace(name=name, cpu_parent=parent, device_type=DeviceType.CPU,
                           kernels=[SimpleNamespace(name=k, duration=d) for k, d in kernels],
                           time_range=_time(*span), cpu_time_total=span[1] - span[0],
                           is_user_annotation=False)


def _kernel(name, start, end, annotation=False):
    return SimpleNamespace(name=name, cpu_parent=None, device_type=DeviceType.CUDA, kernels=[],
                           time_range=_time(start, end), cpu_time_total=0.0,
                           is_user_annotation=annotation)


def test_cuda_attribution_on_synthetic_events():
    """A kernel counts in its launcher's innermost category range (a linear inside KDA is a
    dense projection); launches outside every range and kernels no launcher claims go by name;
    GPU mirrors of ranges are not kernels; busy time is the union of the kernels' spans."""
    cat = pc.CATEGORY_PREFIX
    prefill = _host(pc.PREFILL_RANGE, span=(0, 100))
    kda = _host(cat + "KDA", parent=prefill)
    proj = _host(cat + "dense projections", parent=kda)
    gemm = _host("aten::mm", parent=proj, kernels=[("sm90_gemm", 10.0)])
    chunk = _host("aten::empty", parent=kda, kernels=[("chunk_kda_fwd_kernel", 20.0)])
    moe = _host(cat + "MoE", parent=prefill)
    moe.kernels = [SimpleNamespace(name="fused_moe_kernel", duration=30.0),  # launched directly
                   SimpleNamespace(name=cat + "MoE", duration=40.0)]  # its GPU mirror
    argmax = _host("aten::argmax", parent=prefill, kernels=[("argmax_kernel", 2.0)])
    device = [_kernel("sm90_gemm", 0, 10), _kernel("chunk_kda_fwd_kernel", 5, 25),
              _kernel("fused_moe_kernel", 30, 60), _kernel("argmax_kernel", 70, 72),
              _kernel("flash_fwd_kernel", 80, 84),  # no launcher: by name, attention first
              _kernel(cat + "MoE", 30, 70, annotation=True)]
    out = pc.prefill_census([prefill, kda, proj, gemm, chunk, moe, argmax] + device, cuda=True)
    cats = out["categories"]
    got = {c: (r["kernels"], r["us"]) for c, r in cats.items() if r["kernels"]}
    assert got == {"dense projections": (1, 10.0), "KDA": (1, 20.0), "MoE": (1, 30.0),
                   "other": (1, 2.0), "MLA attention": (1, 4.0)}
    assert out["total"] == {"kernels": 5, "us": 66.0}
    assert out["busy_us"] == 25 + 30 + 2 + 4  # [0, 25] overlaps: counted once
    assert cats["MoE"]["share"] == pytest.approx(30 / 66)
    assert cats["KDA"]["top"] == [["chunk_kda_fwd_kernel", 20.0, 1]]


def test_cpu_attribution_counts_the_prefill_range_only():
    """CPU: top-level aten ops inside the prefill range (nested aten calls and ops outside the
    range, e.g. the batch's set-up, are not counted); ops outside category ranges by name."""
    prefill = _host(pc.PREFILL_RANGE, span=(0, 50))
    norm = _host(pc.CATEGORY_PREFIX + "norms", parent=prefill, span=(0, 10))
    mean = _host("aten::mean", parent=norm, span=(0, 4))
    inner = _host("aten::sum", parent=mean, span=(1, 3))  # inside an aten op: not top-level
    sdpa = _host("aten::scaled_dot_product_attention", parent=prefill, span=(10, 30))
    emb = _host("aten::embedding", parent=prefill, span=(35, 40))
    setup = _host("aten::randint", span=(60, 70))  # outside the prefill range
    out = pc.prefill_census([prefill, norm, mean, inner, sdpa, emb, setup], cuda=False)
    got = {c: (r["kernels"], r["us"]) for c, r in out["categories"].items() if r["kernels"]}
    assert got == {"norms": (1, 4.0), "MLA attention": (1, 20.0), "other": (1, 5.0)}
    assert out["total"] == {"kernels": 3, "us": 29.0} and out["busy_us"] == 29.0


@pytest.mark.parametrize("name, category", [
    ("flash_fwd_splitkv_kernel", "MLA attention"),
    ("fmha_cutlassF_f32_aligned_64x64_rf_sm80", "MLA attention"),
    ("aten::scaled_dot_product_attention", "MLA attention"),
    ("chunk_kda_fwd_kernel_o", "KDA"), ("chunk_gated_delta_rule_fwd_h", "KDA"),
    ("causal_conv1d_fwd_kernel", "KDA"), ("aten::_convolution", "KDA"),
    ("fused_moe_kernel", "MoE"), ("aten::index_add_", "MoE"), ("_grouped_mm_kernel", "MoE"),
    ("_rms_norm_kernel", "norms"), ("aten::mm", "dense projections"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", "dense projections"),
    ("_dequant_fp8_blockwise", "dense projections"),
    ("triton_poi_fused_convert_element_type_0", "other"), ("aten::argmax", "other"),
])
def test_name_fallback(name, category):
    assert pc.category_by_name(name) == category


def test_busy_union():
    assert pc.busy_us([]) == 0.0
    assert pc.busy_us([(5, 6), (0, 2), (1, 3), (3, 4), (2.5, 3.5)]) == 5.0


def test_plot_writes_png_and_svg_of_the_census(census, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    # A second run (another label) and a re-run of the first, which replaces it in place.
    rec = dict(census["rec"], label="tiny x2", wall_ms=census["rec"]["wall_ms"] * 2)
    with open(census["path"], "a") as f:
        f.write(json.dumps(rec) + "\n" + json.dumps(dict(census["rec"], wall_ms=1.0)) + "\n")
    png = tmp_path / "p.png"
    assert plot.main([str(census["path"]), "-o", str(png), "--title", "t"]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    table = capsys.readouterr().out
    assert re.search(rf"^\| tiny {PROMPT} \| .* \| 1\.00 \| ", table, re.MULTILINE), table
    assert "| tiny x2 |" in table
    runs = plot.load_runs([str(census["path"])])
    assert [r.label for r in runs] == [f"tiny {PROMPT}", f"tiny {PROMPT // 2}", "tiny x2"]
    assert list(runs[0].categories) == list(pc.CATEGORIES)
    svg = tmp_path / "p.svg"
    assert plot.main([str(census["path"]), "-o", str(svg), "--metric", "share"]) == 0
    assert svg.read_text().lstrip().startswith("<?xml") and "MoE" in svg.read_text()
    assert plot.main([str(census["path"]), "-o", str(tmp_path / "k.png"), "--metric",
                      "kernels"]) == 0


def test_plot_rejects_bad_lines(tmp_path, capsys):
    good = {"label": "a", "wall_ms": 2.0, "host_gap_ms": -0.001,
            "categories": {"MoE": {"kernels": 1, "ms": 1.0, "share": 1.0}}}
    bad = tmp_path / "bad.jsonl"
    for line, message in [
        ({**good, "label": ""}, "'label' must be a non-empty string"),
        ({**good, "categories": {"MoE": {"kernels": 1, "ms": -1, "share": 0}}},
         "'MoE'.ms must be a finite non-negative number"),
        ({**good, "categories": {"KDA": {"kernels": 1, "ms": 1, "share": 1}}},
         "categories differ"),
        ({**good, "wall_ms": None}, "wall_ms must be a finite non-negative number"),
    ]:
        bad.write_text(json.dumps(good) + "\n" + json.dumps(line) + "\n")
        with pytest.raises(SystemExit):
            plot.main([str(bad), "-o", str(tmp_path / "x.png")])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plot.main([str(bad), "-o", str(tmp_path / "x.pdf")])
    assert "--out must name a .png or .svg file" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# --sync-sites
# --------------------------------------------------------------------------------------------
REPO_TREES = [str(ROOT / "python"), str(ROOT / "sgl-kernel" / "python")]
SITE_PACKAGES = "/venv/lib/python3.11/site-packages"


def _frames(*spec):
    """``traceback.FrameSummary`` objects of ``(filename, lineno, function)``, outermost first."""
    return [traceback.FrameSummary(f, n, name, lookup_line=False) for f, n, name in spec]


def test_sync_site_innermost_repo_frame_has_no_via():
    frames = _frames((f"{SITE_PACKAGES}/torch/nn/modules/module.py", 1750, "_call_impl"),
                     (str(ROOT / "python/sglang/srt/models/bailing_moe_v3.py"), 310, "forward"),
                     (str(ROOT / "python/sglang/srt/layers/moe/topk.py"), 88, "select_experts"))
    assert ha.sync_site(frames, REPO_TREES) == ("sglang/srt/layers/moe/topk.py:88 "
                                                "(select_experts)", None)
    # The sgl-kernel tree is the repository too.
    frames.append(traceback.FrameSummary(str(ROOT / "sgl-kernel/python/sgl_kernel/moe.py"),
                                         42, "moe_align", lookup_line=False))
    assert ha.sync_site(frames, REPO_TREES) == ("sgl_kernel/moe.py:42 (moe_align)", None)


def test_sync_site_library_frame_is_the_via_of_its_repo_caller():
    """The innermost frame in site-packages (fla's index helper) is the via; the site is the
    innermost repository frame, not the outer one nor a library frame in between."""
    frames = _frames((str(ROOT / "python/sglang/srt/models/bailing_moe_v3.py"), 310, "forward"),
                     (str(ROOT / "python/sglang/srt/layers/attention/kda.py"), 205, "prefill"),
                     (f"{SITE_PACKAGES}/fla/ops/kda/chunk.py", 300, "chunk_kda"),
                     (f"{SITE_PACKAGES}/fla/ops/utils/index.py", 164, "prepare_chunk_indices"))
    assert ha.sync_site(frames, REPO_TREES) == (
        "sglang/srt/layers/attention/kda.py:205 (prefill)",
        "fla/ops/utils/index.py:164 (prepare_chunk_indices)")
    # Outside site-packages: below the longest import root that holds it.
    frames[-1] = traceback.FrameSummary("/opt/py/lib/python3.11/contextlib.py", 81, "inner",
                                        lookup_line=False)
    assert ha.sync_site(frames, REPO_TREES, ["/opt", "/opt/py/lib/python3.11"])[1] == (
        "contextlib.py:81 (inner)")


def test_sync_site_without_repo_frame_is_the_innermost_frame():
    # A sibling folder whose name starts like a tree's is not inside it.
    frames = _frames((str(ROOT / "python_old/sglang/x.py"), 3, "run"),
                     (f"{SITE_PACKAGES}/torch/functional.py", 1500, "unique"))
    assert ha.sync_site(frames, REPO_TREES) == ("torch/functional.py:1500 (unique)", None)
    frames = _frames((str(ROOT / "python_old/sglang/x.py"), 3, "run"))
    assert ha.sync_site(frames, REPO_TREES) == (f"{ROOT.as_posix()}/python_old/sglang/x.py:3 (run)",
                                                None)
    assert ha.sync_site([], REPO_TREES) == ("<unknown>", None)


def test_count_sync_sites_ranks_by_count():
    a, b = "sglang/a.py:1 (f)", "sglang/b.py:2 (g)"
    via = "fla/ops/utils/index.py:164 (prepare_chunk_indices)"
    records = [(a, None)] * 3 + [(b, via)] * 5 + [(a, via), (b, None), (b, None), (b, None)]
    assert pc.count_sync_sites(records) == [
        {"site": b, "via": via, "count": 5}, {"site": a, "via": None, "count": 3},
        {"site": b, "via": None, "count": 3}, {"site": a, "via": via, "count": 1}]
    assert pc.count_sync_sites([]) == []


# A library function compiled under a site-packages path, its warn call on line 164.
_LIB = {}
exec(compile("\n" * 162 + "def prepare_chunk_indices(warn, message):\n    warn(message)\n",
             f"{SITE_PACKAGES}/fla/ops/utils/index.py", "exec"), _LIB)


def _layer_forward():
    """Repository code: a sync through the library, a direct one, and another warning."""
    _LIB["prepare_chunk_indices"](warnings.warn, "called a synchronizing CUDA operation "
                                                 "(Triggered internally at Copy.cpp:1.)")
    for _ in range(2):
        warnings.warn("called a synchronizing CUDA operation")
    warnings.warn("an unrelated warning")


class _Worker:
    def __init__(self, body):
        self.body = body

    def prefill(self, batch):
        return self.body()


def test_sync_census_records_every_sync_at_its_site(monkeypatch):
    """The debug mode is on around exactly the prefill and restored after it, also when it
    fails; each sync is counted at its site (the warnings machinery and the hook dropped from
    the stack); other warnings reach the previous handler once."""
    modes, shown = [], []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(pc, "run_once", lambda worker, b, n, o, seed: worker.prefill("batch"))
    monkeypatch.setattr(pc, "repo_roots", lambda: [str(Path(__file__).resolve().parent)])
    monkeypatch.setattr(warnings, "showwarning", lambda message, *args: shown.append(str(message)))

    def body():
        assert modes == ["warn"]
        _layer_forward()
        return "result"

    worker = _Worker(body)
    out = pc.sync_census(worker, 16, 0)
    assert modes == ["warn", 0] and "prefill" not in vars(worker)
    line = _layer_forward.__code__.co_firstlineno
    me = Path(__file__).name
    assert out == {"syncs": 3, "sync_sites": [
        {"site": f"{me}:{line + 5} (_layer_forward)", "via": None, "count": 2},
        {"site": f"{me}:{line + 2} (_layer_forward)",
         "via": "fla/ops/utils/index.py:164 (prepare_chunk_indices)", "count": 1}]}
    assert shown == ["an unrelated warning"]
    table = pc.sync_table(out)
    assert f"| 2 | {me}:{line + 5} (_layer_forward) |  |" in table
    assert table.splitlines()[-1] == "| **3** | **total** (2 sites) | |"

    def failing():
        raise RuntimeError("boom")

    modes.clear()
    worker = _Worker(failing)
    with pytest.raises(RuntimeError, match="boom"):
        pc.sync_census(worker, 16, 0)
    assert modes == ["warn", 0] and "prefill" not in vars(worker)
    warnings.warn("called a synchronizing CUDA operation")  # the hook is gone again
    assert shown[-1] == "called a synchronizing CUDA operation"


def _copying_layer(x: torch.Tensor):
    """Repository code: three copies and a fill of 16-32 KiB, a small copy, no-copy ops."""
    a = x.t().contiguous()
    b = torch.cat([x, x])
    c = x.to(torch.float64)
    a.zero_()
    small = x[:2].t().contiguous()
    return a, b, c, small, x + 1, x[:1].contiguous()


def test_recording_copies_names_each_copy_at_its_site():
    """``--copy-sites``' recorder: each torch op that only copies or fills memory, at its
    caller's line with its op and bytes, the small one left out; ranked by bytes, then site."""
    x = torch.randn(64, 64)  # 16 KiB
    with ha.recording_copies([str(Path(__file__).resolve().parent)], min_bytes=4096) as recs:
        _copying_layer(x)
    line = _copying_layer.__code__.co_firstlineno
    me = Path(__file__).name
    site = lambda n: f"{me}:{line + n} (_copying_layer)"  # noqa: E731
    assert ha.count_copy_sites(recs) == [
        {"site": site(3), "via": None, "op": "cat", "count": 1, "mb": 32 / 1024},
        {"site": site(4), "via": None, "op": "_to_copy", "count": 1, "mb": 32 / 1024},
        {"site": site(2), "via": None, "op": "clone", "count": 1, "mb": 16 / 1024},
        {"site": site(5), "via": None, "op": "zero_", "count": 1, "mb": 16 / 1024}]
    with ha.recording_copies([str(Path(__file__).resolve().parent)]) as recs:
        pass
    assert recs == [] and ha.count_copy_sites([]) == []
    x.t().contiguous()  # the mode is gone after the block


def test_sync_sites_on_cpu_is_a_noop(tmp_path):
    path = tmp_path / "sync.jsonl"
    out = _run_census("--prompt-len", str(PROMPT // 2), "--timed", "0", "--sync-sites",
                      "--result-filename", str(path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("--sync-sites needs CUDA") == 1
    [rec] = [json.loads(line) for line in path.read_text().splitlines()]
    assert "sync_sites" not in rec and "syncs" not in rec
    assert rec["total"]["kernels"] > 0 and "| syncs |" not in out.stdout


def _squares(n: int) -> int:
    total = 0
    for i in range(n):  # a Python loop: the time is the function's own
        total += i * i
    return total


def _big_layer():
    """Repository code the host profile should rank first by its own time."""
    return _squares(300000)


def _small_layer():
    return _squares(100000) + 1


def _two_layers():
    return _big_layer() + _small_layer()


def test_host_census_times_and_ranks_the_prefill(monkeypatch):
    """``--host-profile``: one timed and one cProfiled prefill around exactly
    ``worker.prefill``, the prefill's costliest function first by own time, the repository's
    functions by time with callees without the calls around the whole prefill, and the
    printed tables."""
    monkeypatch.setattr(pc, "run_once", lambda worker, b, n, o, seed: worker.prefill("batch"))
    monkeypatch.setattr(pc, "repo_roots", lambda: [str(Path(__file__).resolve().parent)])
    worker = _Worker(_two_layers)
    worker.model_runner = SimpleNamespace(device=torch.device("cpu"))
    out = pc.host_census(worker, 16, 0, top=4)
    assert "prefill" not in vars(worker)
    assert 0 < out["host_return_ms"] <= out["host_wall_ms"] and out["host_profile_ms"] > 0
    me = Path(__file__).name
    sq, big, small = (f.__code__.co_firstlineno for f in (_squares, _big_layer, _small_layer))
    by_self, by_cum = out["host_profile"]["by_self"], out["host_profile"]["by_cumulative"]
    assert len(by_self) == 4 and by_self[0]["function"] == f"{me}:{sq} (_squares)"
    assert by_self[0]["calls"] == 2
    # This file's functions, without _Worker.prefill, _two_layers and _squares (each over 90%
    # of the whole prefill).
    assert [r["function"] for r in by_cum] == [f"{me}:{big} (_big_layer)",
                                               f"{me}:{small} (_small_layer)"]
    assert all(set(r) == {"function", "calls", "self_ms", "cumulative_ms"}
               for r in by_self + by_cum)
    packages = out["host_profile"]["by_package"]
    assert packages[0]["package"] == me  # this file: top-level, so its name is the package
    assert abs(sum(r["share"] for r in packages) - 1) < 1e-9
    text = pc.host_tables(out)
    assert f"| {me} | {packages[0]['self_ms']:.2f} | " in text
    row = by_cum[0]
    assert f"| {row['self_ms']:.2f} | {row['cumulative_ms']:.2f} | 1 | {me}:{big} " \
           f"(_big_layer) |" in text


def test_package_of_labels():
    assert ha.package_of("triton/runtime/jit.py:695 (run)") == "triton"
    assert ha.package_of("sgl_kernel/rmsnorm.py:137 (rmsnorm)") == "sgl_kernel"
    assert ha.package_of("<built-in method torch._scaled_mm>") == "torch (C++)"
    assert ha.package_of("<method 'stride' of 'torch._C.TensorBase' objects>") == "torch (C++)"
    assert ha.package_of("<method 'get' of 'dict' objects>") == "python built-ins"
    rows = [{"function": "fla/a.py:1 (f)", "self_ms": 3.0},
            {"function": "fla/b.py:2 (g)", "self_ms": 1.0},
            {"function": "<built-in method builtins.len>", "self_ms": 4.0}]
    assert ha.host_time_by_package(rows) == [
        {"package": "fla", "self_ms": 4.0, "share": 0.5},
        {"package": "python built-ins", "self_ms": 4.0, "share": 0.5}]


def test_function_label_paths():
    roots = ["/repo/python"]
    assert ha.function_label(("/repo/python/sglang/x.py", 3, "f"), roots) == "sglang/x.py:3 (f)"
    assert ha.function_label(("/usr/lib/python3/site-packages/fla/ops/k.py", 9, "g"), roots) \
        == "fla/ops/k.py:9 (g)"
    assert ha.function_label(("~", 0, "<built-in method torch.empty>"), roots) \
        == "<built-in method torch.empty>"


def test_routing_census_counts_pairs_per_expert(tmp_path):
    """``--routing``: every MoE layer of the bundled model reports the experts its prefill
    touched and its largest group, consistent with the pairs routed, beside the uniform
    expectation."""
    path = tmp_path / "routing.jsonl"
    out = _run_census("--prompt-len", str(PROMPT), "--timed", "0", "--routing",
                      "--copy-sites", "--copy-min-mb", "0.001", "--result-filename", str(path))
    assert out.returncode == 0, out.stderr[-2000:]
    [rec] = [json.loads(line) for line in path.read_text().splitlines()]
    cfg = _tiny_config()
    r = rec["routing"]
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    assert r["moe_layers"] == len(r["per_layer"]) == moe_layers > 0
    assert r["experts"] == cfg.num_experts and r["top_k"] == cfg.num_experts_per_tok
    assert r["tokens"] == PROMPT
    pairs = PROMPT * r["top_k"]
    for touched, largest in r["per_layer"]:
        # At least pairs / touched in the largest group, at most one pair per token.
        assert r["top_k"] <= touched <= r["experts"]
        assert pairs / touched <= largest <= PROMPT
    assert r["touched_min"] == min(t for t, _ in r["per_layer"])
    assert 0 < r["uniform_touched"] <= r["experts"]
    assert "routing: " in out.stdout and "uniform top-" in out.stdout
    # --copy-sites in the same run: the KDA layers' conv window cat is among the sites, each
    # site named in this repository, the total their sum.
    sites = rec["copy_sites"]
    assert rec["copy_min_mb"] == 0.001 and sites
    assert rec["copy_mb"] == pytest.approx(sum(s["mb"] for s in sites))
    assert all(s["site"].startswith(("sglang/", "sgl_kernel/")) for s in sites)
    assert any(s["op"] == "cat" and "kda_ops.py" in s["site"] for s in sites)
    assert "| MiB | ops | op | site | via |" in out.stdout
