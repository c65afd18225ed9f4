"""Census of one batch-1 prefill, in process: device time and kernels per category of model work.

H200 command lines (the 12-layer bf16 model, then the whole 42-layer model in block fp8; each at
1024 and 8192 prompt tokens, one JSON line each into prefill_census.jsonl):

    python benchmark/batch1/prefill_census.py --model-path ling-3.0-flash --load-format dummy \\
        --json-model-override-args '{"num_hidden_layers": 12}' --moe-runner-backend triton \\
        --attention-backend triton --disable-cuda-graph --prompt-len 1024 \\
        --label "flash12 bf16 1024" --result-filename prefill_census.jsonl
    python benchmark/batch1/prefill_census.py --model-path ling-3.0-flash --load-format dummy \\
        --json-model-override-args '{"num_hidden_layers": 12}' --moe-runner-backend triton \\
        --attention-backend triton --disable-cuda-graph --prompt-len 8192 \\
        --label "flash12 bf16 8192" --result-filename prefill_census.jsonl
    python benchmark/batch1/prefill_census.py --model-path ling-3.0-flash --load-format dummy \\
        --quantization fp8 --mem-fraction-static 0.93 --context-length 9216 \\
        --max-running-requests 1 --moe-runner-backend triton --attention-backend triton \\
        --disable-cuda-graph --prompt-len 1024 \\
        --label "flash42 fp8 1024" --result-filename prefill_census.jsonl
    python benchmark/batch1/prefill_census.py --model-path ling-3.0-flash --load-format dummy \\
        --quantization fp8 --mem-fraction-static 0.93 --context-length 9216 \\
        --max-running-requests 1 --moe-runner-backend triton --attention-backend triton \\
        --disable-cuda-graph --prompt-len 8192 \\
        --label "flash42 fp8 8192" --result-filename prefill_census.jsonl
    python benchmark/batch1/plot_prefill_census.py prefill_census.jsonl -o prefill_census.png

(``--disable-cuda-graph`` and ``--max-running-requests 1`` are what the script sets anyway: a
prefill runs eager and the census holds one request. ``--prefill-graphs`` then captures a
prefill graph at each prompt length and times its replays in the same process: the A/B of
``--prefill-cuda-graph-tokens``. ``--kernel-choices moe_grouped_mm=1`` puts
the torch-native MoE's routed experts of a long prompt on torch's grouped GEMMs: an A/B of its
own label.)

On CPU (the bundled tiny model, the default ``--model-path``)::

    python benchmark/batch1/prefill_census.py --prompt-len 64

The worker is built as ``python -m sglang.bench_one_batch`` builds it (the same server flags:
``--model-path``, ``--load-format dummy``, ``--json-model-override-args``, ``--quantization``,
``--moe-runner-backend``, ``--attention-backend``, ...; pools for one request of the prompt,
no CUDA graphs) and each prefill is bench_one_batch's ``run_once`` with one output token: one
request of ``--prompt-len`` random ids in a fresh request slot, its KV and state released after.
One warm-up prefill, ``--timed`` unprofiled timed ones, then one profiled prefill (and with
``--sync-sites``, ``--copy-sites``, ``--host-profile`` and ``--routing`` more, last: they
perturb none of the measured ones; ``--routing`` counts the pairs per expert of every MoE layer,
to tell whether the model routes as uniformly as the MoE tile sweep assumes).

Attribution: module forward hooks (installed for the profiled prefill only; no model edits)
open a profiler range per model component and the innermost range around an op names its
category (:func:`prefill_category_of`):

* ``MoE``: the whole ``BailingMoE`` block: router, routed experts (grouped GEMM / grouped_mm /
  per-expert mm + index_add / gather), the shared expert, the combine and its all-reduce;
* ``dense projections``: every linear layer outside the MoE blocks (KDA's fused q|k|v|b|f|g and
  o_proj, MLA's q / kv_a / g / dense projections, with the dequantisation of fp8 weights) and
  the dense MLP layers (``first_k_dense_replace``), their activation included;
* ``KDA``: the rest of a KDA layer: short convolution, gate, the chunked recurrence (fla's
  ``chunk_kda`` / the torch chunk form);
* ``MLA attention``: the rest of an MLA layer: RoPE assembly, the absorbed ``w_kc`` / ``w_vc``
  matmuls, the attention kernel (sdpa / flash / Triton), the sigmoid head gate;
* ``norms``: every RMSNorm (the layers' residual norms, the final norm, MLA's q_a / kv_a norms)
  and KDA's gated output norm;
* ``lm_head``: the logits processor (the last-token GEMM on ``[1, vocab]``);
* ``other``: embedding, sampling, glue.

Work outside every range (a kernel no host op claims, or a model without these modules) is
classified by its name (:func:`category_by_name`), else "other". On CUDA each device kernel
(copies and memsets included) counts with its device time; on CPU, which has no kernels, the
"device" is the CPU: each top-level aten op counts with its CPU time. Reported beside the
categories: the prefill's wall time (synchronised, profiled and unprofiled) and its host gaps,
the profiled wall time minus the union of the device's busy intervals.

Synchronisations (``--sync-sites``, CUDA only): after the census, one more unprofiled prefill
runs under ``torch.cuda.set_sync_debug_mode("warn")`` and every synchronising call in it
(``.item()``, ``.tolist()``, ``.cpu()``, a copy from pageable host memory, ``nonzero``, ...) is
counted at its site, the innermost frame in this repository's ``python/`` or
``sgl-kernel/python/`` trees, and the library frame that made the call when that lies outside
them (``host_attribution.sync_site``). Each sync drains the GPU queue: the host waits for the device, then the
device for the host's next launches, so a host-bound prefill's host and device time add up at
every one. The JSON line gets ``sync_sites`` (``site``, ``via``, ``count``; most first) and
``syncs`` (their total); the table ``| syncs | site | via |`` follows the census. On CPU the
option prints that it needs CUDA and adds nothing.

Host time (``--host-profile N``, any device): then one prefill timed without synchronising
(``host_return_ms``: when the call returned; ``host_wall_ms``: when the device was done) and
one under ``cProfile``: the N functions with the most time of their own (a launcher, a guard,
a shape check) and this repository's N with the most time including callees
(:func:`host_census`). An eager prefill whose GPU is idle most of its wall is host-bound; this
says on which lines.

Copies (``--copy-sites``, any device): one more prefill under a ``TorchDispatchMode`` that
counts every torch op that only moves or fills memory (``copy_``, ``clone`` (a ``.contiguous()``
of a strided view), ``_to_copy``, ``cat``, fills, index copies: ``host_attribution.COPY_OPS``)
writing at least ``--copy-min-mb`` (1 MiB), at its call site as for syncs, with the MiB written
there: ``copy_sites`` (``site``, ``via``, ``op``, ``count``, ``mb``; most bytes first) and
``copy_mb``, and the table ``| MiB | ops | op | site | via |``. Kernels launched without a torch
op (Triton's, a library's own) are not seen.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import statistics
import sys
import time
from typing import (Any, Callable, ContextManager, Dict, Iterable, Iterator, List, Optional,
                    Sequence, Tuple)

import torch
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import profile, record_function

from sglang.bench_one_batch import BenchArgs, build_worker, run_once
from sglang.srt.layers.kernel_choices import add_kernel_choices_arg
from sglang.srt.layers.layernorm import GatedRMSNorm, RMSNorm
from sglang.srt.layers.linear import LinearBase
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.moe.moe_layer import BailingMLP, BailingMoE, FusedMoE
from sglang.srt.layers.moe.topk import MoEGate
from sglang.srt.rounds.plain import TpModelWorker
from sglang.srt.models.bailing_moe_v3 import BailingKDA, BailingMLA
from sglang.srt.server_args import ServerArgs

try:  # run as a script, benchmark/batch1 is on sys.path; imported by file path it may not be
    from census_common import (activities, device_events, git_commit, innermost_range,
                               install_range_hooks, is_top_level_op)
    from host_attribution import (copy_table, count_copy_sites, count_sync_sites, host_tables,
                                  library_roots, rank_host_functions, recording_copies,
                                  recording_syncs, repo_roots, sync_table)
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from census_common import (activities, device_events, git_commit, innermost_range,
                               install_range_hooks, is_top_level_op)
    from host_attribution import (copy_table, count_copy_sites, count_sync_sites, host_tables,
                                  library_roots, rank_host_functions, recording_copies,
                                  recording_syncs, repo_roots, sync_table)

CATEGORY_PREFIX = "prefill-category::"  # category ranges (hooks)
PREFILL_RANGE = "prefill-census::prefill"  # around the profiled worker.prefill call

CATEGORIES: Tuple[str, ...] = ("MoE", "dense projections", "KDA", "MLA attention", "norms",
                               "lm_head", "other")
# Categories whose modules' children open no range of their own: everything inside counts for
# the block (a shared expert's linears are MoE work, not dense projections).
_LEAF_CATEGORIES = frozenset(CATEGORIES) - {"KDA", "MLA attention"}

# The name fallback, first match wins. Attention first: flash-attention kernels are named
# "flash_fwd_..." and would otherwise match KDA's "fwd_"; "conv" but not "convert".
NAME_RULES: List[Tuple[str, "re.Pattern[str]"]] = [
    ("MLA attention", re.compile(r"flash|sdpa|scaled_dot_product|efficient_attention|fmha|mla",
                                 re.I)),
    ("MoE", re.compile(r"moe|grouped_mm|grouped_gemm|grouped_gemv|index_add|expert|router|topk",
                       re.I)),
    ("KDA", re.compile(r"chunk|kda|gated_delta|fwd_|conv(?!ert)", re.I)),
    ("norms", re.compile(r"rms_?norm|layer_?norm", re.I)),
    ("dense projections", re.compile(r"gemm|matmul|cublas|cutlass|aten::(mm|addmm|linear)$|"
                                     r"dequant|fp8", re.I)),
]


# ============================================================================================
# Attribution
# ============================================================================================
def prefill_category_of(module: nn.Module, enclosing: Optional[str]) -> Optional[str]:
    """The category range ``module`` opens inside a range of category ``enclosing`` (None:
    outside every range), or None when it opens none."""
    if enclosing in _LEAF_CATEGORIES:
        return None
    if isinstance(module, (BailingMoE, FusedMoE, MoEGate)):
        return "MoE"
    if isinstance(module, LogitsProcessor):
        return "lm_head"
    if isinstance(module, (RMSNorm, GatedRMSNorm)):
        return "norms"
    if isinstance(module, (LinearBase, BailingMLP)):  # a BailingMLP outside MoE: a dense layer
        return "dense projections"
    if isinstance(module, BailingKDA):
        return "KDA"
    if isinstance(module, BailingMLA):
        return "MLA attention"
    return None


def prefill_categorised_modules(model: nn.Module) -> List[Tuple[str, nn.Module, str]]:
    """``(qualified name, module, category)`` of every module of ``model`` that opens a census
    range, parents before children (a module reachable twice is listed once, where first
    seen)."""
    found: List[Tuple[str, nn.Module, str]] = []
    seen = set()

    def walk(parent: nn.Module, prefix: str, enclosing: Optional[str]) -> None:
        for name, child in parent.named_children():
            if id(child) in seen:
                continue
            seen.add(id(child))
            qualified = f"{prefix}.{name}" if prefix else name
            category = prefill_category_of(child, enclosing)
            if category is not None:
                found.append((qualified, child, category))
            if (category or enclosing) not in _LEAF_CATEGORIES:
                walk(child, qualified, category or enclosing)

    walk(model, "", None)
    return found


def install_prefill_hooks(models: Iterable[nn.Module]) -> Callable[[], None]:
    """Wrap the forward of every categorised module of ``models`` in a profiler range named
    ``CATEGORY_PREFIX + category``; returns the function that removes the hooks again."""
    return install_range_hooks(((module, category) for model in models
                                for _, module, category in prefill_categorised_modules(model)),
                               CATEGORY_PREFIX)


def category_by_name(name: str) -> str:
    """The category of a kernel or op by its name alone (:data:`NAME_RULES`), else "other"."""
    for category, pattern in NAME_RULES:
        if pattern.search(name):
            return category
    return "other"


def busy_us(intervals: Iterable[Tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (overlapping work counts once)."""
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total


def _in_prefill(event: Any) -> bool:
    return innermost_range(event, PREFILL_RANGE) is not None


def prefill_census(events: Sequence[Any], cuda: bool, top: int = 3) -> Dict[str, Any]:
    """Attribute a profiled prefill's work to :data:`CATEGORIES`.

    CUDA: every device kernel (copies and memsets included; not the GPU mirrors of ranges)
    counts in the category of the innermost census range around the host op that launched it;
    a kernel outside every range, or that no host op claims, by its name. CPU: every top-level
    aten op inside the prefill range, with its CPU time. Returns ``categories`` (per category:
    ``kernels``, ``us``, ``share`` of the total time, its ``top`` kernel names by time as
    ``[name, us, count]`` and ``most_launched``, the same by launch count: where a host-bound
    prefill's launches come from), ``total`` (``kernels``, ``us``: counted from the whole profile,
    independently of the attribution) and ``busy_us`` (the union of the busy intervals).
    """
    rows = {c: {"kernels": 0, "us": 0.0} for c in CATEGORIES}
    names: Dict[str, Dict[str, List[float]]] = {c: {} for c in CATEGORIES}

    def add(category: str, name: str, us: float) -> None:
        rows[category]["kernels"] += 1
        rows[category]["us"] += us
        slot = names[category].setdefault(name, [0.0, 0])
        slot[0] += us
        slot[1] += 1

    def category(event: Any, name: str) -> str:
        return innermost_range(event, CATEGORY_PREFIX) or category_by_name(name)

    mirrors = (CATEGORY_PREFIX, PREFILL_RANGE)
    host = [e for e in events if e.device_type == DeviceType.CPU]
    if cuda:
        claimed: Dict[str, int] = {}  # kernel name -> launches host ops claim
        for e in host:
            for k in e.kernels:
                if not k.name.startswith(mirrors):
                    add(category(e, k.name), k.name, k.duration)
                    claimed[k.name] = claimed.get(k.name, 0) + 1
        device = device_events(events, mirrors)
        for e in device:  # kernels without a launcher (rare): by name
            if claimed.get(e.name, 0) > 0:
                claimed[e.name] -= 1
            else:
                add(category_by_name(e.name), e.name, e.time_range.elapsed_us())
        spans = [(e.time_range.start, e.time_range.end) for e in device]
        total = {"kernels": len(device), "us": float(sum(e.time_range.elapsed_us()
                                                         for e in device))}
        if any(n > 0 for n in claimed.values()):  # more launches claimed than kernels ran
            print("warning: host ops claim kernels the profile does not hold: "
                  f"{sorted(n for n, c in claimed.items() if c > 0)[:5]}", file=sys.stderr)
    else:
        ops = [e for e in host if is_top_level_op(e) and _in_prefill(e)]
        for e in ops:
            add(category(e, e.name), e.name, float(e.cpu_time_total))
        spans = [(e.time_range.start, e.time_range.end) for e in ops]
        total = {"kernels": len(ops), "us": float(sum(e.cpu_time_total for e in ops))}
    scale = total["us"] or 1.0
    out = {}
    for c, row in rows.items():
        ranked = sorted(names[c].items(), key=lambda kv: -kv[1][0])[:top]
        launched = sorted(names[c].items(), key=lambda kv: (-kv[1][1], -kv[1][0]))[:top]
        out[c] = {**row, "share": row["us"] / scale,
                  "top": [[n, us, int(count)] for n, (us, count) in ranked],
                  "most_launched": [[n, us, int(count)] for n, (us, count) in launched]}
    return {"categories": out, "total": total, "busy_us": busy_us(spans)}


# ============================================================================================
# Measurement
# ============================================================================================
def _sync(device: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _run_once_around_prefill(worker: TpModelWorker, prompt_len: int, seed: int,
                             wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """One prefill as bench_one_batch's ``run_once`` runs it (one output token) with
    ``worker.prefill`` replaced by ``wrap(worker.prefill)`` for the call: what the wrapper does
    covers exactly the prefill (the batch is built and released outside it)."""
    prefill = worker.prefill
    own = vars(worker).get("prefill")  # an instance attribute to restore; None: the method
    worker.prefill = wrap(prefill)
    try:
        run_once(worker, 1, prompt_len, 1, seed)
    finally:
        if own is None:
            del worker.prefill
        else:
            worker.prefill = own


def profiled_prefill(worker: TpModelWorker, prompt_len: int, seed: int
                     ) -> Tuple[Any, float]:
    """One prefill (bench_one_batch's ``run_once``, one output token) with the census hooks
    installed and the profiler running around exactly the ``worker.prefill`` call (the batch is
    built and released outside it). Returns ``(profiler events, synchronised wall ms)``."""
    runner = worker.model_runner
    cuda = runner.device.type == "cuda"
    sync = _sync(runner.device)
    got: Dict[str, Any] = {}

    def wrap(prefill: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            sync()  # the batch's host-to-device copies are not the prefill's
            with profile(activities=activities(cuda)) as prof:
                t0 = time.perf_counter()
                with record_function(PREFILL_RANGE):
                    out = prefill(*args, **kwargs)
                sync()
                got["wall_ms"] = (time.perf_counter() - t0) * 1e3
            got["prof"] = prof
            return out
        return wrapped

    remove = install_prefill_hooks([runner.model])
    try:
        _run_once_around_prefill(worker, prompt_len, seed, wrap)
    finally:
        remove()
    return got["prof"].events(), got["wall_ms"]


def _records_of_one_prefill(worker: TpModelWorker, prompt_len: int, seed: int,
                            recording: Callable[[], ContextManager[List[Any]]]) -> List[Any]:
    """One unprofiled prefill (as the timed ones run) inside ``recording()``, a context that
    yields the list it records into, around exactly the ``worker.prefill`` call; that list."""
    got: Dict[str, List[Any]] = {}

    def wrap(prefill: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with recording() as records:
                got["records"] = records
                return prefill(*args, **kwargs)
        return wrapped

    _run_once_around_prefill(worker, prompt_len, seed, wrap)
    return got["records"]


@contextlib.contextmanager
def _warning_syncs(roots: List[str], lib_roots: List[str]) -> Iterator[List[Any]]:
    """``recording_syncs`` with torch's sync debug mode on ("warn") inside it, restored after."""
    with recording_syncs(roots, lib_roots) as records:
        before = torch.cuda.get_sync_debug_mode()  # "default" (0) unless set outside
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield records
        finally:  # also on an error: a later sync must not warn
            torch.cuda.set_sync_debug_mode(before)


def sync_census(worker: TpModelWorker, prompt_len: int, seed: int) -> Dict[str, Any]:
    """One unprofiled prefill with torch's sync debug mode on ("warn") around exactly the
    ``worker.prefill`` call; every synchronising call in it is counted at its
    ``host_attribution.sync_site``. Returns ``{"sync_sites": count_sync_sites(...), "syncs":
    total}``. CUDA only: the debug mode is CUDA's."""
    roots, lib_roots = repo_roots(), library_roots()
    records = _records_of_one_prefill(worker, prompt_len, seed,
                                      lambda: _warning_syncs(roots, lib_roots))
    sites = count_sync_sites(records)
    return {"sync_sites": sites, "syncs": sum(s["count"] for s in sites)}


def copy_census(worker: TpModelWorker, prompt_len: int, seed: int, min_mb: float = 1.0
                ) -> Dict[str, Any]:
    """One unprofiled prefill with every torch op that only copies or fills memory
    (``host_attribution.COPY_OPS``, writing at least ``min_mb`` MiB) counted at its call site:
    the tensors a prefill writes twice. Returns ``{"copy_sites": count_copy_sites(...),
    "copy_mb": total MiB, "copy_min_mb": min_mb}``. Any device (the ops are seen on the host,
    by torch's dispatcher)."""
    roots, lib_roots = repo_roots(), library_roots()
    records = _records_of_one_prefill(
        worker, prompt_len, seed, lambda: recording_copies(roots, lib_roots, int(min_mb * 2**20)))
    sites = count_copy_sites(records)
    return {"copy_sites": sites, "copy_mb": sum(s["mb"] for s in sites), "copy_min_mb": min_mb}


def host_census(worker: TpModelWorker, prompt_len: int, seed: int, top: int = 25
                ) -> Dict[str, Any]:
    """Where the host's time of one prefill goes. One unprofiled prefill times the host alone:
    ``host_return_ms`` from the ``worker.prefill`` call until it returns (no synchronisation
    added; a prefill that synchronises inside waits there) and ``host_wall_ms`` until the
    device is done too. A host-bound prefill returns about when the device finishes; a
    device-bound one returns early. Then one prefill under ``cProfile`` (its overhead inflates
    every Python call, so its shares, not its times, are the finding): ``host_profile``, the
    ``host_attribution.rank_host_functions`` tables (and the own time per package), and
    ``host_profile_ms``, the profiled call's time."""
    import cProfile
    import pstats

    sync = _sync(worker.model_runner.device)
    got: Dict[str, Any] = {}

    def timing(prefill: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            sync()
            t0 = time.perf_counter()
            out = prefill(*args, **kwargs)
            got["host_return_ms"] = (time.perf_counter() - t0) * 1e3
            sync()
            got["host_wall_ms"] = (time.perf_counter() - t0) * 1e3
            return out
        return wrapped

    def profiling(prefill: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            sync()
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            out = prof.runcall(prefill, *args, **kwargs)
            got["host_profile_ms"] = (time.perf_counter() - t0) * 1e3
            sync()
            got["stats"] = pstats.Stats(prof).stats
            return out
        return wrapped

    _run_once_around_prefill(worker, prompt_len, seed, timing)
    _run_once_around_prefill(worker, prompt_len, seed, profiling)
    lib_roots = library_roots()
    ranked = rank_host_functions(got.pop("stats"), repo_roots(), lib_roots, top)
    return {**got, "host_profile": ranked}


def routing_census(worker: TpModelWorker, prompt_len: int, seed: int) -> Dict[str, Any]:
    """How one prefill routes its tokens: a forward pre-hook on every ``FusedMoE`` counts the
    (token, expert) pairs per expert of that layer's ``topk_ids``. The grouped GEMM streams the
    weights of every expert touched, so its time depends on the routing, and a tile sweep on
    uniform random routing (``benchmark/kernels/tune_moe_grouped_gemm.py``) only predicts a
    model that routes about as uniformly: this says whether it does. Returns ``{"routing":
    {...}}``: per MoE layer ``[experts touched, largest group]``, their means over the layers,
    and ``uniform_touched``, the experts a uniform top-k routing of the same tokens touches on
    average. One more prefill after the measured ones (the counts read the device)."""
    from sglang.srt.layers.moe.moe_layer import FusedMoE

    layers: List[List[int]] = []
    shape: Dict[str, int] = {}

    def count(module: nn.Module, args: Tuple[Any, ...]) -> None:
        ids = args[2]  # FusedMoE.forward(hidden, topk_weights, topk_ids, ...)
        per_expert = torch.bincount(ids.reshape(-1).long(), minlength=module.num_experts)
        layers.append([int((per_expert > 0).sum()), int(per_expert.max())])
        shape.update(experts=module.num_experts, top_k=ids.shape[-1], tokens=ids.shape[0])

    handles = [m.register_forward_pre_hook(count)
               for m in worker.model_runner.model.modules() if isinstance(m, FusedMoE)]
    try:
        run_once(worker, 1, prompt_len, 1, seed)
    finally:
        for h in handles:
            h.remove()
    if not layers:
        return {"routing": None}
    e, k, t = shape["experts"], shape["top_k"], shape["tokens"]
    return {"routing": {
        "experts": e, "top_k": k, "tokens": t, "moe_layers": len(layers),
        "touched_mean": statistics.mean(n for n, _ in layers),
        "touched_min": min(n for n, _ in layers),
        "largest_group_mean": statistics.mean(g for _, g in layers),
        "uniform_touched": e * (1 - (1 - k / e) ** t),
        "per_layer": layers}}


def run_prefill_census(worker: TpModelWorker, prompt_len: int, seed: int, timed: int,
                       top: int = 3, sync_sites: bool = False, host_profile: int = 0,
                       routing: bool = False, copy_sites: bool = False,
                       copy_min_mb: float = 1.0) -> Dict[str, Any]:
    """Warm-up, ``timed`` unprofiled prefills, then the profiled one and its census (times in
    ms; ``top`` names per category by time and by launches). ``sync_sites`` (CUDA): then one
    more prefill, :func:`sync_census`, whose keys join the result (last: the debug mode's
    warnings and stack walks slow the host, so no measured prefill runs with them).
    ``host_profile`` > 0: then :func:`host_census` with that many functions per table.
    ``routing``: then :func:`routing_census`. ``copy_sites``: then :func:`copy_census` (writes
    of at least ``copy_min_mb`` MiB)."""
    run_once(worker, 1, prompt_len, 1, seed)  # warm-up: allocator, Triton compiles, autotune
    plain = [run_once(worker, 1, prompt_len, 1, seed)["prefill_latency"] * 1e3
             for _ in range(timed)]
    events, wall_ms = profiled_prefill(worker, prompt_len, seed)
    census = prefill_census(events, worker.model_runner.device.type == "cuda", top)
    cats = {c: {"kernels": row["kernels"], "ms": row["us"] / 1e3, "share": row["share"],
                **{key: [[n, us / 1e3, count] for n, us, count in row[key]]
                   for key in ("top", "most_launched")}}
            for c, row in census["categories"].items()}
    busy_ms = census["busy_us"] / 1e3
    out = {"categories": cats,
           "total": {"kernels": census["total"]["kernels"],
                     "ms": census["total"]["us"] / 1e3},
           "wall_ms": wall_ms, "unprofiled_wall_ms": statistics.median(plain) if plain else None,
           "busy_ms": busy_ms, "host_gap_ms": wall_ms - busy_ms}
    if sync_sites and worker.model_runner.device.type == "cuda":
        out.update(sync_census(worker, prompt_len, seed))
    if host_profile > 0:
        out.update(host_census(worker, prompt_len, seed, host_profile))
    if routing:
        out.update(routing_census(worker, prompt_len, seed))
    if copy_sites:
        out.update(copy_census(worker, prompt_len, seed, copy_min_mb))
    return out


# ============================================================================================
# Output and command line
# ============================================================================================
def census_table(result: Dict[str, Any]) -> str:
    """The markdown table ``| category | kernels | <device> ms | share |`` with a total row."""
    unit = "device ms" if result["device"] == "cuda" else "CPU ms"
    count = "kernels" if result["device"] == "cuda" else "aten ops"
    lines = [f"| category | {count} | {unit} | share |", "|---|---|---|---|"]
    for c in CATEGORIES:
        row = result["categories"][c]
        lines.append(f"| {c} | {row['kernels']} | {row['ms']:.3f} | {row['share']:.1%} |")
    tot = result["total"]
    lines.append(f"| **total** | {tot['kernels']} | {tot['ms']:.3f} | 100.0% |")
    return "\n".join(lines)


def _print(result: Dict[str, Any]) -> None:
    device = "the GPU" if result["device"] == "cuda" else "the CPU"
    if result["device"] != "cuda":
        print("CPU: the device is the CPU; 'aten ops' are top-level aten ops and their CPU time")
    plain = result["unprofiled_wall_ms"]
    plain_txt = f", {plain:.2f} ms unprofiled" if plain is not None else ""
    print(f"prefill of {result['prompt_len']} tokens, {result['layers']} layers, "
          f"{result['dtype']}{' ' + result['quantization'] if result['quantization'] else ''}: "
          f"wall {result['wall_ms']:.2f} ms profiled{plain_txt}; {device} busy "
          f"{result['busy_ms']:.2f} ms, host gaps {result['host_gap_ms']:.2f} ms "
          f"({result['host_gap_ms'] / result['wall_ms']:.1%} of the profiled wall)")
    print(census_table(result))
    for c in CATEGORIES:
        top = result["categories"][c]["top"]
        if top:
            print(f"  {c}: " + "; ".join(f"{n[:60]} {ms:.3f} ms x{k}" for n, ms, k in top))
        launched = result["categories"][c].get("most_launched")
        if launched:
            print(f"  {c}, most launched: "
                  + "; ".join(f"{n[:60]} x{k} ({ms:.3f} ms)" for n, ms, k in launched))
    if "graph_unprofiled_wall_ms" in result:
        failed = result["graph_capture_failed"]
        memory = result["graph_memory_gib"]
        print(f"prefill graph: {result['graph_unprofiled_wall_ms']:.2f} ms unprofiled "
              f"({result['graph_replays']} replays"
              f"{f'; the captures hold {memory:.2f} GiB' if memory is not None else ''}"
              f"{'; capture failed: ' + failed if failed else ''})")
    if "sync_sites" in result:
        print(f"synchronising calls in one more prefill (sync debug mode): {result['syncs']}")
        print(sync_table(result))
    if "copy_sites" in result:
        print(f"copies and fills of at least {result['copy_min_mb']:g} MiB in one more "
              f"prefill: {result['copy_mb']:.1f} MiB written")
        print(copy_table(result))
    if "host_profile" in result:
        print(host_tables(result))
    routing = result.get("routing")
    if routing:
        pairs = routing["tokens"] * routing["top_k"]
        print(f"routing: {routing['moe_layers']} MoE layers touch {routing['touched_mean']:.1f} "
              f"of {routing['experts']} experts on average (fewest {routing['touched_min']}; "
              f"uniform top-{routing['top_k']} routing: {routing['uniform_touched']:.1f}); "
              f"largest group {routing['largest_group_mean']:.1f} pairs on average (mean "
              f"{pairs / routing['experts']:.1f} per expert)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="benchmark/batch1/prefill_census.py",
                                     description=__doc__.splitlines()[0])
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--prompt-len", type=int, nargs="+", default=[1024],
                        help="prompt tokens; several lengths run one after another on one "
                             "loaded model, one JSON line each")
    parser.add_argument("--timed", type=int, default=1,
                        help="unprofiled timed prefills after the warm-up (their median)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompt ids")
    parser.add_argument("--top", type=int, default=3,
                        help="kernel names listed per category, by time and by launch count")
    parser.add_argument("--label", type=str, default="",
                        help="run name, followed by the prompt length "
                             "(default: '<layers>L <dtype> <prompt-len>')")
    parser.add_argument("--result-filename", type=str, default=None,
                        help="append one JSON line with every number")
    parser.add_argument("--sync-sites", action="store_true",
                        help="CUDA: one more prefill under torch's sync debug mode, counting "
                             "every host<->device synchronisation at its call site")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="then one more prefill timed without synchronising (when the "
                             "host returns against when the device is done) and one under "
                             "cProfile: its N costliest functions by own time and, of this "
                             "repository, by time with callees")
    parser.add_argument("--prefill-graphs", action="store_true",
                        help="CUDA (emulated elsewhere): after the eager census, capture a "
                             "prefill graph at each --prompt-len and time --timed replays in "
                             "the same process (graph_unprofiled_wall_ms, the A/B of "
                             "--prefill-cuda-graph-tokens)")
    parser.add_argument("--routing", action="store_true",
                        help="then one more prefill counting the (token, expert) pairs per "
                             "expert of every MoE layer: experts touched and the largest group, "
                             "against uniform routing (what a tile sweep assumes)")
    parser.add_argument("--copy-sites", action="store_true",
                        help="then one more prefill counting every torch op that only copies "
                             "or fills memory (at least --copy-min-mb) at its call site, with "
                             "the MiB it wrote")
    parser.add_argument("--copy-min-mb", type=float, default=1.0,
                        help="--copy-sites: the smallest write counted, MiB")
    add_kernel_choices_arg(parser)
    return parser


def time_prefill_graphs(worker: TpModelWorker, prompt_lens: List[int], seed: int,
                        timed: int) -> Dict[int, Dict[str, Any]]:
    """Capture a one-request prefill graph per length in ``prompt_lens`` (after the eager
    census: a replay compiles nothing) and time ``max(timed, 1)`` replays of each, after one
    warm replay. Returns ``{length: {"graph_unprofiled_wall_ms", "graph_replays",
    "graph_capture_failed", "graph_memory_gib"}}``; the last is the device memory the captures
    took, all lengths together (None off CUDA)."""
    runner = worker.model_runner
    graphs = runner.init_prefill_graphs(prompt_lens)
    memory_gib = None if graphs.memory_bytes is None else graphs.memory_bytes / 2**30
    out = {}
    for n in prompt_lens:
        start = graphs.num_replays
        run_once(worker, 1, n, 1, seed)
        walls = [run_once(worker, 1, n, 1, seed)["prefill_latency"] * 1e3
                 for _ in range(max(timed, 1))]
        failed = [why for key, why in graphs.failed.items() if key.tokens == n]
        out[n] = {"graph_unprofiled_wall_ms": statistics.median(walls),
                  "graph_replays": graphs.num_replays - start,
                  "graph_capture_failed": failed[0] if failed else None,
                  "graph_memory_gib": memory_gib}
    runner.prefill_graphs = None  # later prefills (none here) run eagerly again
    return out


def main(argv: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    """Command line; returns the JSON line's dict of each prompt length."""
    parser = _parser()
    args = parser.parse_args(argv)
    if min(args.prompt_len) < 1 or args.timed < 0 or args.top < 1 or args.host_profile < 0:
        parser.error(f"--prompt-len and --top must be >= 1 and --timed, --host-profile >= 0, "
                     f"got {args.prompt_len}, {args.top}, {args.timed}, {args.host_profile}")
    if args.copy_min_mb < 0:
        parser.error(f"--copy-min-mb must be >= 0, got {args.copy_min_mb}")
    try:
        server_args = ServerArgs.from_cli_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if server_args.tp_size != 1:
        parser.error("the census runs one rank: --tp-size 1")
    # A prefill runs eager: no graphs to capture (time and memory the census would not use).
    server_args = dataclasses.replace(server_args, disable_cuda_graph=True)
    bench_args = BenchArgs(run_name=args.label, batch_size=[1], input_len=list(args.prompt_len),
                           output_len=[1], seed=args.seed, kernel_choices=args.kernel_choices)
    worker = build_worker(server_args, bench_args, 0, None)
    runner = worker.model_runner
    longest = max(args.prompt_len)
    if longest + 1 > runner.context_len:
        raise SystemExit(f"--prompt-len {longest} plus one output token exceeds the "
                         f"context length {runner.context_len} (raise --context-length)")
    cfg = runner.model_config.hf_config
    dtype = str(runner.dtype).replace("torch.", "")
    quant = server_args.quantization or (
        (runner.model_config.quantization_config or {}).get("quant_method"))
    layers = cfg.num_hidden_layers
    sync_sites = args.sync_sites and runner.device.type == "cuda"
    if args.sync_sites and not sync_sites:  # not an error: the census itself runs anywhere
        print(f"--sync-sites needs CUDA (torch's sync debug mode); the device is "
              f"{runner.device.type}: no sync census")
    results = []
    for prompt_len in args.prompt_len:
        measured = run_prefill_census(worker, prompt_len, args.seed, args.timed, args.top,
                                      sync_sites, args.host_profile, args.routing,
                                      args.copy_sites, args.copy_min_mb)
        default_label = f"{layers}L {dtype}{' ' + quant if quant else ''}"
        result = {"label": f"{args.label or default_label} {prompt_len}",
                  "device": runner.device.type,
                  "counts": "kernels" if runner.device.type == "cuda" else "aten ops",
                  "prompt_len": prompt_len, "layers": layers, "dtype": dtype,
                  "quantization": quant, "model_path": server_args.model_path,
                  "moe_runner_backend": server_args.moe_runner_backend,
                  "attention_backend": server_args.attention_backend,
                  "kda_prefill_impl": server_args.kda_prefill_impl,
                  "kernel_choices": runner.kernel_choices.describe(),
                  **git_commit(), **measured}
        results.append(result)
    if args.prefill_graphs:
        timed = time_prefill_graphs(worker, list(args.prompt_len), args.seed, args.timed)
        for result in results:
            result.update(timed[result["prompt_len"]])
    for result in results:
        _print(result)
        if args.result_filename:
            with open(args.result_filename, "a") as f:
                f.write(json.dumps(result) + "\n")
    return results


if __name__ == "__main__":
    main()
