"""Small helpers shared by the manager processes: tokenizer loading, EOS ids, process hygiene."""
from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path
from typing import Any, List, Optional, Set

logger = logging.getLogger(__name__)

# Any of these in a folder means "there is a tokenizer here".
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def resolve_tokenizer_path(server_args: Any) -> Optional[str]:
    """The folder to load the tokenizer from, or ``None`` when the model has no tokenizer.

    ``--tokenizer-path`` wins over ``--model-path``; a preset name or a checkpoint folder without
    tokenizer files (random / dummy checkpoints) has none, and then the engine works on
    ``input_ids`` only. ``--skip-tokenizer-init`` forces ``None``.
    """
    if getattr(server_args, "skip_tokenizer_init", False):
        return None
    path = getattr(server_args, "tokenizer_path", None) or getattr(server_args, "model_path", None)
    if path is None:
        from sglang.srt.configs.model_config import resolve_model_path

        path = resolve_model_path(None)
    if not os.path.isdir(path):
        return None
    if not any((Path(path) / f).exists() for f in _TOKENIZER_FILES):
        return None
    return str(path)


# tokenizer_config.json classes that name transformers' fast tokenizer over tokenizer.json.
# Such a folder is loaded by that class directly: AutoTokenizer would resolve the same class
# after importing its mapping of every model transformers knows, about 0.4 s of every process
# that loads a tokenizer (a server's tokenizer manager, scheduler and detokenizer).
_FAST_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def names_fast_tokenizer(path: str) -> bool:
    """Whether the tokenizer folder ``path`` holds a ``tokenizer.json`` and a
    ``tokenizer_config.json`` whose ``tokenizer_class`` is transformers' fast tokenizer itself
    (no ``auto_map`` to remote code): then :func:`load_tokenizer` loads that class directly."""
    config = Path(path) / "tokenizer_config.json"
    if not (Path(path) / "tokenizer.json").is_file() or not config.is_file():
        return False
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return False  # AutoTokenizer reports what is wrong with it
    return (isinstance(data, dict) and data.get("tokenizer_class") in _FAST_TOKENIZER_CLASSES
            and "auto_map" not in data)


def load_tokenizer(server_args: Any):
    """A ``transformers`` tokenizer for the model, or ``None`` when there is none (see above)."""
    path = resolve_tokenizer_path(server_args)
    if path is None:
        return None
    from transformers import PreTrainedTokenizerFast

    if names_fast_tokenizer(path):
        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as e:  # e.g. model_type unknown to transformers and no tokenizer_class
        tok_file = Path(path) / "tokenizer.json"
        if not tok_file.exists():
            raise RuntimeError(f"cannot load the tokenizer from {path!r}: {e}") from e
        logger.info("AutoTokenizer failed (%s); loading %s directly", e, tok_file)
        return PreTrainedTokenizerFast(tokenizer_file=str(tok_file))


def _as_id_list(value: Any) -> List[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if v is not None]
    return [int(value)]


def get_eos_token_ids(model_config: Any, tokenizer: Any = None) -> Set[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer (their union)."""
    ids: Set[int] = set(model_config.hf_config.eos_token_ids)
    gen_cfg = Path(model_config.model_path) / "generation_config.json"
    if gen_cfg.is_file():
        try:
            ids.update(_as_id_list(json.loads(gen_cfg.read_text()).get("eos_token_id")))
        except (json.JSONDecodeError, ValueError, TypeError) as e:
            logger.warning("ignoring unreadable %s: %s", gen_cfg, e)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def exit_if_parent_died(parent_pid: int) -> None:
    """Child processes call this when idle: an orphan (parent gone) exits instead of lingering."""
    if os.getppid() != parent_pid:
        logger.warning("parent process %d is gone; exiting", parent_pid)
        os._exit(0)


def set_parent_death_signal() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (best effort, no-op elsewhere)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def configure_child_logging(server_args: Any, prefix: str) -> None:
    """Log format for a child process (the level comes from ``--log-level``)."""
    level = str(getattr(server_args, "log_level", "info") or "info").upper()
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        format=f"[%(asctime)s {prefix}] %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
