"""CUDA graphs of one-request prefills: captured once per token bucket, replayed padded.

Eager, a batch-1 prefill of the 42-layer model issues about two thousand launches, and at a
thousand tokens the host takes longer to issue them than the GPU to run them
(docs/performance.md, the prefill census). A replay issues them all at once.

* **Which prefills.** A fresh request alone: EXTEND (or an MTP draft's DRAFT_EXTEND over the
  prompt), one request, no cached prefix (its attention would read a prefix whose length the
  graph cannot know), no logits for every row (input logprobs), no speculative payload, at
  most the largest bucket's tokens, and exactly the per-token model inputs the runner was
  built for (the draft's: the target's hidden state of every prompt row). Anything else runs
  eagerly.
* **Padding.** The request's ``T`` tokens are padded at their end to the smallest bucket
  ``P >= T``. The batch the graph was captured with says one request of ``P`` tokens; what
  changes per replay lives in static device buffers: the token ids, the per-token model
  inputs, the KV slots (padded rows write to slot 0, every pool's padding slot), the request's
  length and slot
  (:class:`~sglang.srt.model_executor.forward_batch_info.PrefillPadding`). Positions are
  ``0 .. P-1`` for every replay. The logits come from row ``T - 1`` (the device's
  ``extend_seq_lens``); the KDA layers end their state at that row and write it to the slot
  (``TorchNativeKDABackend._extend_padded``); attention and the row-wise layers need nothing,
  since a real row never sees a later one.
* **Keys.** A bucket and the hidden states the caller asks for
  (:class:`~sglang.srt.model_executor.forward_batch_info.CaptureHiddenMode`). The modes the
  round worker's prefill uses (``RoundWorker.prefill_graph_plan``) are captured at start-up,
  largest bucket first, into a memory pool of their own; another mode is captured when first
  needed. A capture that fails leaves its key to
  eager execution with a warning, never a crash.
* **Outputs** are copied out of the graph's buffers, which the next replay overwrites: per
  request rows as they are, per token rows (full hidden states, a drafter's auxiliary hidden
  states) for the ``T`` real rows.

Off CUDA the same logic runs with :class:`~sglang.srt.model_executor.cuda_graph_runner.EmulatedGraph`,
so the CPU tests check the padding against eager prefills.
"""
from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from sglang.srt.configs.engine_defaults import DEFAULT_PREFILL_CUDA_GRAPH_TOKENS
from sglang.srt.model_executor.cuda_graph_runner import (
    SLOW_REPLAY_GRAPH_COUNT,
    captured_graph_count,
    new_graph,
    record_failed_capture,
)
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
    PrefillPadding,
)

if TYPE_CHECKING:
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.model_executor.model_runner import ModelRunner

__all__ = ["PrefillGraphRunner", "PrefillGraphKey", "TokenInputs", "prefill_graph_buckets",
           "auto_prefill_graph_tokens", "init_prefill_graphs_from_args"]

logger = logging.getLogger(__name__)


class PrefillGraphKey(NamedTuple):
    """What a captured prefill graph is specialised for."""

    tokens: int  # the bucket: rows the graph runs
    capture_hidden_mode: CaptureHiddenMode


# Per-token model inputs a runner's prefill takes besides the ids: name -> (shape of one row,
# dtype), e.g. an MTP draft's {"hidden_states": ((hidden,), dtype)} (the target's hidden state
# of every prompt row).
TokenInputs = Dict[str, Tuple[Tuple[int, ...], torch.dtype]]


def auto_prefill_graph_tokens(*, chunk_tokens: Optional[int], graphs_before: int,
                              graphs_per_size: int,
                              ladder: Sequence[int] = DEFAULT_PREFILL_CUDA_GRAPH_TOKENS,
                              slow_count: int = SLOW_REPLAY_GRAPH_COUNT) -> Tuple[List[int], str]:
    """The prefill sizes to capture when ``--prefill-cuda-graph-tokens`` is not given, and why.

    ``ladder`` capped at ``chunk_tokens`` (``--chunked-prefill-size``; None or < 1: no
    chunking), since no prefill step is longer. Then the graph count: a process that has
    captured ``slow_count`` graphs replays every graph more slowly (cuda_graph_runner.py,
    ``SLOW_REPLAY_GRAPH_COUNT``). When the graphs captured so far (``graphs_before``: the
    decode graphs) are fewer, only as many sizes are kept as stay below it, ``graphs_per_size``
    graphs each (one per runner of the round worker's prefill plan), the smallest ones: short
    prompts are the ones whose eager prefill waits on the host, while a long prompt's eager
    prefill is about as fast as its replay, and a mid-size prompt padded up to a far larger size
    replays slower than it runs eagerly (docs/performance.md, "Prefill graphs by default").
    When the decode graphs are past the count already, every size is kept: more graphs cost
    their replays nothing more.
    """
    cap = chunk_tokens if chunk_tokens is not None and chunk_tokens >= 1 else None
    sizes = sorted({min(int(t), cap) if cap is not None else int(t) for t in ladder})
    if graphs_before >= slow_count:
        return sizes, (f"{graphs_before} graphs were captured before them, past the "
                       f"{slow_count} that slow every replay already")
    room = max(0, slow_count - 1 - graphs_before) // max(1, graphs_per_size)
    if room >= len(sizes):
        return sizes, (f"{graphs_before + len(sizes) * graphs_per_size} graphs in all, below "
                       f"the {slow_count} that slow every replay")
    kept = sizes[:room]
    return kept, (f"{graphs_before} decode graphs and {graphs_per_size} graph(s) a size leave "
                  f"room for {room} of {sizes} below the {slow_count} graphs that slow every "
                  f"replay (give --prefill-cuda-graph-tokens to choose)")


def init_prefill_graphs_from_args(worker: Any, server_args: object) -> List["PrefillGraphRunner"]:
    """The prefill graphs of ``server_args`` on CUDA unless ``--disable-cuda-graph``: for each
    ``(runner, keywords)`` of the round worker's ``prefill_graph_plan()``,
    ``runner.init_prefill_graphs(tokens, **keywords)``. ``tokens``: ``--prefill-cuda-graph-tokens``
    when given (an empty list: none), else :func:`auto_prefill_graph_tokens`. Empty when there
    are none. Call it after the decode graphs (the automatic sizes count them) and after any
    eager warm-up (a replay is no warm-up)."""
    if getattr(server_args, "disable_cuda_graph", False):
        return []
    plan = [(runner, keywords) for runner, keywords in worker.prefill_graph_plan()
            if torch.device(runner.device).type == "cuda"]
    if not plan:
        return []
    tokens = getattr(server_args, "prefill_cuda_graph_tokens", None)
    if tokens is None:
        tokens, why = _default_tokens(plan, server_args)
        if getattr(plan[0][0], "tp_rank", 0) == 0:
            logger.info("Prefill CUDA graphs by default: token counts %s (%s)", tokens, why)
    if not tokens:
        return []
    return [runner.init_prefill_graphs(tokens, **keywords) for runner, keywords in plan]


def _default_tokens(plan: List[Tuple[Any, Dict[str, Any]]],
                    server_args: object) -> Tuple[List[int], str]:
    """The sizes (and why) when ``--prefill-cuda-graph-tokens`` is not given, for the CUDA
    runners and keywords of ``plan``."""
    if getattr(server_args, "enable_deterministic_inference", False):
        # A padded replay rounds differently from the eager prefill of the same prompt, and the
        # default sizes depend on the decode graphs, which differ between a speculative server
        # and a plain one: bit-exact speculation needs both to prefill alike, i.e. eagerly.
        return [], ("none with --enable-deterministic-inference: eager prefills are the same "
                    "in every server; --prefill-cuda-graph-tokens captures some")
    per_size = sum(len(keywords.get("capture_modes", (CaptureHiddenMode.NULL,)))
                   for _, keywords in plan)
    return auto_prefill_graph_tokens(
        chunk_tokens=getattr(server_args, "chunked_prefill_size", None),
        graphs_before=captured_graph_count(), graphs_per_size=per_size)


def prefill_graph_buckets(requested: Sequence[int], *, max_tokens: int,
                          graph_token_limit: Optional[int]) -> List[int]:
    """The buckets to capture: ``requested`` sizes (deduplicated, ascending) that a prefill can
    reach (``max_tokens``: the context length and the request map's width) and that the model
    can run inside a graph (``graph_token_limit``, :meth:`ModelRunner.max_cuda_graph_tokens`;
    None: no limit)."""
    limit = max_tokens if graph_token_limit is None else min(max_tokens, graph_token_limit)
    return sorted({int(b) for b in requested if 1 <= int(b) <= limit})


class PrefillGraphRunner:
    """Captures and replays one-request prefills of ``model_runner``; see the module docstring.

    ``buckets``: token counts to capture (:func:`prefill_graph_buckets` filters them; on real
    graphs the model's own capture limit applies, in emulation it does not, since re-running a
    forward eagerly is correct whatever it reads on the host). ``capture_modes``: the hidden
    state modes captured now (the others when first needed; none with ``capture_now=False``).
    ``forward_mode``: the prefills' mode (``EXTEND``; ``DRAFT_EXTEND`` for an MTP draft's
    extend over the prompt). ``token_inputs``: per-token model inputs (:data:`TokenInputs`)
    that every replayed prefill passes, copied into static buffers like the ids. ``emulate``:
    :class:`EmulatedGraph` instead of CUDA graphs (default: off CUDA).
    """

    def __init__(self, model_runner: "ModelRunner", buckets: Sequence[int], *,
                 capture_modes: Sequence[CaptureHiddenMode] = (CaptureHiddenMode.NULL,),
                 forward_mode: ForwardMode = ForwardMode.EXTEND,
                 token_inputs: Optional[TokenInputs] = None,
                 emulate: Optional[bool] = None, capture_now: bool = True):
        if forward_mode not in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND):
            raise ValueError(f"PrefillGraphRunner: prefills are EXTEND or DRAFT_EXTEND, got "
                             f"{forward_mode.name}")
        self.runner = model_runner
        self.forward_mode = forward_mode
        self.token_inputs: TokenInputs = dict(token_inputs or {})
        self.device = torch.device(model_runner.device)
        self.emulate = self.device.type != "cuda" if emulate is None else emulate
        if not self.emulate and self.device.type != "cuda":
            raise ValueError("PrefillGraphRunner: real CUDA graphs need a CUDA device")
        max_tokens = min(model_runner.context_len, model_runner.req_to_token_pool.max_context_len)
        limit = None if self.emulate else model_runner.max_cuda_graph_tokens()
        self.buckets = prefill_graph_buckets(buckets, max_tokens=max_tokens,
                                             graph_token_limit=limit)
        dropped = sorted({int(b) for b in buckets} - set(self.buckets))
        if dropped:
            logger.info("Prefill CUDA graphs: token counts %s exceed what a prefill can reach "
                        "or the model can capture (%s); those prefills run eagerly", dropped,
                        f"at most {limit if limit is not None else max_tokens} tokens")
        self.graphs: Dict[PrefillGraphKey, "_Captured"] = {}
        self.failed: Dict[PrefillGraphKey, str] = {}
        self.num_replays = 0
        # Device memory the captures made at construction took (None: emulated, or none made).
        self.memory_bytes: Optional[int] = None
        self._pool = None if self.emulate else torch.cuda.graph_pool_handle()
        if not self.buckets:
            return
        top = self.buckets[-1]
        i64 = dict(dtype=torch.int64, device=self.device)
        self.input_ids = torch.zeros(top, **i64)
        self.loc = torch.zeros(top, **i64)  # 0: the KV pool's padding slot
        self.positions = torch.arange(top, **i64)
        self.real_len = torch.ones(1, **i64)
        self.slot = torch.zeros(1, **i64)
        self.zero = torch.zeros(1, **i64)
        self.inputs = {name: torch.zeros(top, *shape, dtype=dtype, device=self.device)
                       for name, (shape, dtype) in self.token_inputs.items()}
        if capture_now:
            # The eager cache is released before measuring (each capture releases it anyway),
            # so that the difference is what the captures hold, not the cache they freed.
            start, free_before = time.perf_counter(), self._free_bytes(release_cache=True)
            for mode in capture_modes:
                for tokens in reversed(self.buckets):  # largest first: the others reuse its pool
                    self._capture(PrefillGraphKey(tokens, mode))
            if free_before is not None:
                self.memory_bytes = free_before - self._free_bytes()
            if model_runner.tp_rank == 0:
                held = "" if self.memory_bytes is None else \
                    f", {self.memory_bytes / 2**30:.2f} GiB of device memory"
                logger.info("Prefill CUDA graphs: %d of %d captured (token counts %s) in %.1f s%s",
                            len(self.graphs), len(self.buckets) * len(capture_modes),
                            self.buckets, time.perf_counter() - start, held)

    # ------------------------------------------------------------------ keys
    def key(self, forward_batch: ForwardBatch,
            model_inputs: Optional[Dict[str, Any]] = None) -> Optional[PrefillGraphKey]:
        """The graph ``forward_batch`` (with the model keyword arguments ``model_inputs``) would
        replay, or None when it runs eagerly."""
        fb, inputs = forward_batch, model_inputs or {}
        if (not self.buckets or fb.forward_mode != self.forward_mode or fb.batch_size != 1
                or fb.extend_prefix_lens_cpu is None or list(fb.extend_prefix_lens_cpu) != [0]
                or fb.return_full_logits or fb.spec_info is not None or fb.padding is not None
                or set(inputs) != set(self.token_inputs)):
            return None
        for name, value in inputs.items():
            shape, dtype = self.token_inputs[name]
            if not isinstance(value, torch.Tensor) or value.dtype != dtype \
                    or tuple(value.shape) != (fb.num_tokens, *shape):
                return None
        i = bisect.bisect_left(self.buckets, fb.num_tokens)
        if fb.num_tokens < 1 or i == len(self.buckets):
            return None
        key = PrefillGraphKey(self.buckets[i], CaptureHiddenMode(fb.capture_hidden_mode))
        return None if key in self.failed else key

    # ------------------------------------------------------------------ capture
    def _static_batch(self, tokens: int, mode: CaptureHiddenMode) -> ForwardBatch:
        """The batch a graph runs: host mirrors of one fresh request of ``tokens`` rows in slot 0
        (host values only shape launches: the padded KDA path writes by the device slot), device
        tensors from the static buffers."""
        valid = self.positions[:tokens] < self.real_len  # recomputed by every replay
        return ForwardBatch(
            forward_mode=self.forward_mode, batch_size=1,
            input_ids=self.input_ids[:tokens], positions=self.positions[:tokens],
            req_pool_indices=self.slot, seq_lens=self.real_len,
            out_cache_loc=self.loc[:tokens], extend_seq_lens=self.real_len,
            extend_prefix_lens=self.zero, extend_start_loc=self.zero,
            req_pool_indices_cpu=[0], seq_lens_cpu=torch.tensor([tokens]),
            extend_seq_lens_cpu=[tokens], extend_prefix_lens_cpu=[0],
            seq_lens_upper_bound=tokens, capture_hidden_mode=mode,
            padding=PrefillPadding(self.real_len, self.slot, valid))

    def _body(self, key: PrefillGraphKey) -> Dict[str, torch.Tensor]:
        out = self.runner.forward_eager(self._static_batch(key.tokens, key.capture_hidden_mode),
                                        **{n: b[:key.tokens] for n, b in self.inputs.items()})
        return {f.name: getattr(out, f.name) for f in dataclasses.fields(out)
                if isinstance(getattr(out, f.name), torch.Tensor)}

    def _warm_up(self, key: PrefillGraphKey,
                 body: Optional[Callable[[PrefillGraphKey], object]] = None) -> None:
        """The eager runs before ``key``'s capture (JIT compiles, autotuning, allocator): the
        static buffers set for one request of the bucket's length in the padding slot, ``body``
        (default :meth:`_body`) run twice, then a sync."""
        self.loc.zero_()
        self.real_len.fill_(key.tokens)
        self.slot.zero_()  # warm-up and capture write the padding slots only
        for _ in range(2):
            (body or self._body)(key)
        self._sync()

    def _capture(self, key: PrefillGraphKey) -> Optional["_Captured"]:
        """Warm up and capture ``key``; on failure remember why and return None."""
        try:
            self._warm_up(key)
            if not self.emulate:
                # The warm-ups' activations sit cached in the eager pool; give them back so
                # that the graph's own pool can take that memory (a large bucket on a nearly
                # full GPU would otherwise need it twice).
                torch.cuda.empty_cache()
            graph = new_graph(self.emulate, self._pool)
            outputs = graph.capture(lambda: self._body(key))
            self._sync()
        except Exception as e:  # a capture problem must never take the server down
            record_failed_capture(self.failed, key, e, self.emulate, self.device, logger,
                                  "Prefill CUDA graph", "such prefills run eagerly")
            return None
        captured = _Captured(graph, outputs)
        self.graphs[key] = captured
        return captured

    def _free_bytes(self, release_cache: bool = False) -> Optional[int]:
        """Free device memory after the queue drains (None in emulation), after releasing the
        allocator's cached blocks when ``release_cache``."""
        if self.emulate:
            return None
        torch.cuda.synchronize(self.device)
        if release_cache:
            torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)[0]

    def _sync(self) -> None:
        if not self.emulate:
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ replay
    def run(self, forward_batch: ForwardBatch, model_inputs: Optional[Dict[str, Any]] = None
            ) -> Optional["LogitsProcessorOutput"]:
        """Replay the graph of ``forward_batch`` with the model keyword arguments
        ``model_inputs`` (capturing it first if needed) and return the forward's output for its
        real rows, or None when it must run eagerly."""
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput

        key = self.key(forward_batch, model_inputs)
        if key is None:
            return None
        captured = self.graphs.get(key) or self._capture(key)
        if captured is None:
            return None
        t = forward_batch.num_tokens
        # Padded rows keep the previous replay's token ids (any id does) but must write their
        # KV rows to the padding slot, never to another request's slots.
        self.input_ids[:t].copy_(forward_batch.input_ids, non_blocking=True)
        self.loc[:t].copy_(forward_batch.out_cache_loc, non_blocking=True)
        self.loc[t:key.tokens].zero_()
        self.real_len.fill_(t)
        self.slot.copy_(forward_batch.req_pool_indices, non_blocking=True)
        for name, value in (model_inputs or {}).items():  # padded rows keep older rows
            self.inputs[name][:t].copy_(value, non_blocking=True)
        captured.graph.replay()
        self.num_replays += 1
        fields = {name: (value[:t] if value.dim() and value.shape[0] == key.tokens else value)
                  .clone() for name, value in captured.outputs.items()}
        return LogitsProcessorOutput(**fields)


@dataclasses.dataclass
class _Captured:
    graph: object
    outputs: Dict[str, torch.Tensor]
