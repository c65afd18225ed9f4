"""``--speculative-algorithm`` name -> the algorithm's worker and flags.

The generic layers (server arguments, CLI, scheduler) reach an algorithm only through this
module; no algorithm is the plain :class:`~sglang.srt.rounds.plain.TpModelWorker`. An entry
names two import paths, so that ``--help`` and a server without speculation import no worker:

* ``worker`` — ``"module:Class"``, a :class:`~sglang.srt.rounds.contract.BaseSpecWorker`;
* ``args`` — a light module (no torch at import) with the algorithm's own flags:

  - ``ARGS``: a dataclass whose fields (all defaulting to ``None``: "not given") join
    :class:`~sglang.srt.server_args.ServerArgs`;
  - ``add_args(group, defaults, add_flag)``: registers them on the CLI's argument group
    (``add_flag`` is the CLI's own helper, which takes a ``words`` description of a default);
  - ``resolve_args(server_args)``: fills the algorithm's defaults when it is the one chosen;
  - ``check_args(server_args)``: raises ``ValueError`` starting with the offending flag.

A flag of one algorithm given with another (or with none) is refused here, by name. A new
algorithm is a folder under ``rounds/`` plus one :func:`register_algorithm` call.
"""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Type

if TYPE_CHECKING:
    from sglang.srt.rounds.contract import BaseSpecWorker

__all__ = ["Algorithm", "ALGORITHMS", "register_algorithm", "algorithm_names", "canonical_name",
           "describe_algorithms", "get_spec_worker_class", "arg_classes", "add_algorithm_flags",
           "resolve_algorithm_args", "check_algorithm_args", "check_foreign_flags"]


@dataclass(frozen=True)
class Algorithm:
    """One speculative algorithm: its name, its worker and its flags (import paths)."""

    name: str  # the --speculative-algorithm value, upper case
    worker: str  # "module:Class" of its BaseSpecWorker
    args: Optional[str] = None  # module of its flags (ARGS, add_args, resolve_args, check_args)
    aliases: Tuple[str, ...] = ()  # other names that select it (upper case)


ALGORITHMS: Dict[str, Algorithm] = {}


def register_algorithm(algorithm: Algorithm) -> None:
    """Add ``algorithm`` (a test may register its own; a name is registered once)."""
    taken = {a for entry in ALGORITHMS.values() for a in (entry.name, *entry.aliases)}
    for name in (algorithm.name, *algorithm.aliases):
        if name != name.upper() or name in taken or name == "NONE":
            raise ValueError(f"speculative algorithm name {name!r} is taken or not upper case")
    ALGORITHMS[algorithm.name] = algorithm


register_algorithm(Algorithm("NEXTN", "sglang.srt.rounds.nextn.worker:NEXTNWorker",
                             "sglang.srt.rounds.nextn.args", aliases=("EAGLE",)))
register_algorithm(Algorithm("DSPARK", "sglang.srt.rounds.dspark.worker:DSparkWorker",
                             "sglang.srt.rounds.dspark.args"))


def algorithm_names() -> Tuple[str, ...]:
    """The registered names (aliases not included), in registration order."""
    return tuple(ALGORITHMS)


def describe_algorithms() -> str:
    """The registered names with their aliases, for messages and ``--help``."""
    parts = []
    for entry in ALGORITHMS.values():
        alias = f" (alias {', '.join(entry.aliases)})" if entry.aliases else ""
        parts.append(entry.name + alias)
    return ", ".join(parts)


def canonical_name(name: Optional[str]) -> Optional[str]:
    """The registered name ``name`` selects (case-insensitive, aliases resolved); ``None`` for
    no speculation (``None``, ``""``, ``"none"``); an unknown name is returned upper-cased, for
    :func:`check_algorithm_args` to refuse with the list of known ones."""
    if name is None:
        return None
    key = name.strip().upper()
    if key in ("", "NONE"):
        return None
    for entry in ALGORITHMS.values():
        if key in entry.aliases:
            return entry.name
    return key


def _entry(name: Optional[str]) -> Optional[Algorithm]:
    key = canonical_name(name)
    if key is None:
        return None
    entry = ALGORITHMS.get(key)
    if entry is None:
        raise ValueError(f"--speculative-algorithm {name!r} is not supported; supported: "
                         f"{describe_algorithms()}")
    return entry


def _args_module(entry: Algorithm) -> Optional[ModuleType]:
    return None if entry.args is None else importlib.import_module(entry.args)


def get_spec_worker_class(algorithm: Optional[str]) -> Optional[Type["BaseSpecWorker"]]:
    """The worker class of ``algorithm`` (``None`` / ``"NONE"``: no speculation, ``None``).
    Raises ``ValueError`` for an unknown name."""
    entry = _entry(algorithm)
    if entry is None:
        return None
    module, _, name = entry.worker.partition(":")
    return getattr(importlib.import_module(module), name)


def arg_classes() -> Tuple[type, ...]:
    """Every algorithm's ``ARGS`` dataclass (the fields they add to ``ServerArgs``)."""
    out = []
    for entry in ALGORITHMS.values():
        module = _args_module(entry)
        if module is not None:
            out.append(module.ARGS)
    return tuple(out)


def _owned_flags() -> List[Tuple[str, str, str]]:
    """(algorithm, field, flag) for every algorithm-owned field."""
    out = []
    for entry in ALGORITHMS.values():
        module = _args_module(entry)
        if module is not None:
            for f in dataclasses.fields(module.ARGS):
                out.append((entry.name, f.name, "--" + f.name.replace("_", "-")))
    return out


def add_algorithm_flags(group: Any, defaults: Dict[str, Any],
                        add_flag: Callable[..., Any]) -> None:
    """Each algorithm's ``add_args`` on the CLI's speculative-decoding group."""
    for entry in ALGORITHMS.values():
        module = _args_module(entry)
        if module is not None:
            module.add_args(group, defaults, add_flag)


def resolve_algorithm_args(server_args: Any) -> None:
    """The chosen algorithm's ``resolve_args`` (nothing without speculation or for an unknown
    name, which :func:`check_algorithm_args` refuses)."""
    entry = ALGORITHMS.get(canonical_name(server_args.speculative_algorithm) or "")
    module = None if entry is None else _args_module(entry)
    if module is not None:
        module.resolve_args(server_args)


def check_foreign_flags(algorithm: Optional[str], server_args: Any) -> None:
    """``ValueError`` naming an algorithm's flag that was given while ``algorithm`` (a
    registered name, or None for no speculation) runs."""
    for owner, field, flag in _owned_flags():
        if owner == algorithm or getattr(server_args, field, None) is None:
            continue
        if algorithm is None:
            raise ValueError(f"{flag} needs --speculative-algorithm ({describe_algorithms()})")
        raise ValueError(f"{flag} is {owner}-only (--speculative-algorithm {algorithm} does "
                         "not use it)")


def check_algorithm_args(server_args: Any) -> None:
    """Refuse an unknown algorithm, another algorithm's flags, and whatever the chosen one's
    ``check_args`` refuses; every message starts with the flag it is about."""
    entry = _entry(server_args.speculative_algorithm)
    name = None if entry is None else entry.name
    check_foreign_flags(name, server_args)
    module = None if entry is None else _args_module(entry)
    if module is not None:
        module.check_args(server_args)
