"""Summary table of DSpark draft folders trained by ``python -m sglang.train.dspark``: the
held-out evaluation each run stored in its ``train_log.json`` (offline greedy accept length,
per-slot prefix acceptance, confidence ECE) beside the run's loss weights and block size.

    python benchmark/dspark/summarize_ablation.py DRAFT_DIR [DRAFT_DIR ...] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
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


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmark/dspark/summarize_ablation.py")
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON lines")
    args = ap.parse_args(argv)
    rows = [summarize(f) for f in args.folders]
    print(f"{'draft':<18}{'block':>6}{'ce/l1/accept':>14}{'steps':>7}{'accept len':>11}  "
          f"prefix acceptance (slots 1..)")
    for r in rows:
        pa = ", ".join(f"{x:.3f}" for x in (r["prefix_acceptance"] or [])[:8])
        alphas = f"{r['alpha_ce']}/{r['alpha_tv']}/{r['alpha_accept']}"
        print(f"{r['draft']:<18}{r['block_size']:>6}{alphas:>14}{r['steps']:>7}"
              f"{r['accept_length']:>11.3f}  {pa}")
    if args.json:
        args.json.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
