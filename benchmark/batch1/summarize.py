"""Summarise bench_serving JSONL lines (tagged by spec_ab.sh) as a Markdown table, one row per run:
mean / median TPOT, accept length, step time = mean TPOT x accept length, output throughput.

    python benchmark/batch1/summarize.py out/spec_ab.jsonl
"""
from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    print("| run | mean TPOT (ms) | median TPOT (ms) | accept length | step time (ms) "
          "| output tok/s | mean TTFT (ms) |")
    print("|---|---|---|---|---|---|---|")
    for line in open(path):
        r = json.loads(line)
        if "mean_tpot_ms" not in r:
            print(f"| {r.get('tag')} | failed | | | | | |")
            continue
        accept = r.get("accept_length") or 1.0
        print(f"| {r['tag']} | {r['mean_tpot_ms']:.2f} | {r['median_tpot_ms']:.2f} | "
              f"{accept:.2f} | {r['mean_tpot_ms'] * accept:.2f} | {r['output_throughput']:.1f} | "
              f"{r['mean_ttft_ms']:.1f} |")


if __name__ == "__main__":
    main(sys.argv[1])
