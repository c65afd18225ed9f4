"""Upstream SGLang's import path of the TP model worker; the worker lives in
:mod:`sglang.srt.rounds.plain` (the plain round worker, beside the other round workers)."""
from sglang.srt.rounds.plain import GenerationBatchResult, TpModelWorker

__all__ = ["GenerationBatchResult", "TpModelWorker"]
