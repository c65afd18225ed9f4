"""Per-request sampling parameters (SGLang's ``sampling_params`` JSON keys and defaults).

Life cycle: ``SamplingParams.from_dict(request_json)`` (unknown keys are an error) ->
``verify(vocab_size)`` (range checks; every message names the key) -> ``normalize(tokenizer)``
(canonical internal form: temperature 0 becomes greedy ``top_k = 1``, ``top_k = -1`` becomes
"all", ``stop`` becomes a list, ``logit_bias`` keys become ints). ``verify`` accepts both the
user-facing and the normalized form, and ``normalize`` is idempotent.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Union

# Temperatures below this are greedy (as upstream): dividing logits by ~0 would overflow anyway.
SAMPLING_EPS = 1e-6
# ``top_k`` meaning "no top-k cut" after normalization (larger than any vocabulary).
TOP_K_ALL = 1 << 30
# Keys SGLang accepts for constrained decoding, which this server does not implement.
UNSUPPORTED_KEYS = ("json_schema", "regex", "ebnf", "structural_tag", "stop_regex")
# Largest seed accepted; seeds feed a 64-bit counter hash (see layers/sampler.py).
MAX_SAMPLING_SEED = (1 << 63) - 1
# Largest |logit_bias| (OpenAI's range): +-100 already forces or bans a token, and larger
# values would overflow the softmax into inf / NaN logprobs.
MAX_LOGIT_BIAS = 100.0


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request, and when to stop."""

    max_new_tokens: Optional[int] = 128  # None: until the context length
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[Union[List[int], Set[int]]] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: all tokens
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: Optional[int] = None
    logit_bias: Optional[Dict[Union[str, int], float]] = None
    sampling_seed: Optional[int] = None
    custom_params: Optional[Dict[str, Any]] = None
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    structural_tag: Optional[str] = None
    stop_regex: Optional[Union[str, List[str]]] = None
    # Filled by normalize()
    stop_strs: List[str] = field(default_factory=list, repr=False)
    stop_str_max_len: int = field(default=0, repr=False)

    @classmethod
    def from_dict(cls, params: Optional[Dict[str, Any]]) -> "SamplingParams":
        """Build from a request's ``sampling_params`` object; unknown keys raise ``ValueError``.

        ``None`` values mean "use the default" (OpenAI-style clients send explicit nulls).
        """
        if params is None:
            return cls()
        if not isinstance(params, dict):
            raise ValueError(f"sampling_params must be a JSON object, got {type(params).__name__}")
        known = public_keys()
        for key in params:
            if key not in known:
                raise ValueError(
                    f"unknown sampling parameter {key!r}; known: {', '.join(sorted(known))}"
                )
        return cls(**{k: v for k, v in params.items() if v is not None})

    def to_dict(self) -> Dict[str, Any]:
        """The public keys and their current values (JSON-friendly)."""
        out = {k: getattr(self, k) for k in public_keys()}
        if isinstance(out["stop_token_ids"], set):
            out["stop_token_ids"] = sorted(out["stop_token_ids"])
        return out

    @property
    def is_greedy(self) -> bool:
        """Deterministic argmax decoding (temperature 0, or top_k 1)."""
        return _is_number(self.temperature) and self.temperature < SAMPLING_EPS or self.top_k == 1

    # ------------------------------------------------------------------ validation
    def verify(self, vocab_size: Optional[int] = None) -> None:
        """Raise ``ValueError`` naming the key for any out-of-range or ill-typed value."""
        for key in UNSUPPORTED_KEYS:
            if getattr(self, key) is not None:
                raise ValueError(
                    f"{key} is not supported: this server does not implement constrained decoding"
                )
        if self.max_new_tokens is not None:
            _check_int("max_new_tokens", self.max_new_tokens, low=0)
        _check_int("min_new_tokens", self.min_new_tokens, low=0)
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens "
                f"({self.max_new_tokens})"
            )
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < 1 and self.top_k != -1:
            raise ValueError(f"top_k must be -1 (all tokens) or >= 1, got {self.top_k}")
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for key in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, key)
            _check_number(key, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{key} must be in [-2, 2], got {value}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        _check_int("n", self.n, low=1)
        for key in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                    "no_stop_trim"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key} must be a boolean, got {getattr(self, key)!r}")
        if self.stream_interval is not None:
            _check_int("stream_interval", self.stream_interval, low=1)
        self._verify_stop(vocab_size)
        self._verify_logit_bias(vocab_size)
        if self.sampling_seed is not None:
            _check_int("sampling_seed", self.sampling_seed, low=0)
            if self.sampling_seed > MAX_SAMPLING_SEED:
                raise ValueError(f"sampling_seed must be < 2**63, got {self.sampling_seed}")
        if self.custom_params is not None and not isinstance(self.custom_params, dict):
            raise ValueError("custom_params must be a JSON object")

    def _verify_stop(self, vocab_size: Optional[int]) -> None:
        stop = self.stop
        if stop is not None:
            items = [stop] if isinstance(stop, str) else stop
            if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
                raise ValueError("stop must be a string or a list of strings")
            if any(s == "" for s in items):
                raise ValueError("stop must not contain empty strings")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple, set)):
                raise ValueError("stop_token_ids must be a list of token ids")
            for t in self.stop_token_ids:
                _check_token_id("stop_token_ids", t, vocab_size)

    def _verify_logit_bias(self, vocab_size: Optional[int]) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise ValueError("logit_bias must be an object mapping token ids to biases")
        for key, bias in self.logit_bias.items():
            _check_token_id("logit_bias", _token_key(key), vocab_size)
            _check_number(f"logit_bias[{key!r}]", bias)
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias[{key!r}] must be in [-{MAX_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}], got {bias}")

    # ------------------------------------------------------------------ normalization
    def normalize(self, tokenizer: Any = None) -> "SamplingParams":
        """Bring to the internal form (idempotent); returns ``self``.

        With a tokenizer, ``stop_str_max_len`` is the longest stop string in tokens (how far
        back the detokenizer must look); without one, in characters (an upper bound).
        """
        if self.temperature < SAMPLING_EPS:
            # Greedy: keep the logits unscaled and cut to the single best token.
            self.temperature = 1.0
            self.top_k = 1
        if self.top_k == -1:
            self.top_k = TOP_K_ALL
        if self.stop is None:
            self.stop_strs = []
        else:
            self.stop_strs = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if tokenizer is not None and self.stop_strs:
            self.stop_str_max_len = max(
                len(tokenizer.encode(s, add_special_tokens=False)) for s in self.stop_strs
            )
        else:
            self.stop_str_max_len = max((len(s) for s in self.stop_strs), default=0)
        if self.stop_token_ids is not None:
            self.stop_token_ids = set(self.stop_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = {_token_key(k): float(v) for k, v in self.logit_bias.items()}
        return self

    def clone(self) -> "SamplingParams":
        """An independent copy (for ``n > 1`` fan-out)."""
        return dataclasses.replace(
            self,
            stop_strs=list(self.stop_strs),
            stop_token_ids=None if self.stop_token_ids is None else set(self.stop_token_ids),
            logit_bias=None if self.logit_bias is None else dict(self.logit_bias),
        )


_DERIVED_FIELDS = ("stop_strs", "stop_str_max_len")


def public_keys() -> Set[str]:
    """The JSON keys a request may set (everything except fields filled by ``normalize``)."""
    return {f.name for f in dataclasses.fields(SamplingParams) if f.name not in _DERIVED_FIELDS}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_number(key: str, value: Any) -> None:
    if not _is_number(value) or not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, got {value!r}")


def _check_int(key: str, value: Any, low: Optional[int] = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{key} must be >= {low}, got {value}")


def _token_key(key: Any) -> Any:
    # JSON object keys are strings: "42" -> 42; anything non-numeric is left for the check.
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)
    return key


def _check_token_id(key: str, token: Any, vocab_size: Optional[int]) -> None:
    if not isinstance(token, int) or isinstance(token, bool):
        raise ValueError(f"{key}: token id {token!r} is not an integer")
    if token < 0 or (vocab_size is not None and token >= vocab_size):
        bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise ValueError(f"{key}: token id {token} is out of range {bound}")
