"""Programmatic dependent launch (PDL): one switch and one protocol for every kernel that uses it.

With PDL a kernel may start while the kernel before it on the stream is still running; a CUDA
graph keeps the property, so a chain of small kernels overlaps each one's launch and prologue with
its predecessor's tail, which shortens the time per graph node (docs/performance.md, "Kernel
design measurements (moved from code comments)"). The protocol that keeps this exact, followed
by every kernel here:

* the host launches the kernel with ``launch_pdl=True`` (:func:`launch_options`);
* the kernel calls :func:`wait` before its first read of anything an earlier kernel wrote, and
  before its first write (an earlier kernel may still read the buffer); reads of data no kernel
  of the step writes (weights) may come before it;
* it calls :func:`launch_dependents` only after its own :func:`wait`, so that when a kernel starts,
  every kernel two or more places before it has finished.

A kernel whose weights are known before the wait asks for its first weight tiles in L2 there
(:func:`prefetch_l2`, while the kernel before it finishes; :func:`weight_prefetch` says when):
the loads after the wait then start from L2 instead of DRAM. A prefetch reads nothing into the
kernel, so results are unchanged.

Only small launches (at most :data:`PDL_MAX_ROWS` rows: decode and verify) use it: there the
launch floor rivals the arithmetic, while a prefill kernel saturates the GPU on its own. The
switch is process-wide (:func:`set_pdl`), set once from the engine's configuration; Triton's CPU
interpreter has no PDL, so it never turns on there.
"""
from __future__ import annotations

import triton
import triton.language as tl

from sgl_kernel._triton_mode import INTERPRETED

__all__ = ["PDL_MAX_ROWS", "set_pdl", "pdl_enabled", "use_pdl", "launch_options", "wait",
           "launch_dependents", "set_weight_prefetch", "weight_prefetch", "prefetch_l2",
           "REFERENCE_NOTE"]

REFERENCE_NOTE = ("no reference: launch-order helpers (PDL waits, L2 prefetch hints) that change "
                  "no value; test/kernels/test_pdl.py checks the kernels using them are unchanged")

PDL_MAX_ROWS = 512
_ENABLED = False
_PREFETCH = True


def set_pdl(enabled: bool) -> bool:
    """Turn PDL on or off for the kernels launched from now on; returns the state in force (off
    under the interpreter, whatever was asked)."""
    global _ENABLED
    _ENABLED = bool(enabled) and not INTERPRETED
    return _ENABLED


def pdl_enabled() -> bool:
    """Whether :func:`set_pdl` turned PDL on."""
    return _ENABLED


def use_pdl(rows: int) -> bool:
    """Whether a launch over ``rows`` rows (tokens, pairs) uses PDL: on, and a small launch."""
    return _ENABLED and rows <= PDL_MAX_ROWS


def set_weight_prefetch(enabled: bool) -> bool:
    """Whether PDL launches prefetch their weights before the wait (on by default; off for an
    A/B); returns the setting."""
    global _PREFETCH
    _PREFETCH = bool(enabled)
    return _PREFETCH


def weight_prefetch(rows: int) -> bool:
    """Whether a launch over ``rows`` rows prefetches its weights: a PDL launch (only there
    does the prefetch overlap the kernel before) with prefetching on."""
    return use_pdl(rows) and _PREFETCH


def launch_options(pdl: bool) -> dict:
    """The launch keyword that makes a launch programmatic-dependent (none when ``pdl`` is off)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def wait(PDL: tl.constexpr):
    """Block until the kernels this one depends on have finished and their writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Let the next kernel on the stream start (call after :func:`wait`)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, mask):
    """Bring the 128-byte lines holding ``ptrs`` (where ``mask``) into L2, keeping nothing in
    registers: a read of data no kernel of the step writes, issued before :func:`wait`. CUDA
    only (inline PTX; the interpreter never runs a PDL launch)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
