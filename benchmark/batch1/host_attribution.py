"""Where in the host's code a measured call spends its time and synchronises: the call site of
each synchronising CUDA call (from the warnings of torch's sync debug mode), the call site of
each torch op that only copies or fills memory, a cProfile run ranked by function and by
package, and their tables. Used by ``prefill_census.py`` (``--sync-sites``, ``--copy-sites``,
``--host-profile``); nothing here runs a model.

Paths are named as a reader would look for them: below this checkout's ``python/`` and
``sgl-kernel/python/`` trees (the lines to change), else as an import path below
``site-packages`` (a library's file, e.g. ``fla/ops/utils/index.py``).
"""
from __future__ import annotations

import contextlib
import os
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

# What torch's sync debug mode warns in "warn" (c10's warn_or_error_on_sync); the warning's text
# may carry a "(Triggered internally at ...)" suffix, so it is matched as a substring.
SYNC_WARNING = "called a synchronizing CUDA operation"
# Folders whose name marks an installed library's import root (the "via" frame's path is
# relative to it: "fla/ops/utils/index.py", "torch/functional.py").
_LIBRARY_DIRS = ("site-packages", "dist-packages")


def _norm(path: str) -> str:
    return os.path.normpath(path)


def _relative(path: str, roots: Sequence[str]) -> Optional[str]:
    """``path`` (normalised) relative to the longest of ``roots`` holding it, with ``/``
    separators; None when none holds it."""
    best: Optional[str] = None
    for root in roots:
        root = _norm(root)
        inside = path == root or path.startswith(root.rstrip(os.sep) + os.sep)
        if inside and (best is None or len(root) > len(best)):
            best = root
    if best is None:
        return None
    return "/".join(Path(path[len(best):].lstrip(os.sep)).parts)


def _library_path(path: str, lib_roots: Sequence[str]) -> str:
    """A path outside the repository as an import path: below the last ``site-packages`` /
    ``dist-packages`` folder, else below the longest of ``lib_roots``, else as it is."""
    parts = Path(path).parts
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] in _LIBRARY_DIRS:
            return "/".join(parts[i + 1:])
    return _relative(path, lib_roots) or Path(path).as_posix()


def _where(path: str, frame: Any) -> str:
    return f"{path}:{frame.lineno} ({frame.name})"


def sync_site(frames: Sequence[Any], repo_roots: Sequence[str],
              lib_roots: Sequence[str] = ()) -> Tuple[str, Optional[str]]:
    """Where a synchronising call was made: ``(site, via)`` from the Python stack at the call.

    ``frames`` is that stack, outermost first (as :func:`traceback.extract_stack` returns it),
    of objects with ``filename``, ``lineno`` and ``name`` (``traceback.FrameSummary``).
    ``site`` is the innermost frame inside ``repo_roots`` (this checkout's ``python/`` and
    ``sgl-kernel/python/``), as ``path/below/its/root.py:LINE (function)``: the line to change.
    ``via`` is the innermost frame of all when that lies outside ``repo_roots`` (the library
    code that synchronised, e.g. ``fla/ops/utils/index.py:164 (prepare_chunk_indices)``: its
    path below ``site-packages``, else below the longest of ``lib_roots``), else None. A stack
    with no repository frame is attributed to its innermost frame (``via`` None); an empty one
    to ``"<unknown>"``.
    """
    if not frames:
        return "<unknown>", None
    innermost = frames[-1]
    for depth, frame in enumerate(reversed(frames)):
        rel = _relative(_norm(frame.filename), repo_roots)
        if rel is not None:
            via = None if depth == 0 else _where(_library_path(_norm(innermost.filename),
                                                               lib_roots), innermost)
            return _where(rel, frame), via
    return _where(_library_path(_norm(innermost.filename), lib_roots), innermost), None


def count_sync_sites(records: Iterable[Tuple[str, Optional[str]]]) -> List[Dict[str, Any]]:
    """``[{"site", "via", "count"}, ...]``: one entry per distinct ``(site, via)`` record, most
    counted first (ties by site, then via, so that runs compare line by line)."""
    counts = Counter(records)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0][0], kv[0][1] or ""))
    return [{"site": site, "via": via, "count": n} for (site, via), n in ranked]


def repo_roots() -> List[str]:
    """This checkout's ``python/`` and ``sgl-kernel/python/`` trees, as found from this file and
    with links resolved (a frame names its file by the ``sys.path`` entry it was imported
    through, which may be either)."""
    here = Path(os.path.abspath(__file__)).parents[2]
    roots: List[str] = []
    for base in (here, here.resolve()):
        for tree in (base / "python", base / "sgl-kernel" / "python"):
            if str(tree) not in roots:
                roots.append(str(tree))
    return roots


def library_roots() -> List[str]:
    """The ``sys.path`` entries as absolute paths: the import roots a library file outside
    ``site-packages`` is named below."""
    return [os.path.abspath(p or os.curdir) for p in sys.path]


def _stack_at_warning(filename: str, lineno: int) -> List[traceback.FrameSummary]:
    """From inside a ``showwarning`` hook: the Python stack of the code the warning being shown
    was raised in, outermost first. A warning from C++ (``TORCH_WARN``) names the innermost
    Python frame, so the stack is cut after the innermost frame at ``filename:lineno``, dropping
    the warnings module and the hook; without such a frame, after the last frame that is
    neither."""
    walked = traceback.StackSummary.extract(traceback.walk_stack(sys._getframe(1)),
                                            lookup_lines=False)
    stack = list(reversed(walked))
    for i in range(len(stack) - 1, -1, -1):
        if stack[i].filename == filename and stack[i].lineno == lineno:
            return stack[:i + 1]
    machinery = {_norm(__file__), _norm(warnings.__file__)}
    while stack and _norm(stack[-1].filename) in machinery:
        stack.pop()
    return stack


@contextlib.contextmanager
def recording_syncs(roots: Sequence[str], lib_roots: Sequence[str] = ()
                    ) -> Iterator[List[Tuple[str, Optional[str]]]]:
    """Within the block, every warning whose message says a synchronizing CUDA operation was
    called appends its :func:`sync_site` to the yielded list; every time (the "always"
    filter: a site in a layer syncs once per layer, the default filter would show it once).
    Other warnings go to the handler in place before, each once."""
    records: List[Tuple[str, Optional[str]]] = []
    shown = set()
    with warnings.catch_warnings():  # restores the filters and showwarning on exit
        warnings.simplefilter("always")
        previous = warnings.showwarning

        def hook(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                 line: Optional[str] = None) -> None:
            if SYNC_WARNING not in str(message):
                key = (str(message), category, filename, lineno)
                if key not in shown:
                    shown.add(key)
                    previous(message, category, filename, lineno, file, line)
                return
            records.append(sync_site(_stack_at_warning(filename, lineno), roots, lib_roots))

        warnings.showwarning = hook
        yield records




# The aten ops that only move or fill memory (a layout or dtype change, a concatenation, a
# gather, a fill): what a prefill can drop by writing its tensors where they are read.
COPY_OPS = frozenset({"copy_", "clone", "_to_copy", "cat", "stack", "fill_", "zero_",
                      "index_select", "index_copy_", "index_put_", "masked_fill_", "zeros_like",
                      "new_zeros"})


def _bytes_written(func_name: str, args: Sequence[Any], out: Any) -> int:
    """Bytes an op of :data:`COPY_OPS` wrote: its outputs' (an in-place op's: the tensor it
    wrote into, its first argument)."""
    import torch

    if func_name.endswith("_") and args and isinstance(args[0], torch.Tensor):
        out = args[0]
    tensors = out if isinstance(out, (list, tuple)) else [out]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


# Frames of torch's mode machinery between an op's caller and a dispatch mode's handler.
_DISPATCH_FRAMES = (os.sep.join(("torch", "_dynamo", "")), os.sep.join(("torch", "_compile.py")),
                    os.sep.join(("torch", "utils", "_python_dispatch.py")))


def _is_dispatch_machinery(filename: str) -> bool:
    path = _norm(filename)
    return path == _norm(__file__) or any(part in path for part in _DISPATCH_FRAMES)


@contextlib.contextmanager
def recording_copies(roots: Sequence[str], lib_roots: Sequence[str] = (), min_bytes: int = 1
                     ) -> Iterator[List[Tuple[str, Optional[str], str, int]]]:
    """Within the block, every aten op of :data:`COPY_OPS` that writes at least ``min_bytes``
    appends ``(site, via, op, bytes)`` to the yielded list (:func:`sync_site` of the Python
    stack that called it), through a ``TorchDispatchMode``: torch ops only, so a Triton or
    library kernel launched directly is not seen, and ops are seen below autograd (``x.to()``
    is ``_to_copy``, ``x.contiguous()`` of a strided view is ``clone``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    records: List[Tuple[str, Optional[str], str, int]] = []

    class _Copies(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (),
                               kwargs: Optional[Dict[str, Any]] = None) -> Any:
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in COPY_OPS:
                written = _bytes_written(name, args, out)
                if written >= min_bytes:
                    stack = traceback.extract_stack(sys._getframe(1), limit=None)
                    while stack and _is_dispatch_machinery(stack[-1].filename):
                        stack.pop()  # the caller of the op is what is named
                    records.append((*sync_site(stack, roots, lib_roots), name, written))
            return out

    with _Copies():
        yield records


def count_copy_sites(records: Iterable[Tuple[str, Optional[str], str, int]]
                     ) -> List[Dict[str, Any]]:
    """``[{"site", "via", "op", "count", "mb"}, ...]``: one entry per distinct ``(site, via,
    op)``, most bytes first (ties by site, via, op), ``mb`` the MiB written there in all."""
    counts: Counter = Counter()
    written: Counter = Counter()
    for site, via, op, nbytes in records:
        counts[(site, via, op)] += 1
        written[(site, via, op)] += nbytes
    ranked = sorted(counts, key=lambda k: (-written[k], k[0], k[1] or "", k[2]))
    return [{"site": site, "via": via, "op": op, "count": counts[(site, via, op)],
             "mb": written[(site, via, op)] / 2**20} for site, via, op in ranked]


# ============================================================================================
# cProfile
# ============================================================================================
def function_label(key: Tuple[str, int, str], roots: Sequence[str],
                   lib_roots: Sequence[str] = ()) -> str:
    """A cProfile function key ``(filename, line, name)`` as ``path:LINE (name)``: the path
    below this checkout's ``python/`` trees, else as an import path (:func:`_library_path`);
    built-ins (``~``) by their name alone."""
    filename, lineno, name = key
    if filename == "~" or filename.startswith("<"):
        return name
    path = _norm(filename)
    rel = _relative(path, roots)
    return f"{rel if rel is not None else _library_path(path, lib_roots)}:{lineno} ({name})"


def rank_host_functions(stats: Dict[Tuple[str, int, str], Tuple[int, int, float, float, Any]],
                        roots: Sequence[str], lib_roots: Sequence[str], top: int
                        ) -> Dict[str, List[Dict[str, Any]]]:
    """From ``pstats.Stats(...).stats`` (key -> ``(primitive calls, calls, tottime, cumtime,
    callers)``, seconds): ``{"by_self": [...], "by_cumulative": [...], "by_package": [...]}``,
    the first two the ``top`` functions as ``{"function", "calls", "self_ms",
    "cumulative_ms"}``, the last :func:`host_time_by_package` of every function. ``by_self`` ranks every
    function by its own time (where the host's time goes: a launcher, a guard, a copy);
    ``by_cumulative`` only this repository's functions by their time with callees (the code to
    change), leaving out the chain of calls around the whole prefill (those over 90% of the
    outermost call's time: they say nothing the total does not). Ties by label, so runs
    compare line by line."""
    rows = [{"function": function_label(key, roots, lib_roots), "calls": calls,
             "self_ms": tottime * 1e3, "cumulative_ms": cumtime * 1e3,
             "repo": _relative(_norm(key[0]), roots) is not None}
            for key, (_, calls, tottime, cumtime, _) in stats.items()]
    by_self = sorted(rows, key=lambda r: (-r["self_ms"], r["function"]))[:top]
    repo = [r for r in rows if r["repo"]]
    outermost = max((r["cumulative_ms"] for r in repo), default=0.0)
    by_cum = sorted((r for r in repo if r["cumulative_ms"] < 0.9 * outermost),
                    key=lambda r: (-r["cumulative_ms"], r["function"]))[:top]
    strip = lambda rs: [{k: v for k, v in r.items() if k != "repo"} for r in rs]  # noqa: E731
    return {"by_self": strip(by_self), "by_cumulative": strip(by_cum),
            "by_package": host_time_by_package(rows)}


def package_of(label: str) -> str:
    """The area a :func:`function_label` belongs to: the first folder of its path (``triton``,
    ``fla``, ``torch``, ``sglang``, ``sgl_kernel``, ...; a file at the top: its name), a
    built-in that names torch ``torch (C++)``, any other built-in ``python built-ins``."""
    if label.startswith("<"):
        return "torch (C++)" if "torch" in label else "python built-ins"
    path = label.split(":", 1)[0]
    return path.split("/", 1)[0]


def host_time_by_package(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Own time summed per :func:`package_of` area, most first, as ``{"package", "self_ms",
    "share"}``: own times add up to the profiled call, so the shares split it without
    overlap."""
    sums: Counter = Counter()
    for r in rows:
        sums[package_of(r["function"])] += r["self_ms"]
    total = sum(sums.values()) or 1.0
    return [{"package": name, "self_ms": ms, "share": ms / total}
            for name, ms in sorted(sums.items(), key=lambda kv: (-kv[1], kv[0]))]




# ============================================================================================
# Tables
# ============================================================================================
def sync_table(result: Dict[str, Any]) -> str:
    """The markdown table ``| syncs | site | via |`` of a result with ``sync_sites``, most
    first, with a total row."""
    lines = ["| syncs | site | via |", "|---|---|---|"]
    for row in result["sync_sites"]:
        lines.append(f"| {row['count']} | {row['site']} | {row['via'] or ''} |")
    lines.append(f"| **{result['syncs']}** | **total** ({len(result['sync_sites'])} sites) | |")
    return "\n".join(lines)


def copy_table(result: Dict[str, Any]) -> str:
    """The markdown table ``| MiB | ops | op | site | via |`` of a result with ``copy_sites``,
    most bytes first, with a total row."""
    lines = ["| MiB | ops | op | site | via |", "|---|---|---|---|---|"]
    for row in result["copy_sites"]:
        lines.append(f"| {row['mb']:.1f} | {row['count']} | {row['op']} | {row['site']} | "
                     f"{row['via'] or ''} |")
    total = sum(row["mb"] for row in result["copy_sites"])
    lines.append(f"| **{total:.1f}** | **{sum(r['count'] for r in result['copy_sites'])}** | "
                 f"| **total** ({len(result['copy_sites'])} sites) | |")
    return "\n".join(lines)


def host_tables(result: Dict[str, Any]) -> str:
    """The host census of a result with ``host_profile``: its times, then the tables
    ``| self ms | cumulative ms | calls | function |`` by own time and (this repository's
    functions) by time with callees."""
    lines = [f"host: the prefill call returned after {result['host_return_ms']:.2f} ms, the "
             f"device was done after {result['host_wall_ms']:.2f} ms; under cProfile "
             f"{result['host_profile_ms']:.2f} ms",
             "", "host time by package (own time, cProfile):", "",
             "| package | self ms | share |", "|---|---|---|"]
    lines += [f"| {r['package']} | {r['self_ms']:.2f} | {r['share']:.1%} |"
              for r in result["host_profile"].get("by_package", [])]
    for key, title in (("by_self", "by own time"),
                       ("by_cumulative", "this repository's functions, by time with callees")):
        lines += ["", f"host functions {title} (cProfile):", "",
                  "| self ms | cumulative ms | calls | function |", "|---|---|---|---|"]
        lines += [f"| {r['self_ms']:.2f} | {r['cumulative_ms']:.2f} | {r['calls']} | "
                  f"{r['function']} |" for r in result["host_profile"][key]]
    return "\n".join(lines)


