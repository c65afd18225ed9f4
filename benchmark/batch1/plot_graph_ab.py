"""Draw the eager-vs-graph, overlap-on-vs-off results of ``graph_ab.py`` as an SVG bar chart.

    python benchmark/batch1/plot_graph_ab.py benchmark/results/graph_ab_h200.jsonl \\
        --out docs/graph_ab.svg --floor-ms 0.84 --max-ms 40 --title "..."

Reads one or more JSONL files written by ``benchmark/batch1/graph_ab.py`` (one line per
configuration: ``label``, ``mode`` "graph" / "eager", ``overlap``, ``iter_ms``, ``replay_ms``,
optionally ``gpu_idle_share``) and writes a grouped horizontal bar chart: one group per label in
first-seen order, one bar per configuration (graph + overlap, graph, eager + overlap, eager)
with its iteration time at the bar end, a dashed tick at the label's back-to-back graph replay
time and, with ``--floor-ms``, a dotted tick at the weight-bandwidth floor on the labels matching
``--floor-match`` (default: labels containing "nextn0", the plain decode step the floor is
computed for); a line's own ``floor_ms`` field sets its label's floor instead (charts of
several models or step widths, each with its floor). The axis is linear; ``--max-ms`` clips
longer bars, which get a break mark and keep their true value as text. A Markdown table of
the same numbers goes to stdout.

Only the standard library is used, so the figure can be redrawn anywhere.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple
from xml.sax.saxutils import escape

# (mode, overlap) -> display name, colour; the order is the bar order inside a group.
CONFIGS: List[Tuple[Tuple[str, bool], str, str]] = [
    (("graph", True), "graph + overlap", "#1f4e79"),
    (("graph", False), "graph", "#5b9bd5"),
    (("eager", True), "eager + overlap", "#c55a11"),
    (("eager", False), "eager", "#f4b183"),
]

# Layout in px. The left margin holds the configuration names, the right one the values.
WIDTH, LEFT, RIGHT = 900, 140, 100
BAR_H, BAR_GAP, HEAD_H, GROUP_GAP = 16, 4, 22, 12
TOP_TITLE, LEGEND_H, AXIS_H = 36, 24, 40


class Group:
    """The rows of one label: its bars by configuration, replay time and GPU idle share."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.iter_ms: Dict[Tuple[str, bool], float] = {}
        self.replay_ms: Optional[float] = None
        self.idle_share: Optional[float] = None
        self.floor_ms: Optional[float] = None  # the data's own floor for this label

    def configs(self) -> List[Tuple[Tuple[str, bool], str, str]]:
        """The configurations this label has, in bar order."""
        return [c for c in CONFIGS if c[0] in self.iter_ms]

    def profiled_config(self) -> Tuple[str, bool]:
        """The configuration ``graph_ab.py`` profiles for the idle share: the overlapped loop,
        with graphs when the run had a graph runner."""
        return ("graph", True) if any(k[0] == "graph" for k in self.iter_ms) else ("eager", True)


def _number(rec: dict, key: str, where: str, optional: bool = False) -> Optional[float]:
    """``rec[key]`` as a finite positive float (or None when optional and absent / null)."""
    val = rec.get(key)
    if val is None and optional:
        return None
    if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val):
        raise ValueError(f"{where}: {key!r} must be a finite number, got {val!r}")
    if key != "gpu_idle_share" and val <= 0:
        raise ValueError(f"{where}: {key!r} must be positive, got {val!r}")
    return float(val)


def read_jsonl(paths: Sequence[str]) -> Iterator[Tuple[str, Dict[str, Any]]]:
    """``(where, record)`` for every non-empty line of the JSONL ``paths`` (``where`` =
    ``path:line`` for error messages); a line that is not a JSON object raises ``ValueError``
    naming it. Shared by the project's benchmark plotters."""
    for path in paths:
        try:
            lines = open(path).read().splitlines()
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror}") from None
        for num, line in enumerate(lines, 1):
            where = f"{path}:{num}"
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc.msg})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{where}: expected a JSON object per line")
            yield where, rec


def load_groups(paths: Sequence[str]) -> List[Group]:
    """Parse ``graph_ab.py`` JSONL files into groups, one per label in first-seen order.

    A later line for a (label, configuration) already seen replaces the earlier one: appending a
    re-run to the same file updates the chart.
    """
    groups: Dict[str, Group] = {}
    for where, rec in read_jsonl(paths):
        label, mode, overlap = rec.get("label"), rec.get("mode"), rec.get("overlap")
        if not isinstance(label, str) or not label:
            raise ValueError(f"{where}: 'label' must be a non-empty string, got {label!r}")
        if mode not in ("graph", "eager"):
            raise ValueError(f"{where}: 'mode' must be 'graph' or 'eager', got {mode!r}")
        if not isinstance(overlap, bool):
            raise ValueError(f"{where}: 'overlap' must be true or false, got {overlap!r}")
        group = groups.setdefault(label, Group(label))
        group.iter_ms[(mode, overlap)] = _number(rec, "iter_ms", where)
        replay = _number(rec, "replay_ms", where, optional=True)
        group.replay_ms = replay if replay is not None else group.replay_ms
        idle = _number(rec, "gpu_idle_share", where, optional=True)
        group.idle_share = idle if idle is not None else group.idle_share
        floor = _number(rec, "floor_ms", where, optional=True)
        group.floor_ms = floor if floor is not None else group.floor_ms
    if not groups:
        raise ValueError("no result lines in " + ", ".join(paths))
    return list(groups.values())


def markdown_table(groups: Sequence[Group]) -> str:
    """One row per (label, configuration): iter ms, replay ms, their ratio, GPU idle share.

    The idle share is printed only on the row of the loop it was profiled on (see
    ``Group.profiled_config``); ``graph_ab.py`` copies it onto every line of its run.
    """
    rows = ["| label | config | iter ms | replay ms | iter / replay | GPU idle share |",
            "|---|---|---|---|---|---|"]
    for g in groups:
        replay = f"{g.replay_ms:.3f}" if g.replay_ms is not None else "-"
        for key, name, _ in g.configs():
            ms = g.iter_ms[key]
            ratio = f"{ms / g.replay_ms:.2f}" if g.replay_ms is not None else "-"
            idle = (f"{g.idle_share:.3f}" if g.idle_share is not None
                    and key == g.profiled_config() else "-")
            rows.append(f"| {g.label} | {name} | {ms:.3f} | {replay} | {ratio} | {idle} |")
    return "\n".join(rows)


def _nice_step(span: float, target: int = 8) -> float:
    """A 1 / 2 / 5 x 10^k tick step giving about ``target`` ticks over ``span``."""
    raw = span / target
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


def _fmt_tick(v: float) -> str:
    return f"{v:g}"


def render_svg(groups: Sequence[Group], title: str = "", max_ms: Optional[float] = None,
               floor_ms: Optional[float] = None, floor_match: str = "nextn0") -> str:
    """The chart as an SVG document; the bars are its only ``<rect>`` elements (one per row)."""
    floor_re = re.compile(floor_match)
    floors = {g.label: g.floor_ms if g.floor_ms is not None
              else floor_ms if floor_ms is not None and floor_re.search(g.label) else None
              for g in groups}
    floored = {label for label, f in floors.items() if f is not None}
    values = [v for g in groups for v in g.iter_ms.values()]
    values += [g.replay_ms for g in groups if g.replay_ms is not None]
    values += [floors[label] for label in floored]
    axis_max = max_ms if max_ms is not None else max(values) * 1.05
    plot_w = WIDTH - LEFT - RIGHT

    def x_of(v: float) -> float:
        return LEFT + plot_w * min(v, axis_max) / axis_max

    any_clipped = max_ms is not None and any(v > max_ms for g in groups
                                             for v in g.iter_ms.values())

    top = TOP_TITLE + LEGEND_H
    body: List[str] = []
    y = top
    for g in groups:
        body.append(f'<text class="group" x="{LEFT - 130}" y="{y + 15}" font-weight="bold">'
                    f"{escape(g.label)}</text>")
        y += HEAD_H
        first_bar = y
        for key, name, colour in g.configs():
            ms = g.iter_ms[key]
            clipped = max_ms is not None and ms > max_ms
            x_end = x_of(ms)
            cls = "bar clipped" if clipped else "bar"
            body.append(f'<text x="{LEFT - 6}" y="{y + BAR_H - 4}" text-anchor="end">'
                        f"{escape(name)}</text>")
            body.append(f'<rect class="{cls}" x="{LEFT}" y="{y}" width="{x_end - LEFT:.1f}" '
                        f'height="{BAR_H}" fill="{colour}"><title>{escape(g.label)}, {name}: '
                        f"{ms:.3f} ms</title></rect>")
            if clipped:  # two white slashes near the end: the bar is longer than drawn
                bx = x_end - 16
                body.append(f'<path class="break" d="M{bx:.1f} {y + BAR_H + 2} l6 {-BAR_H - 4} '
                            f'M{bx + 5:.1f} {y + BAR_H + 2} l6 {-BAR_H - 4}" stroke="white" '
                            f'stroke-width="2.5" fill="none"/>')
            weight = ' font-weight="bold"' if clipped else ""
            body.append(f'<text class="value" x="{x_end + 4:.1f}" y="{y + BAR_H - 4}"{weight}>'
                        f"{ms:.2f} ms</text>")
            y += BAR_H + BAR_GAP
        span = (first_bar - 3, y - BAR_GAP + 3)
        if g.replay_ms is not None and g.replay_ms <= axis_max:
            x = x_of(g.replay_ms)
            body.append(f'<line class="replay" x1="{x:.1f}" y1="{span[0]}" x2="{x:.1f}" '
                        f'y2="{span[1]}" stroke="black" stroke-width="1.2" '
                        f'stroke-dasharray="4,3"><title>replay {g.replay_ms:.3f} ms</title>'
                        f"</line>")
        floor = floors[g.label]
        if floor is not None and floor <= axis_max:
            x = x_of(floor)
            body.append(f'<line class="floor" x1="{x:.1f}" y1="{span[0]}" x2="{x:.1f}" '
                        f'y2="{span[1]}" stroke="#c00000" stroke-width="2" '
                        f'stroke-dasharray="1.5,2"><title>weight floor {floor:.3f} ms</title>'
                        f"</line>")
        y += GROUP_GAP

    # Axis: ticks and light grid lines behind the bars (drawn first, so bars cover them).
    bottom = y - GROUP_GAP
    grid: List[str] = []
    step = _nice_step(axis_max)
    ticks = [i * step for i in range(int(axis_max / step + 1e-9) + 1)]
    for t in ticks:
        x = x_of(t)
        grid.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}" stroke="#dddddd"/>')
        grid.append(f'<text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle">'
                    f"{_fmt_tick(t)}</text>")
    grid.append(f'<line x1="{LEFT}" y1="{bottom}" x2="{LEFT + plot_w}" y2="{bottom}" '
                f'stroke="black"/>')
    axis_label = "ms per scheduler iteration"
    if any_clipped:
        axis_label += f" (bars clipped at {max_ms:g} ms, true value printed)"
    grid.append(f'<text x="{LEFT + plot_w / 2:.1f}" y="{bottom + 34}" text-anchor="middle">'
                f"{escape(axis_label)}</text>")

    # Legend for the markers (the configurations are named beside each bar).
    legend: List[str] = []
    lx, ly = LEFT, TOP_TITLE + 8
    entries = [("black", "4,3", "graph replayed back to back")]
    if floored:
        same = {floors[label] for label in floored}
        entries.append(("#c00000", "1.5,2", f"weight floor ({same.pop():g} ms)" if len(same) == 1
                        else "weight floor (per label)"))
    for colour, dash, text in entries:
        legend.append(f'<line x1="{lx}" y1="{ly - 10}" x2="{lx}" y2="{ly + 4}" '
                      f'stroke="{colour}" stroke-width="1.5" stroke-dasharray="{dash}"/>')
        legend.append(f'<text x="{lx + 6}" y="{ly}">{escape(text)}</text>')
        lx += 16 + 7 * len(text)

    height = bottom + AXIS_H + 4
    head = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">']
    if title:
        head.append(f'<text class="title" x="{WIDTH / 2}" y="22" text-anchor="middle" '
                    f'font-size="15" font-weight="bold">{escape(title)}</text>')
    return "\n".join(head + legend + grid + body + ["</svg>"]) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    """Command line: parse the files, write the SVG, print the Markdown table."""
    parser = argparse.ArgumentParser(prog="benchmark/batch1/plot_graph_ab.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="JSONL files written by graph_ab.py")
    parser.add_argument("--out", default="docs/graph_ab.svg", help="SVG path to write")
    parser.add_argument("--title", default="", help="chart title")
    parser.add_argument("--max-ms", type=float, default=None,
                        help="axis end: longer bars are clipped and marked")
    parser.add_argument("--floor-ms", type=float, default=None,
                        help="weight-bandwidth floor, drawn on labels matching --floor-match")
    parser.add_argument("--floor-match", default="nextn0",
                        help="regular expression (re.search) choosing the labels the floor "
                             "applies to (default: nextn0)")
    args = parser.parse_args(argv)
    for name in ("max_ms", "floor_ms"):
        val = getattr(args, name)
        if val is not None and not (math.isfinite(val) and val > 0):
            parser.error(f"--{name.replace('_', '-')} must be a positive number, got {val}")
    try:
        re.compile(args.floor_match)
    except re.error as exc:
        parser.error(f"--floor-match is not a valid regular expression: {exc}")
    try:
        groups = load_groups(args.files)
    except ValueError as exc:
        parser.error(str(exc))
    if args.floor_ms is not None and not any(re.search(args.floor_match, g.label)
                                             for g in groups):
        parser.error(f"--floor-ms given but no label matches --floor-match "
                     f"{args.floor_match!r}")
    svg = render_svg(groups, args.title, args.max_ms, args.floor_ms, args.floor_match)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(svg)
    print(markdown_table(groups))
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
