"""Census of one batch-1 decode step or NEXTN round, in process (no server), per category of
model work (default) or per round phase.

    python benchmark/batch1/round_census.py [server flags, e.g. --speculative-algorithm NEXTN
        --speculative-num-steps 3] [--prompt-len 1024] [--steps 20] [--by category|phase]
        [--label before] [--result-filename census.jsonl] [--bandwidth-tbs 4.3]

One request with a random-id prompt runs through an in-process scheduler; after a warm-up the
script measures ``--steps`` scheduler iterations (decode steps or speculative rounds).

``--by category``: module forward hooks open a profiler range per model component
(:data:`CATEGORY_RULES`; innermost range wins; "other" is sampling, acceptance, embedding, glue)
and the iterations run EAGER (the graph runner set aside) so every launch has a Python caller.
On CUDA each device kernel (copies and memsets included) counts with its device time; on CPU,
which has no kernels, each top-level aten op counts with its CPU time. Beside each category: its
weight-bandwidth floor, the bytes it must read (:func:`category_floor_bytes`) over
``--bandwidth-tbs``. With a graph runner (CUDA) the iterations also run with graphs: unprofiled
wall time, and total kernels and kernel time of the profiled replays, to compare with the eager
sum. When the Triton MoE path runs the shared expert inside the FusedMoE launches, its time
counts as "routed experts + combine".

``--by phase``: top-level aten ops, device launches and their kernel time per phase, plus
profiled vs unprofiled wall time, with the graph runner as configured (replayed graphs call no
Python, so pass ``--disable-cuda-graph`` to split a CUDA round). Phases of a NEXTN round:
target forward, KDA verify staging, MTP forwards, draft picks, acceptance, other. Of a DSPARK
round (:data:`DSPARK_PHASES`): the draft layers (the backbone over the block) with the draft's
pass through the target's LM head apart, the Markov slot loop, the confidence head and the
planner (both run only with ``--speculative-dspark-sps-table-path``; a one-probe table is flat
and verifies every draft), the verify forward (the target's, with its KDA staging apart), the
acceptance, the KDA commit and the context write; other.

On CUDA, both splits count a kernel under the range around the host op that launched it; device
work the profiler links to no host op (Triton's launches can come without that link) counts
under the range open on the host when it started, which an eager, host-bound round makes
right (the phase table says how many, and warns when the device was busy most of the wall).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import profile, record_function

from sglang.srt.layers.attention.torch_native_backend import TorchNativeKDABackend
from sglang.srt.layers.kernel_choices import add_kernel_choices_arg, kernel_choices_from_args
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.moe.moe_layer import BailingMLP, BailingMoE, FusedMoE
from sglang.srt.layers.moe.topk import MoEGate
from sglang.srt.managers.io_struct import AbortReq
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.models.bailing_moe_v3 import (BailingKDA, BailingMLA, BailingMoeV3DecoderLayer,
                                              BailingMoeV3Model)
from sglang.srt.rounds import chain_verify
from sglang.srt.rounds.dspark import worker as dspark_worker
from sglang.srt.rounds.dspark.worker import DSparkWorker
from sglang.srt.models.bailing_moe_v3_nextn import BailingMoeNextNModel
from sglang.srt.server_args import ServerArgs

try:  # run as a script, benchmark/batch1 is on sys.path; imported by file path it may not be
    from census_common import activities as _activities
    from census_common import RangeTimeline, device_events, innermost_range as _innermost
    from census_common import unclaimed_device_events
    from census_common import install_range_hooks, is_top_level_op as _is_top_level_op
    from graph_ab import start_request
    from weight_floor import FP8_BLOCK_BYTES, decode_step_bytes
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from census_common import activities as _activities
    from census_common import RangeTimeline, device_events, innermost_range as _innermost
    from census_common import unclaimed_device_events
    from census_common import install_range_hooks, is_top_level_op as _is_top_level_op
    from graph_ab import start_request
    from weight_floor import FP8_BLOCK_BYTES, decode_step_bytes

PREFIX = "census::"  # phase ranges
CATEGORY_PREFIX = "census-category::"  # category ranges

# The phase labels of a DSPARK round (``--by phase``), in round order.
DSPARK_PHASES: Tuple[str, ...] = (
    "draft layers", "draft LM head", "Markov slot loop", "confidence head", "planner",
    "verify forward", "KDA verify (in target)", "acceptance", "KDA commit", "context write")

CATEGORIES: Tuple[str, ...] = ("routed experts + combine", "shared expert", "router", "KDA",
                               "MLA", "dense MLP", "norms", "lm_head", "other")

# The parents whose RMSNorm children are "norms" (the inner norms of KDA / MLA count there).
_NORM_PARENTS = (BailingMoeV3DecoderLayer, BailingMoeV3Model, BailingMoeNextNModel)

# (category, predicate(module, attribute name in its parent, parent)); the first match wins.
# BailingMoE itself is routed: its routed + shared sum and the TP all-reduce are the combine,
# while its router and shared expert, nested inside, are innermost ranges of their own.
CATEGORY_RULES: List[Tuple[str, Callable[[nn.Module, str, nn.Module], bool]]] = [
    ("routed experts + combine", lambda m, name, parent: isinstance(m, (FusedMoE, BailingMoE))),
    ("shared expert", lambda m, name, parent: isinstance(m, BailingMLP)
     and name == "shared_experts"),
    ("router", lambda m, name, parent: isinstance(m, MoEGate)),
    ("KDA", lambda m, name, parent: isinstance(m, BailingKDA)),
    ("MLA", lambda m, name, parent: isinstance(m, BailingMLA)),
    ("dense MLP", lambda m, name, parent: isinstance(m, BailingMLP) and name == "mlp"),
    ("norms", lambda m, name, parent: isinstance(m, RMSNorm) and isinstance(parent, _NORM_PARENTS)),
    ("lm_head", lambda m, name, parent: isinstance(m, LogitsProcessor)),
]

# Census category -> the parts of weight_floor.decode_step_bytes it reads. Norms and "other"
# (embedding rows, the MTP layer's eh_proj) are not parts there: see _forward_floor_bytes.
FLOOR_PARTS: Dict[str, Tuple[str, ...]] = {
    "routed experts + combine": ("moe_routed",), "shared expert": ("moe_shared",),
    "router": ("router",), "KDA": ("kda_weights", "kda_state"),
    "MLA": ("mla_weights", "mla_cache"), "dense MLP": ("dense_mlp",), "lm_head": ("lm_head",),
}


# ============================================================================================
# Attribution
# ============================================================================================
def category_of(module: nn.Module, name: str, parent: nn.Module) -> Optional[str]:
    """The census category of ``parent.<name> = module`` (None: not a category boundary)."""
    for category, match in CATEGORY_RULES:
        if match(module, name, parent):
            return category
    return None


def categorised_modules(model: nn.Module) -> List[Tuple[str, nn.Module, str]]:
    """``(qualified name, module, category)`` of every module of ``model`` that opens a census
    range, in ``named_modules`` order (a module reachable twice is listed once)."""
    found: List[Tuple[str, nn.Module, str]] = []
    seen = set()
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            category = category_of(child, name, parent)
            if category is not None and id(child) not in seen:
                seen.add(id(child))
                found.append((f"{parent_name}.{name}" if parent_name else name, child, category))
    return found


def install_category_hooks(models: Iterable[nn.Module]) -> Callable[[], None]:
    """Wrap the forward of every categorised module of ``models`` in a profiler range named
    ``CATEGORY_PREFIX + category``; returns the function that removes the hooks again."""
    return install_range_hooks(((module, category) for model in models
                                for _, module, category in categorised_modules(model)),
                               CATEGORY_PREFIX)


def _device_events(events: Sequence[Any]) -> List[Any]:
    """Device work of a CUDA profile without the GPU mirrors of the census ranges."""
    return device_events(events, (PREFIX, CATEGORY_PREFIX))


def category_census(events: Sequence[Any], steps: int, cuda: bool
                    ) -> Tuple[Dict[str, Dict[str, float]], Dict[str, float]]:
    """``(rows, total)`` per iteration. A row per category of :data:`CATEGORIES` (work outside
    every range is "other"): ``kernels`` and ``us`` (CUDA: device kernels and their device time;
    CPU: top-level aten ops and their CPU time) and ``ops`` (top-level aten ops). ``total``
    counts the same from the whole profile, independently of the attribution."""
    rows = {c: {"kernels": 0.0, "us": 0.0, "ops": 0.0} for c in CATEGORIES}
    top = [e for e in events if e.device_type == DeviceType.CPU and _is_top_level_op(e)]
    for e in top:
        row = rows[_innermost(e, CATEGORY_PREFIX) or "other"]
        row["ops"] += 1
        if not cuda:
            row["kernels"] += 1
            row["us"] += e.cpu_time_total
    total = {"kernels": float(len(top)), "us": float(sum(e.cpu_time_total for e in top))}
    if cuda:
        # torch links each kernel to the innermost CPU op (or range) that launched it, when
        # it sees the launch (below: the kernels it does not).
        host = [e for e in events if e.device_type == DeviceType.CPU]
        for e in host:
            kernels = [k for k in e.kernels if not k.name.startswith((PREFIX, CATEGORY_PREFIX))]
            if kernels:
                row = rows[_innermost(e, CATEGORY_PREFIX) or "other"]
                row["kernels"] += len(kernels)
                row["us"] += sum(k.duration for k in kernels)
        device = _device_events(events)
        total = {"kernels": float(len(device)),
                 "us": float(sum(e.time_range.elapsed_us() for e in device))}
        # Kernels torch did not link to a launcher: the category range open on the host when
        # they started (an eager census is host-bound, so a kernel starts right after its
        # launch); outside every range, "other".
        timeline = RangeTimeline(events, CATEGORY_PREFIX)
        for e in unclaimed_device_events(host, device, (PREFIX, CATEGORY_PREFIX)):
            row = rows[timeline.at(e.time_range.start) or "other"]
            row["kernels"] += 1
            row["us"] += e.time_range.elapsed_us()
        attributed = sum(r["kernels"] for r in rows.values())
        if attributed > total["kernels"]:
            print(f"warning: {attributed - total['kernels']:.0f} more kernels attributed than "
                  "the profile holds", file=sys.stderr)
    per = {c: {k: v / steps for k, v in row.items()} for c, row in rows.items()}
    return per, {k: v / steps for k, v in total.items()}


# ============================================================================================
# Floors
# ============================================================================================
def _forward_floor_bytes(cfg: Any, context: int, weight_bytes: int, tokens: int,
                         norms: int, eh_proj: bool,
                         quant_bytes: Optional[float] = None) -> Dict[str, float]:
    """Bytes of one forward of ``tokens`` tokens per category: ``decode_step_bytes`` (with
    ``quant_bytes`` per weight of the quantised projections) plus what it leaves out, ``norms``
    RMSNorm weights, the embedding rows and (MTP) ``eh_proj`` [H, 2H] (quantised as the
    projections are)."""
    parts = decode_step_bytes(cfg, context, weight_bytes, tokens, quant_bytes=quant_bytes)
    out = {c: float(sum(parts[p] for p in FLOOR_PARTS.get(c, ()))) for c in CATEGORIES}
    h = cfg.hidden_size
    proj_bytes = weight_bytes if quant_bytes is None else quant_bytes
    out["norms"] += norms * h * weight_bytes
    out["other"] += tokens * h * weight_bytes + (2 * h * h * proj_bytes if eh_proj else 0)
    return out


def category_floor_bytes(cfg: Any, context: int, weight_bytes: int,
                         nextn_draft_tokens: Optional[int] = None,
                         verify_tokens: int = 1, quant_bytes: Optional[float] = None,
                         draft_quant_bytes: Optional[float] = None) -> Dict[str, float]:
    """Bytes one iteration must read, per census category.

    ``quant_bytes`` / ``draft_quant_bytes``: bytes per weight of the target's / the MTP
    layer's quantised projections (``weight_floor.FP8_BLOCK_BYTES`` for block fp8; None: the
    model dtype's ``weight_bytes``), as :func:`weight_floor.decode_step_bytes` takes them.

    Plain decode: one target forward of one token. NEXTN with ``N = nextn_draft_tokens``: the
    target verify of ``N`` tokens, ``N - 2`` MTP decode forwards and one MTP extend of ``N``
    tokens (the round of ``NEXTNWorker``), each MTP forward reading the MTP layer (MLA + MoE,
    its five norms, ``eh_proj``) and the shared lm_head. Otherwise (other algorithms) the target
    forward of ``verify_tokens`` tokens only.
    """
    if context < 1 or weight_bytes < 1:
        raise ValueError(f"context and weight_bytes must be positive, got {context}, "
                         f"{weight_bytes}")
    target_tokens = nextn_draft_tokens or verify_tokens
    total = _forward_floor_bytes(cfg, context, weight_bytes, target_tokens,
                                 2 * cfg.num_hidden_layers + 1, eh_proj=False,
                                 quant_bytes=quant_bytes)
    if nextn_draft_tokens:
        if nextn_draft_tokens < 2:
            raise ValueError(f"a NEXTN chain has >= 2 tokens, got {nextn_draft_tokens}")
        # The MTP layer as a one-layer model whose layer is MLA + MoE.
        mtp = dataclasses.replace(cfg, num_hidden_layers=1, layer_group_size=1,
                                  first_k_dense_replace=0)
        draft = [1] * (nextn_draft_tokens - 2) + [nextn_draft_tokens]
        for tokens in draft:
            part = _forward_floor_bytes(mtp, context, weight_bytes, tokens, 5, eh_proj=True,
                                        quant_bytes=draft_quant_bytes)
            for c in CATEGORIES:
                total[c] += part[c]
    return total


def _quant_bytes(runner: Any) -> Optional[float]:
    """Bytes per weight of ``runner``'s quantised projections: block fp8 when its model holds
    e4m3 weights (``--quantization fp8`` or an fp8 checkpoint), else (or without a runner)
    None: the model dtype."""
    fp8 = runner is not None and any(p.dtype == torch.float8_e4m3fn
                                     for p in runner.model.parameters())
    return FP8_BLOCK_BYTES if fp8 else None


# ============================================================================================
# Measurement
# ============================================================================================
def _start(sched: Scheduler, prompt_len: int, budget: int, prefill_steps: int) -> None:
    """The prefill, then warm decode steps."""
    start_request(sched, prompt_len, budget, rid="census")
    for _ in range(prefill_steps - 1):
        sched.step()


def _timer(sched: Scheduler, steps: int) -> Callable[[], float]:
    """A function that runs ``steps`` scheduler iterations and returns ms per iteration."""
    sync = torch.cuda.synchronize if sched.device.type == "cuda" else (lambda: None)

    def timed() -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            sched.step()
        sync()
        return (time.perf_counter() - t0) / steps * 1e3

    return timed


def _models(sched: Scheduler) -> List[nn.Module]:
    models = [sched.tp_worker.model_runner.model]
    draft = getattr(sched.draft_worker, "draft_runner", None)
    if draft is not None:
        models.append(draft.model)
    return models


def kernels_by_name(device: Sequence[Any], steps: int) -> List[List[Any]]:
    """``[[name, launches per iteration, µs per iteration], ...]`` of device events (``name``,
    ``time_range``), most launched first (ties: more time first, then name): what a replayed
    graph's nodes are, where a category census cannot see them (replays call no Python)."""
    count: Dict[str, int] = collections.Counter()
    us: Dict[str, float] = collections.Counter()
    for e in device:
        count[e.name] += 1
        us[e.name] += e.time_range.elapsed_us()
    ranked = sorted(count, key=lambda n: (-count[n], -us[n], n))
    return [[n, count[n] / steps, us[n] / steps] for n in ranked]


def run_category_census(sched: Scheduler, steps: int) -> Dict[str, Any]:
    """Eager census by category (hooks installed only while profiling) and, with a graph
    runner, the graph totals. The request must be running and warm."""
    cuda = sched.device.type == "cuda"
    timed = _timer(sched, steps)
    worker = sched.round_worker
    runner = worker.graph_runner
    graph: Optional[Dict[str, float]] = None
    if runner is not None:
        iter_ms = timed()
        with profile(activities=_activities(cuda)) as prof:
            profiled_ms = timed()
        device = _device_events(prof.events())
        graph = {"iter_ms": iter_ms, "profiled_iter_ms": profiled_ms,
                 "kernels": len(device) / steps,
                 "us": sum(e.time_range.elapsed_us() for e in device) / steps,
                 "by_kernel": kernels_by_name(device, steps)}
    worker.graph_runner = None  # eager: every launch has a Python caller
    try:
        for _ in range(2):  # the eager path's first calls after graph replays
            sched.step()
        eager_ms = timed()
        remove = install_category_hooks(_models(sched))
        try:
            with profile(activities=_activities(cuda)) as prof:
                profiled_ms = timed()
        finally:
            remove()
    finally:
        worker.graph_runner = runner
    categories, total = category_census(prof.events(), steps, cuda)
    return {"categories": categories, "total": total, "graph": graph,
            "eager": {"iter_ms": eager_ms, "profiled_iter_ms": profiled_ms}}


def _label(obj: object, name: str, phase: str) -> Callable[[], None]:
    """Run ``obj.name`` inside a profiler range named after ``phase``; returns the undo."""
    fn: Callable = getattr(obj, name)
    own = vars(obj).get(name)  # a class attribute, or an instance's own; None: inherited

    def wrapped(*args, **kwargs):
        with record_function(PREFIX + phase):
            return fn(*args, **kwargs)

    setattr(obj, name, wrapped)
    return lambda: setattr(obj, name, own) if own is not None else delattr(obj, name)


def _instrument(sched: Scheduler) -> List[Callable[[], None]]:
    worker = sched.draft_worker
    if isinstance(worker, DSparkWorker):
        return _instrument_dspark(sched, worker)
    undo = [_label(sched.tp_worker.model_runner, "forward", "target forward"),
            _label(TorchNativeKDABackend, "_forward_target_verify", "KDA verify (in target)")]
    if worker is not None:
        undo += [_label(worker.draft_runner, "forward", "MTP forward"),
                 _label(worker, "_pick_draft", "draft pick"),
                 _label(chain_verify, "accept_chain", "acceptance")]
    return undo


def _instrument_dspark(sched: Scheduler, worker: DSparkWorker) -> List[Callable[[], None]]:
    """The :data:`DSPARK_PHASES` ranges of a DSPARK round (innermost wins: the draft's LM head
    inside the draft layers, the KDA staging inside the verify forward). The target runner
    forwards only to verify during rounds (prefills are not measured)."""
    draft = worker.draft
    undo = [_label(draft, "forward_block", "draft layers"),
            _label(draft, "lm_logits", "draft LM head"),
            _label(draft, "markov_draft", "Markov slot loop"),
            _label(draft, "confidence", "confidence head"),
            _label(sched.tp_worker.model_runner, "forward", "verify forward"),
            _label(TorchNativeKDABackend, "_forward_target_verify", "KDA verify (in target)"),
            _label(worker, "_verify", "acceptance"),
            # Imported by name into the worker's module: wrapped where the worker looks it up.
            _label(dspark_worker, "commit_chain", "KDA commit"),
            # round_phases() is asked for every round, so it picks the instance's wrapper up.
            _label(worker, "_context_phase", "context write")]
    if worker.planner is not None:
        undo += [_label(worker.planner, name, "planner")
                 for name in ("plan", "plan_top_k", "capacity")]
    return undo


def _phase_census(events: Sequence[Any], steps: int) -> Dict[str, Dict[str, float]]:
    """Per phase and iteration: top-level aten ops, and on CUDA the launches of device work
    (kernels, copies) with the device time of that work. A launch counts in the innermost phase
    around the host op that made it; device work the profile links to no host op (Triton's
    launches can come without that link) counts in the phase open on the host when it started
    (``by_time``, included in ``launches``), as in :func:`category_census`: an eager round is
    host-bound, so its kernels start right after their launches."""
    rows: Dict[str, Dict[str, float]] = collections.defaultdict(
        lambda: {"ops": 0, "launches": 0, "kernel_us": 0.0, "by_time": 0})
    mirrors = (PREFIX, CATEGORY_PREFIX)  # the GPU spans of the ranges are not device work
    host = [e for e in events if e.device_type == DeviceType.CPU]
    for e in host:
        kernels = [k for k in getattr(e, "kernels", None) or () if not k.name.startswith(mirrors)]
        phase = _innermost(e, PREFIX) or "other"  # a range itself: launches made directly in it
        if kernels:
            row = rows[phase]
            row["launches"] += 1
            row["kernel_us"] += sum(k.duration for k in kernels)
        if _is_top_level_op(e):
            rows[phase]["ops"] += 1
    device = _device_events(events)
    if device:
        timeline = RangeTimeline(events, PREFIX)
        for e in unclaimed_device_events(host, device, mirrors):
            row = rows[timeline.at(e.time_range.start) or "other"]
            row["launches"] += 1
            row["by_time"] += 1
            row["kernel_us"] += e.time_range.elapsed_us()
    return {k: {m: v / steps for m, v in row.items()} for k, row in rows.items()}


def run_phase_census(sched: Scheduler, steps: int) -> Tuple[float, float, Dict[str, Any]]:
    """``(unprofiled ms, profiled ms, per-phase rows)`` with the graph runner as configured."""
    timed = _timer(sched, steps)
    plain_ms = timed()
    undo = _instrument(sched)
    try:
        with profile(activities=_activities(sched.device.type == "cuda")) as prof:
            profiled_ms = timed()
    finally:
        for u in reversed(undo):
            u()
    return plain_ms, profiled_ms, _phase_census(prof.events(), steps)


# ============================================================================================
# Output and command line
# ============================================================================================
def category_table(result: Dict[str, Any]) -> str:
    """The markdown table ``| category | kernels | device us | floor us |`` with a total row."""
    lines = ["| category | kernels | device us | floor us |", "|---|---|---|---|"]
    for c in CATEGORIES:
        row = result["categories"][c]
        lines.append(f"| {c} | {row['kernels']:.1f} | {row['us']:.1f} | {row['floor_us']:.2f} |")
    tot = result["total"]
    lines.append(f"| **total** | {tot['kernels']:.1f} | {tot['us']:.1f} | {tot['floor_us']:.2f} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="benchmark/batch1/round_census.py",
                                     description=__doc__.splitlines()[0])
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20, help="measured scheduler iterations")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--by", choices=("category", "phase"), default="category",
                        help="attribute the work to model components (default) or round phases")
    parser.add_argument("--bandwidth-tbs", type=float, default=4.3,
                        help="HBM bandwidth of the floors in TB/s (H200 measured copy: 4.3)")
    parser.add_argument("--label", type=str, default="", help="run name (default: the mode)")
    parser.add_argument("--result-filename", type=str, default=None,
                        help="append one JSON line with every number (--by phase: a line with "
                             "'phases' instead of 'categories', which plot_census.py does not "
                             "read: give it a file of its own)")
    add_kernel_choices_arg(parser)
    return parser


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    """Command line; returns the printed census as the JSON line's dict."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.prompt_len < 1:
        parser.error(f"--steps must be >= 1, --warmup >= 0 and --prompt-len >= 1, got "
                     f"{args.steps}, {args.warmup}, {args.prompt_len}")
    if not args.bandwidth_tbs > 0:
        parser.error(f"--bandwidth-tbs must be positive, got {args.bandwidth_tbs}")
    server_args = ServerArgs.from_cli_args(args)
    server_args.kernel_choices = kernel_choices_from_args(args)  # read by the target's runner
    sched = Scheduler(server_args)
    per_step = sched.round_worker.round_tokens
    # Enough tokens that no iteration finishes the request (every round may commit N tokens):
    # warm-up, the graph and the eager measurements (two runs each), two eager warm steps.
    want = (args.warmup + 4 * args.steps + 4) * per_step
    if args.prompt_len + want > sched.max_req_len:
        raise SystemExit(f"--prompt-len {args.prompt_len} leaves fewer than {want} tokens of the "
                         f"context length {sched.max_req_len}")
    _start(sched, args.prompt_len, want, args.warmup + 1)
    mode = census_mode(server_args.speculative_algorithm, server_args.speculative_num_steps,
                       sched.round_worker.proposed_per_round)
    print(f"{sched.device}, {mode}, prompt {args.prompt_len}, {args.steps} iterations")
    try:
        if args.by == "phase":
            phases = _print_phases(*run_phase_census(sched, args.steps))
            record = {"label": args.label or mode, "mode": mode, "by": "phase",
                      "device": sched.device.type, "prompt_len": args.prompt_len,
                      "steps": args.steps, "round_tokens": per_step, **phases}
            if args.result_filename:
                with open(args.result_filename, "a") as f:
                    f.write(json.dumps(record) + "\n")
            return record
        before = sched.num_generated_tokens
        result = run_category_census(sched, args.steps)
        context = args.prompt_len + (before + sched.num_generated_tokens) // 2
    finally:
        sched.abort_request(AbortReq(abort_all=True))
    algo = server_args.speculative_algorithm
    runner = sched.tp_worker.model_runner
    cfg = sched.model_config.hf_config
    draft_runner = getattr(sched.round_worker, "draft_runner", None)
    floors = category_floor_bytes(
        cfg, context, torch.empty((), dtype=runner.dtype).element_size(),
        sched.round_worker.round_tokens if algo == "NEXTN" else None,
        verify_tokens=per_step, quant_bytes=_quant_bytes(runner),
        draft_quant_bytes=_quant_bytes(draft_runner))
    for c in CATEGORIES:
        result["categories"][c]["floor_us"] = floors[c] / (args.bandwidth_tbs * 1e6)
    result["total"]["floor_us"] = sum(r["floor_us"] for r in result["categories"].values())
    cuda = sched.device.type == "cuda"
    result = {"label": args.label or mode, "mode": mode, "device": sched.device.type,
              "counts": "kernels" if cuda else "aten ops", "prompt_len": args.prompt_len,
              "context": context, "steps": args.steps, "bandwidth_tbs": args.bandwidth_tbs,
              "kernel_choices": sched.tp_worker.model_runner.kernel_choices.describe(),
              **result}
    _print_categories(result, floors_note=algo not in (None, "NEXTN"))
    if args.result_filename:
        with open(args.result_filename, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


def census_mode(algo: Optional[str], nextn_steps: Optional[int], proposed: int) -> str:
    """The run's mode: ``decode``, ``NEXTN-<steps>``, ``DSPARK-<drafts per round>`` (block 7 and
    15 rows stay apart) or another algorithm's name."""
    if algo == "NEXTN":
        return f"NEXTN-{nextn_steps}"
    if algo == "DSPARK":
        return f"DSPARK-{proposed}"
    return algo or "decode"


def _print_categories(result: Dict[str, Any], floors_note: bool) -> None:
    eager = result["eager"]
    print(f"eager: {eager['iter_ms']:.2f} ms per iteration unprofiled, "
          f"{eager['profiled_iter_ms']:.2f} ms profiled")
    graph = result["graph"]
    if graph is not None:
        print(f"graphs: {graph['iter_ms']:.2f} ms per iteration unprofiled, "
              f"{graph['profiled_iter_ms']:.2f} ms profiled; replays {graph['kernels']:.1f} "
              f"kernels, {graph['us']:.1f} us kernel time per iteration")
        print("| launches / iteration | us / iteration | kernel (replayed graphs) |")
        print("|---|---|---|")
        for name, n, us in graph["by_kernel"]:
            print(f"| {n:.1f} | {us:.1f} | {name[:110]} |")
    if result["device"] != "cuda":
        print("CPU: 'kernels' are top-level aten ops and 'device us' their CPU time")
    if floors_note:
        print("floors: the target's verify forward only (the draft model is not counted)")
    print(f"floors at {result['bandwidth_tbs']:g} TB/s, context {result['context']}")
    print(category_table(result))


def _print_phases(plain_ms: float, profiled_ms: float,
                  census: Dict[str, Dict[str, float]]) -> Dict[str, Any]:
    print(f"wall per iteration: {plain_ms:.2f} ms unprofiled, {profiled_ms:.2f} ms profiled")
    print("| phase | top-level ops | device launches | device time (us) |")
    print("|---|---|---|---|")
    for name, row in sorted(census.items(), key=lambda kv: -kv[1]["ops"]):
        print(f"| {name} | {row['ops']:.0f} | {row['launches']:.0f} | {row['kernel_us']:.0f} |")
    total = {k: sum(r.get(k, 0) for r in census.values())
             for k in ("ops", "launches", "kernel_us", "by_time")}
    print(f"| **total** | {total['ops']:.0f} | {total['launches']:.0f} | {total['kernel_us']:.0f} |")
    if total["by_time"]:
        print(f"({total['by_time']:.0f} of the launches: device work linked to no host op, counted "
              "in the phase open on the host when it started)")
        if total["kernel_us"] > 0.5e3 * profiled_ms:
            print("warning: the device was busy for more than half of the profiled wall, so "
                  "kernels may start well after their launch and the by-time counts drift into "
                  "later phases", file=sys.stderr)
    return {"phases": census, "total": total, "iter_ms": plain_ms,
            "profiled_iter_ms": profiled_ms}


if __name__ == "__main__":
    main()
