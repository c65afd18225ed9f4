"""Draw the category census of ``round_census.py`` as stacked horizontal bars (PNG, matplotlib).

    python benchmark/batch1/plot_census.py results.jsonl [more.jsonl ...] -o census.png \\
        [--metric us|kernels] [--title "..."]

Reads the JSON lines ``round_census.py --result-filename`` appends (``label``, ``mode``,
``categories: {name: {kernels, us, floor_us}}``, optionally ``graph``) and draws one bar per
(label, mode) in first-seen order: its categories stacked in the order the census wrote them,
with a legend. With ``--metric us`` (the default) a thinner hatched bar under each run is the
sum of its category floors (the weight-bandwidth floor of the iteration), and a dashed tick marks
the kernel time of the same iteration replayed as CUDA graphs when the run measured it.
``--metric kernels`` stacks the kernel counts instead (no floor). A later line for a (label,
mode) already seen replaces the earlier one, so appending a re-run updates the figure. A Markdown
table of the same numbers goes to stdout.
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

FIELDS = ("kernels", "us", "floor_us")
BAR_H, FLOOR_H, GAP = 0.5, 0.22, 0.35  # in y units: a run's bar, its floor bar, the space after


class Run:
    """One census line: its label, mode, per-category numbers and the graph kernel time."""

    def __init__(self, label: str, mode: str, categories: Dict[str, Dict[str, float]],
                 graph_us: Optional[float], cpu: bool = False) -> None:
        self.label = label
        self.mode = mode
        self.categories = categories
        self.graph_us = graph_us
        self.cpu = cpu  # a CPU run: aten ops and their CPU time stand for kernels

    @property
    def name(self) -> str:
        """The bar's label: ``label (mode)``, or the mode alone when the label is the mode."""
        return self.mode if self.label == self.mode else f"{self.label} ({self.mode})"

    def total(self, field: str) -> float:
        """Sum over the categories of ``field``."""
        return sum(row[field] for row in self.categories.values())


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0:
        raise ValueError(f"{where} must be a finite non-negative number, got {value!r}")
    return float(value)


def _parse(rec: Any, where: str) -> Run:
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object per line")
    label, mode, cats = rec.get("label"), rec.get("mode"), rec.get("categories")
    for key, val in (("label", label), ("mode", mode)):
        if not isinstance(val, str) or not val:
            raise ValueError(f"{where}: {key!r} must be a non-empty string, got {val!r}")
    if not isinstance(cats, dict) or not cats:
        raise ValueError(f"{where}: 'categories' must be a non-empty object, got {cats!r}")
    rows: Dict[str, Dict[str, float]] = {}
    for name, row in cats.items():
        if not isinstance(row, dict):
            raise ValueError(f"{where}: category {name!r} must be an object, got {row!r}")
        rows[name] = {f: _number(row.get(f), f"{where}: {name!r}.{f}") for f in FIELDS}
    graph = rec.get("graph")
    if graph is not None and not isinstance(graph, dict):
        raise ValueError(f"{where}: 'graph' must be an object or null, got {graph!r}")
    graph_us = _number(graph.get("us"), f"{where}: graph.us") if graph else None
    return Run(label, mode, rows, graph_us, cpu=rec.get("device") == "cpu")


def load_runs(paths: Sequence[str]) -> List[Run]:
    """Parse census JSONL files into runs, one per (label, mode) in first-seen order. Every run
    must list the same categories (the first run's order is the stacking order)."""
    runs: Dict[tuple, Run] = {}
    order: Optional[List[str]] = None
    for where, rec in read_jsonl(paths):
        run = _parse(rec, where)
        names = list(run.categories)
        if order is None:
            order = names
        elif set(names) != set(order):
            missing = sorted(set(order) - set(names))
            extra = sorted(set(names) - set(order))
            raise ValueError(f"{where}: categories differ from the first run's (missing "
                             f"{missing}, extra {extra})")
        run.categories = {c: run.categories[c] for c in order}
        runs[(run.label, run.mode)] = run  # a re-run replaces, keeping the first position
    if not runs:
        raise ValueError("no result lines in " + ", ".join(paths))
    return list(runs.values())


def markdown_table(runs: Sequence[Run], field: str = "us") -> str:
    """One row per run: ``field`` per category, the total and (for us) the floor sum."""
    cats = list(runs[0].categories)
    head = ["run"] + cats + ["total"] + (["floor"] if field == "us" else [])
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        cells = [r.name] + [f"{r.categories[c][field]:.1f}" for c in cats]
        cells.append(f"{r.total(field):.1f}")
        if field == "us":
            cells.append(f"{r.total('floor_us'):.1f}")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(runs: Sequence[Run], out: str, field: str = "us", title: str = "") -> None:
    """Write the stacked bar chart of ``runs`` to ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    cats = list(runs[0].categories)
    colours = plt.get_cmap("tab10").colors
    with_floor = field == "us"
    step = BAR_H + (FLOOR_H if with_floor else 0) + GAP
    fig, ax = plt.subplots(figsize=(10, max(2.8, 1.2 + step * len(runs))))
    top = max(max(r.total(field), r.total("floor_us") if with_floor else 0,
                  (r.graph_us or 0) if with_floor else 0) for r in runs) or 1.0
    graph_label = "kernel time with CUDA graphs"  # the legend entry, on the first tick drawn
    for i, run in enumerate(runs):
        y = -i * step
        left = 0.0
        for j, c in enumerate(cats):
            width = run.categories[c][field]
            ax.barh(y, width, BAR_H, left=left, color=colours[j % len(colours)],
                    label=c if i == 0 else None)
            left += width
        unit = " us" if with_floor else " kernels"
        ax.text(left + top * 0.01, y, f"{left:.0f}{unit}", va="center", fontsize=8)
        if with_floor:
            fy = y - (BAR_H + FLOOR_H) / 2
            floor = run.total("floor_us")
            ax.barh(fy, floor, FLOOR_H, color="#d9d9d9", edgecolor="#404040", hatch="///",
                    linewidth=0.5, label="floor (sum of categories)" if i == 0 else None)
            ax.text(floor + top * 0.01, fy, f"floor {floor:.0f} us", va="center", fontsize=7)
            if run.graph_us is not None:
                ax.vlines(run.graph_us, y - BAR_H / 2 - 0.05, y + BAR_H / 2 + 0.05,
                          colors="black", linestyles="dashed", linewidth=1.2, label=graph_label)
                graph_label = None
    ax.set_yticks([-i * step - (FLOOR_H / 2 if with_floor else 0) for i in range(len(runs))])
    ax.set_yticklabels([r.name for r in runs])
    ax.set_xlim(0, top * 1.15)
    xlabel = "device us per iteration (eager)" if with_floor else "kernels per iteration (eager)"
    if any(r.cpu for r in runs):
        xlabel += "; CPU runs: top-level aten ops and their CPU time"
    ax.set_xlabel(xlabel)
    if title:
        ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="x", color="#e0e0e0")
    ax.set_axisbelow(True)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    """Command line: parse the files, write the PNG, print the Markdown table."""
    parser = argparse.ArgumentParser(prog="benchmark/batch1/plot_census.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="JSONL files written by round_census.py")
    parser.add_argument("-o", "--out", default="census.png", help="PNG path to write")
    parser.add_argument("--metric", choices=("us", "kernels"), default="us",
                        help="what the bars stack: device us (with the floor) or kernel counts")
    parser.add_argument("--title", default="", help="chart title")
    args = parser.parse_args(argv)
    if not args.out.lower().endswith(".png"):
        parser.error(f"--out must name a .png file, got {args.out!r}")
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
