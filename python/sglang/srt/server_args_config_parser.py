"""``--config FILE.yaml``: server flags from a YAML file, overridden by the command line.

The file is a YAML mapping from flag names to values. A key may be written as on the command line
or as the field name: ``--tp-size``, ``tp-size`` and ``tp_size`` are the same flag (aliases such
as ``model`` for ``--model-path`` work too). Values are YAML scalars of the flag's type; a flag
that takes several values takes a list; a switch (``--enable-metrics``) takes ``true`` or
``false``; ``json-model-override-args`` may also be a mapping (it is passed on as JSON)::

    model-path: ling-3.0-flash
    tp_size: 4
    --enable-metrics: true
    cuda-graph-bs: [1, 2, 4]
    json-model-override-args: {num_hidden_layers: 2}

The values become the parser's defaults, so any flag given on the command line wins over the
file. A missing or unreadable file, malformed YAML, a key that is no server flag and a value of the
wrong type or outside the flag's choices are errors naming the file and the key.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["ConfigArgumentMerger", "load_config_file"]

# The only parser destinations a file cannot set.
_NOT_FROM_FILE = ("help", "config", "version")
# Flags whose value is JSON text: a file may write it as a YAML mapping instead.
_JSON_FLAGS = ("json_model_override_args",)


def load_config_file(path: str) -> Dict[Any, Any]:
    """The mapping in the YAML file at ``path`` (empty for an empty file); ``ValueError``
    naming the file when it is missing, unreadable, not YAML or not a mapping."""
    if not os.path.isfile(path):
        raise ValueError(f"--config {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--config {path}: cannot read the file: {e}") from e
    import yaml  # here: only a launch with --config needs it

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: invalid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: the file must be a YAML mapping of flag names to "
                         f"values, not a {type(data).__name__}")
    return data


class ConfigArgumentMerger:
    """Turns a ``--config`` file into defaults of ``parser`` (see the module docstring)."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser
        # argparse has no public table of its options; this private one has been stable across
        # every Python 3 release. Long spellings only (aliases such as --model included).
        self._options: Dict[str, argparse.Action] = {
            opt: action for opt, action in parser._option_string_actions.items()
            if opt.startswith("--") and action.dest not in _NOT_FROM_FILE
        }

    def apply(self, argv: List[str]) -> Optional[str]:
        """If ``argv`` names a config file, load it and set its values as the parser's defaults;
        return the file's path (``None`` without ``--config``). ``ValueError`` on bad input."""
        path = self.config_path(argv)
        if path is None:
            return None
        defaults = self.defaults_from(path, load_config_file(path))
        self.parser.set_defaults(**defaults)
        return path

    @staticmethod
    def config_path(argv: List[str]) -> Optional[str]:
        """The ``--config`` value of ``argv`` (any spelling argparse accepts), or ``None``."""
        # No abbreviations, like the server's parser: "--conf" is not --config there either.
        pre = argparse.ArgumentParser(add_help=False, exit_on_error=False, allow_abbrev=False)
        pre.add_argument("--config", action="append", default=None)
        try:
            known, _ = pre.parse_known_args(argv)
        except argparse.ArgumentError:  # "--config" as the last word
            raise ValueError("--config needs the path of a YAML file") from None
        if not known.config:
            return None
        if len(known.config) > 1:
            raise ValueError(f"--config is given {len(known.config)} times; pass one file")
        return known.config[0]

    def defaults_from(self, path: str, data: Dict[Any, Any]) -> Dict[str, Any]:
        """``{dest: value}`` for the parser from the file's mapping, every value converted and
        checked against its flag."""
        out: Dict[str, Any] = {}
        seen: Dict[str, Any] = {}
        for key, value in data.items():
            flag, action = self._action_for(path, key)
            if action.dest in seen:
                raise ValueError(f"--config {path}: keys {seen[action.dest]!r} and {key!r} set "
                                 f"the same flag {flag}")
            seen[action.dest] = key
            try:
                out[action.dest] = _convert(flag, action, value)
            except ValueError as e:
                raise ValueError(f"--config {path}: key {key!r}: {e}") from None
        return out

    def _action_for(self, path: str, key: Any) -> Tuple[str, argparse.Action]:
        if not isinstance(key, str) or not key.strip("- "):
            raise ValueError(f"--config {path}: key {key!r} is not a flag name")
        flag = "--" + key.strip().lstrip("-").replace("_", "-")
        action = self._options.get(flag)
        if action is not None:
            return flag, action
        if flag in ("--config", "--help", "--version"):
            raise ValueError(f"--config {path}: {flag} cannot be set from a config file")
        close = difflib.get_close_matches(flag, list(self._options), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ValueError(f"--config {path}: unknown key {key!r}: no server flag {flag}{hint}")


def _convert(flag: str, action: argparse.Action, value: Any) -> Any:
    """The parsed value of ``flag`` from a YAML value; ``ValueError`` naming the flag."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ValueError(f"{flag} is a switch: use true or false, got {value!r}")
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if value is None:
        return None  # explicitly unset: the field's "not given"
    if action.nargs in ("+", "*"):
        items = value if isinstance(value, list) else [value]
        if action.nargs == "+" and not items:
            raise ValueError(f"{flag} needs at least one value")
        return [_scalar(flag, action, item) for item in items]
    return _scalar(flag, action, value)


def _scalar(flag: str, action: argparse.Action, value: Any) -> Any:
    kind = action.type or str
    if isinstance(value, dict) and action.dest in _JSON_FLAGS:
        value = json.dumps(value)
    if isinstance(value, (dict, list)):
        raise ValueError(f"{flag} takes a single value, got a {type(value).__name__}")
    if isinstance(value, bool):
        raise ValueError(f"{flag} takes a value, not a switch's true / false")
    # YAML already typed the value; accept only lossless conversions (2.5 is no integer).
    allowed = {int: (int, str), float: (int, float, str), str: (str, int, float)}.get(kind)
    if allowed is None or not isinstance(value, allowed):
        raise ValueError(f"{flag} must be {_type_name(kind)}, got {value!r}")
    try:
        out = kind(value)
    except ValueError:
        raise ValueError(f"{flag} must be {_type_name(kind)}, got {value!r}") from None
    if action.choices is not None and out not in action.choices:
        raise ValueError(f"{flag} must be one of {', '.join(map(str, action.choices))}; "
                         f"got {out!r}")
    return out


def _type_name(kind: Any) -> str:
    return {int: "an integer", float: "a number", str: "a string"}.get(kind, str(kind))
