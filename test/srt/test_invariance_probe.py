"""benchmark/batch1/invariance_probe.py on CPU (the bundled model, fp32, NEXTN-3): it runs end
to end, pairs verify rows with plain decode rows, and names exactly the module where an injected
verify-only difference appears (not an earlier one, not its parent)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Tuple

import pytest
import torch

from sglang.test.script_loader import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmark/batch1/invariance_probe.py"
PROMPT_LEN, GEN = 16, 4
ARGV = ["--device", "cpu", "--dtype", "float32", "--speculative-algorithm", "NEXTN",
        "--speculative-num-steps", "3", "--max-total-tokens", "2048",
        "--max-running-requests", "2", "--random-seed", "0", "--log-level", "warning",
        "--prompt-len", str(PROMPT_LEN), "--gen", str(GEN)]
# Injected where the un-patched run of the same setup agrees up to it (row-by-row GEMMs, or a CPU
# whose GEMMs round a row alike at M = 1 and M = 4): a module with children, past KDA and GEMMs.
DEEP_TARGET = "model.layers.1.mlp"


def _load_probe() -> Any:
    return load_script(SCRIPT)


PROBE = _load_probe()


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Tuple[Dict[str, Any], str, Dict[str, Any]]:
    """The un-patched probe through its command line: (returned record, printed report, the
    --result-filename JSON line)."""
    out = tmp_path_factory.mktemp("probe") / "probe.jsonl"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        result = PROBE.main(ARGV + ["--result-filename", str(out)])
    lines = out.read_text().splitlines()
    assert len(lines) == 1
    return result, stdout.getvalue(), json.loads(lines[0])


def test_probe_runs_nextn_end_to_end(baseline):
    result, report, line = baseline
    assert result["modules_compared"] > 10, report
    assert result["paired_rows"] >= 1, report
    assert result["prefill_rows"] == PROMPT_LEN  # the two prefills, row by row
    # Row 0 of the first verify is the anchor: the prefill's token at the first new position.
    anchor = result["pairs"][0]
    assert (anchor["spec"], anchor["position"]) == (f"verify 0 row 0 @ pos {PROMPT_LEN}",
                                                    PROMPT_LEN)
    assert anchor["token"] == result["plain_tokens"][0] == result["spec_tokens"][0]
    # The table is in return order: a layer's children before the layer, layers in order.
    names = [m["module"] for m in result["modules"]]
    assert names.index("model.layers.0.input_layernorm") < names.index("model.layers.0") \
        < names.index("model.layers.1.input_layernorm") < names.index("logits_processor")
    assert line["modules_compared"] == result["modules_compared"]
    assert line["first_difference"] == result["first_difference"]
    assert PROBE.verdict(result) in report.splitlines()
    if result["first_difference"] is None:
        assert f"batch-invariant over {result['modules_compared']} modules" in report
    else:
        # Pairing puts the same token at the same position side by side: the lookup agrees.
        first = result["first_difference"]["module"]
        assert first != "model.word_embeddings", report
        assert f"first difference at {first}" in report


def injection_target(result: Dict[str, Any]) -> str:
    """Where to inject, from an un-patched run's report: :data:`DEEP_TARGET` when the first
    verify calls it before the first difference (or nothing differed), else the module that
    returned right before the first difference. Either way nothing before the target differed
    in the first verify (the table is in its return order; a later verify may differ earlier,
    but the injected difference shows in the first one already)."""
    names = [m["module"] for m in result["modules"]]
    first = result["first_difference"]
    if first is not None:
        assert not first["where"][0].startswith("extend"), first  # the prefills agree
    end = len(names) if first is None else names.index(first["module"])
    if DEEP_TARGET in names[:end]:
        return DEEP_TARGET
    assert end > 0, f"nothing precedes the first difference {first['module']}"
    return names[end - 1]


def bump_when_several_rows(module: torch.nn.Module) -> None:
    """Make ``module`` add one ulp to its (first) output whenever its first argument has more
    than one row: a verify (and a prefill, the same in both runs) but never a 1-row decode."""
    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        if args[0].shape[0] <= 1:
            return out
        if isinstance(out, tuple):
            return (torch.nextafter(out[0], torch.full_like(out[0], float("inf"))),) + out[1:]
        return torch.nextafter(out, torch.full_like(out, float("inf")))

    module.forward = forward


def _server_args() -> Tuple[Any, Any]:
    """(speculative, plain) server args of :data:`ARGV`, as the probe's command line makes
    them."""
    parser = PROBE._parser()
    args = parser.parse_args(ARGV)
    args.disable_cuda_graph = True
    spec_args = PROBE.ServerArgs.from_cli_args(args)
    plain_args = PROBE.plain_server_args(args, parser.parse_args([]))
    assert spec_args.speculative_algorithm == "NEXTN" and not plain_args.is_speculative()
    return spec_args, plain_args


def _row_by_row_linear(monkeypatch) -> None:
    """``F.linear`` one row at a time: every dense GEMM rounds a row as at M = 1 (the CPU's
    library GEMM does not), so the un-patched run agrees deeper into the model."""
    inner = torch.nn.functional.linear

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: Any = None) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] <= 1:
            return inner(x, weight, bias)
        return torch.cat([inner(x[i:i + 1], weight, bias) for i in range(x.shape[0])])

    monkeypatch.setattr(torch.nn.functional, "linear", linear)


@pytest.mark.parametrize("gemm", ["library", "row-by-row"])
def test_probe_finds_an_injected_difference(baseline, gemm, monkeypatch):
    """The injected module is the reported first difference, with equal inputs: an ordering
    that put a parent before its children (row-by-row GEMMs: the injection goes into a whole
    MoE block), or rows paired at the wrong positions (different embeddings, so an earlier
    difference), fails here. The target comes before whatever the un-patched run of the same
    setup reports first (CPU GEMMs round M = 1 and M = 4 apart), so that report is the
    baseline."""
    spec_args, plain_args = _server_args()
    result = baseline[0]
    if gemm == "row-by-row":
        _row_by_row_linear(monkeypatch)
        result = PROBE.run_probe(spec_args, plain_args, result["prompt"], GEN)
    target = injection_target(result)
    got = PROBE.run_probe(spec_args, plain_args, result["prompt"], GEN,
                          prepare=lambda m: bump_when_several_rows(m.get_submodule(target)))
    first = got["first_difference"]
    assert first is not None and first["module"] == target, PROBE.format_report(got)
    assert first["inputs_differ"] == [], first  # it differs by itself
    assert "verify 0 row 0 @ pos %d" % PROMPT_LEN in first["where"]
    # Every paired row of that verify differs there: the bump hits every row of a verify.
    verify0 = [p for p in got["pairs"] if p["spec"].startswith("verify 0 ")]
    assert len(first["where"]) == len(verify0)
    print(f"{gemm} GEMMs: un-patched first difference "
          f"{(result['first_difference'] or {}).get('module')}, injected into {target}")


def test_pairing_follows_drafts_that_match_the_plain_tokens():
    """A verify row pairs only while every token from the first new position on is the plain
    run's: drafts that stop matching end the pairing; the next verify starts from the tokens
    the earlier one committed."""
    F = PROBE.ForwardRecord
    prompt_len = 10
    plain_ids = [5, 6, 7, 8, 9, 1, 2]  # inputs of the plain decodes at positions 10..16
    plain = [F(0, "extend", list(range(prompt_len)), list(range(prompt_len)))]
    plain += [F(1 + i, "decode", [prompt_len + i], [t]) for i, t in enumerate(plain_ids)]
    spec = [F(0, "extend", list(range(prompt_len)), list(range(prompt_len))),
            F(1, "verify", [10, 11, 12, 13], [5, 6, 4, 8]),  # 3rd draft wrong: rows 0, 1
            F(2, "verify", [12, 13, 14, 15], [7, 8, 9, 1])]  # the bonus token 7, then matches
    pairs = PROBE.pair_rows(plain, spec, prompt_len)
    assert [(p.spec_forward, p.spec_row, p.position, p.plain_forward) for p in pairs] == [
        (1, 0, 10, 1), (1, 1, 11, 2), (2, 0, 12, 3), (2, 1, 13, 4), (2, 2, 14, 5), (2, 3, 15, 6)]
    assert [p.token for p in pairs] == [5, 6, 7, 8, 9, 1]
    prefill = PROBE.pair_prefill_rows(plain, spec)
    assert [(p.position, p.plain_row, p.spec_row) for p in prefill] == [(i, i, i)
                                                                        for i in range(10)]
    # A first token that is not the plain run's pairs nothing.
    wrong = [spec[0], F(1, "verify", [10, 11, 12, 13], [4, 6, 7, 8])]
    assert PROBE.pair_rows(plain, wrong, prompt_len) == []


def test_rows_compare_bitwise():
    """-0.0 and 0.0 differ, a NaN equals itself, integer outputs compare exactly; a tensor not
    laid out one row per token is left out."""
    a = torch.tensor([[0.0, float("nan"), 1.0]])
    b = torch.tensor([[-0.0, float("nan"), 1.0]])
    d = PROBE.compare_row(a[0], b[0], 0)
    assert (d.differing, d.max_abs_diff) == (1, 0.0)
    assert PROBE.compare_row(a[0], a[0].clone(), 0).differing == 0
    ids = PROBE.compare_row(torch.tensor([3, 4]), torch.tensor([3, 5]), 1)
    assert (ids.differing, ids.max_abs_diff) == (1, 1.0)
    assert PROBE.per_token_row(torch.zeros(4, 2), 1, 0) is None
    assert PROBE.per_token_row(torch.zeros(()), 1, 0) is None


def test_help_exits_cleanly():
    path = os.pathsep.join([str(ROOT / "python"), str(ROOT / "sgl-kernel/python"),
                            os.environ.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": path})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--prompt-index" in out.stdout and "--speculative-algorithm" in out.stdout
