"""Build a model on its target device and fill it from a safetensors checkpoint (or dummy values).

Loading is split in two passes so that a bad checkpoint fails fast and completely:

1. **Index**: open every file of the checkpoint (one ``model.safetensors`` or the shards named by
   ``model.safetensors.index.json``), read only the headers, canonicalise the names through
   ``model.canonical_checkpoint_name`` and compare against ``model.checkpoint_spec()``. Every
   missing, unexpected, duplicated and mis-shaped tensor is reported in one
   :class:`CheckpointError`.
2. **Load**: hand ``(canonical_name, LazyWeight)`` pairs to ``model.load_weights``; each parameter's
   weight loader narrows the lazy tensor to its TP rank's slice, so only that slice is read.

Quantisation (``--quantization``, see ``layers/quantization``): the model is built inside a
quantization scope, so its layers create (and load) block-fp8 weights when asked. In an fp8
checkpoint, an fp8 tensor whose ``weight_scale_inv`` the model does not take (a tensor kept in
the model dtype, e.g. MLA's ``kv_b_proj``, split into ``w_kc`` / ``w_vc``, or every tensor of an
unquantized draft) is dequantised as it loads.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from sglang.srt.configs.engine_defaults import LOAD_FORMAT_CHOICES
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.quantization import quantization_scope, resolve_quant_config
from sglang.srt.layers.quantization.fp8_utils import dequantize_block_fp8
from sglang.srt.model_loader.dummy import init_dummy_weights
from sglang.srt.model_loader.weight_utils import LazyWeight, same_up_to_unit_dims

logger = logging.getLogger(__name__)

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
LOAD_FORMATS = LOAD_FORMAT_CHOICES


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: the message lists every problem by name."""


# ---------------------------------------------------------------------------------------------
# Finding and indexing the files
# ---------------------------------------------------------------------------------------------
def find_safetensors_files(model_path: str) -> List[str]:
    """The checkpoint's safetensors files, in load order.

    Preference: the index's shard set, else ``model.safetensors``, else every ``*.safetensors``
    in the folder. A shard named by the index but absent on disk is an error naming the file.
    """
    if not os.path.isdir(model_path):
        raise CheckpointError(f"checkpoint folder {model_path!r} does not exist")
    index_path = os.path.join(model_path, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.exists(index_path):
        weight_map = _read_index(index_path)
        shards = sorted(set(weight_map.values()))
        missing = [f for f in shards if not os.path.isfile(os.path.join(model_path, f))]
        if missing:
            counts = {f: sum(1 for v in weight_map.values() if v == f) for f in missing}
            listed = ", ".join(f"{f} ({counts[f]} tensors)" for f in missing)
            raise CheckpointError(
                f"{SAFE_WEIGHTS_INDEX_NAME} in {model_path} names shard file(s) that do not "
                f"exist: {listed}"
            )
        return [os.path.join(model_path, f) for f in shards]
    single = os.path.join(model_path, SAFE_WEIGHTS_NAME)
    if os.path.isfile(single):
        return [single]
    found = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
    if not found:
        raise CheckpointError(
            f"no safetensors weights in {model_path} (expected {SAFE_WEIGHTS_NAME} or "
            f"{SAFE_WEIGHTS_INDEX_NAME}); use --load-format dummy to run without weights"
        )
    return [os.path.join(model_path, f) for f in found]


def _read_index(index_path: str) -> Dict[str, str]:
    try:
        with open(index_path) as f:
            weight_map = json.load(f).get("weight_map")
    except (json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"{index_path} is not a valid safetensors index: {e}") from e
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path} has no 'weight_map' object")
    return weight_map


@dataclass
class _Entry:
    """One checkpoint tensor: where it lives and its header shape."""

    name: str  # name as stored in the file
    file: str
    shape: Tuple[int, ...]
    weight: LazyWeight


class SafetensorsCheckpoint(contextlib.AbstractContextManager):
    """Open safetensors files of one checkpoint; tensors are exposed as :class:`LazyWeight`.

    Only headers are read on construction. Close it (or use ``with``) to release the mmaps.
    """

    def __init__(self, model_path: str):
        from safetensors import safe_open

        self.model_path = model_path
        self.files = find_safetensors_files(model_path)
        self._stack = contextlib.ExitStack()
        self.entries: List[_Entry] = []
        problems: List[str] = []
        seen: Dict[str, str] = {}
        try:
            for path in self.files:
                handle = self._stack.enter_context(safe_open(path, framework="pt", device="cpu"))
                fname = os.path.basename(path)
                for name in handle.keys():
                    if name in seen:
                        problems.append(
                            f"tensor {name} is stored twice: in {seen[name]} and {fname}")
                        continue
                    seen[name] = fname
                    weight = LazyWeight.from_safetensors_slice(name, handle.get_slice(name))
                    self.entries.append(_Entry(name, fname, weight.shape, weight))
            problems += self._index_problems(seen)
        except Exception:
            self._stack.close()
            raise
        if problems:
            self._stack.close()
            raise CheckpointError(_format_problems(model_path, problems))

    def _index_problems(self, seen: Dict[str, str]) -> List[str]:
        """Tensors the index places in a shard that does not actually contain them."""
        index_path = os.path.join(self.model_path, SAFE_WEIGHTS_INDEX_NAME)
        if not os.path.exists(index_path):
            return []
        out = []
        for name, fname in sorted(_read_index(index_path).items()):
            if seen.get(name) != fname:
                where = f"it is in {seen[name]}" if name in seen else "no shard contains it"
                out.append(f"index maps tensor {name} to {fname} but {where}")
        return out

    def close(self) -> None:
        """Release the file handles."""
        self._stack.close()

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# Validation against the model
# ---------------------------------------------------------------------------------------------
def _format_problems(model_path: str, problems: List[str]) -> str:
    lines = "\n  ".join(problems)
    return (f"checkpoint {model_path} does not match the model "
            f"({len(problems)} problem(s)):\n  {lines}")


def _shape(s) -> str:
    return "[" + ", ".join(str(int(x)) for x in s) + "]"


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_SCALE_SUFFIX = "_scale_inv"


def _dequantizing(weight: LazyWeight, scale: LazyWeight) -> LazyWeight:
    """``weight`` (block fp8) seen as fp32: dequantised whole with ``scale`` when first read
    (only small tensors the model keeps unquantized come here), then sliced."""

    def slicer(spec):
        full = dequantize_block_fp8(weight.load(), scale.load(), torch.float32)
        return full if spec is None else full.narrow(*spec)

    return LazyWeight(weight.name, weight.shape, torch.float32, slicer)


def _resolve_fp8_tensors(by_canon: Dict[str, "_Entry"], spec: Dict[str, Tuple[int, ...]],
                         checkpoint_quantized: bool, problems: List[str]) -> None:
    """Dequantise fp8 tensors whose scale the model does not take; report fp8 tensors of a
    checkpoint whose config declares no quantization."""
    for canon in [c for c in by_canon if c.endswith(_SCALE_SUFFIX) and c not in spec]:
        wname = canon[: -len(_SCALE_SUFFIX)]
        entry = by_canon.get(wname)
        if entry is None or wname not in spec or entry.weight.dtype not in _FP8_DTYPES:
            continue  # reported as unexpected below
        if checkpoint_quantized:
            entry.weight = _dequantizing(entry.weight, by_canon.pop(canon).weight)
    if checkpoint_quantized:
        return
    for canon, e in by_canon.items():
        if e.weight.dtype in _FP8_DTYPES:
            problems.append(f"fp8 tensor without quantization_config: {e.name} is stored as "
                            f"{e.weight.dtype} in {e.file} but config.json declares no "
                            "quantization_config")


def match_checkpoint(
    model: nn.Module, checkpoint: SafetensorsCheckpoint, checkpoint_quantized: bool = False,
) -> List[Tuple[str, LazyWeight]]:
    """Canonicalise names and check them against ``model.checkpoint_spec()``.

    Returns ``(canonical_name, weight)`` in file order, each weight viewed with the spec's shape.
    Raises :class:`CheckpointError` listing every missing, unexpected, duplicated (two names
    that are aliases of one tensor) and mis-shaped tensor, and (unless ``checkpoint_quantized``:
    its config has a ``quantization_config``) every fp8 tensor.
    """
    spec = {k: tuple(int(x) for x in v) for k, v in model.checkpoint_spec().items()}
    problems: List[str] = []
    by_canon: Dict[str, _Entry] = {}
    for e in checkpoint.entries:
        canon = model.canonical_checkpoint_name(e.name)
        if canon is None:
            continue  # the model deliberately ignores this tensor
        if canon in by_canon:
            problems.append(
                f"duplicate tensor: {e.name} ({e.file}) and {by_canon[canon].name} "
                f"({by_canon[canon].file}) are both {canon}"
            )
            continue
        by_canon[canon] = e
    _resolve_fp8_tensors(by_canon, spec, checkpoint_quantized, problems)
    for canon in spec:
        if canon not in by_canon:
            problems.append(f"missing tensor: {canon} (expected shape {_shape(spec[canon])})")
    for canon, e in by_canon.items():
        alias = "" if e.name == canon else f" (stored as {e.name})"
        if canon not in spec:
            problems.append(
                f"unexpected tensor: {canon}{alias} shape {_shape(e.shape)} in {e.file}")
        elif e.shape != spec[canon] and not same_up_to_unit_dims(e.shape, spec[canon]):
            problems.append(
                f"shape mismatch: {canon}{alias} expected {_shape(spec[canon])}, "
                f"found {_shape(e.shape)} in {e.file}"
            )
    if problems:
        raise CheckpointError(_format_problems(checkpoint.model_path, problems))
    return [(canon, e.weight.reshape_to(spec[canon])) for canon, e in by_canon.items()]


def load_safetensors_weights(model: nn.Module, model_path: str,
                             checkpoint_quantized: bool = False) -> int:
    """Validate the checkpoint in ``model_path`` against ``model``, then load it
    (``checkpoint_quantized``: its config.json has a ``quantization_config``).

    Returns the number of bytes actually read from the files (less than the checkpoint's size
    under TP, since each rank reads only its slices).
    """
    with SafetensorsCheckpoint(model_path) as ckpt:
        weights = match_checkpoint(model, ckpt, checkpoint_quantized)
        start = time.perf_counter()
        # An iterator, so a model may stream: nothing is read until its loader narrows/loads.
        loaded = model.load_weights(iter(weights))
        if isinstance(loaded, (set, frozenset)):  # models that report what they consumed
            skipped = sorted({name for name, _ in weights} - loaded)
            if skipped:
                raise CheckpointError(
                    f"model.load_weights skipped {len(skipped)} tensor(s) it declared in "
                    f"checkpoint_spec: {', '.join(skipped)}")
        read = sum(w.bytes_read for _, w in weights)
        logger.info(
            "loaded %d tensors from %d file(s) of %s: %.2f GB read in %.1f s",
            len(weights), len(ckpt.files), model_path, read / 1e9, time.perf_counter() - start,
        )
    return read


# ---------------------------------------------------------------------------------------------
# Building the model
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(model_config: ModelConfig, *, dtype: torch.dtype, device,
                is_draft: bool = False, quantization: Optional[str] = None) -> nn.Module:
    """Construct the (uninitialised) model directly on ``device`` in ``dtype``.

    Parameters are allocated on the target device by the ``torch.device`` context, so a
    real-size model is never staged in host memory first. ``quantization`` (``--quantization``,
    or the draft's ``--speculative-draft-model-quantization``) is resolved against the
    checkpoint's ``quantization_config``; the result is kept as ``model.quant_config``.
    """
    from sglang.srt.models.registry import get_model_class

    arch = model_config.hf_config.architectures[0]
    model_cls = get_model_class(arch, is_draft)
    if not dtype.is_floating_point:
        raise ValueError(f"model dtype must be a floating-point dtype, got {dtype}")
    flag = "--speculative-draft-model-quantization" if is_draft else "--quantization"
    quant_config = resolve_quant_config(quantization, model_config.quantization_config, flag)
    with torch.device(device), _default_dtype(dtype), quantization_scope(quant_config):
        model = model_cls(model_config.hf_config, dtype=dtype)
    model.quant_config = quant_config
    return model


def model_weight_bytes(model_config: ModelConfig, *, dtype: torch.dtype,
                       is_draft: bool = False, quantization: Optional[str] = None) -> int:
    """Bytes of parameters and buffers one TP rank of the model would hold, from building it on
    the meta device (no memory, no weights read): fp8 weights count one byte per element plus
    their fp32 block scales. A NEXTN draft counts only its own layers: it borrows the target's
    embedding and LM head."""
    model = build_model(model_config, dtype=dtype, device="meta", is_draft=is_draft,
                        quantization=quantization)
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def get_model(
    model_config: ModelConfig,
    *,
    load_format: str = "auto",
    dtype: torch.dtype,
    device,
    is_draft: bool = False,
    seed: int = 0,
    quantization: Optional[str] = None,
) -> nn.Module:
    """Build the target (or NEXTN draft, ``is_draft``) model and fill its weights.

    ``load_format``: ``"auto"``/``"safetensors"`` read the checkpoint folder
    ``model_config.model_path``; ``"dummy"`` fills deterministic random values from ``seed``
    (the only choice for presets, which have no files). ``quantization``: see
    :func:`build_model` (fp8 of a bf16 checkpoint or of dummy weights quantises as it loads).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"unknown load_format {load_format!r}; choose one of {', '.join(LOAD_FORMATS)}")
    if model_config.is_preset and load_format != "dummy":
        raise ValueError(
            f"--model-path {model_config.model_path!r} is a preset (a config without weights): "
            "pass --load-format dummy, or point --model-path at a checkpoint folder"
        )
    if load_format != "dummy":
        # Fail on a missing/broken file set before spending time building a large model.
        find_safetensors_files(model_config.model_path)
    model = build_model(model_config, dtype=dtype, device=device, is_draft=is_draft,
                        quantization=quantization)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        load_safetensors_weights(model, model_config.model_path,
                                 model_config.quantization_config is not None)
    return model.eval()
