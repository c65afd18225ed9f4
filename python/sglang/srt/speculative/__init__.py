"""Upstream SGLang's speculative-decoding package path. Here it holds the shared vocabulary
(:mod:`.spec_info`); the workers, their setup and the chain maths live in
:mod:`sglang.srt.rounds`, one folder per algorithm."""
