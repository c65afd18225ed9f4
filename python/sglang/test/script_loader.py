"""Importing the repository's scripts (``benchmark/``, ``scripts/``: folders that are no
packages) in tests, by their path."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional, Union

__all__ = ["load_script"]


def load_script(path: Union[str, Path], name: Optional[str] = None) -> ModuleType:
    """The script at ``path`` imported as ``python path`` would run it (``__name__`` is not
    ``"__main__"``), under ``name`` (default: the file's stem). The module is registered in
    ``sys.modules`` before it executes: dataclasses look their module up while they are built."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
