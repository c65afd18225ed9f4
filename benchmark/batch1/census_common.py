"""Profiler helpers shared by the census scripts (``round_census.py``, ``prefill_census.py``).

Both attribute profiled work to model components through ``record_function`` ranges that module
forward hooks open, then walk the profiler's events: the innermost range of a given prefix
around an op names its component; a CPU run counts top-level aten ops, a CUDA run the device
work each op launched.
"""
from __future__ import annotations

import bisect
import subprocess
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, record_function


def range_hooks(module: nn.Module, range_name: str) -> List[Any]:
    """Pre/post forward hooks that open and close ``record_function(range_name)``; the caller
    removes the returned handles."""
    open_ranges: List[record_function] = []  # a stack: a re-entered module nests

    def enter(mod: nn.Module, args: Any) -> None:
        rf = record_function(range_name)
        rf.__enter__()
        open_ranges.append(rf)

    def leave(mod: nn.Module, args: Any, output: Any) -> None:
        if open_ranges:  # always_call: also on an exception, after a failed pre-hook too
            open_ranges.pop().__exit__(None, None, None)

    return [module.register_forward_pre_hook(enter),
            module.register_forward_hook(leave, always_call=True)]


def install_range_hooks(modules: Iterable[Tuple[nn.Module, str]],
                        prefix: str) -> Callable[[], None]:
    """Wrap the forward of every ``(module, category)`` in a profiler range named
    ``prefix + category``; returns the function that removes the hooks again."""
    handles: List[Any] = []
    for module, category in modules:
        handles += range_hooks(module, prefix + category)

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return remove


def innermost_range(event: Any, prefix: str) -> Optional[str]:
    """The innermost range named ``prefix...`` at ``event`` (itself included), without the
    prefix; None when there is none."""
    while event is not None:
        if event.name.startswith(prefix):
            return event.name[len(prefix):]
        event = event.cpu_parent
    return None


def is_top_level_op(event: Any) -> bool:
    """An aten op not called from inside another aten op (ranges in between do not count)."""
    return event.name.startswith("aten::") and not (
        event.cpu_parent is not None and event.cpu_parent.name.startswith("aten::"))


def device_events(events: Sequence[Any], exclude_prefixes: Tuple[str, ...] = ()) -> List[Any]:
    """Device work (kernels, copies, memsets) of a CUDA profile, without the GPU spans that
    mirror ``record_function`` ranges (user annotations, or names with ``exclude_prefixes``)."""
    return [e for e in events if e.device_type == DeviceType.CUDA
            and not getattr(e, "is_user_annotation", False)
            and not e.name.startswith(exclude_prefixes)]


def unclaimed_device_events(host: Sequence[Any], device: Sequence[Any],
                            exclude_prefixes: Tuple[str, ...] = ()) -> List[Any]:
    """The events of ``device`` that no host event's ``kernels`` claims, matched by name and
    count: device work the profile did not link to the host op that launched it (kernels
    launched through the driver API, such as Triton's, can come without that link). Kernels
    named with ``exclude_prefixes`` (the GPU mirrors of ranges) are no claims."""
    claimed: Dict[str, int] = {}
    for e in host:
        for k in getattr(e, "kernels", None) or ():
            if not k.name.startswith(exclude_prefixes):
                claimed[k.name] = claimed.get(k.name, 0) + 1
    left = []
    for e in device:
        if claimed.get(e.name, 0) > 0:
            claimed[e.name] -= 1
        else:
            left.append(e)
    return left


class RangeTimeline:
    """Which host range named ``prefix...`` is innermost at each instant of a profile.

    The ranges (``record_function`` spans on the host) are swept once into breakpoints, so
    that :meth:`at` answers by bisection. The ranges are taken to nest, as one thread's spans
    do.
    """

    def __init__(self, events: Iterable[Any], prefix: str):
        spans = sorted(((e.time_range.start, e.time_range.end, e.name[len(prefix):])
                        for e in events if e.device_type == DeviceType.CPU
                        and e.name.startswith(prefix)), key=lambda r: (r[0], -r[1]))
        self.times: List[float] = []
        self.names: List[Optional[str]] = []
        stack: List[Tuple[float, str]] = []  # (end, name) of the open ranges, innermost last

        def mark(t: float, name: Optional[str]) -> None:
            if self.times and self.times[-1] == t:
                self.names[-1] = name  # the last change at an instant wins
            else:
                self.times.append(t)
                self.names.append(name)

        def close_until(t: float) -> None:
            while stack and stack[-1][0] <= t:
                end = stack.pop()[0]
                mark(end, stack[-1][1] if stack else None)

        for start, end, name in spans:
            close_until(start)
            stack.append((end, name))
            mark(start, name)
        close_until(float("inf"))

    def at(self, t: float) -> Optional[str]:
        """The innermost range open at ``t`` (a range's end excluded), without the prefix;
        None outside every range."""
        i = bisect.bisect_right(self.times, t) - 1
        return self.names[i] if i >= 0 else None


def activities(cuda: bool) -> List[ProfilerActivity]:
    """The profiler activities of a census: host ops always, device work on CUDA."""
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])


def git_commit(path: Optional[str] = None) -> Dict[str, Any]:
    """``{"commit": sha or "unknown", "dirty": bool or None}`` of the checkout holding ``path``
    (default: this file), so a result line names the code it measured."""
    cwd = Path(path or __file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=cwd, capture_output=True, text=True, timeout=10,
                                check=True).stdout
    except (OSError, subprocess.SubprocessError):  # no git, or not a checkout (a copied tree)
        return {"commit": "unknown", "dirty": None}
    return {"commit": sha, "dirty": bool(status.strip())}
