"""Helpers shared by the engine/scheduler tests: tiny checkpoints (optionally with a trained
byte-level BPE tokenizer), in-process schedulers and reference-model greedy decoding."""
from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional, Tuple

import torch

from sglang.srt.managers.io_struct import BatchTokenIDOutput, TokenizedGenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.test.random_checkpoint import tiny_config, write_random_checkpoint

VOCAB = 512


def write_checkpoint(path: str, with_tokenizer: bool = False, **config_overrides: Any) -> str:
    """A random tiny BailingMoeV3 checkpoint; with a 512-token BPE tokenizer if asked."""
    write_random_checkpoint(path, tiny_config(vocab_size=VOCAB, **config_overrides), seed=0)
    if with_tokenizer:
        from sglang.train.tokenizer import save_tokenizer, train_tokenizer

        import argparse
        import json
        import textwrap

        texts = [inspect.getsource(m) for m in (argparse, json.decoder, json.encoder, textwrap)]
        tok = train_tokenizer(texts, vocab_size=VOCAB)
        assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
        save_tokenizer(tok, path, model_max_length=512)
    return path


def server_args(model_path: str, **kw: Any) -> ServerArgs:
    """CPU fp32 server args for tests (small pools, fixed seed). Prefills run eagerly unless a
    test asks for prefill graphs: the GPU gates compare the decode graphs' tokens with an eager
    run's exactly, and a padded prefill replay rounds differently from the eager prefill of the
    same prompt in bf16 (test_prefill_graphs.py gates the prefill graphs, within a tolerance)."""
    defaults = dict(model_path=model_path, device="cpu", dtype="float32", random_seed=0,
                    max_total_tokens=2048, max_running_requests=8, log_level="warning",
                    prefill_cuda_graph_tokens=[])
    defaults.update(kw)
    return ServerArgs(**defaults)


def make_scheduler(model_path: str, **kw: Any) -> Scheduler:
    """An in-process scheduler (no sockets): submit() requests, run_until_idle(), read outbox."""
    return Scheduler(server_args(model_path, **kw))


def sampling(vocab: int = VOCAB, tokenizer: Any = None, **params: Any) -> SamplingParams:
    sp = SamplingParams.from_dict(params)
    sp.verify(vocab)
    return sp.normalize(tokenizer)


def request(rid: str, ids: List[int], **kw: Any) -> TokenizedGenerateReqInput:
    """A tokenized request; keyword arguments other than the logprob ones are sampling params."""
    lp = {k: kw.pop(k) for k in ("return_logprob", "logprob_start_len", "top_logprobs_num",
                                 "stream") if k in kw}
    return TokenizedGenerateReqInput(rid, None, list(ids), sampling(**kw), **lp)


class Collected:
    """Outputs of an in-process scheduler, accumulated per rid."""

    def __init__(self) -> None:
        self.ids: Dict[str, List[int]] = {}
        self.finish: Dict[str, Optional[dict]] = {}
        self.finish_count: Dict[str, int] = {}
        self.out_lp: Dict[str, List[float]] = {}
        self.in_lp: Dict[str, List[Optional[float]]] = {}
        self.in_ids: Dict[str, List[int]] = {}

    def add(self, outbox: List[Any]) -> "Collected":
        for out in outbox:
            assert isinstance(out, BatchTokenIDOutput), type(out)
            for i, rid in enumerate(out.rids):
                self.ids.setdefault(rid, []).extend(out.decode_ids[i])
                self.out_lp.setdefault(rid, []).extend(out.output_token_logprobs_val[i])
                self.in_lp.setdefault(rid, []).extend(out.input_token_logprobs_val[i])
                self.in_ids.setdefault(rid, []).extend(out.input_token_logprobs_idx[i])
                if out.finished_reasons[i] is not None:
                    self.finish[rid] = out.finished_reasons[i]
                    self.finish_count[rid] = self.finish_count.get(rid, 0) + 1
        outbox.clear()
        return self


def take_token_ids(sched: Scheduler) -> Dict[str, List[int]]:
    """The output ids per rid in ``sched``'s outbox (other messages, such as a speculative
    server's metrics, skipped), emptying it."""
    ids: Dict[str, List[int]] = {}
    for msg in sched.outbox:
        if isinstance(msg, BatchTokenIDOutput):
            for i, rid in enumerate(msg.rids):
                ids.setdefault(rid, []).extend(msg.decode_ids[i])
    sched.outbox.clear()
    return ids


def run_requests(sched: Scheduler, reqs: List[TokenizedGenerateReqInput]) -> Collected:
    for r in reqs:
        sched.submit(r)
    sched.run_until_idle()
    return Collected().add(sched.outbox)


def reference_greedy(model: Any, prompt: List[int], n: int) -> Tuple[List[int], torch.Tensor]:
    """Greedy tokens by full recompute with the reference model, and the logits of the final
    sequence at every position ``[len(prompt) + n, V]``."""
    ids = torch.tensor([prompt])
    out: List[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(ids)
            nxt = int(logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        logits, _ = model(ids)
    return out, logits[0]


# Tensor methods that turn a tensor into a host value (each one a device sync on CUDA).
HOST_READS = ("tolist", "item", "numpy", "__int__", "__float__", "__bool__", "__index__")


def refuse_host_reads(monkeypatch: Any, obj: Any, name: str, calls: List[Any]) -> None:
    """Wrap ``obj.name`` so that every Tensor-to-Python conversion raises inside it (the
    run-ahead invariant: launching a round never reads a device value); results go to
    ``calls``."""
    inner = getattr(obj, name)

    def guarded(*args: Any, **kwargs: Any) -> Any:
        with monkeypatch.context() as m:
            for method in HOST_READS:
                def refuse(self, *a, _name=method, **k):
                    raise AssertionError(f"host read Tensor.{_name} inside {name}")
                m.setattr(torch.Tensor, method, refuse)
            out = inner(*args, **kwargs)
        calls.append(out)
        return out

    monkeypatch.setattr(obj, name, guarded)


def submit_staggered(sched: Scheduler, reqs: List[TokenizedGenerateReqInput], stagger: int = 0,
                     after_each: Optional[Any] = None) -> None:
    """Submit ``reqs`` one by one, running ``stagger`` scheduler iterations after each (so they
    join a running batch at different points; ``after_each(i)`` runs after request ``i``), then
    run until idle (the scheduler's leak check runs when it goes idle)."""
    for i, r in enumerate(reqs):
        sched.submit(r)
        for _ in range(stagger):
            sched.process_input_requests(sched.recv_requests())
            sched.step()
        if after_each is not None:
            after_each(i)
    sched.run_until_idle()


def held_out_prompts(tokenizer: Any, n: int = 3, length: int = 24) -> List[List[int]]:
    """``n`` prompts of ``length`` tokens from held-out Python files (never trained on), each
    starting at a function definition a third of the way into its file."""
    from sglang.train.data import HELD_OUT_FILES, stdlib_root

    out = []
    for name in HELD_OUT_FILES[:n]:
        text = (stdlib_root() / name).read_text(encoding="utf-8")
        start = text.find("\ndef ", len(text) // 3) + 1
        out.append(tokenizer.encode(text[start:start + 1000])[:length])
    return out
