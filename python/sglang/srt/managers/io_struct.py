"""Messages exchanged between the TokenizerManager, the Scheduler and the DetokenizerManager.

They are plain dataclasses pickled over ZMQ (``send_pyobj``). Names follow SGLang's
``managers/io_struct.py``. Direction of each message:

* ``GenerateReqInput``: user / HTTP layer -> TokenizerManager (not sent over a socket).
* ``TokenizedGenerateReqInput``, ``AbortReq``, ``FlushCacheReqInput``, ``GetInternalStateReq``,
  ``ProfileReq``: TokenizerManager -> Scheduler (rank 0, then broadcast to the other TP ranks).
* ``BatchTokenIDOutput``: Scheduler -> DetokenizerManager (one message per step with outputs).
* ``BatchStrOutput``: DetokenizerManager -> TokenizerManager.
* ``FlushCacheReqOutput``, ``GetInternalStateReqOutput``, ``ProfileReqOutput``: Scheduler ->
  TokenizerManager.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from sglang.srt.environ import envs
from sglang.srt.sampling.sampling_params import UNSUPPORTED_KEYS as CONSTRAINED_DECODING_KEYS

# Most top-logprob alternatives per token a request may ask for (OpenAI's limit; the
# OpenAI-compatible API and /generate share it).
MAX_TOP_LOGPROBS = 20
# Most prompts in one batched request: each is tokenized and registered before anything runs,
# so an unbounded batch could hold the event loop and the queue for one client.
MAX_BATCH_SIZE = 512


# SGLang request fields for features this engine does not implement. They are accepted when
# unset (``null`` / ``false``, as SGLang clients such as bench_serving send them) and refused,
# naming the field, when set: silently ignoring e.g. a LoRA adapter would return the base
# model's answer as if it were the adapter's.
UNSUPPORTED_FEATURES = ("lora_path", "custom_logit_processor", "return_routed_experts",
                        "token_ids_logprob", "session_params")


def is_set(value: Any) -> bool:
    """Whether a request field asks for something: not ``None`` / ``False``, nor a list of them
    (a batch may send one ``null`` per prompt)."""
    if isinstance(value, list):
        return any(is_set(v) for v in value)
    return value is not None and value is not False


def check_unsupported_features(fields: Dict[str, Any]) -> None:
    """``ValueError`` naming the first field of :data:`UNSUPPORTED_FEATURES` that is set."""
    for name in UNSUPPORTED_FEATURES:
        if is_set(fields.get(name)):
            raise ValueError(f"'{name}' is not supported by this server (leave it unset or null)")


def _new_rid() -> str:
    return uuid.uuid4().hex


def check_batch_size(n: int) -> None:
    """``ValueError`` naming :data:`MAX_BATCH_SIZE` if a batch of ``n`` prompts is too large."""
    if n > MAX_BATCH_SIZE:
        raise ValueError(f"the batch has {n} prompts; at most {MAX_BATCH_SIZE} (MAX_BATCH_SIZE) "
                         "are accepted in one request")


@dataclass
class GenerateReqInput:
    """A generation request, single or batched (SGLang's ``/generate`` body).

    Exactly one of ``text`` / ``input_ids`` must be given. In the batched form ``text`` is a list
    of strings (or ``input_ids`` a list of lists) and per-request fields may be lists too.
    """

    text: Optional[Union[List[str], str]] = None
    input_ids: Optional[Union[List[List[int]], List[int]]] = None
    sampling_params: Optional[Union[List[Dict[str, Any]], Dict[str, Any]]] = None
    rid: Optional[Union[List[str], str]] = None
    return_logprob: Optional[Union[List[bool], bool]] = None
    # -1: only output logprobs; k >= 0: also logprobs of prompt tokens k .. end.
    logprob_start_len: Optional[Union[List[int], int]] = None
    top_logprobs_num: Optional[Union[List[int], int]] = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    log_metrics: bool = True
    # The final-normed hidden states that feed the LM head, in meta_info["hidden_states"]
    # (per prompt of a batch, as a list); plain decoding only (refused with speculation).
    return_hidden_states: Union[List[bool], bool] = False
    # Accepted for compatibility with SGLang clients (bench_serving sends some of them) only
    # while unset: a set value is refused in normalization (see UNSUPPORTED_FEATURES).
    lora_path: Optional[Any] = None
    return_routed_experts: bool = False
    custom_logit_processor: Optional[Any] = None
    token_ids_logprob: Optional[Any] = None
    session_params: Optional[Any] = None
    image_data: Optional[Any] = None
    video_data: Optional[Any] = None
    audio_data: Optional[Any] = None
    input_embeds: Optional[Any] = None
    modalities: Optional[Any] = None
    routed_dp_rank: Optional[int] = None
    data_parallel_rank: Optional[int] = None
    routing_key: Optional[str] = None
    bootstrap_host: Optional[Any] = None
    bootstrap_port: Optional[Any] = None
    bootstrap_room: Optional[Any] = None

    # Filled by normalize_batch_and_arguments().
    is_single: bool = field(default=True, init=False)
    batch_size: int = field(default=1, init=False)

    @classmethod
    def from_dict(cls, body: Dict[str, Any]) -> "GenerateReqInput":
        """Build from a JSON body; unknown keys are ignored (as SGLang's HTTP layer does),
        except constrained-decoding keys at the top level, which are refused: they belong in
        ``sampling_params``, where they are refused too (no constrained decoding here)."""
        if not isinstance(body, dict):
            raise ValueError(f"request body must be a JSON object, got {type(body).__name__}")
        for key in CONSTRAINED_DECODING_KEYS:
            if body.get(key) is not None:
                raise ValueError(f"'{key}' is not supported: this server does not implement "
                                 "constrained decoding")
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        return cls(**{k: v for k, v in body.items() if k in names})

    # ------------------------------------------------------------------ normalization
    def normalize_batch_and_arguments(self) -> None:
        """Decide single vs batch, validate the prompt fields and expand per-request fields.

        Raises ``ValueError`` naming the problem (both/neither of text and input_ids, empty batch,
        wrong types, per-request lists of the wrong length, unsupported features).
        """
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of 'text' and 'input_ids' must be given")
        for name in ("input_embeds", "image_data", "video_data", "audio_data"):
            if getattr(self, name) is not None:
                raise ValueError(f"'{name}' is not supported by this engine (text-only model)")
        check_unsupported_features({name: getattr(self, name) for name in UNSUPPORTED_FEATURES})
        if self.text is not None:
            if isinstance(self.text, str):
                self.is_single, self.batch_size = True, 1
            elif isinstance(self.text, list) and all(isinstance(t, str) for t in self.text):
                self.is_single, self.batch_size = False, len(self.text)
            else:
                raise ValueError("'text' must be a string or a list of strings")
        else:
            ids = self.input_ids
            if not isinstance(ids, list):
                raise ValueError("'input_ids' must be a list of ints or a list of lists of ints")
            if ids and all(isinstance(x, list) for x in ids):
                self.is_single, self.batch_size = False, len(ids)
                bad = [x for row in ids for x in row if not _is_int(x)]
            else:
                self.is_single, self.batch_size = True, 1
                bad = [x for x in ids if not _is_int(x)]
            if bad:
                raise ValueError(f"'input_ids' must contain only integers, got {bad[0]!r}")
        if not self.is_single and self.batch_size == 0:
            raise ValueError("the batch of prompts is empty")
        check_batch_size(self.batch_size)

        n = self.batch_size
        self.sampling_params = self._expand("sampling_params", self.sampling_params, {}, dict)
        for sp in (self.sampling_params if not self.is_single else [self.sampling_params]):
            if sp.get("n", 1) not in (None, 1):
                raise ValueError("sampling_params.n > 1 (parallel sampling) is not supported")
        self.return_logprob = self._expand("return_logprob", self.return_logprob, False, bool)
        self.logprob_start_len = self._expand("logprob_start_len", self.logprob_start_len, -1, int)
        self.top_logprobs_num = self._expand("top_logprobs_num", self.top_logprobs_num, 0, int)
        self.return_hidden_states = self._expand("return_hidden_states",
                                                 self.return_hidden_states, False, bool)
        for k in (self.top_logprobs_num if not self.is_single else [self.top_logprobs_num]):
            if not 0 <= k <= MAX_TOP_LOGPROBS:
                raise ValueError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {k}")
        if self.is_single:
            self.rid = self.rid if self.rid is not None else _new_rid()
            _check_rid("rid", self.rid)
        else:
            if self.rid is None:
                self.rid = [_new_rid() for _ in range(n)]
            elif not (isinstance(self.rid, list) and len(self.rid) == n):
                raise ValueError(f"'rid' of a batch must be a list of {n} strings")
            for i, rid in enumerate(self.rid):
                _check_rid(f"rid[{i}]", rid)

    def _expand(self, name: str, value: Any, default: Any, kind: type) -> Any:
        """Single: the value (or default). Batch: a list of ``batch_size`` values."""
        if value is None:
            value = default
        if self.is_single:
            if isinstance(value, list):
                raise ValueError(f"'{name}' must not be a list for a single request")
            return _check_kind(name, value, kind)
        if isinstance(value, list):
            if len(value) != self.batch_size:
                raise ValueError(
                    f"'{name}' has {len(value)} entries but the batch has {self.batch_size} prompts"
                )
            return [_check_kind(name, v if v is not None else default, kind) for v in value]
        value = _check_kind(name, value, kind)
        return [copy.deepcopy(value) for _ in range(self.batch_size)]

    def __getitem__(self, i: int) -> "GenerateReqInput":
        """The ``i``-th request of a normalized batch as a normalized single request."""
        assert not self.is_single, "indexing a single request"
        item = dataclasses.replace(
            self,
            text=self.text[i] if self.text is not None else None,
            input_ids=self.input_ids[i] if self.input_ids is not None else None,
            sampling_params=self.sampling_params[i],
            rid=self.rid[i],
            return_logprob=self.return_logprob[i],
            logprob_start_len=self.logprob_start_len[i],
            top_logprobs_num=self.top_logprobs_num[i],
            return_hidden_states=self.return_hidden_states[i],
        )
        item.is_single, item.batch_size = True, 1
        return item


def _check_rid(name: str, rid: Any) -> None:
    # A rid keys the manager's registry and the scheduler's abort lookups: only a non-empty
    # string can be told apart (and hashed) reliably.
    if not isinstance(rid, str) or not rid:
        raise ValueError(f"'{name}' must be a non-empty string, got {rid!r}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_kind(name: str, value: Any, kind: type) -> Any:
    if kind is int and not _is_int(value):
        raise ValueError(f"'{name}' must be an integer, got {value!r}")
    if kind is bool and not isinstance(value, bool):
        raise ValueError(f"'{name}' must be a boolean, got {value!r}")
    if kind is dict and not isinstance(value, dict):
        raise ValueError(f"'{name}' must be a JSON object, got {type(value).__name__}")
    return value


@dataclass
class TokenizedGenerateReqInput:
    """A validated, tokenized request as the scheduler receives it."""

    rid: str
    input_text: Optional[str]
    input_ids: List[int]
    sampling_params: Any  # sglang.srt.sampling.sampling_params.SamplingParams (normalized)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    return_hidden_states: bool = False


@dataclass
class AbortReq:
    """Abort one request by rid (or every request with ``abort_all``); frees its slots."""

    rid: str = ""
    abort_all: bool = False


@dataclass
class FlushCacheReqInput:
    """Reset the pools; only acts when the scheduler is idle."""


@dataclass
class FlushCacheReqOutput:
    """Whether the flush happened (refused while requests are in flight), and why not."""

    success: bool
    message: str = ""


@dataclass
class GetInternalStateReq:
    """Ask the scheduler for its internal-state dict (``/server_info`` ``internal_states``)."""


@dataclass
class GetInternalStateReqOutput:
    """The scheduler's counters (see ``Scheduler.get_internal_state``)."""

    internal_state: Dict[str, Any]


PROFILE_ACTIVITIES = ("CPU", "GPU", "MEM")


@dataclass
class ProfileReq:
    """Start (``/start_profile``) or stop (``/stop_profile``) the torch profiler on every rank.

    ``start_step``: begin once the scheduler's forward counter reaches it (else at once);
    ``num_steps``: stop and write the trace after that many scheduler steps (else at
    ``/stop_profile``); ``activities`` from :data:`PROFILE_ACTIVITIES` (GPU = CUDA kernels, MEM
    = allocations); ``output_dir`` defaults to ``SGLANG_TORCH_PROFILER_DIR`` and must lie
    inside it (see :func:`resolve_profile_output_dir`); ``profile_prefix`` is a file-name
    prefix, never a path.
    """

    start: bool
    output_dir: Optional[str] = None
    start_step: Optional[int] = None
    num_steps: Optional[int] = None
    activities: List[str] = field(default_factory=lambda: ["CPU", "GPU"])
    with_stack: bool = True
    record_shapes: bool = False
    profile_prefix: str = ""

    @classmethod
    def from_body(cls, body: Any) -> "ProfileReq":
        """A start request from a ``/start_profile`` JSON body (``None`` = defaults); raises
        ``ValueError`` naming the offending field."""
        body = {} if body is None else body
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        if body.get("profile_by_stage"):
            raise ValueError("profile_by_stage is not supported by this server")
        known = {f.name for f in dataclasses.fields(cls)} - {"start"} | {"profile_by_stage"}
        unknown = sorted(set(body) - known)
        if unknown:
            raise ValueError(f"unknown field(s) {unknown}; known: {sorted(known)}")
        req = cls(start=True)
        for name in ("start_step", "num_steps"):
            value = body.get(name)
            low = 0 if name == "start_step" else 1
            if value is not None and (type(value) is not int or value < low):
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
            setattr(req, name, value)
        for name in ("output_dir", "profile_prefix"):
            if body.get(name) is not None:
                if not isinstance(body[name], str):
                    raise ValueError(f"{name} must be a string")
                setattr(req, name, body[name])
        check_profile_prefix(req.profile_prefix)
        req.output_dir = resolve_profile_output_dir(req.output_dir)
        for name in ("with_stack", "record_shapes"):
            if body.get(name) is not None:
                if not isinstance(body[name], bool):
                    raise ValueError(f"{name} must be true or false")
                setattr(req, name, body[name])
        acts = body.get("activities")
        if acts is not None:
            if (not isinstance(acts, list) or not acts
                    or any(a not in PROFILE_ACTIVITIES for a in acts)):
                raise ValueError(f"activities must be a non-empty list drawn from "
                                 f"{list(PROFILE_ACTIVITIES)}, got {acts!r}")
            req.activities = list(acts)
        return req


def check_profile_prefix(prefix: str) -> None:
    """``ValueError`` unless ``prefix`` is a plain file-name prefix (no separator, no ``..``)."""
    if "/" in prefix or "\\" in prefix or ".." in prefix or "\0" in prefix:
        raise ValueError(f"profile_prefix must be a plain file-name prefix (no '/', '\\', '..' "
                         f"or NUL), got {prefix!r}")


def resolve_profile_output_dir(output_dir: Optional[str]) -> str:
    """The absolute directory a profile may write to, inside ``SGLANG_TORCH_PROFILER_DIR``.

    ``None`` / ``""`` is the profiler directory itself; a relative path is taken inside it; an
    absolute one must already point inside it. A ``..`` component is refused outright, and
    symbolic links are resolved before the containment check, so a trace never lands elsewhere.
    Raises ``ValueError`` naming ``output_dir``.
    """
    base = os.path.realpath(envs.SGLANG_TORCH_PROFILER_DIR.get())
    if not output_dir:
        return base
    if "\0" in output_dir or ".." in output_dir.replace("\\", "/").split("/"):
        raise ValueError(f"output_dir must not contain '..' components or NUL, "
                         f"got {output_dir!r}")
    target = os.path.realpath(os.path.join(base, output_dir))
    if os.path.commonpath([base, target]) != base:
        raise ValueError(f"output_dir {output_dir!r} is outside the profiler directory {base!r} "
                         "(SGLANG_TORCH_PROFILER_DIR)")
    return target


@dataclass
class ProfileReqOutput:
    """Whether the start / stop took effect, and what happened (the trace path on a stop)."""

    success: bool
    message: str = ""


# Short alias, as in older SGLang versions.
FlushCacheReq = FlushCacheReqInput


@dataclass
class BatchTokenIDOutput:
    """New output tokens of the requests that have something to report this step.

    Lists are parallel (one entry per rid). ``decode_ids`` holds only the ids produced since the
    previous message for that rid; logprob lists likewise hold only the new entries. Input
    logprobs are sent once, in the first message of a request.
    """

    rids: List[str]
    finished_reasons: List[Optional[Dict[str, Any]]]
    decode_ids: List[List[int]]
    prompt_tokens: List[int]
    completion_tokens: List[int]
    cached_tokens: List[int]
    # Detokenization options of each request (the detokenizer keeps no request registry).
    skip_special_tokens: List[bool]
    spaces_between_special_tokens: List[bool]
    no_stop_trim: List[bool]
    stop_strs: List[List[str]]
    # Logprobs: one entry per rid as well (an empty list when the request did not ask).
    output_token_logprobs_val: List[List[float]] = field(default_factory=list)
    output_token_logprobs_idx: List[List[int]] = field(default_factory=list)
    output_top_logprobs_val: List[List[List[float]]] = field(default_factory=list)
    output_top_logprobs_idx: List[List[List[int]]] = field(default_factory=list)
    input_token_logprobs_val: List[List[Optional[float]]] = field(default_factory=list)
    input_token_logprobs_idx: List[List[int]] = field(default_factory=list)
    input_top_logprobs_val: List[List[List[float]]] = field(default_factory=list)
    input_top_logprobs_idx: List[List[List[int]]] = field(default_factory=list)
    # Hidden states (requests that asked; else an empty list): the new entries as CPU tensors,
    # a prompt chunk's rows ``[n, H]`` (chunks in order) or one decode row ``[H]`` each.
    output_hidden_states: List[List[Any]] = field(default_factory=list)


@dataclass
class BatchStrOutput:
    """Detokenized update per request: ``output_strs`` is the NEW text since the last update."""

    rids: List[str]
    finished_reasons: List[Optional[Dict[str, Any]]]
    output_strs: List[str]
    output_ids: List[List[int]]
    prompt_tokens: List[int]
    completion_tokens: List[int]
    cached_tokens: List[int]
    output_token_logprobs_val: List[List[float]] = field(default_factory=list)
    output_token_logprobs_idx: List[List[int]] = field(default_factory=list)
    output_top_logprobs_val: List[List[List[float]]] = field(default_factory=list)
    output_top_logprobs_idx: List[List[List[int]]] = field(default_factory=list)
    input_token_logprobs_val: List[List[Optional[float]]] = field(default_factory=list)
    input_token_logprobs_idx: List[List[int]] = field(default_factory=list)
    input_top_logprobs_val: List[List[List[float]]] = field(default_factory=list)
    input_top_logprobs_idx: List[List[List[int]]] = field(default_factory=list)
    output_hidden_states: List[List[Any]] = field(default_factory=list)  # as BatchTokenIDOutput's
