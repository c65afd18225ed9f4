"""Value checks shared by the server arguments and each speculative algorithm's flags: each
raises ``ValueError`` whose message starts with the flag, as ``ServerArgs.check`` promises."""
from __future__ import annotations

from typing import Any, Sequence

__all__ = ["is_int", "is_number", "int_at_least", "one_of"]


def is_int(value: Any) -> bool:
    """An int that is not a bool (``True`` is no batch size)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or a float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def int_at_least(flag: str, value: Any, low: int) -> None:
    """``value`` is an integer ``>= low``."""
    if not is_int(value) or value < low:
        raise ValueError(f"{flag} must be an integer >= {low}, got {value!r}")


def one_of(flag: str, value: Any, choices: Sequence[str]) -> None:
    """``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{flag} must be one of {', '.join(choices)}; got {value!r}")
