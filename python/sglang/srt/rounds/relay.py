"""Host run-ahead: what step ``k`` hands to step ``k + 1`` on the device, and what the host
reads back one step late.

* :class:`FutureMap` (upstream's name) — per request slot, persistent device buffers: the next
  input token (``tokens``: the last sampled / bonus token, whose KV is not written yet), the
  number of tokens whose KV is committed (``seq_lens``; the next token sits at that position),
  and a per-worker payload (a speculative drafter's seed state, for example). A step gathers its
  inputs by slot and scatters its outputs by slot, so nothing that depends on the device's results
  ever has to cross to the host before the next step is launched: the host passes slot indices,
  which it already knows.
* :class:`RoundOutput` / :class:`PendingRound` — a launched step ("round": one token per request
  for plain decode, a draft/verify chain for speculative decoding) and its outcome on the host,
  read through a copy-done event after the next step has been launched.
* :func:`host_to_device` — a host list to the device without waiting for the stream.

Slot 0 is the padding slot of every pool: padded rows of fixed-shape batches (CUDA graphs) read
and write it. Its ``seq_lens`` entry is pinned to 0 so that a padded row never walks off the
request->token map however often a graph replays.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch


__all__ = ["FutureMap", "RoundOutput", "PendingRound", "AsyncHostCopy", "host_to_device"]

_SIDE_STREAMS: Dict[torch.device, "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = torch.cuda.Stream(device=device)
        _SIDE_STREAMS[device] = stream
    return stream


def host_to_device(values: Sequence[int], device: torch.device,
                   dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``values`` as a device tensor. On CUDA through pinned memory with ``non_blocking``: a
    pageable copy would wait for every kernel queued on the stream and reset run-ahead to zero."""
    host = torch.tensor(list(values), dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class AsyncHostCopy:
    """Start copying named device tensors to the host now; :meth:`wait` returns the host copies.

    On CUDA the copies go into pinned host memory with a ``copy_done`` event, so the host never
    waits until it asks. By default they run on a side stream ordered after the producing
    kernels, so the next step's kernels need not queue behind them; the sources must then not be
    written again by later work (per-round tensors). ``on_current_stream=True`` issues them on
    the current stream instead, for sources a later step overwrites (a CUDA graph's static
    outputs): stream order puts the copy before the next replay. On CPU the call is a plain copy.
    """

    def __init__(self, tensors: Dict[str, torch.Tensor], on_current_stream: bool = False):
        if not tensors:
            raise ValueError("AsyncHostCopy needs at least one tensor")
        devices = {t.device for t in tensors.values()}
        if len(devices) != 1:
            raise ValueError(f"AsyncHostCopy: tensors on several devices {sorted(map(str, devices))}")
        device = devices.pop()
        self._event: Optional["torch.cuda.Event"] = None
        if device.type != "cuda":
            self._host = {name: t.detach().clone() for name, t in tensors.items()}
            return
        main = torch.cuda.current_stream(device)
        stream = main if on_current_stream else _side_stream(device)
        if stream is not main:
            stream.wait_stream(main)  # after the kernels that produce the tensors
        with torch.cuda.stream(stream):
            self._host = {}
            for name, t in tensors.items():
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                if stream is not main:
                    t.record_stream(stream)  # keep the source alive until the copy ran
                self._host[name] = host
            self._event = torch.cuda.Event()
            self._event.record(stream)

    def ready(self) -> bool:
        """Whether the copies have completed (never blocks)."""
        return self._event is None or self._event.query()

    def wait(self) -> Dict[str, torch.Tensor]:
        """Block until the copies are done; the host tensors by name."""
        if self._event is not None:
            self._event.synchronize()
        return self._host


class FutureMap:
    """Per-slot device buffers relaying step ``k``'s results to step ``k + 1``.

    ``payload`` declares extra per-slot fields as ``name -> (trailing shape, dtype)``; a field
    whose entry is marked lazy in ``lazy`` is allocated on first use (a distribution over the
    vocabulary that only sampled requests need, say) and filled with ``lazy[name]``.
    ``fused_prep`` (default: on CUDA) starts a round with one Triton launch
    (:meth:`assign_round`).
    """

    def __init__(self, num_slots: int, device: torch.device | str,
                 payload: Optional[Dict[str, Tuple[Tuple[int, ...], torch.dtype]]] = None,
                 lazy: Optional[Dict[str, float]] = None, fused_prep: Optional[bool] = None):
        if num_slots < 1:
            raise ValueError(f"FutureMap needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.device = torch.device(device)
        n = num_slots + 1  # + the padding slot 0
        self.tokens = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.seq_lens = torch.zeros(n, dtype=torch.int64, device=self.device)
        # The one-launch round start (sgl_kernel.round_prep) on CUDA; the torch ops elsewhere or
        # when a test or benchmark asks for them (benchmark/batch1/graph_ab.py's "prep=torch").
        self.fused_prep = self.device.type == "cuda" if fused_prep is None else fused_prep
        self._specs = dict(payload or {})
        self._lazy = dict(lazy or {})
        unknown = set(self._lazy) - set(self._specs)
        if unknown:
            raise ValueError(f"FutureMap: lazy fields {sorted(unknown)} are not in the payload")
        self._fields: Dict[str, torch.Tensor] = {}
        for name, (shape, dtype) in self._specs.items():
            if name in ("tokens", "seq_lens"):
                raise ValueError(f"FutureMap: payload field {name!r} shadows a built-in field")
            if name not in self._lazy:
                self._fields[name] = torch.zeros((n, *shape), dtype=dtype, device=self.device)

    def field(self, name: str) -> torch.Tensor:
        """The whole ``[slots + 1, ...]`` buffer of a payload field (allocated if lazy)."""
        buf = self._fields.get(name)
        if buf is None:
            if name not in self._specs:
                raise KeyError(f"FutureMap has no field {name!r}; fields: {sorted(self._specs)}")
            shape, dtype = self._specs[name]
            buf = torch.full((self.num_slots + 1, *shape), self._lazy[name], dtype=dtype,
                             device=self.device)
            self._fields[name] = buf
        return buf

    def assign_round(self, req_to_token: torch.Tensor, slots: torch.Tensor, loc: torch.Tensor,
                     with_tokens: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The start of a round: ``(prefix [B], tokens [B] or None)`` gathered at ``slots`` and
        ``req_to_token[slot_b, prefix_b + j] = loc[b, j]`` recorded. On CUDA one Triton launch
        (``sgl_kernel.round_prep``) unless :attr:`fused_prep` is off, else the torch ops."""
        from sgl_kernel.round_prep import assign_round_cache_locs, assign_round_cache_locs_ref

        fn = assign_round_cache_locs if self.fused_prep else assign_round_cache_locs_ref
        return fn(req_to_token, self.seq_lens, slots, loc, self.tokens if with_tokens else None)

    def gather(self, slots: torch.Tensor, *names: str) -> List[torch.Tensor]:
        """Copies of the named fields (``tokens``, ``seq_lens`` or payload) at ``slots [B]``."""
        return [self._buffer(n)[slots] for n in names]

    def scatter(self, slots: torch.Tensor, **values: Optional[torch.Tensor]) -> None:
        """Write the given fields at ``slots [B]`` (device ``index_copy_``; ``None`` skips).
        ``seq_lens`` of the padding slot 0 stays 0."""
        for name, value in values.items():
            if value is None:
                continue
            buf = self._buffer(name)
            value = value.to(buf.dtype)
            if name == "seq_lens":
                value = value.masked_fill(slots == 0, 0)
            buf.index_copy_(0, slots, value)

    def _buffer(self, name: str) -> torch.Tensor:
        if name == "tokens":
            return self.tokens
        if name == "seq_lens":
            return self.seq_lens
        return self.field(name)


@dataclass
class RoundOutput:
    """A round's outcome on the host (one entry per request of the round)."""

    accept_lens: List[int]  # tokens committed per request (1 for plain decode)
    tokens: List[List[int]]  # the accept_lens[b] committed tokens
    round_cache_loc: torch.Tensor  # [B, N] int64 CPU: the round's KV slots
    token_logprobs: Optional[List[List[float]]] = None  # per committed token
    top_logprobs_val: Optional[List[List[List[float]]]] = None
    top_logprobs_idx: Optional[List[List[List[int]]]] = None
    # The verify length each request's round was planned with (how many drafts it could
    # accept at most), for workers that plan one; None otherwise. Speculative metrics only.
    cap_lens: Optional[List[int]] = None
    # Per request its hidden-state row [H] (CPU) when the round was launched with hidden-state
    # rows (``return_hidden_states``), None for the others; None when no request asked.
    hidden_states: Optional[List[Optional[torch.Tensor]]] = None


class PendingRound:
    """A launched round: device outputs being copied to the host; :meth:`wait` (normally one
    round later) converts them into a :class:`RoundOutput`.

    ``tensors`` must hold ``accept_len [B]``, ``tokens [B, N]`` and ``loc [B, N]``, optionally
    ``logprobs [B, N]`` and ``top_val`` / ``top_idx [B, N, k]``. They must be this round's own
    tensors, not buffers a later round overwrites (a CUDA graph's outputs are cloned first).
    ``on_current_stream`` as :class:`AsyncHostCopy`'s.
    """

    def __init__(self, tensors: Dict[str, torch.Tensor], on_current_stream: bool = False):
        self.host_copy = AsyncHostCopy(tensors, on_current_stream)

    def wait(self) -> RoundOutput:
        """Block on the copy-done event and convert to host lists."""
        host = self.host_copy.wait()
        lens = host["accept_len"].tolist()
        rows = host["tokens"].tolist()
        out = RoundOutput(lens, [row[:a] for row, a in zip(rows, lens)], host["loc"])
        if "logprobs" in host:
            lp = host["logprobs"].tolist()
            out.token_logprobs = [row[:a] for row, a in zip(lp, lens)]
        if "top_val" in host:
            vals, idx = host["top_val"].tolist(), host["top_idx"].tolist()
            out.top_logprobs_val = [row[:a] for row, a in zip(vals, lens)]
            out.top_logprobs_idx = [row[:a] for row, a in zip(idx, lens)]
        return out
