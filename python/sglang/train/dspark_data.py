"""Distribution-aligned training data for a DSpark draft, produced by the serving stack itself.

1. **Prompts** are windows of the training corpus (:mod:`sglang.train.data`): a random file, a
   random line start in it, the next ``prompt_len`` tokens. Held-out prompts come from the
   held-out files, which the target never saw.
2. **Generations**: the target continues every prompt under several sampling settings (greedy
   and e.g. ``T = 0.7, top_p = 0.8``) through :class:`sglang.Engine`, in-process, with a
   per-request ``sampling_seed`` so the data are reproducible. The draft thus learns the
   distribution it faces when serving, sampling noise included.
3. **Target features**: one prefill forward of the engine's model over each whole sequence
   (prompt + generation), with :meth:`BailingMoeV3ForCausalLM.set_dspark_layers_to_capture`, on
   a :class:`ModelRunner` built in this process from the same checkpoint and dtype as the
   engine's scheduler (with the default kernels, as the engine's). (The engine's own runner lives in its scheduler process, and handing
   ``[T, m*d]`` hidden states back through the scheduler's output path is outside what
   ``Engine.generate`` exposes; a prefill of the finished sequence gives the same causal states.)
   Kept per position: the captured layers' outputs (``aux``, the draft's context input) and the
   target's **final-normed hidden state** (``final``). The target distribution is recomputed
   from ``final`` with the frozen LM head when a block needs it: exact full-vocabulary logits for
   ``d`` floats per position instead of ``V`` (or a lossy top-k).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = [
    "SamplingSetting",
    "parse_sampling_settings",
    "FeatureSequence",
    "draw_prompts",
    "generate_with_engine",
    "TargetFeatureRunner",
    "target_fingerprint",
    "save_feature_cache",
    "load_feature_cache",
]

CACHE_VERSION = 1


@dataclass(frozen=True)
class SamplingSetting:
    """One sampling setting of the data generation (``temperature <= 0``: greedy)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1

    @property
    def is_greedy(self) -> bool:
        """Argmax decoding."""
        return self.temperature <= 0

    @property
    def name(self) -> str:
        """``greedy`` or ``T0.7-p0.8[-k20]``."""
        if self.is_greedy:
            return "greedy"
        name = f"T{self.temperature:g}-p{self.top_p:g}"
        return name + (f"-k{self.top_k}" if self.top_k > 0 else "")

    def params(self, max_new_tokens: int, seed: int) -> Dict[str, Any]:
        """Engine ``sampling_params`` for one request (EOS ignored: fixed-length sequences)."""
        p: Dict[str, Any] = {"max_new_tokens": max_new_tokens, "ignore_eos": True,
                             "temperature": max(self.temperature, 0.0)}
        if not self.is_greedy:
            p.update(top_p=self.top_p, top_k=self.top_k, sampling_seed=seed)
        return p


def parse_sampling_settings(specs: Sequence[str]) -> List[SamplingSetting]:
    """``greedy`` or ``TEMPERATURE[:TOP_P[:TOP_K]]`` per entry, e.g. ``0.7:0.8`` or
    ``1.0:0.95:50``; a malformed entry is an error naming it."""
    if not specs:
        raise ValueError("at least one sampling setting is needed (e.g. --sampling greedy)")
    out = []
    for spec in specs:
        if spec.strip().lower() == "greedy":
            out.append(SamplingSetting())
            continue
        parts = spec.split(":")
        try:
            if len(parts) > 3:
                raise ValueError
            t = float(parts[0])
            p = float(parts[1]) if len(parts) > 1 else 1.0
            k = int(parts[2]) if len(parts) > 2 else -1
        except ValueError:
            raise ValueError(f"sampling setting {spec!r}: expected 'greedy' or "
                             "TEMPERATURE[:TOP_P[:TOP_K]], e.g. 0.7:0.8") from None
        if not (t >= 0 and 0 < p <= 1 and (k == -1 or k >= 1)):
            raise ValueError(f"sampling setting {spec!r}: need temperature >= 0, top_p in "
                             "(0, 1] and top_k -1 or >= 1")
        out.append(SamplingSetting(t, p, k))
    return out


@dataclass
class FeatureSequence:
    """One training (or evaluation) sequence with the target's per-position features."""

    tokens: torch.Tensor  # [T] int64: prompt then generation
    prompt_len: int
    setting: str  # SamplingSetting.name of the generation
    aux: torch.Tensor  # [T, m*d] outputs of the draft's target layers
    final: torch.Tensor  # [T, d] final-normed hidden (target logits = final @ lm_head.T)

    @property
    def num_generated(self) -> int:
        """Generated tokens (the positions anchors are drawn from)."""
        return int(self.tokens.numel()) - self.prompt_len


def draw_prompts(texts: Sequence[str], tokenizer: Any, count: int, prompt_len: int,
                 generator: torch.Generator, min_len: int = 8) -> List[List[int]]:
    """``count`` prompts of ``prompt_len`` tokens, each from a random text starting at a random
    line start (code prompts that begin mid-line are unnatural). Texts too short to give
    ``min_len`` tokens there are redrawn."""
    if count < 0 or prompt_len < 1:
        raise ValueError(f"need count >= 0 and prompt_len >= 1, got {count}, {prompt_len}")
    usable = [t for t in texts if t.strip()]
    if count and not usable:
        raise ValueError("no non-empty text to draw prompts from")
    prompts: List[List[int]] = []
    attempts = 0
    while len(prompts) < count:
        attempts += 1
        if attempts > 50 * count + 100:
            raise ValueError(f"could not draw {count} prompts of >= {min_len} tokens; the texts "
                             "are too short")
        text = usable[int(torch.randint(len(usable), (1,), generator=generator))]
        start = int(torch.randint(len(text), (1,), generator=generator))
        start = text.find("\n", start) + 1 if start else 0  # 0 when no newline follows
        window = text[start:start + 12 * prompt_len]  # BPE tokens are short: enough characters
        ids = tokenizer.encode(window, add_special_tokens=False).ids[:prompt_len]
        if len(ids) >= min(min_len, prompt_len):
            prompts.append(ids)
    return prompts


def generate_with_engine(target_path: str, prompts: Sequence[List[int]],
                         settings: Sequence[SamplingSetting], max_new_tokens: int, seed: int,
                         engine_kwargs: Dict[str, Any]) -> List[List[int]]:
    """Generated token ids of ``prompts[i]`` under ``settings[i]``, one batched
    :meth:`sglang.Engine.generate` call (the engine batches up to ``max_running_requests``)."""
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.managers.io_struct import MAX_BATCH_SIZE

    if len(prompts) != len(settings):
        raise ValueError(f"{len(prompts)} prompts but {len(settings)} settings")
    if not prompts:
        return []
    params = [s.params(max_new_tokens, seed * 1_000_003 + i) for i, s in enumerate(settings)]
    outs: List[Dict[str, Any]] = []
    with Engine(model_path=target_path, **engine_kwargs) as engine:
        # A request carries at most MAX_BATCH_SIZE prompts (io_struct); the engine still batches
        # each slice up to its max_running_requests.
        for i in range(0, len(prompts), MAX_BATCH_SIZE):
            outs += engine.generate(input_ids=[list(p) for p in prompts[i:i + MAX_BATCH_SIZE]],
                                    sampling_params=params[i:i + MAX_BATCH_SIZE])
    return [list(o["output_ids"]) for o in outs]


class TargetFeatureRunner:
    """The target on an in-process :class:`ModelRunner`: features of whole sequences.

    ``layer_ids`` are the draft's ``target_layer_ids``. Sequences are prefilled in groups of at
    most ``max_batch_tokens`` tokens (the KV pool size), each from a clean pool.
    """

    def __init__(self, target_path: str, layer_ids: Sequence[int], *, device: str = "cpu",
                 dtype: str = "float32", max_batch_tokens: int = 4096,
                 max_batch_seqs: int = 16, seed: int = 0):
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.model_executor.model_runner import ModelRunner

        if max_batch_tokens < 1 or max_batch_seqs < 1:
            raise ValueError("max_batch_tokens and max_batch_seqs must be >= 1")
        self.model_config = ModelConfig.from_path(target_path)
        self.max_batch_tokens, self.max_batch_seqs = max_batch_tokens, max_batch_seqs
        self.runner = ModelRunner(self.model_config, device=device, dtype=dtype,
                                  max_running_requests=max_batch_seqs,
                                  max_total_tokens=max_batch_tokens, random_seed=seed)
        self.runner.model.set_dspark_layers_to_capture(list(layer_ids))
        self.layer_ids = list(layer_ids)

    @property
    def hf_config(self) -> Any:
        """The target's parsed config (``BailingMoeV3Config``)."""
        return self.model_config.hf_config

    def embed_and_head(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Detached fp32 copies of the word embedding and LM head, ``[V, d]`` each (the
        draft's shared, frozen tensors)."""
        embed, head = self.runner.model.get_embed_and_head()
        v = self.hf_config.vocab_size
        return embed[:v].detach().float().clone(), head[:v].detach().float().clone()

    def _groups(self, lengths: Sequence[int]) -> List[List[int]]:
        groups: List[List[int]] = [[]]
        used = 0
        for i, n in enumerate(lengths):
            if n > self.max_batch_tokens:
                raise ValueError(f"sequence {i} has {n} tokens, more than max_batch_tokens "
                                 f"{self.max_batch_tokens}")
            if groups[-1] and (used + n > self.max_batch_tokens
                               or len(groups[-1]) >= self.max_batch_seqs):
                groups.append([])
                used = 0
            groups[-1].append(i)
            used += n
        return [g for g in groups if g]

    def features(self, sequences: Sequence[List[int]], progress: Any = None
                 ) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """``(aux [T, m*d], final [T, d])`` on the CPU, fp32, for every token list."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch

        runner = self.runner
        dev = runner.device
        lengths = [len(s) for s in sequences]
        if any(n < 1 for n in lengths):
            raise ValueError("empty sequence: every sequence needs at least one token")
        limit = runner.context_len
        if max(lengths, default=0) > limit:
            raise ValueError(f"a sequence of {max(lengths)} tokens exceeds the target's context "
                             f"length {limit}")
        out: List[Optional[Tuple[torch.Tensor, torch.Tensor]]] = [None] * len(sequences)
        for group in self._groups(lengths):
            runner.req_to_token_pool.clear()
            runner.token_to_kv_pool_allocator.clear()
            reqs = runner.req_to_token_pool.alloc(len(group))
            if runner.kda_state_pool is not None and runner.kda_state_pool.layer_ids:
                runner.kda_state_pool.clear_slots(reqs)  # every sequence starts from zero state
            locs = []
            for r, i in zip(reqs, group):
                loc = runner.token_to_kv_pool_allocator.alloc(lengths[i])
                runner.req_to_token_pool.write(r, 0, loc)
                locs.append(loc)
            ids = torch.cat([torch.as_tensor(sequences[i], dtype=torch.long) for i in group])
            fb = ForwardBatch.for_extend(ids.to(dev), reqs, [0] * len(group),
                                         [lengths[i] for i in group], torch.cat(locs),
                                         capture_hidden_mode=CaptureHiddenMode.FULL)
            res = runner.forward(fb)
            aux = res.aux_hidden_states.float().cpu().split([lengths[i] for i in group])
            final = res.hidden_states.float().cpu().split([lengths[i] for i in group])
            for j, i in enumerate(group):
                out[i] = (aux[j].clone(), final[j].clone())
            if progress is not None:
                progress(len(group))
        return out  # type: ignore[return-value]


def target_fingerprint(target_path: str) -> str:
    """SHA-256 of the target's config.json plus the names and sizes of its weight files: a
    cache made for another checkpoint is refused."""
    h = hashlib.sha256()
    cfg = os.path.join(target_path, "config.json")
    if not os.path.isfile(cfg):
        raise FileNotFoundError(f"target {target_path!r} has no config.json")
    with open(cfg, "rb") as f:
        h.update(f.read())
    for name in sorted(os.listdir(target_path)):
        if name.endswith(".safetensors"):
            h.update(f"{name}:{os.path.getsize(os.path.join(target_path, name))}".encode())
    return h.hexdigest()


def save_feature_cache(path: str, meta: Dict[str, Any], train: Sequence[FeatureSequence],
                       held_out: Sequence[FeatureSequence]) -> None:
    """Write the sequences and their features (``torch.save``) with ``meta`` describing how
    they were made. The file appears whole (written beside it, then renamed), so another run
    waiting for the cache never reads half of it."""
    def pack(seqs: Sequence[FeatureSequence]) -> List[Dict[str, Any]]:
        return [{"tokens": s.tokens, "prompt_len": s.prompt_len, "setting": s.setting,
                 "aux": s.aux, "final": s.final} for s in seqs]

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    partial = f"{path}.partial"
    torch.save({"version": CACHE_VERSION, "meta": meta, "train": pack(train),
                "held_out": pack(held_out)}, partial)
    os.replace(partial, path)


def load_feature_cache(path: str, expect_meta: Dict[str, Any]
                       ) -> Tuple[List[FeatureSequence], List[FeatureSequence]]:
    """Read a cache written by :func:`save_feature_cache`; every key of ``expect_meta`` must
    match (target fingerprint, layers, data settings), else the error names the first that
    differs."""
    blob = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(blob, dict) or blob.get("version") != CACHE_VERSION:
        raise ValueError(f"{path}: not a DSpark feature cache of version {CACHE_VERSION}")
    meta = blob.get("meta", {})
    for key, want in expect_meta.items():
        if json.dumps(meta.get(key), sort_keys=True) != json.dumps(want, sort_keys=True):
            raise ValueError(f"{path} was made with {key} = {meta.get(key)!r}, this run needs "
                             f"{want!r}; delete the file or pass another --data-cache")

    def unpack(rows: List[Dict[str, Any]]) -> List[FeatureSequence]:
        return [FeatureSequence(r["tokens"], int(r["prompt_len"]), r["setting"], r["aux"],
                                r["final"]) for r in rows]

    return unpack(blob["train"]), unpack(blob["held_out"])
