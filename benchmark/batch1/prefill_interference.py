"""What a long prompt's prefill does to a request that is already decoding.

Against a running server (SGLang's ``/generate``, token ids: any model, tokenizer or not):

1. **Alone.** Request A (``--decode-prompt-len`` random ids, ``--decode-output-len`` tokens)
   streams by itself: its mean inter-token latency is the baseline.
2. **Interfered.** A streams again; once it has been decoding for ``--start-after`` of its
   baseline ITLs, request B arrives (``--prefill-len`` random ids, one output token). The server
   prefills B in chunks of ``--chunked-prefill-size`` and lets running requests take a decode step
   between the chunks (``managers/scheduler.py``), so A keeps streaming while B is prefilled.

Reported (a table and one JSON line appended to ``--output-file``): A's mean ITL alone, A's mean
and largest ITL while B was being prefilled (B's arrival to its first token), their ratio, and
B's TTFT. A's token times are rebuilt from its stream (TTFT, then the ITLs), as
``bench_serving`` measures them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from typing import Any, Dict, List, Optional

import aiohttp
import numpy as np

from sglang.benchmark.backends import AIOHTTP_TIMEOUT, RequestFuncInput, async_request_sglang_generate
from sglang.benchmark.metrics import RequestFuncOutput


def _ids(n: int, vocab: int, rng: np.random.Generator) -> List[int]:
    # Ids 1 .. vocab-1: id 0 is often a special token; random ids keep the prompt uncached.
    return rng.integers(1, vocab, size=n).tolist()


def _token_times(out: RequestFuncOutput) -> List[float]:
    """Absolute arrival time of every output token after the first (``perf_counter`` clock)."""
    t = out.start_time + out.ttft
    times = []
    for gap in out.itl:
        t += gap
        times.append(t)
    return times


async def _vocab_size(session: aiohttp.ClientSession, base_url: str) -> int:
    async with session.get(f"{base_url}/get_model_info") as resp:
        info = await resp.json()
    if not info.get("vocab_size"):
        raise SystemExit(f"{base_url}/get_model_info has no vocab_size; pass --vocab-size")
    return int(info["vocab_size"])


def _request(base_url: str, ids: List[int], output_len: int) -> RequestFuncInput:
    return RequestFuncInput(prompt=ids, api_url=f"{base_url}/generate", prompt_len=len(ids),
                            output_len=output_len, ids_only=True)


async def measure(base_url: str, decode_prompt_len: int, decode_output_len: int,
                  prefill_len: int, start_after: int, seed: int,
                  vocab_size: Optional[int] = None) -> Dict[str, Any]:
    """Run the two phases (module docstring) and return the result row."""
    rng = np.random.default_rng(seed)
    async with aiohttp.ClientSession(timeout=AIOHTTP_TIMEOUT) as session:
        vocab = vocab_size or await _vocab_size(session, base_url)
        a_ids = _ids(decode_prompt_len, vocab, rng)
        alone = await async_request_sglang_generate(
            session, _request(base_url, a_ids, decode_output_len))
        if not alone.success or not alone.itl:
            raise SystemExit(f"request A alone failed: {alone.error}")
        base_itl = statistics.mean(alone.itl)
        b_ids = _ids(prefill_len, vocab, rng)
        a_task = asyncio.create_task(async_request_sglang_generate(
            session, _request(base_url, _ids(decode_prompt_len, vocab, rng), decode_output_len)))
        # A's prefill, then ``start_after`` of its decode steps at the baseline rate.
        await asyncio.sleep(alone.ttft + start_after * base_itl)
        b = await async_request_sglang_generate(session, _request(base_url, b_ids, 1))
        a = await a_task
    for name, out in (("A", a), ("B", b)):
        if not out.success:
            raise SystemExit(f"request {name} failed: {out.error}")
    b_start, b_first = b.start_time, b.start_time + b.ttft
    times = _token_times(a)
    # A token's gap spans (t - gap, t]; it counts when that span overlaps B's prefill.
    during = [g for t, g in zip(times, a.itl) if t > b_start and t - g < b_first]
    return {
        "decode_prompt_len": decode_prompt_len, "decode_output_len": decode_output_len,
        "prefill_len": prefill_len, "start_after": start_after,
        "alone_mean_itl_ms": 1e3 * base_itl,
        "during_prefill_tokens": len(during),
        "during_prefill_mean_itl_ms": 1e3 * statistics.mean(during) if during else None,
        "during_prefill_max_itl_ms": 1e3 * max(during) if during else None,
        "during_over_alone": (statistics.mean(during) / base_itl) if during else None,
        "prefill_ttft_ms": 1e3 * b.ttft,
        "interfered_mean_itl_ms": 1e3 * statistics.mean(a.itl) if a.itl else None,
    }


def _print_table(row: Dict[str, Any]) -> None:
    def fmt(v: Any) -> str:
        return "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))

    print(f"{'=' * 16} Prefill interference {'=' * 16}")
    for key, label in (("prefill_len", "Prefill tokens (B)"),
                       ("alone_mean_itl_ms", "A mean ITL alone (ms)"),
                       ("during_prefill_tokens", "A tokens during B's prefill"),
                       ("during_prefill_mean_itl_ms", "A mean ITL during B's prefill (ms)"),
                       ("during_prefill_max_itl_ms", "A max ITL during B's prefill (ms)"),
                       ("during_over_alone", "During / alone"),
                       ("prefill_ttft_ms", "B TTFT (ms)")):
        print(f"{label + ':':<40}{fmt(row[key]):>14}")
    print("=" * 54)


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    """CLI entry point; returns the result row."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="server URL (default: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--decode-prompt-len", type=int, default=128)
    p.add_argument("--decode-output-len", type=int, default=512)
    p.add_argument("--prefill-len", type=int, default=8192)
    p.add_argument("--start-after", type=int, default=32,
                   help="A's decode steps (at its baseline rate) before B arrives")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="default: the server's (/get_model_info)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--label", default="")
    p.add_argument("--output-file", default=None, help="append the JSON line here")
    args = p.parse_args(argv)
    for flag in ("decode_prompt_len", "decode_output_len", "prefill_len"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.start_after < 0:
        p.error("--start-after must be >= 0")
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    row = asyncio.run(measure(base_url, args.decode_prompt_len, args.decode_output_len,
                              args.prefill_len, args.start_after, args.seed, args.vocab_size))
    row["label"] = args.label
    _print_table(row)
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


if __name__ == "__main__":
    main(sys.argv[1:])
