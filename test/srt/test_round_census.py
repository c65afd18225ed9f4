"""benchmark/batch1/round_census.py's category census and plot_census.py: the module -> category
table on the bundled model, the attribution of a CPU run (decode step and NEXTN-3 round, every
top-level aten op in exactly one category), the floors against weight_floor, the CUDA branch of
the attribution on synthetic profiler events, the per-phase mode, and the PNG of two runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from sglang.test.script_loader import load_script

ROOT = Path(__file__).resolve().parents[2]
BATCH1 = ROOT / "benchmark" / "batch1"
TINY = ROOT / "python" / "sglang" / "assets" / "tiny-bailing-v3"
RUN_ARGS = ["--device", "cpu", "--dtype", "float32", "--prompt-len", "16", "--steps", "2",
            "--warmup", "1"]
NEXTN3 = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3"]


def _load(name: str) -> ModuleType:
    """A script under benchmark/batch1 imported by its path (the folder is no package)."""
    return load_script(BATCH1 / f"{name}.py", f"batch1_{name}")


rc = _load("round_census")
pc = _load("plot_census")
wf = _load("weight_floor")


def _run(script: str, *args: str) -> str:
    """Run ``benchmark/batch1/<script>`` in a fresh process; its stdout."""
    path = os.pathsep.join([str(ROOT / "python"), str(ROOT / "sgl-kernel/python"),
                            os.environ.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, str(BATCH1 / script), *args], capture_output=True,
                         text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": path})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.fixture(scope="module")
def census(tmp_path_factory):
    """The JSON lines of a decode census (label "before") and a NEXTN-3 census on the bundled
    model, and the stdout of each."""
    path = tmp_path_factory.mktemp("census") / "census.jsonl"
    out = {"decode": _run("round_census.py", *RUN_ARGS, "--label", "before",
                          "--result-filename", str(path)),
           "NEXTN-3": _run("round_census.py", *RUN_ARGS, *NEXTN3, "--result-filename", str(path))}
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["mode"] for r in lines] == ["decode", "NEXTN-3"]
    return {"decode": lines[0], "NEXTN-3": lines[1], "stdout": out, "path": path}


def _tiny_config():
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig.from_path(str(TINY), None).hf_config


def test_category_table_maps_the_bundled_model_modules():
    """Every decoder layer's attention, MLP pieces and outer norms get their category; the
    attention modules' inner norms and the MTP layer's eh_proj open no range of their own."""
    from sglang.srt.models.bailing_moe_v3 import BailingMoeV3ForCausalLM
    from sglang.srt.models.bailing_moe_v3_nextn import BailingMoeForCausalLMNextN

    cfg = _tiny_config()
    with torch.device("meta"):
        target = BailingMoeV3ForCausalLM(cfg, torch.float32)
        draft = BailingMoeForCausalLMNextN(cfg, torch.float32)
    got = {name: cat for name, _, cat in rc.categorised_modules(target)}
    n = cfg.num_hidden_layers
    want = {"model.norm": "norms", "logits_processor": "lm_head"}
    for i in range(n):
        p = f"model.layers.{i}."
        want[p + "attention"] = "KDA" if cfg.is_kda_layer(i) else "MLA"
        want[p + "input_layernorm"] = want[p + "post_attention_layernorm"] = "norms"
        if cfg.is_moe_layer(i):
            want.update({p + "mlp": "routed experts + combine",
                         p + "mlp.experts": "routed experts + combine",
                         p + "mlp.gate": "router", p + "mlp.shared_experts": "shared expert"})
        else:
            want[p + "mlp"] = "dense MLP"
    assert got == want
    assert {"KDA", "MLA", "dense MLP"} <= set(want.values())  # the bundled model has them all
    got = {name: cat for name, _, cat in rc.categorised_modules(draft)}
    d = "model.decoder."
    assert got == {"model.enorm": "norms", "model.hnorm": "norms",
                   "model.final_layernorm": "norms", "logits_processor": "lm_head",
                   d + "input_layernorm": "norms", d + "post_attention_layernorm": "norms",
                   d + "attention": "MLA", d + "mlp": "routed experts + combine",
                   d + "mlp.experts": "routed experts + combine", d + "mlp.gate": "router",
                   d + "mlp.shared_experts": "shared expert"}


@pytest.mark.parametrize("mode", ["decode", "NEXTN-3"])
def test_cpu_census_attributes_every_op_to_one_category(census, mode):
    rec = census[mode]
    cats = rec["categories"]
    assert list(cats) == list(rc.CATEGORIES)
    for name, row in cats.items():
        assert row["kernels"] > 0 and row["us"] > 0, (name, row)  # the model has every category
        assert row["kernels"] == row["ops"]  # CPU: the counted units are the aten ops
    # The attribution partitions the independently counted top-level ops.
    assert sum(r["kernels"] for r in cats.values()) == rec["total"]["kernels"]
    assert sum(r["us"] for r in cats.values()) == pytest.approx(rec["total"]["us"], rel=1e-9)
    table = census["stdout"][mode]
    assert table.count("\n| ") == len(rc.CATEGORIES) + 2  # the header and the total row
    assert f"| **total** | {rec['total']['kernels']:.1f} |" in table


def test_nextn_round_has_more_work_than_a_decode_step(census):
    """The round runs the target over 4 tokens and the MTP layer (MLA + MoE) 3 times: more
    lm_head, MLA, MoE and acceptance work than one decode step."""
    dec, spec = census["decode"]["categories"], census["NEXTN-3"]["categories"]
    for name in ("lm_head", "MLA", "routed experts + combine", "other"):
        assert spec[name]["kernels"] > dec[name]["kernels"], name


def test_json_line_fields_and_floors(census):
    rec = census["decode"]
    assert rec["label"] == "before" and census["NEXTN-3"]["label"] == "NEXTN-3"
    assert rec["device"] == "cpu" and rec["counts"] == "aten ops" and rec["graph"] is None
    assert rec["steps"] == 2 and rec["prompt_len"] == 16 and rec["bandwidth_tbs"] == 4.3
    assert set(rec["eager"]) == {"iter_ms", "profiled_iter_ms"}
    for r in (rec, census["NEXTN-3"]):
        floors = {c: row["floor_us"] for c, row in r["categories"].items()}
        assert all(v > 0 for v in floors.values()), floors  # every category reads bytes
        assert r["total"]["floor_us"] == pytest.approx(sum(floors.values()))
    # The floors are weight_floor's bytes (fp32 weights here) over 4.3 TB/s.
    parts = wf.decode_step_bytes(_tiny_config(), rec["context"], 4)
    us = {c: row["floor_us"] * 4.3e6 for c, row in rec["categories"].items()}
    assert us["KDA"] == pytest.approx(parts["kda_weights"] + parts["kda_state"])
    assert us["routed experts + combine"] == pytest.approx(parts["moe_routed"])
    assert us["lm_head"] == pytest.approx(parts["lm_head"])
    # NEXTN-3: the target and three MTP forwards each read the whole lm_head.
    spec = census["NEXTN-3"]["categories"]["lm_head"]["floor_us"]
    assert spec == pytest.approx(4 * rec["categories"]["lm_head"]["floor_us"])


def test_floor_bytes_of_a_nextn_round_add_the_mtp_layer():
    cfg = _tiny_config()
    plain = rc.category_floor_bytes(cfg, 100, 2)
    parts = wf.decode_step_bytes(cfg, 100, 2)
    h = cfg.hidden_size
    assert plain["norms"] == (2 * cfg.num_hidden_layers + 1) * h * 2
    assert sum(plain.values()) == pytest.approx(parts["total"] + plain["norms"] + h * 2)
    round_ = rc.category_floor_bytes(cfg, 100, 2, nextn_draft_tokens=4)
    assert round_["KDA"] == plain["KDA"]  # the MTP layer has no KDA
    assert round_["dense MLP"] == plain["dense MLP"]
    assert round_["norms"] == plain["norms"] + 3 * 5 * h * 2
    assert round_["other"] == 4 * h * 2 + 3 * (2 * h * h * 2) + (1 + 1 + 4) * h * 2
    with pytest.raises(ValueError, match="NEXTN chain"):
        rc.category_floor_bytes(cfg, 100, 2, nextn_draft_tokens=1)
    with pytest.raises(ValueError, match="positive"):
        rc.category_floor_bytes(cfg, 0, 2)


def test_floor_bytes_of_fp8_weights_count_a_byte_per_projection_weight():
    """Block-fp8 projections and experts read about one byte a weight (the scales' share
    besides); the router, lm_head, norms and caches stay in the model dtype."""
    cfg = _tiny_config()
    bf16 = rc.category_floor_bytes(cfg, 100, 2, nextn_draft_tokens=4)
    fp8 = rc.category_floor_bytes(cfg, 100, 2, nextn_draft_tokens=4,
                                  quant_bytes=wf.FP8_BLOCK_BYTES,
                                  draft_quant_bytes=wf.FP8_BLOCK_BYTES)
    target = wf.decode_step_bytes(cfg, 100, 2, 4, quant_bytes=wf.FP8_BLOCK_BYTES)
    assert fp8["KDA"] == pytest.approx(target["kda_weights"] + target["kda_state"])
    for c in ("lm_head", "router", "norms"):
        assert fp8[c] == bf16[c]
    for c in ("routed experts + combine", "dense MLP"):
        assert fp8[c] == pytest.approx(bf16[c] * wf.FP8_BLOCK_BYTES / 2)
    # The MTP layer's own projections (eh_proj among them) follow draft_quant_bytes.
    target_only = rc.category_floor_bytes(cfg, 100, 2, nextn_draft_tokens=4,
                                          quant_bytes=wf.FP8_BLOCK_BYTES)
    assert target_only["other"] - fp8["other"] == pytest.approx(
        3 * 2 * cfg.hidden_size ** 2 * (2 - wf.FP8_BLOCK_BYTES))
    weights = torch.nn.Linear(4, 4)
    assert rc._quant_bytes(SimpleNamespace(model=weights)) is None
    weights.weight.data = weights.weight.data.to(torch.float8_e4m3fn)
    assert rc._quant_bytes(SimpleNamespace(model=weights)) == wf.FP8_BLOCK_BYTES


def _event(name, parent=None, device=DeviceType.CPU, kernels=(), us=0.0, annotation=False,
           start=0.0, end=None):
    """A profiler event: host (with the kernels it launched) or device, spanning
    ``[start, end]`` (default ``start + us``)."""
    end = start + us if end is None else end
    return SimpleNamespace(name=name, cpu_parent=parent, device_type=device,
                           kernels=[SimpleNamespace(name=k, duration=d) for k, d in kernels],
                           time_range=SimpleNamespace(elapsed_us=lambda: us, start=start, end=end),
                           cpu_time_total=us, is_user_annotation=annotation)


def test_cuda_attribution_on_synthetic_events():
    """Kernels count under their launcher's innermost category range (a range that launches
    directly counts for itself), the GPU mirrors of ranges are not kernels, and a kernel no CPU
    event claims counts in the category range open on the host when it started, else in
    "other", so the categories add up to the device total."""
    kda = _event(rc.CATEGORY_PREFIX + "KDA", start=0.0, end=100.0)
    norm = _event(rc.CATEGORY_PREFIX + "norms", parent=kda, start=40.0, end=60.0)  # innermost
    mm = _event("aten::mm", parent=kda, kernels=[("gemv", 3.0)])
    add = _event("aten::add", parent=norm, kernels=[("add", 1.0), ("add2", 1.0)])
    kda.kernels = [SimpleNamespace(name="triton_kda", duration=5.0),  # launched in the range
                   SimpleNamespace(name=rc.CATEGORY_PREFIX + "KDA", duration=9.0)]  # its mirror
    argmax = _event("aten::argmax", kernels=[("argmax", 2.0)])  # outside every range
    device = [_event(k, device=DeviceType.CUDA, us=d, start=t) for k, d, t in
              [("gemv", 3.0, 10.0), ("add", 1.0, 45.0), ("add2", 1.0, 46.0),
               ("triton_kda", 5.0, 20.0), ("argmax", 2.0, 150.0),
               ("orphan", 4.0, 200.0),  # unclaimed, after every range: "other"
               ("norm_triton", 6.0, 50.0),  # unclaimed, while "norms" was open on the host
               ("kda_triton", 2.0, 60.0)]]  # unclaimed, as "norms" closed: "KDA" again
    device.append(_event(rc.CATEGORY_PREFIX + "KDA", device=DeviceType.CUDA, us=9.0,
                         annotation=True))
    rows, total = rc.category_census([kda, norm, mm, add, argmax] + device, 2, cuda=True)
    assert total == {"kernels": 4.0, "us": 12.0}  # 8 kernels, 24 us over 2 iterations
    assert rows["KDA"] == {"kernels": 1.5, "us": 5.0, "ops": 0.5}
    assert rows["norms"] == {"kernels": 1.5, "us": 4.0, "ops": 0.5}
    assert rows["other"] == {"kernels": 1.0, "us": 3.0, "ops": 0.5}  # argmax + the orphan
    assert sum(r["kernels"] for r in rows.values()) == total["kernels"]


def test_kernels_by_name_ranks_a_replay_by_launches():
    """The replayed graphs' histogram: launches and µs per iteration, most launched first,
    ties by time then name."""
    ev = lambda name, us: SimpleNamespace(name=name, time_range=SimpleNamespace(  # noqa: E731
        elapsed_us=lambda: us))
    device = [ev("gemv", 3.0), ev("norm", 1.0), ev("gemv", 5.0), ev("norm", 1.0),
              ev("copy", 0.5), ev("add", 0.5)]
    assert rc.kernels_by_name(device, 2) == [["gemv", 1.0, 4.0], ["norm", 1.0, 1.0],
                                             ["add", 0.5, 0.25], ["copy", 0.5, 0.25]]
    assert rc.kernels_by_name([], 3) == []


def test_range_timeline_answers_the_innermost_open_range():
    RangeTimeline = rc.RangeTimeline  # census_common's, as round_census imports it
    p = "r::"
    events = [_event(p + "outer", start=0.0, end=100.0),
              _event(p + "inner", start=10.0, end=20.0),
              _event(p + "inner2", start=20.0, end=30.0),  # starts where the previous ends
              _event(p + "deep", start=25.0, end=28.0),
              _event(p + "later", start=150.0, end=160.0),
              _event("aten::mm", start=12.0, end=13.0),  # not a range of the prefix
              _event(p + "gpu mirror", device=DeviceType.CUDA, start=0.0, end=500.0)]
    tl = RangeTimeline(events, p)
    want = {-1.0: None, 0.0: "outer", 5.0: "outer", 10.0: "inner", 19.9: "inner",
            20.0: "inner2", 25.0: "deep", 28.0: "inner2", 30.0: "outer", 99.0: "outer",
            100.0: None, 120.0: None, 155.0: "later", 160.0: None, 1e9: None}
    assert {t: tl.at(t) for t in want} == want
    assert RangeTimeline([], p).at(3.0) is None


def test_phase_census_counts_unlinked_device_work_by_host_time():
    """A DSPARK-like profile on CUDA: launches a host op claims count under its phase; device
    work no host op claims counts in the phase open when it started (``by_time``); the GPU
    mirrors of the phase ranges are neither."""
    draft = _event(rc.PREFIX + "draft layers", start=0.0, end=50.0)
    verify = _event(rc.PREFIX + "verify forward", start=50.0, end=200.0)
    mm = _event("aten::mm", parent=draft, kernels=[("gemm", 4.0)], start=1.0, end=2.0)
    # The range's own claim on its GPU mirror is no launch.
    verify.kernels = [SimpleNamespace(name=rc.PREFIX + "verify forward", duration=150.0)]
    device = [_event("gemm", device=DeviceType.CUDA, us=4.0, start=3.0),
              _event("_small_m_gemm_kernel", device=DeviceType.CUDA, us=10.0, start=60.0),
              _event("_grouped_gemv_kernel", device=DeviceType.CUDA, us=8.0, start=120.0),
              _event("_kda_step", device=DeviceType.CUDA, us=1.0, start=30.0),
              _event("late", device=DeviceType.CUDA, us=2.0, start=400.0),
              _event(rc.PREFIX + "verify forward", device=DeviceType.CUDA, us=150.0,
                     start=55.0, annotation=True)]
    rows = rc._phase_census([draft, verify, mm] + device, 2)
    assert rows["draft layers"] == {"ops": 0.5, "launches": 1.0, "kernel_us": 2.5, "by_time": 0.5}
    assert rows["verify forward"] == {"ops": 0.0, "launches": 1.0, "kernel_us": 9.0,
                                      "by_time": 1.0}
    assert rows["other"] == {"ops": 0.0, "launches": 0.5, "kernel_us": 1.0, "by_time": 0.5}


def test_hooks_open_nested_ranges_and_come_off():
    """On a real module tree: ops inside a nested categorised module count there, the rest of
    the parent in the parent's category; after removal nothing is attributed."""
    from torch.profiler import profile

    from sglang.srt.layers.moe.moe_layer import BailingMLP

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = BailingMLP(8, 16)

        def forward(self, x):
            return self.mlp(x) * 2

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Layer()

        def forward(self, x):
            return self.block(x)

    model, x = Model(), torch.randn(2, 8)
    for p in model.parameters():
        torch.nn.init.normal_(p)
    remove = rc.install_category_hooks([model])
    with profile() as prof:
        model(x)
    remove()
    rows, total = rc.category_census(prof.events(), 1, cuda=False)
    assert rows["dense MLP"]["kernels"] > 0
    assert rows["other"]["kernels"] == 1  # the "* 2" outside the MLP
    assert sum(r["kernels"] for r in rows.values()) == total["kernels"]
    with profile() as prof:
        model(x)
    rows, _ = rc.category_census(prof.events(), 1, cuda=False)
    assert rows["dense MLP"]["kernels"] == 0 and rows["other"]["kernels"] > 1


def test_plot_census_writes_a_png_of_two_runs(census, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "census.png"
    assert pc.main([str(census["path"]), "-o", str(out), "--title", "t"]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    table = capsys.readouterr().out
    assert "| before (decode) |" in table and "| NEXTN-3 |" in table
    runs = pc.load_runs([str(census["path"])])
    assert [r.name for r in runs] == ["before (decode)", "NEXTN-3"]
    assert list(runs[0].categories) == list(rc.CATEGORIES)
    assert pc.main([str(census["path"]), "-o", str(tmp_path / "k.png"), "--metric",
                    "kernels"]) == 0


def test_plot_census_rejects_bad_lines(tmp_path, capsys):
    good = {"label": "a", "mode": "decode", "graph": None,
            "categories": {"KDA": {"kernels": 1, "us": 2.0, "floor_us": 0.5}}}
    bad = tmp_path / "bad.jsonl"
    for line, message in [
        ({**good, "mode": ""}, "'mode' must be a non-empty string"),
        ({**good, "categories": {"KDA": {"kernels": 1, "us": -1, "floor_us": 0}}},
         "'KDA'.us must be a finite non-negative number"),
        ({**good, "categories": {"MLA": {"kernels": 1, "us": 1, "floor_us": 0}}},
         "categories differ"),
    ]:
        bad.write_text(json.dumps(good) + "\n" + json.dumps(line) + "\n")
        with pytest.raises(SystemExit):
            pc.main([str(bad), "-o", str(tmp_path / "x.png")])
        assert message in capsys.readouterr().err
    bad.write_text("{not json\n")
    with pytest.raises(SystemExit):
        pc.main([str(bad), "-o", str(tmp_path / "x.png")])
    assert "bad.jsonl:1: not JSON" in capsys.readouterr().err


def test_dspark_round_is_split_into_its_phases(tmp_path):
    """``--by phase`` on a DSPARK round of the bundled model (its ``dspark/`` draft, block 3):
    every DSPARK phase gets work of its own, in the table and in the JSON line. A one-probe SPS
    table is flat (every draft is verified) and makes the confidence head and the planner
    run."""
    sps = tmp_path / "flat_sps.json"
    sps.write_text(json.dumps({"sample_batch_tokens": [1], "sample_steps_per_sec": [1.0],
                               "max_batch_tokens": 4096}))
    lines = tmp_path / "phases.jsonl"
    out = _run("round_census.py", *RUN_ARGS, "--speculative-algorithm", "DSPARK",
               "--speculative-dspark-block-size", "3", "--speculative-dspark-sps-table-path",
               str(sps), "--by", "phase", "--result-filename", str(lines))
    assert "DSPARK-3" in out
    record = json.loads(lines.read_text())
    assert (record["mode"], record["label"], record["by"], record["round_tokens"]) == \
        ("DSPARK-3", "DSPARK-3", "phase", 4)
    assert all(record["phases"][p]["ops"] > 0 for p in rc.DSPARK_PHASES)
    ops = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 4 and cells[1].replace(".", "").isdigit():
            ops[cells[0]] = float(cells[1])
    for phase in rc.DSPARK_PHASES:
        assert ops.get(phase, 0) > 0, (phase, out)
    assert "target forward" not in ops and "MTP forward" not in ops
    assert rc.census_mode("DSPARK", None, 15) == "DSPARK-15"
    assert rc.census_mode("NEXTN", 3, 3) == "NEXTN-3" and rc.census_mode(None, None, 0) == "decode"
