"""CUDA graphs of whole decode rounds: capture once per batch-size bucket, replay every step.

A round worker (plain decode in :class:`~sglang.srt.rounds.plain.TpModelWorker`, a
speculative worker) exposes its round as a *body*: ``body(slots, loc, sampling_info, bound,
return_logprob) -> {name: tensor}``, fixed-shape device work over its arguments that never reads
a device value on the host (inputs come from the worker's future map by slot). The runner
captures that body over static input buffers and replays it:

* **Buckets.** Graphs exist for the batch sizes of ``--cuda-graph-bs`` (or the defaults up to
  ``--cuda-graph-max-bs``) that the model can capture (the torch-native MoE reads expert counts
  on the host above a few dozen (token, expert) pairs, so its graphs stop there). A batch of
  ``bs`` requests replays the smallest bucket that holds it; the extra rows point at pool slot 0,
  the padding slot of every pool, and their outputs are dropped.
* **Keys.** Besides the bucket, a graph is keyed by the sampling variant (greedy, or sampled
  with every filter on: neutral parameters make each filter a no-op, so one sampled graph serves
  every temperature / top-k / top-p / min-p / seed mix), by whether logprobs are returned, and
  for attention backends whose work depends on the host gather width
  (``AttentionBackend.width_independent`` False: the torch-native MLA) by a bucket of
  ``seq_lens_bound``. Batches with dense penalty state (frequency / presence / repetition
  penalties, logit bias, min-new-tokens) run eagerly.
* **Refill.** Before a replay the live slot indices, KV slots and the sampling rows the variant
  reads must be in the static buffers, and after it the sampling step counters the body advanced
  go back to the live batch; :mod:`~sglang.srt.model_executor.graph_refill` does that with as
  few device copies as it can (the KV slots are allocated in place, unchanged rows are not
  copied again; opt-in glue graphs), never with a host sync.
* **Capture.** Warm-up runs of the body (Triton JIT, allocator) come first, outside the capture.
  Every graph shares one memory pool; the largest bucket is captured first. A capture that fails
  leaves that key to eager execution with a warning, never a crash. Greedy graphs of
  width-independent backends are captured at start-up, the other keys when first needed.

Off CUDA the same logic runs with :class:`EmulatedGraph` (capture = run the body once, replay =
run it again over the static buffers and copy into the captured outputs), so the CPU tests check
buckets, padding, refill and fallback against eager execution.
"""
from __future__ import annotations

import bisect
import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

import torch

from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.graph_refill import GraphRefill
from sglang.srt.sampling.sampling_batch_info import ROW_FIELDS, SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["CudaGraphRunner", "GraphKey", "EmulatedGraph", "WIDTH_BUCKET", "MAX_GRAPHS",
           "graph_variant", "run_phases", "new_graph", "record_failed_capture",
           "captured_graph_count", "SLOW_REPLAY_GRAPH_COUNT", "report_graph_count"]

# On the H100 and the H200 (driver 580), once a process has captured this many CUDA graphs,
# of any kind and also if some were released since, every replay runs about 5% slower (each
# kernel node about 0.18 µs later); with fewer the decode step is as fast as with one.
# docs/performance.md, "The fourth CUDA graph".
SLOW_REPLAY_GRAPH_COUNT = 4
_captured = 0  # graphs captured in this process (real or emulated), see captured_graph_count


def captured_graph_count() -> int:
    """How many graphs this process has captured so far (each :func:`new_graph` whose capture
    returned, released or not): the count that :data:`SLOW_REPLAY_GRAPH_COUNT` is about."""
    return _captured


def _count_capture() -> None:
    global _captured
    _captured += 1


def _slow_count_warning(what: str, total: int) -> str:
    return (f"{what} made this process's CUDA graphs {total}; with {SLOW_REPLAY_GRAPH_COUNT} "
            f"or more, every replay (each decode step's too) was measured about 5% slower on "
            f"the H100 / H200 (docs/performance.md, \"The fourth CUDA graph\"): for batch-1 "
            f"serving keep the graphs <= {SLOW_REPLAY_GRAPH_COUNT - 1} (--cuda-graph-max-bs 1 "
            f"and fewer prefill sizes; a size is one graph per model, two with an MTP draft)")


def report_graph_count(decode: int, prefill: int, log: logging.Logger = logger) -> None:
    """Log, once start-up has captured its graphs, how many the process has captured:
    ``decode`` before the prefill graphs (the decode graphs), ``prefill`` by them. A warning
    when the prefill graphs are what brings the process to :data:`SLOW_REPLAY_GRAPH_COUNT`
    (the graphs before them stayed below it), since then every decode step pays for them.
    A graph key first met while serving warns on its own (:meth:`CudaGraphRunner.replay`)."""
    total = decode + prefill
    log.info("CUDA graphs captured at start-up: %d (%d decode, %d prefill)", total, decode,
             prefill)
    if prefill and decode < SLOW_REPLAY_GRAPH_COUNT <= total:
        log.warning(_slow_count_warning(f"the {prefill} prefill CUDA graphs", total))


RoundBody = Callable[[torch.Tensor, torch.Tensor, SamplingBatchInfo, int, bool],
                     Dict[str, torch.Tensor]]
# A phase of a round: (outputs of the earlier phases, slots, loc, info, bound, return_logprob)
# -> its own outputs.
RoundPhase = Callable[[Dict[str, torch.Tensor], torch.Tensor, torch.Tensor, SamplingBatchInfo,
                       int, bool], Dict[str, torch.Tensor]]


def run_phases(phases: Sequence[RoundPhase], slots: torch.Tensor, loc: torch.Tensor,
               info: SamplingBatchInfo, bound: int,
               return_logprob: bool) -> Dict[str, torch.Tensor]:
    """Run a round's phases in order; the merged outputs (a later phase's names win)."""
    out: Dict[str, torch.Tensor] = {}
    for phase in phases:
        out.update(phase(dict(out), slots, loc, info, bound, return_logprob))
    return out

# Gather-width granularity of graphs for width-dependent attention backends (cache rows).
WIDTH_BUCKET = 512
# Graphs one runner keeps (each holds its activations in the shared pool): keys first needed
# after that many run eagerly (width buckets of long contexts x batch sizes x variants add up).
MAX_GRAPHS = 96
# Sampling rows a sampled graph reads (refilled before each replay). Greedy graphs read only
# ``steps`` (advanced by the body, copied back) and, for logprobs, the temperatures.
_SAMPLED_FIELDS = ("temperatures", "top_ps", "top_ks", "min_ps", "greedy_mask", "seeds",
                   "has_seed", "steps")


class GraphKey(NamedTuple):
    """What a captured graph is specialised for."""

    bs: int  # bucket (captured batch size)
    width: Optional[int]  # gather-width bucket (None: the backend does not depend on it)
    variant: str  # "greedy" or "sampled"
    return_logprob: bool
    # The worker's round shape (e.g. a verify-width tier: RoundWorker.next_round_shape);
    # None for a worker whose rounds have one shape.
    round_shape: Optional[int] = None


def graph_variant(info: SamplingBatchInfo) -> Optional[str]:
    """``"greedy"``, ``"sampled"``, or ``None`` when the batch needs eager execution (dense
    penalty state, whose tensors are per batch and vocabulary-sized)."""
    if (info.has_frequency_presence or info.has_repetition or info.has_logit_bias
            or info.has_min_new_tokens):
        return None
    return "greedy" if info.is_all_greedy else "sampled"


class EmulatedGraph:
    """Stands in for ``torch.cuda.CUDAGraph`` off CUDA: :meth:`capture` runs ``fn`` once and
    keeps its outputs; :meth:`replay` runs it again (over the same static inputs) and copies the
    results into those outputs, as a real replay overwrites them."""

    def __init__(self, pool: object = None):
        self._fn: Optional[Callable[[], Dict[str, torch.Tensor]]] = None
        self._out: Dict[str, torch.Tensor] = {}

    def capture(self, fn: Callable[[], Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        """Run ``fn`` and return its outputs (the graph's static outputs)."""
        self._fn, self._out = fn, fn()
        _count_capture()
        return self._out

    def replay(self) -> None:
        """Re-run the captured function into the captured outputs."""
        for name, value in self._fn().items():
            self._out[name].copy_(value)


class _GraphChain:
    """Graphs replayed one after the other (a round captured one graph per phase)."""

    def __init__(self, graphs: List[object]):
        self.graphs = graphs

    def replay(self) -> None:
        for graph in self.graphs:
            graph.replay()


class _CudaGraph:
    """``torch.cuda.CUDAGraph`` behind :class:`EmulatedGraph`'s two methods."""

    def __init__(self, pool: object):
        self._graph = torch.cuda.CUDAGraph()
        self._pool = pool

    def capture(self, fn: Callable[[], Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        with torch.cuda.graph(self._graph, pool=self._pool):
            out = fn()
        _count_capture()
        return out

    def replay(self) -> None:
        self._graph.replay()


def record_failed_capture(failed: Dict, key: object, error: Exception, emulate: bool,
                          device: torch.device, log: logging.Logger, what: str,
                          fallback: str) -> None:
    """After ``key``'s capture raised ``error``: remember why in ``failed`` (that key is not
    tried again), warn once (``what`` failed; ``fallback`` says what runs instead) and, on
    CUDA, let the aborted capture's work drain."""
    failed[key] = f"{type(error).__name__}: {error}"
    log.warning("%s capture of %s failed (%s); %s", what, key, failed[key], fallback)
    if not emulate:
        try:  # an error here is the same one
            torch.cuda.synchronize(device)
        except RuntimeError as sync_error:
            log.warning("after the failed capture: %s", sync_error)


def new_graph(emulate: bool, pool: object = None) -> object:
    """A graph to capture into: :class:`EmulatedGraph` when ``emulate``, else a CUDA graph in
    memory pool ``pool``."""
    return EmulatedGraph() if emulate else _CudaGraph(pool)


@dataclass
class _Captured:
    graph: object
    outputs: Dict[str, torch.Tensor]


class CudaGraphRunner:
    """Captures and replays a round worker's body; see the module docstring.

    ``round_tokens``: KV slots per request per round (the static ``loc`` is ``[bs, N]``).
    ``tokens_per_request``: the most tokens one forward of the round holds per request (a
    verify's chain width), for the capture limit ``max_graph_tokens``. ``backends``: every
    attention backend the body runs (their capture hooks validate each capture).
    ``max_width``: the request->token map's width (the largest gather a bound may ask for).
    ``phases`` with ``per_phase=True``: capture one graph per phase (replayed back to back, the
    outputs of one phase the static inputs of the next) instead of one graph of ``body``, which
    must then run the same phases (A/B of the two layouts). Every output is batch-major.
    ``refill_mode``: how the static inputs are refilled (:class:`GraphRefill`).
    ``set_round_shape``: called with a key's ``round_shape`` before its body runs for a capture
    (a worker whose rounds come in several shapes, :meth:`~sglang.srt.rounds.contract.RoundWorker.apply_round_shape`).
    """

    def __init__(self, body: RoundBody, *, device: torch.device, vocab_size: int,
                 round_tokens: int, tokens_per_request: int, batch_sizes: Sequence[int],
                 max_width: int, backends: Sequence[object] = (),
                 max_graph_tokens: Optional[int] = None, width_independent: bool = True,
                 emulate: Optional[bool] = None, capture_now: bool = True,
                 phases: Optional[Sequence[RoundPhase]] = None, per_phase: bool = False,
                 refill_mode: str = "changed",
                 set_round_shape: Optional[Callable[[Optional[int]], None]] = None):
        self.body = body
        self.set_round_shape = set_round_shape
        if per_phase and not phases:
            raise ValueError("CudaGraphRunner: per_phase needs the round's phases")
        self.phases = list(phases) if per_phase else None
        self.device = torch.device(device)
        self.round_tokens = round_tokens
        self.max_width = max_width
        self.width_independent = width_independent
        self.emulate = self.device.type != "cuda" if emulate is None else emulate
        if not self.emulate and self.device.type != "cuda":
            raise ValueError("CudaGraphRunner: real CUDA graphs need a CUDA device")
        limit = max_graph_tokens if max_graph_tokens is not None else float("inf")
        sizes = sorted({int(b) for b in batch_sizes if b >= 1})
        self.batch_sizes = [b for b in sizes if b * tokens_per_request <= limit]
        if sizes and not self.batch_sizes:
            logger.warning("CUDA graphs: no batch size fits the %s-token capture limit; "
                           "decode runs eagerly", max_graph_tokens)
        dropped = sorted(set(sizes) - set(self.batch_sizes))
        if dropped:
            logger.info("CUDA graphs: batch sizes %s exceed the %s-token capture limit (eager)",
                        dropped, max_graph_tokens)
        self.graphs: Dict[GraphKey, _Captured] = {}
        self.failed: Dict[GraphKey, str] = {}
        self.num_replays = 0
        self._pool = None if self.emulate else torch.cuda.graph_pool_handle()
        self._backends = list(backends)
        self.refill: Optional[GraphRefill] = None
        if not self.batch_sizes:
            return
        max_bs = self.batch_sizes[-1]
        for backend in self._backends:
            backend.init_cuda_graph_state(max_bs, max_bs * tokens_per_request)
        self.slots = torch.zeros(max_bs, dtype=torch.int64, device=self.device)
        self.loc = torch.zeros(max_bs, round_tokens, dtype=torch.int64, device=self.device)
        # Neutral sampling rows (temperature 1, no filters, unseeded) as the static base.
        params = [SamplingParams()] * max_bs
        self._info = SamplingBatchInfo.from_reqs(params, [[]] * max_bs, vocab_size, self.device)
        self.refill = GraphRefill(refill_mode, self.slots, self.loc, self._info, self._new_graph)
        if capture_now and width_independent:
            for bs in reversed(self.batch_sizes):  # largest first: smaller ones reuse its pool
                self._capture(GraphKey(bs, None, "greedy", False))

    # ------------------------------------------------------------------ keys
    def bucket(self, bs: int) -> Optional[int]:
        """The smallest captured batch size >= ``bs`` (None: larger than every bucket)."""
        i = bisect.bisect_left(self.batch_sizes, bs)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def width_bucket(self, bound: int) -> int:
        """``bound`` rounded up to :data:`WIDTH_BUCKET`, at most the map's width."""
        return min(-(-max(bound, 1) // WIDTH_BUCKET) * WIDTH_BUCKET, self.max_width)

    def key(self, bs: int, info: SamplingBatchInfo, return_logprob: bool,
            bound: int, round_shape: Optional[int] = None) -> Optional[GraphKey]:
        """The graph a batch would replay, or None when it runs eagerly."""
        bucket = self.bucket(bs)
        variant = graph_variant(info)
        if bucket is None or variant is None:
            return None
        width = None if self.width_independent else self.width_bucket(bound)
        key = GraphKey(bucket, width, variant, bool(return_logprob), round_shape)
        if key in self.failed or (key not in self.graphs and len(self.graphs) >= MAX_GRAPHS):
            return None
        return key

    # ------------------------------------------------------------------ capture
    def _static_info(self, key: GraphKey) -> SamplingBatchInfo:
        sampled = key.variant == "sampled"
        views = {f: getattr(self._info, f)[:key.bs] for f in ROW_FIELDS}
        return dataclasses.replace(
            self._info, **views, is_all_greedy=not sampled, need_top_k=sampled,
            need_top_p=sampled, need_min_p=sampled, any_seeded=sampled)

    def _bound(self, key: GraphKey) -> int:
        """The gather width a graph is captured with (the map's width if it does not matter)."""
        return self.max_width if key.width is None else key.width

    def _run_static(self, key: GraphKey, info: SamplingBatchInfo) -> Dict[str, torch.Tensor]:
        return self.body(self.slots[:key.bs], self.loc[:key.bs], info, self._bound(key),
                         key.return_logprob)

    def _capture(self, key: GraphKey) -> Optional[_Captured]:
        """Warm up and capture ``key``; on failure remember why and return None."""
        info = self._static_info(key)
        # A capture first needed by a replay runs after the round allocated its KV slots into
        # the static loc (graph_refill.py): keep them, and forget what the refill copied.
        live_loc = self.loc.clone()
        self.slots.zero_()
        self.loc.zero_()
        if self.set_round_shape is not None:
            self.set_round_shape(key.round_shape)
        try:
            for backend in self._backends:
                backend.init_forward_metadata_capture_cuda_graph(
                    key.bs, key.bs * self.round_tokens, self.slots[:key.bs],
                    self.slots[:key.bs], _capture_mode(self.round_tokens))
            for _ in range(2):  # warm-up outside the capture: JIT compiles, allocator grows
                self._run_static(key, info)
            if not self.emulate:
                torch.cuda.synchronize(self.device)
            graph, outputs = self._capture_graphs(key, info)
            if not self.emulate:
                torch.cuda.synchronize(self.device)
            short = [n for n, v in outputs.items() if v.dim() == 0 or v.shape[0] != key.bs]
            if short:  # replay() slices outputs by request: they must be batch-major
                raise ValueError(f"round outputs {short} are not batch-major [bs={key.bs}, ...]")
        except Exception as e:  # a capture problem must never take the server down
            record_failed_capture(self.failed, key, e, self.emulate, self.device, logger,
                                  "CUDA graph", "that batch shape runs eagerly")
            return None
        finally:
            self.loc.copy_(live_loc)
            if self.refill is not None:
                self.refill.forget()
        captured = _Captured(graph, outputs)
        self.graphs[key] = captured
        return captured

    def _new_graph(self) -> object:
        return new_graph(self.emulate, self._pool)

    def _capture_graphs(self, key: GraphKey, info: SamplingBatchInfo):
        """One graph of the body, or one per phase chained through their static outputs."""
        if self.phases is None:
            graph = self._new_graph()
            return graph, graph.capture(lambda: self._run_static(key, info))
        width = self._bound(key)
        slots, loc = self.slots[:key.bs], self.loc[:key.bs]
        merged: Dict[str, torch.Tensor] = {}
        graphs = []
        for phase in self.phases:
            graph = self._new_graph()
            prev = dict(merged)  # the earlier phases' static outputs: this phase's inputs
            merged.update(graph.capture(
                lambda phase=phase, prev=prev: phase(prev, slots, loc, info, width,
                                                     key.return_logprob)))
            graphs.append(graph)
        return _GraphChain(graphs), merged

    # ------------------------------------------------------------------ replay
    def replay(self, key: GraphKey, slots: torch.Tensor, loc: torch.Tensor,
               info: SamplingBatchInfo) -> Optional[Dict[str, torch.Tensor]]:
        """Refill the static inputs from the live batch, replay ``key`` (capturing it first if
        needed) and return its outputs for the live rows (views of static buffers that the next
        replay overwrites). None if the key cannot be captured (run the body eagerly)."""
        captured = self.graphs.get(key)
        if captured is None:  # first met while serving (a sampling mode, logprobs, a width)
            before = captured_graph_count()
            captured = self._capture(key)
            if captured is None:
                return None
            if before < SLOW_REPLAY_GRAPH_COUNT <= captured_graph_count():
                logger.warning(_slow_count_warning(f"capturing {key} while serving",
                                                   captured_graph_count()))
        bs = int(slots.shape[0])
        if key.variant == "sampled":
            fields = _SAMPLED_FIELDS
        else:
            fields = ("steps", "temperatures") if key.return_logprob else ("steps",)
        self.refill.before(key.bs, slots, loc, info, fields)
        for backend in self._backends:  # Python-side hooks: always eager (graph_refill.py)
            backend.init_forward_metadata_replay_cuda_graph(
                key.bs, self.slots[:key.bs], self.slots[:key.bs], _capture_mode(self.round_tokens))
        captured.graph.replay()
        self.num_replays += 1
        self.refill.after(slots, info)  # the body advanced the sampling counters
        return {name: value[:bs] for name, value in captured.outputs.items()}


def _capture_mode(round_tokens: int) -> ForwardMode:
    return ForwardMode.DECODE if round_tokens == 1 else ForwardMode.TARGET_VERIFY


def capture_batch_sizes(server_args: object, max_running_requests: int) -> List[int]:
    """Batch sizes to capture: ``ServerArgs.cuda_graph_batch_sizes()`` within the request pool
    (no batch can hold more requests than it has slots)."""
    sizes = server_args.cuda_graph_batch_sizes()
    return [b for b in sizes if b <= max_running_requests] or [max_running_requests]
