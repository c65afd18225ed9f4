"""Batch-invariance probe: which module of the target model rounds a token differently in a
1-row decode than in an ``N``-row speculative verify.

Next session, on the H200: test/srt/test_deterministic_spec.py (bf16, the bundled model,
``--enable-deterministic-inference``) has greedy NEXTN-3 and DSPARK leave plain decoding on one
of its 10 prompts, at the same token for both. Run the probe on each of the test's prompts
(``--prompt-index 0`` .. ``9``: the same held-out text and 64 tokens) with ``--gen`` past the
first differing token the test prints (256 covers the test), then the same with
``--speculative-algorithm DSPARK`` in place of ``--speculative-algorithm NEXTN
--speculative-num-steps 3``; each run appends one JSON line::

    python benchmark/batch1/invariance_probe.py --device cuda --dtype bfloat16 \\
        --enable-deterministic-inference --speculative-algorithm NEXTN \\
        --speculative-num-steps 3 --max-total-tokens 32768 --max-running-requests 4 \\
        --prompt-index 0 --gen 256 --result-filename invariance_probe.jsonl

The report's "first difference at <module>" names the operation to make batch-invariant (its
inputs equal: inside that module; its inputs already different: inline code of the enclosing
module). Should every prompt report "batch-invariant" although the test fails, the difference is
not in an eager batch-1 target forward: check the test with CUDA graphs off (the probe always
runs eager) and its batch-4 leg (the probe runs one request).

On CPU (fp32, the bundled model; the default ``--model-path``)::

    python benchmark/batch1/invariance_probe.py --device cpu --dtype float32 \\
        --speculative-algorithm NEXTN --speculative-num-steps 3

What it does, in process (no server): one greedy request (``--gen`` new tokens) runs through a
speculative scheduler, then through a plain one (the same server flags without the
``--speculative-*`` ones; ``2 N`` more tokens, so that it holds every position a verify window
reaches). Each scheduler is dropped before the next is built, so both fit on one GPU. Forward
hooks on every submodule of the *target* model (the scheduler's ``tp_worker.model_runner.model``:
in a speculative scheduler too, where the round worker holds that same runner as its
``target_runner``; the draft model is never hooked) record, for every call made inside a target
forward, the module's qualified name, the forward mode (decode / verify / extend, read from the
``ForwardBatch`` the runner's ``forward`` receives: a wrapper on that method opens and closes
each forward) and host copies of its output tensors and positional tensor inputs. The runner
calls ``model.forward`` and the model its inner ``model.forward_with_aux`` directly, so those
two never appear (their work is their children's, plus glue).

Pairing (:func:`pair_rows`): a row of a speculative verify at position ``q`` is compared with the
plain decode at ``q`` when the tokens at every generated position up to ``q`` are the same in both
runs (the verify's own inputs, and the tokens earlier rounds committed): row 0 of the first
verify always pairs (the anchor: the prefill's token at the first generated position), later
rows pair where the drafts equal the plain greedy tokens. The two prefills are paired row by row
too (same prompt, same shapes: they should match; a difference there would spoil the rest).

Comparison (:func:`compare_forward`): per speculative forward, in chronological order, per module
call in the order the calls *return* (children before their parent, so the first module that
differs is the innermost, earliest one), each output tensor whose first dimension is the
forward's token count is compared row by row, bitwise (-0.0 and 0.0 differ). The report names the
first module whose output differs (shape, max abs diff, differing elements, the pairs it differs
on) and whether that module's *inputs* were already different (then the difference arose in
code of an enclosing module between its child calls, e.g. a ``torch.bmm`` written inline in a
``forward``), plus a table of every module with its first-difference status. Later forwards read
caches earlier ones wrote: trust the first difference, not the later ones. Both prefills, every
decode and every verify are recorded: keep ``--gen`` small on a big model.

CUDA graphs are disabled whatever the flags say: a replayed graph calls no Python, so no hook
would fire. Exit status 0 whether or not a difference is found; the report says "batch-invariant
over N modules" or "first difference at <module>".
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from sglang.srt.layers.kernel_choices import add_kernel_choices_arg, kernel_choices_from_args
from sglang.srt.managers.io_struct import BatchTokenIDOutput, TokenizedGenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs

try:  # run as a script, benchmark/batch1 is on sys.path; imported by file path it may not be
    from census_common import git_commit
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from census_common import git_commit

MODE_NAMES: Dict[ForwardMode, str] = {ForwardMode.DECODE: "decode",
                                      ForwardMode.TARGET_VERIFY: "verify",
                                      ForwardMode.EXTEND: "extend"}
PROMPT_CHARS = 2000  # text read after the held-out file's "def" (test_deterministic_spec.py's)


# ============================================================================================
# Records
# ============================================================================================
@dataclass
class CallRecord:
    """One module call inside a target forward: host copies of its tensors (``None`` where an
    output or positional argument is not a tensor, so indices line up across runs)."""

    name: str  # qualified name in the target model
    occurrence: int  # 0 for the module's first call in this forward, 1 for the second, ...
    mode: str
    type_name: str
    outputs: List[Optional[torch.Tensor]]
    inputs: List[Optional[torch.Tensor]]

    @property
    def key(self) -> str:
        """``name``, with ``#k`` appended for the module's call ``k > 0`` in a forward."""
        return self.name if self.occurrence == 0 else f"{self.name}#{self.occurrence}"


@dataclass
class ForwardRecord:
    """One target forward: its mode, its tokens (host copies) and its module calls in the order
    they returned."""

    index: int
    mode: str
    positions: List[int]
    input_ids: List[int]
    calls: List[CallRecord] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """``T``: rows of the flattened token batch."""
        return len(self.input_ids)

    def call_map(self) -> Dict[str, CallRecord]:
        """Calls by :attr:`CallRecord.key`."""
        return {c.key: c for c in self.calls}


@dataclass
class RowPair:
    """A plain row and a speculative row that must be bit-identical at every module."""

    kind: str  # "prefill" or "decode/verify"
    position: int
    token: int
    plain_forward: int
    plain_row: int
    spec_forward: int
    spec_row: int

    def describe(self, spec_mode: str, spec_ordinal: int) -> str:
        """``verify 0 row 2 @ pos 66`` (``spec_ordinal``: the forward's rank among its mode)."""
        return f"{spec_mode} {spec_ordinal} row {self.spec_row} @ pos {self.position}"


# ============================================================================================
# Hooks
# ============================================================================================
def forward_mode_name(mode: Any) -> str:
    """``decode`` / ``verify`` / ``extend`` for the modes the probe pairs, else the enum's name
    in lower case (``str(mode)`` for a non-enum)."""
    if mode in MODE_NAMES:
        return MODE_NAMES[mode]
    return mode.name.lower() if isinstance(mode, ForwardMode) else str(mode)


def host_copy(value: Any) -> Optional[torch.Tensor]:
    """A detached host copy of ``value`` when it is a tensor, else None (copied at once: a
    fused residual norm may update its tensors in place after returning them)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return None


def output_tensors(output: Any) -> List[Optional[torch.Tensor]]:
    """Host copies of a module's output: a tensor, each element of a tuple / list, or each field
    of a dataclass (the logits processor's output); non-tensors are ``None`` placeholders."""
    if isinstance(output, torch.Tensor):
        return [host_copy(output)]
    if isinstance(output, (tuple, list)):
        return [host_copy(v) for v in output]
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        return [host_copy(getattr(output, f.name)) for f in dataclasses.fields(output)]
    return []


class ForwardRecorder:
    """Collects :class:`ForwardRecord` s of one model through forward hooks.

    Module calls are recorded only while a target forward of a mode in ``modes`` is open, so
    a draft that calls a shared target module (an LM head) outside the target's forward is not
    mixed in.
    """

    def __init__(self, modes: Sequence[str], record_inputs: bool = True):
        self.modes = frozenset(modes)
        self.record_inputs = record_inputs
        self.forwards: List[ForwardRecord] = []
        self._open: Optional[ForwardRecord] = None
        self._counts: Dict[str, int] = {}
        self._inputs: Dict[str, List[List[Optional[torch.Tensor]]]] = {}  # a stack per name

    def open_forward(self, forward_batch: Any) -> None:
        """Start recording a target forward (nothing is recorded for other modes)."""
        mode = forward_mode_name(getattr(forward_batch, "forward_mode", None))
        self._open, self._counts, self._inputs = None, {}, {}
        if mode not in self.modes:
            return
        self._open = ForwardRecord(len(self.forwards), mode,
                                   forward_batch.positions.tolist(),
                                   forward_batch.input_ids.tolist())

    def close_forward(self) -> None:
        """End the target forward (kept when it was recorded)."""
        if self._open is not None:
            self.forwards.append(self._open)
        self._open = None

    def before_call(self, name: str, args: Tuple[Any, ...]) -> None:
        """Copy the positional tensor inputs of a call before it runs (in-place updates)."""
        if self._open is None:
            return
        inputs = [host_copy(a) for a in args] if self.record_inputs else []
        self._inputs.setdefault(name, []).append(inputs)

    def after_call(self, name: str, module: nn.Module, output: Any) -> None:
        """Record a returning call with host copies of its outputs."""
        if self._open is None:
            return
        stack = self._inputs.get(name)
        inputs = stack.pop() if stack else []
        occurrence = self._counts.get(name, 0)
        self._counts[name] = occurrence + 1
        self._open.calls.append(CallRecord(name, occurrence, self._open.mode,
                                           type(module).__name__, output_tensors(output), inputs))


def install_recorder(runner: Any, recorder: ForwardRecorder) -> Callable[[], None]:
    """Hook ``recorder`` onto a model runner: its ``forward(forward_batch)`` opens and closes a
    forward (the runner calls ``model.forward`` directly, so no hook of the root module fires),
    every submodule of ``runner.model`` records its inputs and outputs. Returns the function
    that undoes it all."""
    handles: List[Any] = []
    for name, module in runner.model.named_modules():
        handles.append(module.register_forward_pre_hook(
            lambda mod, args, _name=name: recorder.before_call(_name, args)))
        handles.append(module.register_forward_hook(
            lambda mod, args, out, _name=name: recorder.after_call(_name, mod, out)))
    inner = runner.forward  # the wrapper shadows it on the instance
    own = vars(runner).get("forward")  # an instance's own wrapper (another tool's), if any

    def forward(forward_batch: Any, **kwargs: Any) -> Any:
        recorder.open_forward(forward_batch)
        try:
            return inner(forward_batch, **kwargs)
        finally:
            recorder.close_forward()

    runner.forward = forward

    def remove() -> None:
        for handle in handles:
            handle.remove()
        if own is not None:
            runner.forward = own
        else:
            del runner.forward  # the class's method again

    return remove


# ============================================================================================
# Runs
# ============================================================================================
def target_runner(sched: Scheduler) -> Any:
    """The target's model runner of a plain or speculative scheduler (never the draft's): the
    NEXTN and DSPARK workers verify with ``tp_worker.model_runner`` (their ``target_runner``)."""
    runner = sched.tp_worker.model_runner
    worker_target = getattr(sched.round_worker, "target_runner", runner)
    if worker_target is not runner:
        raise RuntimeError("the round worker verifies with a runner other than tp_worker's")
    return runner


def held_out_prompt(tokenizer: Any, index: int, length: int) -> List[int]:
    """Prompt ``index`` of test_deterministic_spec.py: ``length`` tokens of the held-out Python
    file ``HELD_OUT_FILES[index]`` from its first ``def`` a third of the way in."""
    from sglang.train.data import HELD_OUT_FILES, stdlib_root

    text = (stdlib_root() / HELD_OUT_FILES[index]).read_text(encoding="utf-8")
    start = text.find("\ndef ", len(text) // 3) + 1
    return list(tokenizer.encode(text[start:start + PROMPT_CHARS]))[:length]


def random_prompt(vocab_size: int, length: int, seed: int) -> List[int]:
    """``length`` random token ids (a checkpoint without a tokenizer)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=gen).tolist()


def greedy_tokens(sched: Scheduler, prompt: List[int], max_new_tokens: int) -> List[int]:
    """Run one greedy request to completion in the in-process scheduler; its new tokens."""
    sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    sp.verify(sched.vocab_size)
    sched.submit(TokenizedGenerateReqInput("probe", None, list(prompt), sp.normalize(None)))
    sched.run_until_idle()
    tokens: List[int] = []
    for msg in sched.outbox:
        if isinstance(msg, BatchTokenIDOutput):
            for i, rid in enumerate(msg.rids):
                if rid == "probe":
                    tokens.extend(msg.decode_ids[i])
    sched.outbox.clear()
    return tokens


def free_device_memory() -> None:
    """Let go of a dropped scheduler's memory before the next one is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def record_run(server_args: ServerArgs, prompt: List[int], max_new_tokens: int,
               modes: Sequence[str],
               prepare: Optional[Callable[[nn.Module], None]] = None
               ) -> Tuple[List[int], List[ForwardRecord], str]:
    """Build a scheduler, hook its target model, run the greedy request; returns ``(tokens,
    recorded forwards, label)``. ``prepare(model)`` runs on the target model before the hooks
    go on (tests inject a difference with it). The scheduler is dropped on return."""
    sched = Scheduler(server_args)
    runner = target_runner(sched)
    if prepare is not None:
        prepare(runner.model)
    recorder = ForwardRecorder(modes)
    remove = install_recorder(runner, recorder)
    try:
        tokens = greedy_tokens(sched, prompt, max_new_tokens)
    finally:
        remove()
    label = run_label(server_args, getattr(sched.round_worker, "round_tokens", 1))
    del sched, runner
    free_device_memory()
    return tokens, recorder.forwards, label


def run_label(server_args: ServerArgs, round_tokens: int) -> str:
    """``plain`` or e.g. ``NEXTN (4-token verify)``."""
    algo = server_args.speculative_algorithm
    return "plain" if algo is None else f"{algo} ({round_tokens}-token verify)"


# ============================================================================================
# Pairing
# ============================================================================================
def plain_rows_by_position(forwards: Sequence[ForwardRecord]) -> Dict[int, Tuple[int, int, int]]:
    """``position -> (forward index, row, input token)`` of every plain decode row (the first
    forward to hold a position wins)."""
    rows: Dict[int, Tuple[int, int, int]] = {}
    for f in forwards:
        if f.mode != "decode":
            continue
        for row, (pos, tok) in enumerate(zip(f.positions, f.input_ids)):
            rows.setdefault(pos, (f.index, row, tok))
    return rows


def pair_prefill_rows(plain: Sequence[ForwardRecord],
                      spec: Sequence[ForwardRecord]) -> List[RowPair]:
    """Row-by-row pairs of the first prefill of each run, when both hold the same tokens at the
    same positions (a chunked prompt: its first chunk only)."""
    p = next((f for f in plain if f.mode == "extend"), None)
    s = next((f for f in spec if f.mode == "extend"), None)
    if p is None or s is None or (p.positions, p.input_ids) != (s.positions, s.input_ids):
        return []
    return [RowPair("prefill", pos, tok, p.index, row, s.index, row)
            for row, (pos, tok) in enumerate(zip(p.positions, p.input_ids))]


def pair_rows(plain: Sequence[ForwardRecord], spec: Sequence[ForwardRecord],
              first_generated: int) -> List[RowPair]:
    """Pairs of a speculative verify row with the plain decode row at its position, where the
    tokens at every generated position (``first_generated`` on) up to it are equal in both runs:
    the verify's inputs up to the row, and before the verify's first position the tokens the
    earlier verifies committed there (the latest verify holding a position wrote what stands
    there: each window starts at the first position not yet committed)."""
    plain_rows = plain_rows_by_position(plain)
    spec_tokens: Dict[int, int] = {}  # what the speculative run holds at each position
    pairs: List[RowPair] = []
    for f in spec:
        if f.mode != "verify":
            continue
        spec_tokens.update(zip(f.positions, f.input_ids))
        for row, pos in enumerate(f.positions):
            if _same_tokens(spec_tokens, plain_rows, first_generated, pos):
                p_index, p_row, tok = plain_rows[pos]
                pairs.append(RowPair("decode/verify", pos, tok, p_index, p_row, f.index, row))
    return pairs


def _same_tokens(spec_tokens: Dict[int, int], plain_rows: Dict[int, Tuple[int, int, int]],
                 first: int, last: int) -> bool:
    """Both runs hold the same token at every position ``first .. last``."""
    return all(q in plain_rows and spec_tokens.get(q) == plain_rows[q][2]
               for q in range(first, last + 1))


# ============================================================================================
# Comparison
# ============================================================================================
_BIT_TYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_pattern(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers of the same width (bitwise equality: NaN equals itself, -0.0
    differs from 0.0); integer and bool tensors as they are."""
    if t.is_floating_point() or t.is_complex():
        return t.contiguous().view(_BIT_TYPES[t.element_size()])
    return t


def per_token_row(t: Optional[torch.Tensor], num_tokens: int,
                  row: int) -> Optional[torch.Tensor]:
    """Row ``row`` of an output laid out one row per token (first dimension = the forward's
    token count), else None."""
    if t is None or t.dim() == 0 or t.shape[0] != num_tokens:
        return None
    return t[row]


@dataclass
class RowDiff:
    """The comparison of one tensor of one module on one row pair."""

    tensor: int  # output (or input) index
    shape: Tuple[int, ...]  # of the row
    differing: int  # elements whose bits differ
    max_abs_diff: float


def compare_row(a: torch.Tensor, b: torch.Tensor, index: int) -> RowDiff:
    """A :class:`RowDiff` of two rows (mismatched shapes or dtypes: every element differs, by
    an infinite amount)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return RowDiff(index, tuple(a.shape), max(a.numel(), b.numel()), float("inf"))
    mask = bit_pattern(a) != bit_pattern(b)
    differing = int(mask.sum())
    max_abs = 0.0
    if differing:  # over the differing elements only: a NaN equal to itself does not count
        delta = (a[mask].double() - b[mask].double()).abs()
        max_abs = float(delta.nan_to_num(nan=float("inf")).max())
    return RowDiff(index, tuple(a.shape), differing, max_abs)


def compare_tensors(spec: Sequence[Optional[torch.Tensor]],
                    plain: Sequence[Optional[torch.Tensor]], pair: RowPair,
                    spec_tokens: int, plain_tokens: int) -> List[RowDiff]:
    """Per-token tensors of one call (outputs or inputs) on one row pair; tensors that are not
    laid out per token in both runs are left out."""
    diffs = []
    for i, (s, p) in enumerate(zip(spec, plain)):
        a = per_token_row(s, spec_tokens, pair.spec_row)
        b = per_token_row(p, plain_tokens, pair.plain_row)
        if a is not None and b is not None:
            diffs.append(compare_row(a, b, i))
    return diffs


@dataclass
class ModuleResult:
    """One module call's status over the pairs of one speculative forward."""

    key: str
    type_name: str
    compared_pairs: int = 0
    differing_pairs: List[RowPair] = field(default_factory=list)
    first_diff: Optional[RowDiff] = None  # on the first differing pair
    # Positional inputs that differ on the first differing pair (None: none is per-token).
    inputs_differ: Optional[List[int]] = None
    missing_in_plain: bool = False

    @property
    def differs(self) -> bool:
        """Any compared row differs."""
        return bool(self.differing_pairs)


def compare_call(call: CallRecord, spec_f: ForwardRecord, plain_calls: Dict[int, CallRecord],
                 plain_forwards: Dict[int, ForwardRecord],
                 pairs: Sequence[RowPair]) -> ModuleResult:
    """Compare one speculative call with the same call of each paired plain forward
    (``plain_calls``: by plain forward index, missing where the plain forward never made it)."""
    result = ModuleResult(call.key, call.type_name)
    for pair in pairs:
        plain_call = plain_calls.get(pair.plain_forward)
        if plain_call is None:
            result.missing_in_plain = True
            continue
        plain_t = plain_forwards[pair.plain_forward].num_tokens
        diffs = compare_tensors(call.outputs, plain_call.outputs, pair, spec_f.num_tokens, plain_t)
        if not diffs:
            continue
        result.compared_pairs += 1
        bad = [d for d in diffs if d.differing]
        if not bad:
            continue
        if not result.differing_pairs:
            result.first_diff = bad[0]
            inputs = compare_tensors(call.inputs, plain_call.inputs, pair, spec_f.num_tokens,
                                     plain_t)
            result.inputs_differ = [d.tensor for d in inputs if d.differing] if inputs else None
        result.differing_pairs.append(pair)
    return result


def compare_forward(spec_f: ForwardRecord, pairs: Sequence[RowPair],
                    plain_forwards: Dict[int, ForwardRecord]) -> List[ModuleResult]:
    """Every module call of one speculative forward, in the order the calls returned, against
    its paired plain rows."""
    plain_maps = {i: plain_forwards[i].call_map() for i in {p.plain_forward for p in pairs}}
    results = []
    for call in spec_f.calls:
        plain_calls = {i: m[call.key] for i, m in plain_maps.items() if call.key in m}
        results.append(compare_call(call, spec_f, plain_calls, plain_forwards, pairs))
    return results


def pairs_by_forward(pairs: Sequence[RowPair]) -> Dict[int, List[RowPair]]:
    """Pairs grouped by speculative forward, in the forwards' order."""
    grouped: Dict[int, List[RowPair]] = {}
    for pair in sorted(pairs, key=lambda p: (p.spec_forward, p.spec_row)):
        grouped.setdefault(pair.spec_forward, []).append(pair)
    return grouped


def ordinals(forwards: Sequence[ForwardRecord]) -> Dict[int, int]:
    """Each forward's rank among the forwards of its mode (``verify 0`` = the first verify)."""
    seen: Dict[str, int] = {}
    out = {}
    for f in forwards:
        out[f.index] = seen.get(f.mode, 0)
        seen[f.mode] = out[f.index] + 1
    return out


# ============================================================================================
# The probe
# ============================================================================================
def plain_server_args(args: argparse.Namespace, defaults: argparse.Namespace) -> ServerArgs:
    """The plain run's server args: the command line without its ``--speculative-*`` flags."""
    plain = argparse.Namespace(**vars(args))
    for name in vars(args):
        if name.startswith("speculative_"):
            setattr(plain, name, getattr(defaults, name))
    return ServerArgs.from_cli_args(plain)


def run_probe(spec_args: ServerArgs, plain_args: ServerArgs, prompt: List[int], gen: int,
              prepare: Optional[Callable[[nn.Module], None]] = None) -> Dict[str, Any]:
    """Record the plain and the speculative run of ``prompt`` (``gen`` new tokens; the plain run
    a few more, so that it holds every position a verify window reaches), pair the rows and
    compare them module by module; returns the report's record (:func:`format_report`)."""
    if spec_args.speculative_algorithm is None:
        raise ValueError("the probe compares a speculative run with a plain one: pass "
                         "--speculative-algorithm")
    spec_tokens, spec_fw, spec_label = record_run(spec_args, prompt, gen, ("extend", "verify"),
                                                  prepare)
    window = max((f.num_tokens for f in spec_fw if f.mode == "verify"), default=1)
    plain_tokens, plain_fw, _ = record_run(plain_args, prompt, gen + 2 * window,
                                           ("extend", "decode"), prepare)
    pairs = pair_prefill_rows(plain_fw, spec_fw) + pair_rows(plain_fw, spec_fw, len(prompt))
    return summarize(spec_fw, plain_fw, pairs, spec_label, prompt, spec_tokens, plain_tokens)


def compare_runs(spec_fw: List[ForwardRecord], plain_fw: List[ForwardRecord],
                 pairs: List[RowPair]) -> Tuple[List[Dict[str, Any]], Optional[Dict[str, Any]]]:
    """Compare every paired speculative forward, in chronological order; returns ``(a table row
    per module call, the first difference)``: the first differing module of the earliest forward
    with a difference (None when every compared row matched)."""
    plain_by_index = {f.index: f for f in plain_fw}
    spec_by_index = {f.index: f for f in spec_fw}
    rank = ordinals(spec_fw)
    modules: Dict[str, Dict[str, Any]] = {}  # key -> table row
    first: Optional[Dict[str, Any]] = None
    for index, group in pairs_by_forward(pairs).items():  # chronological
        f = spec_by_index[index]
        for res in compare_forward(f, group, plain_by_index):  # in return order
            row = modules.setdefault(res.key, {"module": res.key, "type": res.type_name,
                                               "compared_rows": 0, "missing": False})
            row["compared_rows"] += res.compared_pairs
            row["missing"] |= res.missing_in_plain
            if res.differs and "where" not in row:  # this module's first differing forward
                row.update(_difference(res, f, rank))
                if first is None:
                    first = dict(row, status="differs")
    for row in modules.values():
        row["status"] = module_status(row)
    return in_call_order(list(modules.values()), spec_fw, pairs), first


def in_call_order(rows: List[Dict[str, Any]], spec_fw: Sequence[ForwardRecord],
                  pairs: Sequence[RowPair]) -> List[Dict[str, Any]]:
    """Table rows in the return order of the first paired decode / verify forward (a module the
    prefill calls and the verify does not, or the other way round, sits where that forward has
    it; modules it never calls follow in the order first seen)."""
    index = next((p.spec_forward for p in sorted(pairs, key=lambda p: p.spec_forward)
                  if p.kind != "prefill"), None)
    calls = next((f.calls for f in spec_fw if f.index == index), [])
    order = {c.key: i for i, c in enumerate(calls)}
    return sorted(rows, key=lambda r: order.get(r["module"], len(order)))  # stable


def summarize(spec_fw: List[ForwardRecord], plain_fw: List[ForwardRecord],
              pairs: List[RowPair], spec_label: str, prompt: List[int], spec_tokens: List[int],
              plain_tokens: List[int]) -> Dict[str, Any]:
    """The record of the report: the runs' tokens, the pairs, the module table and the first
    difference (:func:`compare_runs`)."""
    modules, first = compare_runs(spec_fw, plain_fw, pairs)
    rank = ordinals(spec_fw)
    modes = {f.index: f.mode for f in spec_fw}
    rows = [p for p in pairs if p.kind != "prefill"]
    return {"run": spec_label, "prompt_len": len(prompt), "prompt": prompt,
            "plain_tokens": plain_tokens, "spec_tokens": spec_tokens,
            "tokens_agree_for": _common_prefix(plain_tokens, spec_tokens),
            "prefill_rows": len(pairs) - len(rows), "paired_rows": len(rows),
            "pairs": [dict(dataclasses.asdict(p),
                           spec=p.describe(modes[p.spec_forward], rank[p.spec_forward]))
                      for p in rows],
            "verify_forwards": sum(f.mode == "verify" for f in spec_fw),
            "modules_compared": sum(1 for m in modules if m["compared_rows"]),
            "first_difference": first, "modules": modules}


def module_status(row: Dict[str, Any]) -> str:
    """``differs``, ``equal`` (every compared row), ``not called in the plain run`` or
    ``not per-token`` (no output laid out one row per token in both runs)."""
    if "where" in row:
        return "differs"
    if row["compared_rows"]:
        return "equal"
    return "not called in the plain run" if row["missing"] else "not per-token"


def _difference(res: ModuleResult, f: ForwardRecord, rank: Dict[int, int]) -> Dict[str, Any]:
    """The table fields of a module's first differing forward."""
    d = res.first_diff
    assert d is not None
    where = [p.describe(f.mode, rank[f.index]) for p in res.differing_pairs]
    return {"where": where, "output": d.tensor, "shape": list(d.shape), "differing": d.differing,
            "max_abs_diff": d.max_abs_diff, "inputs_differ": res.inputs_differ}


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ============================================================================================
# Output and command line
# ============================================================================================
def verdict(result: Dict[str, Any]) -> str:
    """The report's one-line answer."""
    first = result["first_difference"]
    if first is None:
        return f"batch-invariant over {result['modules_compared']} modules"
    return f"first difference at {first['module']}"


def describe_first(first: Dict[str, Any]) -> List[str]:
    """Lines about the first differing module: where, how much, and what its inputs say."""
    lines = [f"  {first['module']} ({first['type']}), output {first['output']}, row shape "
             f"{first['shape']}: {first['differing']} element(s) differ, max abs diff "
             f"{first['max_abs_diff']:.3g}", f"  on {', '.join(first['where'])}"]
    enclosing = first["module"].split("#")[0].rpartition(".")[0] or "the model"
    if first["inputs_differ"]:
        lines.append(f"  its positional input(s) {first['inputs_differ']} already differed: the "
                     f"difference arose outside the hooked modules, in code of {enclosing} "
                     "between its child calls (an op written inline in a forward), or in a "
                     "child output that is not laid out per token")
    elif first["inputs_differ"] == []:
        lines.append("  its per-token inputs were bit-identical: the difference arises inside "
                     "this module (its own code, or a child whose output is not per-token)")
    return lines


def module_table(result: Dict[str, Any]) -> str:
    """``| module | type | rows | status |``, one line per module call, in return order."""
    lines = ["| module | type | rows | status |", "|---|---|---|---|"]
    for m in result["modules"]:
        status = m["status"]
        if status == "differs":
            status = (f"differs: {m['differing']} elem, max {m['max_abs_diff']:.3g}, "
                      f"first on {m['where'][0]}")
        lines.append(f"| {m['module']} | {m['type']} | {m['compared_rows']} | {status} |")
    return "\n".join(lines)


def format_report(result: Dict[str, Any]) -> str:
    """The printed report: runs, pairs, the verdict and the module table."""
    pairs = ", ".join(p["spec"] for p in result["pairs"]) or "none"
    lines = [f"invariance probe: {result['run']} vs plain decode, prompt of "
             f"{result['prompt_len']} tokens",
             f"plain tokens: {result['plain_tokens']}",
             f"speculative tokens: {result['spec_tokens']} (agree for the first "
             f"{result['tokens_agree_for']})",
             f"paired rows: {result['paired_rows']} ({pairs}); prefill rows: "
             f"{result['prefill_rows']}; modules compared: {result['modules_compared']}",
             verdict(result)]
    if result["first_difference"] is not None:
        lines += describe_first(result["first_difference"])
    lines += ["", module_table(result)]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="benchmark/batch1/invariance_probe.py",
                                     description=__doc__.splitlines()[0])
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--prompt-index", type=int, default=0,
                        help="held-out prompt (test_deterministic_spec.py uses 0..9); a "
                             "checkpoint without a tokenizer gets random ids (seed = this index)")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens")
    parser.add_argument("--gen", type=int, default=8,
                        help="new tokens of the speculative run (the plain one runs a few more)")
    parser.add_argument("--label", type=str, default="", help="run name in the JSON line")
    parser.add_argument("--result-filename", type=str, default=None,
                        help="append the report as one JSON line")
    add_kernel_choices_arg(parser)
    return parser


def probe_prompt(server_args: ServerArgs, index: int, length: int) -> List[int]:
    """The prompt of a run: held-out text through the model's tokenizer, else random ids."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.managers.utils import load_tokenizer

    tokenizer = load_tokenizer(server_args)
    if tokenizer is not None:
        return held_out_prompt(tokenizer, index, length)
    cfg = ModelConfig.from_path(server_args.model_path, server_args.json_model_override_args)
    return random_prompt(cfg.vocab_size, length, index)


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    """Command line; prints the report and returns its record (exit status 0 either way)."""
    parser = _parser()
    args = parser.parse_args(argv)
    from sglang.train.data import HELD_OUT_FILES

    if args.gen < 1 or args.prompt_len < 1 or not 0 <= args.prompt_index < len(HELD_OUT_FILES):
        parser.error(f"--gen and --prompt-len must be >= 1 and --prompt-index in "
                     f"0..{len(HELD_OUT_FILES) - 1}")
    if args.tp_size != 1:
        parser.error("the probe runs one rank: --tp-size 1")
    args.disable_cuda_graph = True  # a replayed graph runs no Python: no hook would fire
    try:
        spec_args = ServerArgs.from_cli_args(args)
        plain_args = plain_server_args(args, parser.parse_args([]))
    except ValueError as exc:
        parser.error(str(exc))
    if spec_args.speculative_algorithm is None:
        parser.error("pass --speculative-algorithm (NEXTN or DSPARK): the probe compares its "
                     "verify with plain decoding")
    choices = kernel_choices_from_args(args)
    spec_args.kernel_choices = plain_args.kernel_choices = choices  # read by the runner
    prompt = probe_prompt(spec_args, args.prompt_index, args.prompt_len)
    result = run_probe(spec_args, plain_args, prompt, args.gen)
    result.update(label=args.label, prompt_index=args.prompt_index,
                  device=spec_args.resolved_device(), dtype=str(spec_args.resolved_dtype()),
                  deterministic=spec_args.enable_deterministic_inference,
                  model=spec_args.resolved_model_path(), **git_commit())
    print(format_report(result))
    if args.result_filename:
        with open(args.result_filename, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
