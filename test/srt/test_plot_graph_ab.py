"""benchmark/batch1/plot_graph_ab.py: graph_ab.py JSONL to an SVG bar chart and a Markdown table."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from sglang.test.script_loader import load_script

ROOT = Path(__file__).resolve().parents[2]
NS = "{http://www.w3.org/2000/svg}"


def _load():
    return load_script(ROOT / "benchmark/batch1/plot_graph_ab.py")


plot = _load()


def _line(label, mode, overlap, iter_ms, replay_ms, **extra):
    return json.dumps(dict(label=label, mode=mode, overlap=overlap, iter_ms=iter_ms,
                           replay_ms=replay_ms, tokens=10, **extra))


def _write(tmp_path: Path) -> Path:
    """Two labels as graph_ab.py writes them; the eager bars of 'b nextn3' pass --max-ms 40."""
    lines = [_line("a nextn0", m, o, ms, 2.0, gpu_idle_share=0.05)
             for (m, o), ms in zip([("graph", True), ("graph", False), ("eager", True),
                                     ("eager", False)], [2.1, 2.3, 15.0, 16.0])]
    lines += [_line("b nextn3", m, o, ms, 5.0)
              for (m, o), ms in zip([("eager", False), ("graph", True), ("graph", False),
                                     ("eager", True)], [52.5, 5.2, 5.5, 45.0])]
    path = tmp_path / "ab.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_svg_and_table(tmp_path, capsys):
    src, out = _write(tmp_path), tmp_path / "sub" / "ab.svg"
    assert plot.main([str(src), "--out", str(out), "--floor-ms", "0.84", "--max-ms", "40",
                      "--title", "A & B"]) == 0
    root = ET.parse(out).getroot()
    rects = root.findall(f".//{NS}rect")
    assert len(rects) == 8  # one per (label, configuration)
    texts = [t.text for t in root.iter(f"{NS}text")]
    assert "a nextn0" in texts and "b nextn3" in texts and "A & B" in texts
    # Group order is first-seen, bar order is fixed: the label heads come before their bars.
    assert texts.index("a nextn0") < texts.index("b nextn3")
    assert texts.count("graph + overlap") == 2 and texts.count("eager") == 2

    # The two eager bars of 'b nextn3' are clipped at the axis end, marked, and keep their value.
    clipped = [r for r in rects if "clipped" in r.get("class").split()]
    assert len(clipped) == 2
    widths = {float(r.get("width")) for r in clipped}
    assert widths == {max(float(r.get("width")) for r in rects)}
    assert len(root.findall(f".//{NS}path[@class='break']")) == 2
    assert "52.50 ms" in texts and "45.00 ms" in texts
    # Replay marker on both groups, the floor only on the nextn0 label.
    assert len(root.findall(f".//{NS}line[@class='replay']")) == 2
    assert len(root.findall(f".//{NS}line[@class='floor']")) == 1

    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| ")][1:]
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    assert [c[:2] for c in cells] == [
        ["a nextn0", "graph + overlap"], ["a nextn0", "graph"], ["a nextn0", "eager + overlap"],
        ["a nextn0", "eager"], ["b nextn3", "graph + overlap"], ["b nextn3", "graph"],
        ["b nextn3", "eager + overlap"], ["b nextn3", "eager"]]
    assert cells[0] == ["a nextn0", "graph + overlap", "2.100", "2.000", "1.05", "0.050"]
    assert cells[1][5] == "-"  # the idle share belongs to the profiled (graph + overlap) loop
    assert cells[7] == ["b nextn3", "eager", "52.500", "5.000", "10.50", "-"]


def test_unclipped_axis_and_rerun_replaces(tmp_path, capsys):
    src = _write(tmp_path)
    with open(src, "a") as f:  # a re-run of one configuration replaces the earlier line
        f.write(_line("a nextn0", "graph", True, 2.05, 2.0) + "\n")
    out = tmp_path / "ab.svg"
    plot.main([str(src), "--out", str(out)])
    root = ET.parse(out).getroot()
    rects = root.findall(f".//{NS}rect")
    assert len(rects) == 8 and not [r for r in rects if "clipped" in r.get("class")]
    assert not root.findall(f".//{NS}line[@class='floor']")
    assert "| a nextn0 | graph + overlap | 2.050 |" in capsys.readouterr().out


@pytest.mark.parametrize("bad, needle", [
    ('{"label": "x", "mode": "cuda", "overlap": true, "iter_ms": 1}', "'mode'"),
    ('{"label": "x", "mode": "graph", "overlap": 1, "iter_ms": 1}', "'overlap'"),
    ('{"label": "x", "mode": "graph", "overlap": true, "iter_ms": -1}', "'iter_ms'"),
    ('{"mode": "graph", "overlap": true, "iter_ms": 1}', "'label'"),
    ("not json", "not JSON"),
])
def test_bad_lines_name_the_problem(tmp_path, capsys, bad, needle):
    src = tmp_path / "bad.jsonl"
    src.write_text(bad + "\n")
    with pytest.raises(SystemExit):
        plot.main([str(src), "--out", str(tmp_path / "x.svg")])
    err = capsys.readouterr().err
    assert needle in err and "bad.jsonl:1" in err


def test_floor_without_matching_label_is_an_error(tmp_path, capsys):
    src = _write(tmp_path)
    with pytest.raises(SystemExit):
        plot.main([str(src), "--out", str(tmp_path / "x.svg"), "--floor-ms", "1",
                   "--floor-match", "nextn7"])
    assert "no label matches" in capsys.readouterr().err


def test_each_label_can_carry_its_own_floor(tmp_path):
    """A line's ``floor_ms`` draws that label's floor (two models, two floors), overriding
    --floor-ms; the legend then says the floor is per label."""
    lines = [_line("bf16 12 layers nextn0", "graph", True, 2.4, 2.38, floor_ms=0.84),
             _line("fp8 42 layers nextn0", "graph", True, 5.98, 5.79, floor_ms=1.42),
             _line("fp8 42 layers nextn5", "graph", True, 12.0, 11.4)]
    src, out = tmp_path / "f.jsonl", tmp_path / "f.svg"
    src.write_text("\n".join(lines) + "\n")
    assert plot.main([str(src), "--out", str(out), "--floor-ms", "3.0"]) == 0
    root = ET.parse(out).getroot()
    floors = sorted(ln.find(f"{NS}title").text for ln in root.iter(f"{NS}line")
                    if ln.get("class") == "floor")
    assert floors == ["weight floor 0.840 ms", "weight floor 1.420 ms"]
    assert "weight floor (per label)" in [t.text for t in root.iter(f"{NS}text")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(_line("x nextn0", "graph", True, 1.0, 1.0, floor_ms=-1) + "\n")
    with pytest.raises(SystemExit):
        plot.main([str(bad), "--out", str(tmp_path / "bad.svg")])
