"""``python -m sglang.bench_serving``: SGLang's online serving benchmark (our implementation).

Sends a dataset (a local ShareGPT file, or synthetic ``random`` / ``random-ids`` prompts) to a
running server at a Poisson request rate (or all at once) under an optional concurrency cap, then
prints SGLang's result table and appends one JSON line of results. Nothing is downloaded.
Metric definitions live in :mod:`sglang.benchmark.metrics`; the clients of each ``--backend`` in
:mod:`sglang.benchmark.backends`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from datetime import datetime
from typing import Any, AsyncIterator, Dict, List, Optional

import aiohttp
import numpy as np
import requests
from tqdm.asyncio import tqdm

from sglang.benchmark.backends import (
    AIOHTTP_TIMEOUT,
    ASYNC_REQUEST_FUNCS,
    DEFAULT_PORTS,
    READ_BUFSIZE,
    RequestFuncInput,
    RequestFuncOutput,
)
from sglang.benchmark.datasets import DATASET_NAMES, DatasetRow, get_dataset
from sglang.benchmark.metrics import calculate_metrics, format_table


# ----------------------------------------------------------------------------- helpers
def get_tokenizer(path: str):
    """Load a Hugging Face tokenizer from a local folder (never downloads)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as first_error:
        # A folder with only tokenizer.json (no tokenizer_config.json) is still usable.
        tok_file = os.path.join(path, "tokenizer.json")
        if os.path.isfile(tok_file):
            return PreTrainedTokenizerFast(tokenizer_file=tok_file)
        raise ValueError(f"cannot load a tokenizer from {path!r}: {first_error}") from first_error


def wait_for_server(base_url: str, timeout_s: float) -> None:
    """Poll ``GET /health`` until it answers 200.

    Raises ``RuntimeError`` (one line) at once when nothing answers at ``base_url`` (connection
    refused, unknown host: waiting would only hide a wrong URL or a server that is not running),
    and after ``timeout_s`` seconds when a server answers but is not ready (e.g. 503 during its
    warmup). The wait is announced, never silent.
    """
    deadline = time.monotonic() + timeout_s
    announced = False
    while True:
        remaining = deadline - time.monotonic()
        try:
            r = requests.get(f"{base_url}/health", timeout=max(min(5.0, remaining), 0.5))
            if r.status_code == 200:
                return
            last = f"/health answered HTTP {r.status_code}"
        except requests.ConnectionError as e:
            reason = _connection_error_reason(e)
            raise RuntimeError(f"server not reachable at {base_url} ({reason})") from None
        except requests.RequestException as e:  # a read timeout: up, but too busy to answer
            last = f"/health: {type(e).__name__}"
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RuntimeError(f"server at {base_url} not ready after {timeout_s:g}s ({last}); "
                               "--ready-timeout waits longer")
        if not announced:
            print(f"waiting up to {timeout_s:g}s for the server at {base_url} ({last})")
            announced = True
        time.sleep(min(1.0, remaining))


def _connection_error_reason(error: Exception) -> str:
    """The innermost cause of a requests ``ConnectionError`` in a few words."""
    text = str(error)
    for marker in ("Connection refused", "Name or service not known", "No route to host",
                   "timed out", "Temporary failure in name resolution"):
        if marker in text:
            return marker.lower()
    return type(error).__name__


def _get_json(url: str) -> Optional[Dict[str, Any]]:
    try:
        r = requests.get(url, timeout=30)
        return r.json() if r.status_code == 200 else None
    except (requests.RequestException, ValueError):
        return None


def resolve_model_and_tokenizer(args: argparse.Namespace, base_url: str):
    """Model id for OpenAI payloads and the tokenizer path: CLI first, then the server's answers."""
    model_id = args.model
    if model_id is None:
        models = _get_json(f"{base_url}/v1/models") or {}
        data = models.get("data") or []
        model_id = data[0]["id"] if data else "default"
    tok_path = args.tokenizer
    if tok_path is None and args.model and os.path.isdir(args.model):
        tok_path = args.model
    if tok_path is None:
        info = _get_json(f"{base_url}/model_info") or {}
        tok_path = info.get("tokenizer_path") or info.get("model_path")
    if not tok_path:
        raise ValueError("no tokenizer: pass --tokenizer (a local folder)")
    try:
        return model_id, get_tokenizer(tok_path)
    except ValueError:
        info = _get_json(f"{base_url}/model_info") or {}
        ids_usable = args.dataset_name == "random-ids" and args.backend == "sglang"
        if not ids_usable or not info.get("vocab_size"):
            raise
    # A model served without a tokenizer (a dummy-weight preset): token ids only.
    print(f"no tokenizer at {tok_path!r}: sending token ids and counting tokens by "
          "completion_tokens")
    return model_id, IdsOnlyTokenizer(int(info["vocab_size"]))


class IdsOnlyTokenizer:
    """Stands in for a tokenizer when the served model has none: it knows the vocabulary size
    (for ``random-ids`` prompts) and retokenizes nothing (the server returns no text)."""

    all_special_ids: List[int] = []

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> List[int]:
        return []

    def decode(self, ids: List[int]) -> str:
        raise ValueError("the served model has no tokenizer; use --backend sglang with random-ids")


async def get_request(rows: List[DatasetRow], request_rate: float) -> AsyncIterator[DatasetRow]:
    """Yield rows with exponential gaps (Poisson arrivals); all at once for an infinite rate."""
    for row in rows:
        yield row
        if request_rate == float("inf"):
            continue
        await asyncio.sleep(np.random.exponential(1.0 / request_rate))


def _fetch_accept_length(base_url: str, backend: str) -> Optional[float]:
    """``internal_states[0].avg_spec_accept_length`` from the server (``decode[0]`` in PD mode)."""
    if "sglang" not in backend:
        return None
    info = _get_json(f"{base_url}/server_info")
    if not info:
        return None
    if "decode" in info and info["decode"]:
        info = info["decode"][0]
    states = info.get("internal_states") or [{}]
    return states[0].get("avg_spec_accept_length")


# ----------------------------------------------------------------------------- the run
async def benchmark(
    args: argparse.Namespace,
    base_url: str,
    model_id: str,
    tokenizer,
    rows: List[DatasetRow],
) -> Dict[str, Any]:
    """Warm up, optionally flush, run all rows, and return the JSONL result dict."""
    request_func, path = ASYNC_REQUEST_FUNCS[args.backend]
    api_url = f"{base_url}{path}"
    extra = json.loads(args.extra_request_body) if args.extra_request_body else {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-request-body must be a JSON object")

    def make_input(row: DatasetRow, output_len: Optional[int] = None) -> RequestFuncInput:
        return RequestFuncInput(
            prompt=row.prompt, api_url=api_url, prompt_len=row.prompt_len,
            output_len=output_len or row.output_len, model=model_id,
            temperature=args.temperature, top_p=args.top_p,
            ignore_eos=not args.disable_ignore_eos, stream=not args.disable_stream,
            return_logprob=args.return_logprob, extra_request_body=extra,
            ids_only=isinstance(tokenizer, IdsOnlyTokenizer),
        )

    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    async with aiohttp.ClientSession(timeout=AIOHTTP_TIMEOUT, read_bufsize=READ_BUFSIZE) as session:
        if args.warmup_requests > 0:
            print(f"Starting warmup with {args.warmup_requests} sequences...")
            warm_input = make_input(rows[0], min(rows[0].output_len, 32))
            warm = await asyncio.gather(
                *[request_func(session, warm_input) for _ in range(args.warmup_requests)]
            )
            if not any(o.success for o in warm):
                raise RuntimeError(
                    f"Warmup failed - check the benchmark arguments. Error: {warm[0].error}")
            print(f"Warmup completed with {args.warmup_requests} sequences. "
                  "Starting main benchmark run...")
        if args.flush_cache:
            requests.post(f"{base_url}/flush_cache", timeout=60)
        await asyncio.sleep(1.0)

        pbar = tqdm(total=len(rows), disable=args.disable_tqdm)

        async def one(row: DatasetRow) -> RequestFuncOutput:
            if semaphore is None:
                out = await request_func(session, make_input(row))
            else:
                async with semaphore:
                    out = await request_func(session, make_input(row))
            pbar.update(1)
            return out

        if args.profile:
            _profile_call(base_url, "start")
        start = time.perf_counter()
        tasks = []
        async for row in get_request(rows, args.request_rate):
            tasks.append(asyncio.create_task(one(row)))
        outputs: List[RequestFuncOutput] = await asyncio.gather(*tasks)
        pbar.close()
        if args.profile:
            _profile_call(base_url, "stop")

    server_info = _get_json(f"{base_url}/server_info") if "sglang" in args.backend else None
    accept_length = _fetch_accept_length(base_url, args.backend)
    duration = time.perf_counter() - start  # includes the /server_info round trip, as upstream

    metrics = calculate_metrics(
        [r.prompt_len for r in rows], outputs, duration,
        retokenize=lambda text: len(tokenizer.encode(text, add_special_tokens=False)),
        accept_length=accept_length,
    )
    print(format_table(metrics, args.backend, args.request_rate, args.max_concurrency, duration))
    failed = [o for o in outputs if not o.success]
    if failed:
        print(f"{len(failed)} request(s) failed; first error: {failed[0].error.strip()[-2000:]}")

    result: Dict[str, Any] = {
        "backend": args.backend,
        "dataset_name": args.dataset_name,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "sharegpt_output_len": args.sharegpt_output_len,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        "server_info": server_info,
        "duration": duration,
        "completed": metrics.completed,
        "total_input_tokens": metrics.total_input,
        "total_input_text_tokens": metrics.total_input_text,
        "total_output_tokens": metrics.total_output,
        "total_output_tokens_retokenized": metrics.total_output_retokenized,
        "request_throughput": metrics.request_throughput,
        "input_throughput": metrics.input_throughput,
        "output_throughput": metrics.output_throughput,
        "total_throughput": metrics.total_throughput,
        "concurrency": metrics.concurrency,
        "accept_length": metrics.accept_length,
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
        # Summed over the requests' finishing chunks (None without speculation or for a
        # backend that does not report them).
        "spec_correct_drafts_histogram": metrics.spec_correct_drafts_histogram,
        "spec_cap_length": metrics.spec_cap_length,
        "spec_cap_lens_histogram": metrics.spec_cap_lens_histogram,
        "spec_block_accept_length": metrics.spec_block_accept_length,
    }
    for name in ("e2e_latency", "ttft", "tpot", "itl"):
        for stat in ("mean", "median", "std", "p90", "p95", "p99"):
            key = f"{stat}_{name}_ms"
            result[key] = getattr(metrics, key)
    result["max_itl_ms"] = metrics.max_itl_ms
    if args.output_details:
        result.update(
            input_lens=[r.prompt_len for r in rows],
            output_lens=[o.output_len for o in outputs],
            ttfts=[o.ttft for o in outputs],
            itls=[o.itl for o in outputs],
            generated_texts=[o.generated_text for o in outputs],
            errors=[o.error for o in outputs],
        )
    return result


def run_benchmark(args: argparse.Namespace) -> Dict[str, Any]:
    """Run a benchmark from parsed CLI args; print the table, append the JSONL line, return it."""
    if args.backend not in ASYNC_REQUEST_FUNCS:
        raise ValueError(
            f"unknown backend {args.backend!r}; choose from {sorted(ASYNC_REQUEST_FUNCS)}")
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if args.request_rate <= 0:
        raise ValueError("--request-rate must be positive (inf sends everything at once)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        # Checked before the server is contacted: a wrong command line fails at once.
        raise ValueError("--dataset-name sharegpt needs --dataset-path to a local ShareGPT JSON "
                         "file (this build never downloads)")
    if args.dataset_path and not os.path.isfile(args.dataset_path):
        raise ValueError(f"--dataset-path {args.dataset_path!r} is not a file")
    random.seed(args.seed)
    np.random.seed(args.seed)
    base_url = resolve_base_url(args)
    wait_for_server(base_url, args.ready_check_timeout_sec)
    model_id, tokenizer = resolve_model_and_tokenizer(args, base_url)

    if args.dataset_name == "random" and not args.dataset_path:
        print("random: no --dataset-path, so prompts are random ordinary-vocabulary tokens "
              "(upstream would download ShareGPT for them; this build never downloads)")
    rows = get_dataset(
        args.dataset_name, tokenizer, args.num_prompts,
        args.random_input_len, args.random_output_len, args.random_range_ratio,
        dataset_path=args.dataset_path, sharegpt_output_len=args.sharegpt_output_len,
        sharegpt_context_len=args.sharegpt_context_len,
    )
    if ASYNC_REQUEST_FUNCS[args.backend][1].endswith("/chat/completions"):
        # Chat messages carry text: decode id prompts.
        rows = [DatasetRow(tokenizer.decode(r.prompt), r.prompt_len, r.output_len)
                if isinstance(r.prompt, list) else r for r in rows]
    print(f"#Input tokens: {sum(r.prompt_len for r in rows)}")
    print(f"#Output tokens: {sum(r.output_len for r in rows)}")

    result = asyncio.run(benchmark(args, base_url, model_id, tokenizer, rows))
    output_file = args.output_file or default_output_file(args)
    with open(output_file, "a") as f:
        f.write(json.dumps(result) + "\n")
    print(f"Results saved to {output_file}")
    return result


def resolve_base_url(args: argparse.Namespace) -> str:
    """``--base-url``, else ``http://--host:--port`` with upstream's per-backend default port."""
    if args.base_url:
        return args.base_url.rstrip("/")
    port = args.port if args.port is not None else DEFAULT_PORTS.get(args.backend, 30000)
    return f"http://{args.host}:{port}"


def default_output_file(args: argparse.Namespace) -> str:
    """Upstream's file name when ``--output-file`` is absent: the random lengths for the random
    datasets, the dataset name otherwise."""
    stem = f"{args.backend}_{datetime.now().strftime('%m%d')}_{args.num_prompts}"
    if args.dataset_name.startswith("random"):
        return f"{stem}_{args.random_input_len}_{args.random_output_len}.jsonl"
    return f"{stem}_{args.dataset_name}.jsonl"


def build_parser() -> argparse.ArgumentParser:
    """SGLang's bench_serving flags (the subset that needs no download)."""
    p = argparse.ArgumentParser(description="Benchmark the online serving throughput and latency.")
    p.add_argument("--backend", default="sglang", choices=sorted(ASYNC_REQUEST_FUNCS))
    p.add_argument("--base-url", default=None, help="server URL; overrides --host/--port")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=None,
                   help="default: 8000 for vllm backends, 30000 otherwise (as upstream)")
    p.add_argument("--dataset-name", default="sharegpt", choices=DATASET_NAMES)
    p.add_argument("--dataset-path", default="",
                   help="local ShareGPT JSON file: needed by sharegpt; random's prompt source "
                        "(without it, random vocabulary tokens); never downloaded")
    p.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="output length of every sharegpt request (default: the reply's length)")
    p.add_argument("--sharegpt-context-len", type=int, default=None,
                   help="drop sharegpt pairs whose prompt + output exceed this many tokens")
    p.add_argument("--model", default=None,
                   help="model id for OpenAI payloads (default: the server's /v1/models)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the server's)")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=1024)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (Poisson); inf sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--output-file", default=None, help="JSONL file the result line is appended to")
    p.add_argument("--output-details", action="store_true",
                   help="add per-request lists to the JSONL")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--disable-ignore-eos", action="store_true")
    p.add_argument("--disable-stream", action="store_true")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--return-logprob", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--extra-request-body", default=None,
                   help="JSON object merged into each payload")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--flush-cache", action="store_true", help="POST /flush_cache before the run")
    p.add_argument("--ready-timeout", "--ready-check-timeout-sec", dest="ready_check_timeout_sec",
                   type=float, default=30,
                   help="seconds to wait for a server that answers but is not ready yet; one "
                        "that cannot be reached fails at once")
    p.add_argument("--profile", action="store_true",
                   help="torch-profile the server during the run (/start_profile, /stop_profile; "
                        "traces go to the client's SGLANG_TORCH_PROFILER_DIR if set, else the "
                        "server's)")
    return p


def _profile_call(base_url: str, what: str) -> None:
    """POST /start_profile or /stop_profile and print the server's answer (raises if refused)."""
    body = {}
    if what == "start" and os.environ.get("SGLANG_TORCH_PROFILER_DIR"):
        body["output_dir"] = os.environ["SGLANG_TORCH_PROFILER_DIR"]
    resp = requests.post(f"{base_url}/{what}_profile", json=body or None, timeout=600)
    if resp.status_code != 200:
        raise RuntimeError(f"/{what}_profile failed ({resp.status_code}): {resp.text.strip()}")
    print(resp.text.strip())


def main(argv: Optional[List[str]] = None) -> int:
    """CLI entry; returns a process exit code (2 for a bad argument or unreachable server)."""
    args = build_parser().parse_args(argv)
    try:
        run_benchmark(args)
    except (ValueError, RuntimeError) as e:
        print(f"bench_serving: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
