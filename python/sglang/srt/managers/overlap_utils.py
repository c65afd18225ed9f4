"""Upstream SGLang's import path of the overlap schedule's future map; the relay between rounds
lives in :mod:`sglang.srt.rounds.relay`."""
from sglang.srt.rounds.relay import FutureMap, PendingRound, RoundOutput, host_to_device

__all__ = ["FutureMap", "PendingRound", "RoundOutput", "host_to_device"]
