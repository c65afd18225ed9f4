"""Draw the prefill census of ``prefill_census.py`` as stacked vertical bars (PNG or SVG).

    python benchmark/batch1/plot_prefill_census.py prefill_census.jsonl [more.jsonl ...] \\
        -o docs/prefill_census.png [--metric ms|share|kernels] [--title "..."]

Reads the JSON lines ``prefill_census.py --result-filename`` appends (``label``, ``device``,
``categories: {name: {kernels, ms, share}}``, ``wall_ms``, ``host_gap_ms``) and draws one bar
per label in first-seen order (a later line of a label replaces the earlier one, so appending
a re-run updates the figure), the label on the x axis, its categories stacked in the order the
census wrote them. ``--metric ms`` (the default) stacks device milliseconds and tops each bar
with its host gaps (hatched), so the bar reaches the prefill's profiled wall time; ``share``
stacks each category's share of the device time (runs of different prompt lengths side by
side); ``kernels`` stacks the kernel counts. The format follows the ``-o`` extension (matplotlib,
``Agg``). A Markdown table of the same numbers goes to stdout.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

try:  # run as a script, benchmark/batch1 is on sys.path; imported by file path it may not be
    from plot_graph_ab import read_jsonl
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from plot_graph_ab import read_jsonl

FIELDS = ("kernels", "ms", "share")
METRICS = {"ms": "device ms", "share": "share of device time", "kernels": "kernels"}
GAP_COLOUR = "#d9d9d9"


class Run:
    """One census line: its label, per-category numbers, wall time and host gaps."""

    def __init__(self, label: str, categories: Dict[str, Dict[str, float]], wall_ms: float,
                 host_gap_ms: float, cpu: bool) -> None:
        self.label = label
        self.categories = categories
        self.wall_ms = wall_ms
        self.host_gap_ms = host_gap_ms
        self.cpu = cpu  # a CPU run: aten ops and their CPU time stand for kernels

    def total(self, field: str) -> float:
        """Sum over the categories of ``field``."""
        return sum(row[field] for row in self.categories.values())


def _number(value: Any, where: str, signed: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or (value < 0 and not signed):
        kind = "a finite number" if signed else "a finite non-negative number"
        raise ValueError(f"{where} must be {kind}, got {value!r}")
    return float(value)


def _parse(rec: Dict[str, Any], where: str) -> Run:
    label, cats = rec.get("label"), rec.get("categories")
    if not isinstance(label, str) or not label:
        raise ValueError(f"{where}: 'label' must be a non-empty string, got {label!r}")
    if not isinstance(cats, dict) or not cats:
        raise ValueError(f"{where}: 'categories' must be a non-empty object, got {cats!r}")
    rows: Dict[str, Dict[str, float]] = {}
    for name, row in cats.items():
        if not isinstance(row, dict):
            raise ValueError(f"{where}: category {name!r} must be an object, got {row!r}")
        rows[name] = {f: _number(row.get(f), f"{where}: {name!r}.{f}") for f in FIELDS}
    wall = _number(rec.get("wall_ms"), f"{where}: wall_ms")
    # Host and device clocks differ: a gap a hair below zero is possible, and drawn as none.
    gap = _number(rec.get("host_gap_ms"), f"{where}: host_gap_ms", signed=True)
    return Run(label, rows, wall, gap, cpu=rec.get("device") == "cpu")


def load_runs(paths: Sequence[str]) -> List[Run]:
    """Parse census JSONL files into runs, one per label in first-seen order. Every run must
    list the same categories (the first run's order is the stacking order)."""
    runs: Dict[str, Run] = {}
    order: Optional[List[str]] = None
    for where, rec in read_jsonl(paths):
        run = _parse(rec, where)
        if order is None:
            order = list(run.categories)
        elif set(run.categories) != set(order):
            missing = sorted(set(order) - set(run.categories))
            extra = sorted(set(run.categories) - set(order))
            raise ValueError(f"{where}: categories differ from the first run's (missing "
                             f"{missing}, extra {extra})")
        run.categories = {c: run.categories[c] for c in order}
        runs[run.label] = run  # a re-run replaces, keeping the first position
    if not runs:
        raise ValueError("no result lines in " + ", ".join(paths))
    return list(runs.values())


def _value(run: Run, category: str, metric: str) -> float:
    return run.categories[category]["share" if metric == "share" else metric]


def markdown_table(runs: Sequence[Run], metric: str = "ms") -> str:
    """One row per run: ``metric`` per category, the total, and (ms) the wall and host gaps."""
    cats = list(runs[0].categories)
    extra = ["wall ms", "host gaps ms"] if metric == "ms" else []
    head = ["run"] + cats + ["total"] + extra
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        if metric == "share":
            cells = [f"{_value(r, c, metric):.1%}" for c in cats] + [f"{r.total('share'):.0%}"]
        elif metric == "kernels":
            cells = [f"{_value(r, c, metric):.0f}" for c in cats] + [f"{r.total('kernels'):.0f}"]
        else:
            cells = [f"{_value(r, c, metric):.2f}" for c in cats] + [f"{r.total('ms'):.2f}",
                                                                     f"{r.wall_ms:.2f}",
                                                                     f"{r.host_gap_ms:.2f}"]
        rows.append("| " + " | ".join([r.label] + cells) + " |")
    return "\n".join(rows)


def plot(runs: Sequence[Run], out: str, metric: str = "ms", title: str = "") -> None:
    """Write the stacked bar chart of ``runs`` to ``out`` (the format from its extension)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    cats = list(runs[0].categories)
    colours = plt.get_cmap("tab10").colors
    fig, ax = plt.subplots(figsize=(max(6.0, 1.5 + 1.3 * len(runs)), 5.0))
    tops = []
    for i, run in enumerate(runs):
        bottom = 0.0
        for j, c in enumerate(cats):
            height = _value(run, c, metric)
            ax.bar(i, height, 0.6, bottom=bottom, color=colours[j % len(colours)],
                   label=c if i == 0 else None)
            bottom += height
        if metric == "ms":
            gap = max(run.host_gap_ms, 0.0)
            ax.bar(i, gap, 0.6, bottom=bottom, color=GAP_COLOUR, edgecolor="#404040",
                   hatch="///", linewidth=0.5, label="host gaps (wall - busy)" if i == 0 else None)
            text = f"{run.wall_ms:.1f} ms"
            bottom += gap
        elif metric == "share":
            text = ""
        else:
            text = f"{bottom:.0f}"
        tops.append(bottom)
        if text:
            ax.text(i, bottom, text, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(runs)))
    ax.set_xticklabels([r.label for r in runs], rotation=20 if len(runs) > 3 else 0,
                       ha="right" if len(runs) > 3 else "center", fontsize=8)
    ax.set_xlim(-0.8, len(runs) - 0.2)  # one run: a bar, not the whole width
    ax.set_ylim(0, (max(tops) or 1.0) * 1.1)
    ylabel = {"ms": "ms per prefill (device time stacked, then host gaps)",
              "share": "share of the prefill's device time",
              "kernels": "kernels per prefill"}[metric]
    if any(r.cpu for r in runs):
        ylabel += "\n(CPU runs: top-level aten ops and their CPU time)"
    ax.set_ylabel(ylabel)
    if metric == "share":
        ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    if title:
        ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="y", color="#e0e0e0")
    ax.set_axisbelow(True)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    """Command line: parse the files, write the figure, print the Markdown table."""
    parser = argparse.ArgumentParser(prog="benchmark/batch1/plot_prefill_census.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="JSONL files written by prefill_census.py")
    parser.add_argument("-o", "--out", default="prefill_census.png",
                        help="figure to write (.png or .svg)")
    parser.add_argument("--metric", choices=tuple(METRICS), default="ms",
                        help="what the bars stack: device ms (+ host gaps), shares, kernels")
    parser.add_argument("--title", default="", help="chart title")
    args = parser.parse_args(argv)
    if not args.out.lower().endswith((".png", ".svg")):
        parser.error(f"--out must name a .png or .svg file, got {args.out!r}")
    try:
        runs = load_runs(args.files)
    except ValueError as exc:
        parser.error(str(exc))
    if importlib.util.find_spec("matplotlib") is None:
        parser.error("plotting needs matplotlib (pip install matplotlib)")
    plot(runs, args.out, args.metric, args.title)
    print(markdown_table(runs, args.metric))
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
