"""Profile SPS(B), the target's verify steps per second at B tokens, for the DSpark scheduler.

Usage::

    python -m sglang.benchmark.dspark_sps_profiler --model-path TARGET --output sps.json \\
        [--speculative-draft-model-path DRAFT] [--batch-tokens 1 2 4 8 16 32 64] \\
        [--prefix-len 1024] [--warmup 3] [--repeats 20] [--cuda-graph] \\
        [--device cuda --dtype bfloat16 --load-format dummy --json-model-override-args '{..}']

    python -m sglang.launch_server --model-path TARGET --speculative-algorithm DSPARK \\
        --speculative-dspark-sps-table-path sps.json

Every server flag is accepted (``ServerArgs``: model, device, dtype, load format, config
overrides, attention / MoE / KDA backends, ``--max-running-requests``, the DSPARK flags) and
builds the target's :class:`~sglang.srt.model_executor.model_runner.ModelRunner` in this process
exactly as a DSPARK server's scheduler does (same pools' layout, the draft's captured target
layers switched on). ``--speculative-algorithm`` is DSPARK; the draft (default: the target's
``dspark/`` folder) is read for its block size ``gamma`` and target layers only, so a folder
with just its ``config.json`` is enough. ``--max-total-tokens`` is ignored: the pools are sized
for the probes.

**What is measured.** ``SPS(B) = 1 / t(B)``, where ``t(B)`` is the median wall time of one
``TARGET_VERIFY`` forward of the target over ``B`` tokens (seconds per step; steps per second
is its inverse, not tokens per second). The ``B`` tokens are laid out as the verify of
``R`` requests with a window of ``N`` tokens each, ``R * N = B``, where ``N`` is the largest
divisor of ``B`` not above ``gamma + 1`` (so the fewest requests; every multiple of ``gamma + 1``
is the layout the DSPARK worker runs, ``gamma + 1`` tokens per request). The forward batch is
built by :func:`~sglang.srt.rounds.chain.build_verify_forward_batch` as in the worker;
each request first holds ``--prefix-len`` committed tokens (a prefill of random token ids, so
attention reads a real cache), and the verifies never advance it (KDA stages its states, the
chain's KV slots are rewritten in place), so every repeat sees the same context. Each probe runs
``--warmup`` untimed forwards, then ``--repeats`` timed ones, each between two device
synchronisations on CUDA (plain wall time on CPU). With ``--cuda-graph`` (CUDA only) each probe
is captured in a CUDA graph, as the server captures its rounds, and the replays are timed; a
probe whose capture fails (or exceeds the model's graph token limit) is timed eagerly, recorded
in ``timed_in_cuda_graph``.

**Default probes.** Powers of two up to ``(gamma + 1) * --max-running-requests`` (by default
48, the most request slots a DSPARK server sizes from memory), plus that maximum, which is also the table's ``max_batch_tokens`` (the largest
batch the deployment runs; the last probe when a larger one is given).

**Output** (what :class:`~sglang.srt.rounds.dspark.sps.SPSTable` loads, which ignores the
descriptive fields)::

    {"sample_batch_tokens": [1, 2, 4, ...], "sample_steps_per_sec": [...],
     "max_batch_tokens": 384, "sample_seconds_per_step": [...], "sample_requests": [...],
     "sample_window": [...], "timed_in_cuda_graph": [...], "gamma": 7, "prefix_len": 1024, ...}
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from sglang.srt.configs.engine_defaults import SPECULATIVE_MAX_RUNNING_REQUESTS

logger = logging.getLogger(__name__)

__all__ = ["build_argparser", "verify_layout", "default_batch_tokens", "VerifyStep",
           "VerifyProfiler", "main"]

# Prefill of the prefixes in groups of at most this many tokens (bounds its activations).
_PREFILL_TOKENS = 8192


def build_argparser() -> argparse.ArgumentParser:
    """Every server flag plus the profiler's own (see the module docstring)."""
    from sglang.srt.server_args import ServerArgs

    ap = argparse.ArgumentParser(prog="python -m sglang.benchmark.dspark_sps_profiler",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(ap)
    # A fixed seed: the random prefixes (and dummy weights) are the same on every run.
    ap.set_defaults(speculative_algorithm="DSPARK", random_seed=0)
    g = ap.add_argument_group("profiler")
    g.add_argument("--output", required=True, help="where the JSON SPS table is written")
    g.add_argument("--batch-tokens", type=int, nargs="+", default=None,
                   help="verify batch sizes B in tokens (default: powers of two up to "
                        "(gamma + 1) x --max-running-requests, plus that maximum)")
    g.add_argument("--prefix-len", type=int, default=1024,
                   help="committed tokens per request before the verify")
    g.add_argument("--warmup", type=int, default=3, help="untimed forwards per probe")
    g.add_argument("--repeats", type=int, default=20, help="timed forwards per probe")
    g.add_argument("--cuda-graph", action="store_true",
                   help="time CUDA graph replays of each probe (CUDA only)")
    return ap


def verify_layout(batch_tokens: int, window: int) -> Tuple[int, int]:
    """``(requests, tokens per request)`` of a verify of ``batch_tokens`` tokens: the largest
    window ``N <= window`` that divides ``batch_tokens`` (a verify forward has the same number
    of tokens for every request), ``R = batch_tokens / N``."""
    if batch_tokens < 1 or window < 1:
        raise ValueError(f"need batch_tokens >= 1 and window >= 1, got {batch_tokens}, {window}")
    n = max(d for d in range(1, min(window, batch_tokens) + 1) if batch_tokens % d == 0)
    return batch_tokens // n, n


def default_batch_tokens(max_batch_tokens: int) -> List[int]:
    """Powers of two below ``max_batch_tokens``, then ``max_batch_tokens`` itself."""
    if max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
    out, b = [], 1
    while b < max_batch_tokens:
        out.append(b)
        b *= 2
    return out + [max_batch_tokens]


class VerifyStep(NamedTuple):
    """One probe's verify: ``run()`` does the forward over fixed input tensors (capturable) and
    returns the logits ``[R * N, V]``; ``input_ids [R, N]`` are the window tokens."""

    run: Callable[[], torch.Tensor]
    requests: int
    window: int
    input_ids: torch.Tensor


class VerifyProfiler:
    """Times verify forwards of a target :class:`ModelRunner` (see the module docstring).

    ``runner``: a target runner with room for ``requests`` requests of ``prefix_len + window``
    tokens (KV slots and KDA scratch for ``window`` chain positions). The constructor allocates
    the requests and prefills their prefixes with random ids drawn from ``seed``
    (``prefix_ids [requests, prefix_len]``).
    """

    def __init__(self, runner: Any, window: int, requests: int, prefix_len: int, seed: int = 0):
        from sglang.srt.rounds.chain import assign_chain_req_to_token

        if window < 1 or requests < 1 or prefix_len < 0:
            raise ValueError(f"need window >= 1, requests >= 1, prefix_len >= 0; got {window}, "
                             f"{requests}, {prefix_len}")
        if prefix_len + window > runner.context_len:
            raise ValueError(f"--prefix-len {prefix_len} + the verify window {window} exceeds the "
                             f"model's context length {runner.context_len}")
        self.runner, self.window, self.prefix_len = runner, window, prefix_len
        self.device = runner.device
        self.vocab_size = runner.model_config.vocab_size
        self.gen = torch.Generator().manual_seed(seed)
        slots = runner.req_to_token_pool.alloc(requests)
        per_req = prefix_len + window
        loc = runner.token_to_kv_pool_allocator.alloc(requests * per_req)
        if slots is None or loc is None:
            raise ValueError(f"the runner's pools cannot hold {requests} requests of {per_req} "
                             "tokens")
        if runner.kda_state_pool is not None and runner.kda_state_pool.layer_ids:
            runner.kda_state_pool.clear_slots(slots)
        self.slots = torch.tensor(slots, dtype=torch.int64, device=self.device)
        self.loc = loc.view(requests, per_req)
        assign_chain_req_to_token(runner.req_to_token_pool.req_to_token, self.slots,
                                  torch.zeros(requests, dtype=torch.int64, device=self.device),
                                  self.loc)
        self._prefill(slots)
        self._graph_state_ready = False

    def _random_ids(self, *shape: int) -> torch.Tensor:
        return torch.randint(self.vocab_size, shape, generator=self.gen).to(self.device)

    def _prefill(self, slots: List[int]) -> None:
        """The prefixes, a few requests per forward (their KV and KDA states become the
        context every verify reads)."""
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch

        p = self.prefix_len
        self.prefix_ids = self._random_ids(len(slots), p)
        if p == 0:
            return
        group = max(1, _PREFILL_TOKENS // p)
        for start in range(0, len(slots), group):
            rows = list(range(start, min(start + group, len(slots))))
            ids = self.prefix_ids[rows].reshape(-1)
            loc = self.loc[rows, :p].reshape(-1)
            self.runner.forward(ForwardBatch.for_extend(ids, [slots[r] for r in rows],
                                                        [0] * len(rows), [p] * len(rows), loc))
        self._sync()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def verify_step(self, batch_tokens: int) -> VerifyStep:
        """The verify forward of ``batch_tokens`` tokens (layout :func:`verify_layout`) on the
        first ``R`` requests, with random window tokens."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
        from sglang.srt.rounds.chain import build_verify_forward_batch

        r, n = verify_layout(batch_tokens, self.window)
        if r > self.slots.shape[0]:
            raise ValueError(f"a verify of {batch_tokens} tokens needs {r} requests; the "
                             f"profiler holds {self.slots.shape[0]}")
        window = self._random_ids(r, n)
        slots = self.slots[:r]
        prefix = torch.full((r,), self.prefix_len, dtype=torch.int64, device=self.device)
        loc = self.loc[:r, self.prefix_len:self.prefix_len + n].contiguous()
        bound = self.prefix_len + n

        def step() -> torch.Tensor:
            # As the DSPARK worker's verify: no hidden states returned, the draft's target
            # layers captured by the model itself (set_dspark_layers_to_capture).
            batch = build_verify_forward_batch(window, slots, prefix, loc,
                                               capture_hidden_mode=CaptureHiddenMode.NULL,
                                               seq_lens_upper_bound=bound)
            return self.runner.forward(batch).next_token_logits

        return VerifyStep(step, r, n, window)

    def _timed(self, fn: Callable[[], Any]) -> float:
        self._sync()
        t0 = time.perf_counter()
        fn()
        self._sync()
        return time.perf_counter() - t0

    def _graphed(self, step: Callable[[], torch.Tensor], r: int, n: int, max_tokens: int,
                 emulate: bool) -> Callable[[], None]:
        """A replay function of ``step`` captured in a graph (``EmulatedGraph`` off CUDA, for
        tests); the attention backend's capture and replay hooks run as the server runs them."""
        from sglang.srt.model_executor.cuda_graph_runner import EmulatedGraph
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        backend = self.runner.attn_backend
        if not self._graph_state_ready:
            backend.init_cuda_graph_state(self.slots.shape[0], max_tokens)
            self._pool = None if emulate else torch.cuda.graph_pool_handle()
            self._graph_state_ready = True
        slots = self.slots[:r]
        backend.init_forward_metadata_capture_cuda_graph(r, r * n, slots, slots,
                                                         ForwardMode.TARGET_VERIFY)
        for _ in range(2):  # outside the capture: Triton JIT, allocator growth
            step()
        self._sync()
        if emulate:
            graph: Any = EmulatedGraph()
            graph.capture(lambda: {"logits": step()})
        else:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                step()
        self._sync()

        def replay() -> None:
            backend.init_forward_metadata_replay_cuda_graph(r, slots, slots,
                                                            ForwardMode.TARGET_VERIFY)
            graph.replay()

        return replay

    def profile(self, batch_tokens: int, warmup: int, repeats: int, graph: Optional[str] = None,
                max_graph_tokens: Optional[int] = None) -> Dict[str, Any]:
        """Time one probe: ``{"batch_tokens", "requests", "window", "seconds" (median),
        "steps_per_sec", "cuda_graph"}``. ``graph``: ``None`` (eager), ``"cuda"`` or
        ``"emulated"``; ``max_graph_tokens`` (default the probe) sizes the backend's graph
        state, which is set once for all probes."""
        step, r, n, _ = self.verify_step(batch_tokens)
        fn: Callable[[], Any] = step
        in_graph = False
        limit = self.runner.max_cuda_graph_tokens()
        if graph is not None and limit is not None and batch_tokens > limit:
            logger.warning("B=%d is above the model's CUDA graph limit of %d tokens: timed "
                           "eagerly", batch_tokens, limit)
        elif graph is not None:
            try:
                fn = self._graphed(step, r, n, max_graph_tokens or batch_tokens,
                                   emulate=graph == "emulated")
                in_graph = True
            except Exception as e:  # the server too runs such a batch eagerly
                self._sync()
                logger.warning("capture of B=%d failed (%s: %s): timed eagerly", batch_tokens,
                               type(e).__name__, e)
        for _ in range(warmup):
            fn()
        times = [self._timed(fn) for _ in range(repeats)]
        sec = statistics.median(times)
        return {"batch_tokens": batch_tokens, "requests": r, "window": n, "seconds": sec,
                "steps_per_sec": 1.0 / sec, "cuda_graph": in_graph}


def _check_args(ns: argparse.Namespace) -> None:
    if ns.speculative_algorithm is None or str(ns.speculative_algorithm).upper() != "DSPARK":
        raise SystemExit(f"--speculative-algorithm {ns.speculative_algorithm}: the profiler "
                         "builds a DSPARK target (leave the flag out)")
    for name, low in (("prefix_len", 0), ("warmup", 0), ("repeats", 1)):
        if getattr(ns, name) < low:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= {low}")
    if ns.batch_tokens is not None and min(ns.batch_tokens) < 1:
        raise SystemExit(f"--batch-tokens must all be >= 1, got {ns.batch_tokens}")
    if os.path.isdir(ns.output):
        raise SystemExit(f"--output {ns.output!r} is a folder; give a file path")


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Profile, write ``--output`` and return the written JSON object."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner, runner_kwargs_from_server_args
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.rounds.dspark.sps import SPSTable
    from sglang.srt.rounds.dspark.setup import dspark_setup
    from sglang.srt.rounds.dspark.worker import DSparkWorker

    ap = build_argparser()
    ns = ap.parse_args(argv)
    _check_args(ns)
    try:
        server_args = ServerArgs.from_cli_args(ns)
    except ValueError as e:
        ap.error(str(e))
    if server_args.tp_size != 1:
        raise SystemExit("--tp-size: the profiler runs one rank in process; profile with 1")
    if ns.cuda_graph and server_args.resolved_device() != "cuda":
        raise SystemExit("--cuda-graph needs CUDA (graphs are a CUDA feature)")
    if server_args.cpu_num_threads is not None:
        torch.set_num_threads(server_args.cpu_num_threads)
    model_config = ModelConfig.from_path(server_args.model_path,
                                         server_args.json_model_override_args)
    setup = dspark_setup(server_args, model_config)
    window = setup.gamma + 1
    context = server_args.context_length or model_config.context_len
    if ns.prefix_len + window > context:
        raise SystemExit(f"--prefix-len {ns.prefix_len} + the verify window {window} exceeds "
                         f"the context length {context}")
    # Without --max-running-requests a deployment sizes its slots from memory, never above
    # the speculative cap: the table must cover the largest batch it could run.
    slots = server_args.max_running_requests or SPECULATIVE_MAX_RUNNING_REQUESTS
    deploy_max = window * slots
    probes = sorted(set(ns.batch_tokens or default_batch_tokens(deploy_max)))
    requests = max(verify_layout(b, window)[0] for b in probes)

    kwargs = runner_kwargs_from_server_args(server_args)
    kwargs.update(DSparkWorker.requirements(server_args, model_config).runner_kwargs())
    kwargs.update(max_running_requests=requests,
                  max_total_tokens=requests * (ns.prefix_len + window))
    runner = ModelRunner(model_config, **kwargs)
    runner.model.set_dspark_layers_to_capture(list(setup.config.target_layer_ids))
    profiler = VerifyProfiler(runner, window, requests, ns.prefix_len, server_args.random_seed)
    graph = "cuda" if ns.cuda_graph else None
    rows = []
    for b in probes:
        row = profiler.profile(b, ns.warmup, ns.repeats, graph, max_graph_tokens=probes[-1])
        rows.append(row)
        print(f"[sps] B={b:>5} ({row['requests']} x {row['window']}): "
              f"{row['seconds'] * 1e3:9.3f} ms/step, {row['steps_per_sec']:10.2f} steps/s"
              + (" (CUDA graph)" if row["cuda_graph"] else ""), flush=True)
    table = SPSTable.from_samples([(r["batch_tokens"], r["steps_per_sec"]) for r in rows],
                                  max(deploy_max, probes[-1]))
    out: Dict[str, Any] = {
        **table.to_dict(),
        "sample_seconds_per_step": [r["seconds"] for r in rows],
        "sample_requests": [r["requests"] for r in rows],
        "sample_window": [r["window"] for r in rows],
        "timed_in_cuda_graph": [r["cuda_graph"] for r in rows],
        "gamma": setup.gamma, "prefix_len": ns.prefix_len, "warmup": ns.warmup,
        "repeats": ns.repeats, "statistic": "median",
        "model_path": model_config.model_path, "draft_path": setup.draft_path,
        "device": str(runner.device), "dtype": str(runner.dtype).replace("torch.", ""),
        "attention_backend": server_args.attention_backend,
        "load_format": server_args.load_format,
    }
    os.makedirs(os.path.dirname(os.path.abspath(ns.output)), exist_ok=True)
    with open(ns.output, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    print(f"[sps] wrote {ns.output} ({len(rows)} probes, max_batch_tokens "
          f"{table.max_batch_tokens})")
    return out


if __name__ == "__main__":
    main()
