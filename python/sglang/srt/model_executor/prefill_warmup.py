"""Start-up prefill warm-up: compile the kernels a prefill can reach before the server is ready.

Triton compiles a kernel the first time it is launched with a new combination of its
compile-time inputs (the ``constexpr`` tiles a launch picks, and for every integer argument
whether it equals 1, is divisible by 16, or neither), and fla-core's ``chunk_kda`` autotunes on
its first calls. A server whose only warm-up is one short request therefore pays those compiles
inside the first user prefills of every new size class: on a fresh H200 the first 16-request
prefill of a 12-layer Ling-3.0-flash took 10.1 s instead of 0.21 s (docs/serving_ling_flash.md).

This module moves them before "ready": after the model and its CUDA graphs exist, the scheduler
calls :func:`warm_up_prefill`, which runs eager prefills of dummy tokens through the normal
:meth:`ModelRunner.forward` path over a small set of batch shapes. Each shape takes its request
slots and KV slots through the pools' ``alloc`` and gives them back through ``free``, so the
pools hold as many free slots afterwards as before; the state a shape leaves in its slots is
overwritten by the next request that gets them (the scheduler zeroes a KDA state slot and every
prefill writes its KV rows before reading them).

The shapes (:func:`prefill_warmup_shapes`, a pure function of :class:`PrefillPaths` and two
bounds) are chosen so that every kernel variant a prefill batch can reach is launched once:

* the token counts where a prefill's kernels change, each owned by the code that decides it:
  the dense small-M GEMM (``sgl_kernel.small_m_gemm.SMALL_M_MAX_ROWS``, also the block-fp8
  dense path's lower end), the MLA normal form (the attention backend's
  ``mla_normal_form_min_tokens``), the MoE small-M path against the grouped GEMM
  (``fused_moe_triton.SMALL_M_MAX_PAIRS`` pairs), programmatic dependent launch
  (``sgl_kernel.pdl.PDL_MAX_ROWS`` rows of tokens, pairs or heads) and the grouped GEMM's tile
  configurations (``sgl_kernel.moe_grouped_gemm``'s per-GPU table, up to the largest batch);
* between two of those counts, a count equal to 1, an odd one and a multiple of 16 where the
  range holds them (Triton's integer specialisations);
* for the grouped GEMM, every class of its batch-dependent integer arguments
  (:func:`sgl_kernel.moe_grouped_gemm_configs.launch_int_args`) under each tile configuration;
* one request and two requests (fla's varlen path over several sequences; the per-request
  loops of the MLA prefill), on both sides of the MLA normal-form threshold.

The smallest set of token counts covering all of these is picked greedily, preferring small
counts (a shape costs one forward). The largest batch considered is
``min(--chunked-prefill-size, --max-prefill-tokens)`` tokens, the context length and the free
KV slots. Speculative workers' verify and draft shapes are not warmed here: plain prefill only.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import (TYPE_CHECKING, Any, Dict, FrozenSet, Hashable, List, Mapping, Optional,
                    Sequence, Tuple)

import torch

from sglang.srt.distributed.parallel_state import tensor_model_parallel_min_ints
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

__all__ = ["TokenBoundary", "GroupedGemm", "PrefillPaths", "prefill_warmup_shapes",
           "prefill_token_bound", "prefill_paths", "plan_prefill_warmup", "run_prefill_warmup",
           "prefill_warmup_enabled", "warm_up_prefill"]

logger = logging.getLogger(__name__)

# Shapes are per-request new-token counts: (n,) is one request of n tokens, (a, b) two.
Shape = Tuple[int, ...]


@dataclass(frozen=True)
class TokenBoundary:
    """A batch size where a prefill's kernels change: batches of at most ``last_lower`` tokens
    take one path (or launch variant), larger ones the other."""

    name: str
    last_lower: int


@dataclass(frozen=True)
class GroupedGemm:
    """One of the MoE prefill's grouped GEMMs (``sgl_kernel.moe_grouped_gemm``): its name in the
    plan, its expert count, whether its weight is block fp8, and the tile table's entry for its
    weight on this GPU (:func:`sgl_kernel.moe_grouped_gemm_configs.table_entry`; None: no entry, the
    kernel's fallback tiles). ``shared_pairs``: the shared expert rides it as one more expert
    (``fused_moe_grouped(..., shared_weights=...)``), so a token brings ``top_k + 1`` pairs
    and the pairs are aligned over ``num_experts + 1`` experts."""

    name: str
    num_experts: int
    fp8: bool
    table: Optional[Mapping[str, Mapping[str, Any]]] = None
    shared_pairs: bool = False

    def pairs_per_token(self, top_k: int) -> int:
        """The GEMM's pairs per token: the routed ``top_k``, plus the shared expert's."""
        return top_k + int(self.shared_pairs)

    @property
    def aligned_experts(self) -> int:
        """The experts its pair list is sorted over (the shared expert's id is the last)."""
        return self.num_experts + int(self.shared_pairs)


@dataclass(frozen=True)
class PrefillPaths:
    """What decides a prefill's kernels, in the model's numbers (None / empty: the path is off).

    ``top_k``: experts per token (0 without MoE). ``dense_small_m_rows``: the dense layers take
    the small-M Triton GEMM up to this many rows. ``mla_normal_min_tokens``: EXTEND batches of
    at least this many tokens run MLA in normal form. ``moe_small_m_pairs``: the MoE block takes
    its small-M path up to this many (token, expert) pairs and ``moe_gemms`` above.
    ``pdl_max_rows``: launches over at most this many rows use programmatic dependent launch;
    ``pdl_rows_per_token``: the rows per token of the prefill's launches (1 for per-token
    kernels, ``top_k`` and ``top_k + 1`` for the MoE's mat-vecs over routed pairs and the
    shared expert's, the heads for MLA's per-head mat-vecs)."""

    top_k: int = 0
    dense_small_m_rows: Optional[int] = None
    mla_normal_min_tokens: Optional[int] = None
    moe_small_m_pairs: Optional[int] = None
    moe_gemms: Tuple[GroupedGemm, ...] = ()
    pdl_max_rows: Optional[int] = None
    pdl_rows_per_token: Tuple[int, ...] = (1,)

    def boundaries(self) -> List[TokenBoundary]:
        """The token counts where the paths above change (the grouped GEMM's tile changes
        depend on the largest batch: :func:`prefill_warmup_shapes` adds them)."""
        out: List[TokenBoundary] = []
        if self.dense_small_m_rows:
            out.append(TokenBoundary("dense small-M GEMM", self.dense_small_m_rows))
        if self.mla_normal_min_tokens:
            out.append(TokenBoundary("MLA normal form", self.mla_normal_min_tokens - 1))
        if self.moe_small_m_pairs is not None and self.top_k > 0:
            out.append(TokenBoundary("MoE grouped GEMM", self.moe_small_m_pairs // self.top_k))
        if self.pdl_max_rows:
            for rows in sorted(set(self.pdl_rows_per_token)):
                out.append(TokenBoundary(f"PDL launches of {rows} rows per token",
                                         self.pdl_max_rows // max(rows, 1)))
        return [b for b in out if b.last_lower >= 1]


def _int_class(value: int) -> str:
    """Triton's specialisation of an integer argument: ``1``, divisible by 16, or neither."""
    return "1" if value == 1 else "16" if value % 16 == 0 else "n"


def _token_class(t: int) -> Optional[str]:
    """The token counts a region wants one of each: 1, odd, a multiple of 16 (other even
    counts add nothing of their own to a region, only to the grouped GEMM's classes)."""
    if t == 1:
        return "one"
    if t % 16 == 0:
        return "x16"
    return "odd" if t % 2 else None


def _regions(paths: PrefillPaths, max_tokens: int) -> List[Tuple[int, int]]:
    """``[lo, hi]`` token ranges over which no path of ``paths`` changes (1 alone is one)."""
    cuts = {1} | {b.last_lower for b in paths.boundaries()}
    if paths.moe_gemms and paths.top_k > 0:
        from sgl_kernel.moe_grouped_gemm_configs import config_change_points

        for g in paths.moe_gemms:
            k = g.pairs_per_token(paths.top_k)
            # The routed pairs choose the path: the small-M bound in this GEMM's pairs.
            lo_pairs = (paths.moe_small_m_pairs or 0) * k // paths.top_k
            # Below E pairs the padded pair list grows with every pair, above it with every
            # block (max_padded_pairs): the integer classes repeat differently on each side,
            # which matters only where the grouped GEMM runs.
            if g.aligned_experts > lo_pairs:
                cuts.add(g.aligned_experts // k)
            for p in config_change_points(g.table, g.num_experts, g.fp8, lo_pairs,
                                          max_tokens * k):
                cuts.add(-(-p // k) - 1)  # tokens t with t * k >= p take the new tiles
    out, lo = [], 1
    for cut in sorted(c for c in cuts if 1 <= c < max_tokens) + [max_tokens]:
        out.append((lo, cut))
        lo = cut + 1
    return out


def _candidates(paths: PrefillPaths, max_tokens: int) -> Dict[FrozenSet[Hashable], int]:
    """For each set of compile keys a one-request batch reaches, the fewest tokens reaching it.

    Keys: ``("tokens", region, class)`` (a region's 1 / odd / multiple-of-16 count) and, above
    the MoE small-M path, ``("moe", gemm, tiles, classes of its integer arguments)``. In a
    region every key's class repeats with a period of ``16 * block_m`` tokens (16 for the token
    classes), so one period from the region's start reaches all of them."""
    from_keys: Dict[FrozenSet[Hashable], int] = {}
    k = paths.top_k
    grouped = bool(paths.moe_gemms) and k > 0
    if grouped:  # sgl_kernel imports triton: only when a grouped GEMM is in the plan
        from sgl_kernel.moe_grouped_gemm_configs import launch_int_args, select_config
    for lo, hi in _regions(paths, max_tokens):
        tiles = []
        if grouped and lo * k > (paths.moe_small_m_pairs or 0):
            tiles = [(g, select_config(g.table, g.num_experts, lo * g.pairs_per_token(k),
                                       g.fp8)) for g in paths.moe_gemms]
        period = 16 * max([cfg.block_m for _, cfg in tiles], default=1)
        for t in range(lo, min(hi, lo + period - 1) + 1):
            keys = set()
            cls = _token_class(t)
            if cls is not None:
                keys.add(("tokens", lo, cls))
            for g, cfg in tiles:
                ints = launch_int_args(t * g.pairs_per_token(k), g.aligned_experts,
                                       cfg.block_m)
                keys.add(("moe", g.name, cfg, tuple(_int_class(v) for v in ints)))
            if keys:
                frozen = frozenset(keys)
                from_keys.setdefault(frozen, t)
    return from_keys


def _two_request_shapes(paths: PrefillPaths, max_tokens: int) -> List[Shape]:
    """Two requests on each side of the MLA normal-form threshold: a multiple of 16 and an odd
    count (``(16, t - 16)`` for the smallest odd total ``t >= 17`` of the side, else the side's
    smallest total split in two)."""
    m = paths.mla_normal_min_tokens
    sides = [(2, m - 1), (m, max_tokens)] if m else [(2, max_tokens)]
    out = []
    for lo, hi in sides:
        lo, hi = max(lo, 2), min(hi, max_tokens)
        if lo > hi:
            continue
        odd = max(lo, 17) | 1
        t = odd if odd <= hi else lo
        out.append((16, t - 16) if t > 16 else (t - t // 2, t // 2))
    return out


def prefill_warmup_shapes(paths: PrefillPaths, max_tokens: int, max_requests: int) -> List[Shape]:
    """The batch shapes the warm-up runs (module docstring): tuples of per-request new-token
    counts, sorted by size, each at most ``max_tokens`` tokens in all, with two requests only
    when ``max_requests >= 2``. Pure: the same answer for the same numbers, anywhere."""
    if max_tokens < 1 or max_requests < 1:
        return []
    candidates = _candidates(paths, max_tokens)
    universe = frozenset().union(*candidates)
    covered: FrozenSet[Hashable] = frozenset()
    chosen: List[Shape] = []
    while covered != universe:
        # Greedy set cover: the count reaching the most keys not yet reached; the smaller
        # count on a tie (a warm-up forward costs about its token count).
        keys, t = max(candidates.items(), key=lambda kv: (len(kv[0] - covered), -kv[1]))
        chosen.append((t,))
        covered |= keys
    if max_requests >= 2:
        chosen += _two_request_shapes(paths, max_tokens)
    return sorted(set(chosen), key=lambda s: (sum(s), len(s), s))


def prefill_token_bound(chunked_prefill_size: Optional[int], max_prefill_tokens: Optional[int]
                        ) -> Optional[int]:
    """The largest prefill batch the warm-up plans for: ``min(--chunked-prefill-size,
    --max-prefill-tokens)`` over those set and positive (None when neither is)."""
    caps = [int(c) for c in (chunked_prefill_size, max_prefill_tokens) if c is not None and c > 0]
    return min(caps) if caps else None


def prefill_paths(runner: "ModelRunner") -> PrefillPaths:
    """:class:`PrefillPaths` of ``runner``: its kernel choices, its attention backend's MLA
    threshold, its MoE layers' runner backend and weights, the tile table's entries for its GPU.
    Thresholds are read from the modules that apply them."""
    from sglang.srt.layers.moe.moe_layer import BailingMoE
    from sglang.srt.models.bailing_moe_v3 import BailingMLA

    moes = [m for m in runner.model.modules() if isinstance(m, BailingMoE)]
    top_k = max([m.gate.top_k for m in moes], default=0)
    triton_moe = [m for m in moes if m.experts.runner_backend == "triton"
                  and m.experts.quant_method.triton_small_m_ok()]
    dense_rows = None
    if runner.small_m_gemm:
        from sgl_kernel.small_m_gemm import SMALL_M_MAX_ROWS

        dense_rows = SMALL_M_MAX_ROWS
    small_pairs, gemms = None, ()
    if triton_moe:
        from sglang.srt.layers.moe.fused_moe_triton import SMALL_M_MAX_PAIRS

        small_pairs = SMALL_M_MAX_PAIRS
        if runner.device.type == "cuda":  # the grouped GEMM's tiles come from a per-GPU table
            gemms = _grouped_gemms(runner, triton_moe)
    pdl_rows, per_token = None, {1}
    if runner.pdl:
        from sgl_kernel.pdl import PDL_MAX_ROWS

        pdl_rows = PDL_MAX_ROWS
        if triton_moe:  # the small-M MoE's mat-vecs: routed pairs, plus the shared expert's
            per_token |= {top_k, top_k + 1}
        per_token |= {m.num_heads for m in runner.model.modules()
                      if isinstance(m, BailingMLA) and m.absorb_gemv}
    return PrefillPaths(top_k=top_k, dense_small_m_rows=dense_rows,
                        mla_normal_min_tokens=runner.attn_backend.mla_normal_form_min_tokens(),
                        moe_small_m_pairs=small_pairs, moe_gemms=gemms, pdl_max_rows=pdl_rows,
                        pdl_rows_per_token=tuple(sorted(per_token)))


def _grouped_gemms(runner: "ModelRunner", blocks: Sequence[Any]) -> Tuple[GroupedGemm, ...]:
    """The up and down grouped GEMMs of every distinct expert weight shape among the MoE
    ``blocks`` (with or without the shared expert as pairs), with the tile table's entries for
    the runner's GPU."""
    from sgl_kernel.moe_grouped_gemm_configs import config_key, table_entry

    device_name = torch.cuda.get_device_name(runner.device)
    out: Dict[str, GroupedGemm] = {}
    for block in blocks:
        m = block.experts
        shared = block.shared_as_pairs() is not None
        for which, w in (("up", m.w13_weight), ("down", m.w2_weight)):
            e, n, k = w.shape
            fp8 = w.dtype == torch.float8_e4m3fn
            act_fp8 = fp8 and bool(getattr(m, "fp8_activations", False))  # the w8a8 tiles
            name = f"{which} {config_key(e, n, k, fp8, act_fp8)}{' + shared' if shared else ''}"
            out.setdefault(name, GroupedGemm(name, e, fp8, table_entry(e, n, k, fp8, device_name,
                                                                      act_fp8=act_fp8), shared))
    return tuple(out.values())


def plan_prefill_warmup(runner: "ModelRunner", *, chunked_prefill_size: Optional[int],
                        max_prefill_tokens: Optional[int]) -> List[Shape]:
    """The warm-up shapes for ``runner`` (:func:`prefill_warmup_shapes`), the largest batch
    bounded by :func:`prefill_token_bound`, the context length and the free KV slots, two
    requests only when two request slots are free."""
    bounds = [runner.context_len, runner.token_to_kv_pool_allocator.available_size(),
              runner.req_to_token_pool.max_context_len]
    cap = prefill_token_bound(chunked_prefill_size, max_prefill_tokens)
    if cap is not None:
        bounds.append(cap)
    # Every TP rank must run the same forwards (they all-reduce inside), and each sized its
    # pools from its own memory: plan from the smallest rank's numbers.
    max_tokens, max_requests = tensor_model_parallel_min_ints(
        [min(bounds), runner.req_to_token_pool.available_size()])
    return prefill_warmup_shapes(prefill_paths(runner), max_tokens, max_requests)


def run_prefill_warmup(runner: "ModelRunner", shapes: Sequence[Shape], seed: int = 0) -> float:
    """Run one eager prefill of dummy tokens per shape through ``runner.forward``, taking and
    giving back request and KV slots through the pools; returns the seconds it took (after the
    device finished). Token ids come from a generator of its own (``seed``), so the process's
    random state is untouched; every TP rank draws the same ids."""
    gen = torch.Generator().manual_seed(seed)
    vocab = runner.model_config.vocab_size
    req_pool, kv_alloc = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
    kda = runner.kda_state_pool
    start = time.perf_counter()
    for lens in shapes:
        total = sum(lens)
        rows = req_pool.alloc(len(lens))
        if rows is None:
            raise RuntimeError(f"prefill warm-up: {len(lens)} request slots wanted, "
                               f"{req_pool.available_size()} free")
        loc = None
        try:
            loc = kv_alloc.alloc(total)
            if loc is None:
                raise RuntimeError(f"prefill warm-up: {total} KV slots wanted, "
                                   f"{kv_alloc.available_size()} free")
            if kda is not None and kda.layer_ids:
                kda.clear_slots(rows)  # as the scheduler admits a request: zero state
            offset = 0
            for row, n in zip(rows, lens):
                req_pool.write(row, 0, loc[offset:offset + n])
                offset += n
            ids = torch.randint(0, vocab, (total,), generator=gen, dtype=torch.int64)
            batch = ForwardBatch.for_extend(ids.to(runner.device), rows, [0] * len(lens),
                                            list(lens), loc)
            runner.forward(batch)
        finally:
            if loc is not None:
                kv_alloc.free(loc)
            req_pool.free(rows)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - start


def prefill_warmup_enabled(server_args: Any, device: torch.device,
                           force: Optional[bool] = None) -> bool:
    """Whether the warm-up runs: ``force`` when given, else a ``prefill_warmup`` attribute
    of ``server_args`` when set (not a flag: tests set it, e.g. to run it on CPU), else on CUDA
    unless ``--skip-server-warmup`` (on CPU nothing is compiled, so there is nothing to warm)."""
    if force is not None:
        return bool(force)
    attr = getattr(server_args, "prefill_warmup", None)
    if attr is not None:
        return bool(attr)
    return device.type == "cuda" and not getattr(server_args, "skip_server_warmup", False)


def warm_up_prefill(runner: "ModelRunner", server_args: Any, force: Optional[bool] = None
                    ) -> Optional[Tuple[List[Shape], float]]:
    """The start-up warm-up of ``runner`` (a target, after its CUDA graphs) when
    :func:`prefill_warmup_enabled`: plan, run, log one line; returns ``(shapes, seconds)``, or
    None when it did not run."""
    if not prefill_warmup_enabled(server_args, runner.device, force):
        return None
    shapes = plan_prefill_warmup(runner,
                                 chunked_prefill_size=server_args.chunked_prefill_size,
                                 max_prefill_tokens=server_args.max_prefill_tokens)
    seconds = run_prefill_warmup(runner, shapes)
    if runner.tp_rank == 0:
        logger.info("Prefill warm-up: %d batch shapes (up to %d tokens) in %.1f s",
                    len(shapes), max((sum(s) for s in shapes), default=0), seconds)
        logger.debug("Prefill warm-up shapes (tokens per request): %s", shapes)
    return shapes, seconds
