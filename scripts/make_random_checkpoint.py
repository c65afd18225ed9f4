#!/usr/bin/env python3
"""Write a Ling-3.0 (``BailingMoeV3ForCausalLM``) checkpoint folder with random weights.

The folder has the published Hugging Face layout (docs/model.md §2): ``config.json``,
``model-0000i-of-0000N.safetensors`` shards with ``model.safetensors.index.json``, the MTP
layer under ``model.layers.<num_hidden_layers>.``, and tokenizer files, so that every step of
docs/serving_ling_flash.md can run with a real ``--model-path /some/folder`` on a machine that
cannot download the weights. Example (4 layers of the real width, block fp8, with the MTP layer)::

    python3 scripts/make_random_checkpoint.py /models/ling-flash-4l-fp8 \\
        --json-model-override-args '{"num_hidden_layers": 4}' --quantization fp8

The tensor list is not written down here: the engine's own model classes are built on the meta
device from the config and their ``weight_slots()`` (the table the loader checks a checkpoint
against) name every tensor, its shape and the parameter it fills. So a checkpoint made here
always matches what the loader of this tree expects.

Values follow the dummy loader (``sglang.srt.model_loader.dummy``): a matrix ``[out, in]`` is
``N(0, 1/in)``, norm weights are 1, other vectors 0, and parameters with their own
``dummy_init`` (``A_log``, ``dt_bias``, the router) use it, each seeded from ``--seed`` and the
tensor's name, so the values do not depend on the shard size. Tensors are generated one at a
time on ``--device`` and streamed into the shard being written: host memory stays at about one
tensor (the largest is the embedding or the LM head), not one shard or the whole checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The checkout's package first: the tensor list must be the one this tree's loader expects.
sys.path.insert(0, os.path.join(REPO_ROOT, "python"))

from sglang.srt.configs.bailing_moe_v3 import BailingMoeV3Config, ConfigError  # noqa: E402
from sglang.srt.configs.model_config import (  # noqa: E402
    BUNDLED_MODEL_DIR,
    PRESET_DIR,
    apply_overrides,
    list_presets,
    load_raw_config,
    parse_override_args,
)

INDEX_NAME = "model.safetensors.index.json"
# How published block-fp8 checkpoints describe themselves (Fp8Config.from_config reads it).
FP8_QUANTIZATION_CONFIG: Dict[str, Any] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
# Files that make up a Hugging Face tokenizer; whichever of them the source folder has is copied.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json")
DTYPE_NAMES = ("bfloat16", "float32")
# safetensors' dtype codes of the dtypes written here.
_SAFETENSORS_CODES = {"float32": "F32", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3"}
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float8_e4m3fn": 1}
SCALE_SUFFIX = "_scale_inv"


# ---------------------------------------------------------------------------------------------
# The tensor list
# ---------------------------------------------------------------------------------------------
@dataclass
class StoredTensor:
    """One tensor of the checkpoint: name, full shape and stored dtype (a torch dtype name)."""

    name: str
    shape: Tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data in the file."""
        n = _ITEMSIZE[self.dtype]
        for s in self.shape:
            n *= s
        return n


@dataclass
class Unit:
    """What one draw produces: a weight, plus its block scale when it is stored in fp8.

    ``hook`` is the parameter's ``dummy_init`` (or ``None`` for the default rule) and
    ``draw_dtype`` the dtype it is drawn in; a unit is never split across two shards.
    """

    tensors: List[StoredTensor]
    draw_dtype: str
    hook: Optional[Callable[[Any, Any], None]] = None

    @property
    def name(self) -> str:
        """The weight's name (the first tensor)."""
        return self.tensors[0].name

    @property
    def quantized(self) -> bool:
        """Whether the weight is stored in fp8 with a ``_scale_inv`` next to it."""
        return len(self.tensors) == 2

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors of the unit."""
        return sum(t.nbytes for t in self.tensors)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _fp8_unit(name: str, shape: Tuple[int, ...], scale: Tuple[int, ...], dtype: str) -> Unit:
    """A weight stored in fp8 plus its fp32 ``_scale_inv``, drawn in the model dtype."""
    return Unit([StoredTensor(name, shape, "float8_e4m3fn"),
                 StoredTensor(name + SCALE_SUFFIX, scale, "float32")], dtype)


def plan_tensors(raw: Dict[str, Any], dtype: str, include_mtp: bool) -> List[Unit]:
    """Every tensor a checkpoint of the config ``raw`` (config.json as written) holds.

    The names and shapes come from the engine: the target model (and, with ``include_mtp``, the
    NEXTN draft that loads ``model.layers.<num_hidden_layers>.*``) is built on the meta device
    and its ``weight_slots()`` table is read -- the same table ``match_checkpoint`` checks a
    checkpoint against (docs/model.md §2). A ``quantization_config`` in ``raw`` builds the fp8
    layers, whose slots include each ``weight_scale_inv [ceil(out/128), ceil(in/128)]``.

    Stored dtypes: what the engine holds in fp8 is fp8; MLA's ``kv_b_proj`` too (published fp8
    checkpoints quantise every linear layer; the engine splits it into ``w_kc`` / ``w_vc`` in the
    model dtype and its loader dequantises it); the engine's fp32 vectors (``A_log``,
    ``dt_bias``, ``expert_bias``) are fp32 (§5.2); everything else -- norms, the router,
    embeddings, the LM head, the KDA convolutions -- is ``dtype``.
    """
    import torch

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.quantization.fp8_utils import FP8_DTYPE
    from sglang.srt.model_loader.loader import build_model
    from sglang.srt.models.weight_slots import scale_shape

    cfg = ModelConfig("<random checkpoint>", BailingMoeV3Config.from_dict(raw), raw, False)
    fp8 = raw.get("quantization_config") is not None
    drafts = (False, True) if include_mtp else (False,)
    units: List[Unit] = []
    for is_draft in drafts:
        model = build_model(cfg, dtype=getattr(torch, dtype), device="meta", is_draft=is_draft)
        slots = model.weight_slots()
        for name, slot in slots.items():
            if name.endswith(SCALE_SUFFIX):
                continue  # written with its weight
            shape = tuple(int(s) for s in slot.shape)
            param = slot.param
            scale = slots.get(name + SCALE_SUFFIX)
            if param.dtype == FP8_DTYPE:
                units.append(_fp8_unit(name, shape, tuple(scale.shape), dtype))
                continue
            if fp8 and name.endswith(".kv_b_proj.weight"):
                units.append(_fp8_unit(name, shape, scale_shape(shape), dtype))
                continue
            whole = (slot.shard_id is None and slot.expert_id is None
                     and tuple(param.shape) == shape)
            # A parameter's own dummy_init describes the whole parameter: usable only when this
            # checkpoint tensor is all of it (A_log, dt_bias, the router, plain linears).
            hook = getattr(param, "dummy_init", None) if whole else None
            keep_fp32 = param.dtype == torch.float32 and len(shape) == 1
            stored = "float32" if keep_fp32 else dtype
            units.append(Unit([StoredTensor(name, shape, stored)],
                              _dtype_name(param.dtype) if hook else stored, hook))
    return units


def plan_shards(units: Sequence[Unit], max_shard_bytes: int) -> List[List[Unit]]:
    """Greedy in-order packing of ``units`` into shards of at most ``max_shard_bytes`` (a unit
    larger than that gets a shard of its own)."""
    shards: List[List[Unit]] = [[]]
    size = 0
    for unit in units:
        if shards[-1] and size + unit.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(unit)
        size += unit.nbytes
    return shards


def shard_name(i: int, n: int) -> str:
    """Hugging Face's shard file name (1-based ``i`` of ``n``)."""
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def safetensors_header(tensors: Sequence[StoredTensor]) -> bytes:
    """The 8-byte length plus JSON header of a safetensors file holding ``tensors`` in this order.

    Format (huggingface/safetensors): little-endian u64 header length, a JSON object
    ``{name: {dtype, shape, data_offsets: [begin, end]}}`` with offsets into the data that
    follows, tensors back to back. The JSON is padded with spaces to a multiple of 8 bytes so
    the data starts aligned, as safetensors' own writer does.
    """
    header: Dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": _SAFETENSORS_CODES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


# ---------------------------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------------------------
def draw_unit(unit: Unit, device: str, seed: int) -> List[Any]:
    """The unit's tensors on the CPU, contiguous, in the planned dtypes and shapes."""
    import torch

    from sglang.srt.layers.quantization.fp8_utils import quantize_block_fp8
    from sglang.srt.model_loader.dummy import default_dummy_init, param_seed

    gen = torch.Generator(device=device)
    gen.manual_seed(param_seed(seed, unit.name))
    first = unit.tensors[0]
    value = torch.empty(first.shape, dtype=getattr(torch, unit.draw_dtype), device=device)
    with torch.no_grad():
        if unit.hook is not None:
            unit.hook(value, gen)
        else:
            default_dummy_init(first.name, value, gen)
        if unit.quantized:
            # Drawn in the model dtype, then quantised per 128x128 block, as the engine's fp8
            # dummy init does: the stored values are those a quantised bf16 model would have.
            q, s = quantize_block_fp8(value)
            out = [q, s]
        else:
            out = [value.to(getattr(torch, first.dtype))]
    out = [t.to("cpu").contiguous() for t in out]
    for t, want in zip(out, unit.tensors):
        if tuple(t.shape) != want.shape or _dtype_name(t.dtype) != want.dtype:
            raise AssertionError(f"{want.name}: drew {tuple(t.shape)} {t.dtype}, planned "
                                 f"{want.shape} {want.dtype}")
    return out


def _write_bytes(f, t: Any) -> None:
    """Append the raw bytes of the CPU tensor ``t`` to ``f`` without copying it."""
    import torch

    if t.numel():
        # A byte view of the tensor's memory (numpy has no bf16 / fp8, but it has uint8):
        # f.write reads the buffer in place, no copy.
        f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)


def write_shard(path: str, units: Sequence[Unit], device: str, seed: int) -> int:
    """Write one shard, drawing and streaming each unit in turn; returns the file size."""
    tensors = [t for u in units for t in u.tensors]
    with open(path, "wb") as f:
        f.write(safetensors_header(tensors))
        for unit in units:
            for t in draw_unit(unit, device, seed):
                _write_bytes(f, t)
    return os.path.getsize(path)


# ---------------------------------------------------------------------------------------------
# Config and tokenizer
# ---------------------------------------------------------------------------------------------
def output_config(source_raw: Dict[str, Any], dtype: str, quantization: Optional[str],
                  no_mtp: bool) -> Dict[str, Any]:
    """config.json of the new folder: the source's (overrides applied) with the weight dtype
    (``torch_dtype`` and transformers 5's ``dtype``), the ``quantization_config`` of what is
    written (any the source had described its own weights), and no MTP layer with ``no_mtp``."""
    raw = dict(source_raw)
    raw["torch_dtype"] = dtype
    raw["dtype"] = dtype
    raw.pop("quantization_config", None)
    if quantization == "fp8":
        raw["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    if no_mtp:
        # A config that promises an MTP layer the files lack would fail only when NEXTN starts.
        raw["num_nextn_predict_layers"] = 0
    return raw


def tokenizer_files(folder: str) -> List[str]:
    """The tokenizer files present in ``folder``."""
    return [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, f))]


def tokenizer_vocab_size(folder: str) -> Optional[int]:
    """One more than the largest token id the tokenizer in ``folder`` can produce, from
    ``tokenizer.json`` (its model's vocabulary and added tokens), ``vocab.json``,
    ``added_tokens.json`` and ``tokenizer_config.json``'s ``added_tokens_decoder``; ``None``
    when none of them lists ids (a SentencePiece ``tokenizer.model`` alone)."""
    ids: List[int] = []

    def load(name: str) -> Any:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    tok = load("tokenizer.json")
    if isinstance(tok, dict):
        vocab = (tok.get("model") or {}).get("vocab")
        if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: token -> id
            ids += [int(v) for v in vocab.values()]
        elif isinstance(vocab, list):  # Unigram: [piece, score] in id order
            ids.append(len(vocab) - 1)
        ids += [int(a["id"]) for a in tok.get("added_tokens") or [] if "id" in a]
    for name in ("vocab.json", "added_tokens.json"):
        table = load(name)
        if isinstance(table, dict):
            ids += [int(v) for v in table.values()]
    cfg = load("tokenizer_config.json")
    if isinstance(cfg, dict) and isinstance(cfg.get("added_tokens_decoder"), dict):
        ids += [int(k) for k in cfg["added_tokens_decoder"]]
    return max(ids) + 1 if ids else None


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    p = argparse.ArgumentParser(
        prog="make_random_checkpoint.py", allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write a checkpoint folder in the published Hugging Face layout of\n"
                    "Ling-3.0-flash (BailingMoeV3ForCausalLM) with random weights, to serve\n"
                    "with --model-path OUT_DIR instead of --load-format dummy.",
        epilog="Example (4 layers of the real width, block fp8, with the MTP layer):\n"
               "  python3 scripts/make_random_checkpoint.py /models/ling-flash-4l-fp8 \\\n"
               "      --json-model-override-args '{\"num_hidden_layers\": 4}' "
               "--quantization fp8\n"
               "Fewer than 6 layers of Flash are all MLA (docs/model.md §1.3); 6 layers give "
               "5 KDA + 1 MLA.")
    p.add_argument("out_dir", metavar="OUT_DIR", help="folder to write (created if missing)")
    p.add_argument("--model-path", default="ling-3.0-flash",
                   help="a preset name (" + ", ".join(list_presets()) + ") or a folder with a "
                        "config.json (default: %(default)s)")
    p.add_argument("--json-model-override-args", default=None, metavar="JSON",
                   help="JSON object applied on top of the config, as the server flag of the "
                        "same name (e.g. '{\"num_hidden_layers\": 4}')")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPE_NAMES,
                   help="dtype of the unquantized tensors (default: %(default)s)")
    p.add_argument("--quantization", default=None, choices=("fp8",),
                   help="fp8: block fp8 as published (float8_e4m3fn weights with a float32 "
                        "weight_scale_inv per 128x128 block; norms, router, embeddings and "
                        "LM head stay in --dtype)")
    p.add_argument("--no-mtp", action="store_true",
                   help="leave out the MTP layer (model.layers.<num_hidden_layers>.*) and write "
                        "num_nextn_predict_layers 0")
    p.add_argument("--shard-size-gb", type=float, default=5.0, metavar="GB",
                   help="largest shard in GB (1e9 bytes; default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.add_argument("--tokenizer-from", default=None, metavar="FOLDER",
                   help="copy the tokenizer files from FOLDER (default: the model folder's own, "
                        "else the bundled model's, " + str(BUNDLED_MODEL_DIR) + ", whose 8192 "
                        "ids are all below Flash's vocab_size 157184). A tokenizer with more ids "
                        "than the config's vocab_size is refused.")
    p.add_argument("--no-tokenizer", action="store_true",
                   help="copy no tokenizer files (the server then takes input_ids only)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where values are drawn and quantised (cuda is faster for full-width "
                        "experts; the values differ from cpu's for the same seed)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty OUT_DIR (its old shards, index, config and "
                        "tokenizer files are replaced; other files are left)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the tensor count, sizes and shards, write nothing")
    return p


@dataclass
class Job:
    """Everything a run needs, validated."""

    out_dir: str
    raw: Dict[str, Any]
    source: str
    tokenizer_from: Optional[str]
    units: List[Unit] = field(default_factory=list)


def _resolve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Job:
    """Validate the arguments (``parser.error`` on the first problem) before any file is
    written."""
    out = os.path.abspath(args.out_dir)
    if not args.dry_run:
        if os.path.exists(out) and not os.path.isdir(out):
            parser.error(f"OUT_DIR {args.out_dir!r} exists and is not a folder")
        if os.path.isdir(out) and os.listdir(out) and not args.overwrite:
            parser.error(f"OUT_DIR {args.out_dir!r} exists and is not empty; pass --overwrite "
                         "to write into it, or choose a new folder")
    if not args.shard_size_gb > 0:
        parser.error(f"--shard-size-gb must be positive, got {args.shard_size_gb}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is available; use --device cpu")
    source = args.model_path
    # A DSpark preset name gets load_raw_config's own message (it says where such names go).
    if not os.path.isdir(source) and not (PRESET_DIR / f"{source}.json").exists():
        parser.error(f"--model-path {source!r} is neither a folder with a config.json nor a "
                     f"preset ({', '.join(list_presets())})")
    try:
        overrides = parse_override_args(args.json_model_override_args)
        src_raw = apply_overrides(load_raw_config(source), overrides)
        raw = output_config(src_raw, args.dtype, args.quantization, args.no_mtp)
        cfg = BailingMoeV3Config.from_dict(raw)
    except ConfigError as e:
        parser.error(str(e))
    tok = args.tokenizer_from
    if args.no_tokenizer:
        if tok is not None:
            parser.error("--no-tokenizer and --tokenizer-from exclude each other")
    elif tok is not None:
        if not os.path.isdir(tok) or not tokenizer_files(tok):
            parser.error(f"--tokenizer-from {tok!r} is not a folder with tokenizer files "
                         f"({', '.join(TOKENIZER_FILES[:2])}, ...)")
    elif os.path.isdir(source) and tokenizer_files(source):
        tok = source
    elif tokenizer_files(str(BUNDLED_MODEL_DIR)):
        tok = str(BUNDLED_MODEL_DIR)
    if tok is not None:
        tok = os.path.abspath(tok)
        n = tokenizer_vocab_size(tok)
        if n is not None and n > cfg.vocab_size:
            parser.error(f"the tokenizer in {tok} has token ids up to {n - 1} but the config's "
                         f"vocab_size is {cfg.vocab_size}: its ids would index past the "
                         "embedding; pass --tokenizer-from with a smaller tokenizer, "
                         "--no-tokenizer, or a larger vocab_size")
        if n is None:
            print(f"note: could not read the token ids of the tokenizer in {tok}; not checked "
                  f"against vocab_size {cfg.vocab_size}", file=sys.stderr)
    return Job(out, raw, source, tok)


def _human(n: int) -> str:
    return f"{n / 1e9:.2f} GB ({n / 2 ** 30:.2f} GiB)"


def _clear_old_files(out: str) -> None:
    """--overwrite: remove what a previous run wrote, so no stale shard stays next to the
    new index."""
    for f in os.listdir(out):
        if (f.endswith(".safetensors") or f in (INDEX_NAME, "config.json",
                                                "generation_config.json")
                or f in TOKENIZER_FILES):
            os.remove(os.path.join(out, f))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the tool; returns the exit status (argument errors exit through ``parser.error``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    job = _resolve(args, parser)
    include_mtp = not args.no_mtp and int(job.raw.get("num_nextn_predict_layers") or 0) > 0
    job.units = plan_tensors(job.raw, args.dtype, include_mtp)
    shards = plan_shards(job.units, int(args.shard_size_gb * 1e9))
    tensors = [t for u in job.units for t in u.tensors]
    data_bytes = sum(t.nbytes for t in tensors)
    file_bytes = data_bytes + sum(len(safetensors_header([t for u in s for t in u.tensors]))
                                  for s in shards)
    names = [shard_name(i, len(shards)) for i in range(len(shards))]
    if not args.dry_run:
        os.makedirs(job.out_dir, exist_ok=True)
        if args.overwrite:
            _clear_old_files(job.out_dir)
        start = time.time()
        for fname, shard in zip(names, shards):
            size = write_shard(os.path.join(job.out_dir, fname), shard, args.device, args.seed)
            print(f"[{time.time() - start:7.1f} s] {fname}: {sum(len(u.tensors) for u in shard)} "
                  f"tensors, {_human(size)}", file=sys.stderr, flush=True)
        # The index and config.json come last: a run that stops half-way leaves a folder the
        # loader refuses (no config.json), never one that looks complete.
        weight_map = {t.name: fname for fname, s in zip(names, shards)
                      for u in s for t in u.tensors}
        with open(os.path.join(job.out_dir, INDEX_NAME), "w") as f:
            json.dump({"metadata": {"total_size": data_bytes}, "weight_map": weight_map}, f,
                      indent=2)
        with open(os.path.join(job.out_dir, "config.json"), "w") as f:
            json.dump(job.raw, f, indent=2)
        gen = os.path.join(job.source, "generation_config.json")
        if os.path.isdir(job.source) and os.path.isfile(gen):
            shutil.copyfile(gen, os.path.join(job.out_dir, "generation_config.json"))
        if job.tokenizer_from is not None:
            for f in tokenizer_files(job.tokenizer_from):
                shutil.copyfile(os.path.join(job.tokenizer_from, f), os.path.join(job.out_dir, f))
    verb = "would write" if args.dry_run else "wrote"
    quant = "block fp8" if args.quantization == "fp8" else args.dtype
    mtp = "with the MTP layer" if include_mtp else "without an MTP layer"
    print(f"{verb} {job.out_dir}: {len(tensors)} tensors ({quant}, {mtp}), "
          f"{data_bytes} bytes of tensors, {_human(file_bytes)} on disk in {len(shards)} "
          f"shard(s)")
    print(f"tokenizer: {job.tokenizer_from or 'none (serve with input_ids)'}")
    serve = f"python -m sglang.launch_server --model-path {shlex.quote(job.out_dir)}"
    print(f"serve it:  {serve}")
    if include_mtp:
        print(f"with NEXTN: {serve} --speculative-algorithm NEXTN --speculative-num-steps 3")
    return 0


if __name__ == "__main__":
    sys.exit(main())
