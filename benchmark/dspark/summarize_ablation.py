"""Summary table of DSpark draft folders trained by ``python -m sglang.train.dspark``: the
held-out evaluation each run stored in its ``train_log.json`` (offline greedy accept length,
per-slot prefix acceptance, confidence ECE) beside the run's loss weights and block size.

    python benchmark/dspark/summarize_ablation.py DRAFT_DIR [DRAFT_DIR ...] [--json OUT]
        [--by-loss]

``--by-loss`` also groups the runs by loss weights and block (runs that differ only in their
seed) and prints each group's mean accept length, its sample standard deviation and range, and
the mean prefix acceptance per slot.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional


def summarize(folder: Path) -> Dict[str, Any]:
    """One row: the run's settings and its final held-out evaluation."""
    log = json.loads((folder / "train_log.json").read_text())
    cfg = json.loads((folder / "config.json").read_text())
    ev = log["eval"]
    args = log.get("args", {})
    return {"draft": folder.name, "block_size": cfg["block_size"],
            "alpha_accept": args.get("alpha_accept"), "alpha_ce": args.get("alpha_ce"),
            "alpha_tv": args.get("alpha_tv"),
            "steps": log["train"]["num_steps"], "train_seconds": log["train"]["seconds"],
            "accept_length": ev["accept_length"], "prefix_acceptance": ev.get("slot_accept"),
            "ece": ev.get("mean_ece")}


def group_by_loss(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per (loss weights, block): the seeds' accept lengths, their mean, sample
    standard deviation (0 for one run) and range, and the mean prefix acceptance per slot."""
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in rows:
        key = (r["alpha_ce"], r["alpha_tv"], r["alpha_accept"], r["block_size"])
        groups.setdefault(key, []).append(r)
    out = []
    for (ce, tv, acc, block), runs in groups.items():
        lengths = [r["accept_length"] for r in runs]
        slots = [r["prefix_acceptance"] or [] for r in runs]
        width = min(len(p) for p in slots)
        out.append({"alpha_ce": ce, "alpha_tv": tv, "alpha_accept": acc, "block_size": block,
                    "runs": len(runs), "accept_lengths": lengths,
                    "mean": statistics.fmean(lengths),
                    "stdev": statistics.stdev(lengths) if len(lengths) > 1 else 0.0,
                    "min": min(lengths), "max": max(lengths),
                    "prefix_acceptance": [statistics.fmean(p[i] for p in slots)
                                          for i in range(width)]})
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmark/dspark/summarize_ablation.py")
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON lines")
    ap.add_argument("--by-loss", action="store_true",
                    help="also summarise the runs per loss weights and block (over seeds)")
    args = ap.parse_args(argv)
    rows = [summarize(f) for f in args.folders]
    print(f"{'draft':<18}{'block':>6}{'ce/l1/accept':>14}{'steps':>7}{'accept len':>11}  "
          f"prefix acceptance (slots 1..)")
    for r in rows:
        pa = ", ".join(f"{x:.3f}" for x in (r["prefix_acceptance"] or [])[:8])
        alphas = f"{r['alpha_ce']}/{r['alpha_tv']}/{r['alpha_accept']}"
        print(f"{r['draft']:<18}{r['block_size']:>6}{alphas:>14}{r['steps']:>7}"
              f"{r['accept_length']:>11.3f}  {pa}")
    if args.by_loss:
        print(f"\n{'ce/l1/accept':>14}{'block':>6}{'runs':>5}{'mean':>8}{'stdev':>7}"
              f"{'min':>7}{'max':>7}  mean prefix acceptance (slots 1..)")
        for g in group_by_loss(rows):
            pa = ", ".join(f"{x:.3f}" for x in g["prefix_acceptance"][:8])
            alphas = f"{g['alpha_ce']}/{g['alpha_tv']}/{g['alpha_accept']}"
            print(f"{alphas:>14}{g['block_size']:>6}{g['runs']:>5}{g['mean']:>8.3f}"
                  f"{g['stdev']:>7.3f}{g['min']:>7.3f}{g['max']:>7.3f}  {pa}")
    if args.json:
        args.json.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
