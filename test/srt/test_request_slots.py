"""Request slots sized from memory when ``--max-running-requests`` is not given.

Each slot costs its KDA state, the speculative copies of it (one per chain position of a verify
round), what the speculative worker keeps per slot (asked of the algorithm through
``SpecRequirements``) and a request-map row; the KV cache keeps room for one request of the full
context. Measured on an H200 (2026-12-03): Ling-3.0-flash fp8 with ``--mem-fraction-static 0.93
--context-length 9216`` started plain but refused to start with NEXTN-3, whose fixed 48 slots
left no KV cache. The first test replays those numbers through the sizing functions; the others
build the real scheduler on the bundled model with a fake device budget (``device_memory`` is
the runner's one seam for it).
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Tuple

import pytest
import torch

from engine_test_utils import make_scheduler, sampling
from sglang.srt.configs.engine_defaults import (
    AUTO_MAX_RUNNING_REQUESTS,
    SPECULATIVE_MAX_RUNNING_REQUESTS,
)
from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR, ModelConfig
from sglang.srt.managers.io_struct import BatchTokenIDOutput, TokenizedGenerateReqInput
from sglang.srt.model_executor import model_runner as mr
from sglang.srt.model_executor.model_runner import (
    DeviceMemory,
    kv_bytes_per_token,
    kv_slots_from_memory,
    mla_pool_layer_ids,
    plan_request_slots,
    request_slot_cost,
)
from sglang.srt.rounds.contract import SpecRequirements
from sglang.srt.rounds.registry import get_spec_worker_class
from sglang.srt.server_args import ServerArgs

GIB, MIB = 1 << 30, 1 << 20
MODEL = str(BUNDLED_MODEL_DIR)

pytestmark = pytest.mark.usefixtures("two_torch_threads")

# ---------------------------------------------------------------- the H200 case, by the numbers
# --mem-fraction-static 0.93 allowed 130.01 GiB; the fp8 weights (MTP layer included) took
# 119.82 GiB. The same weights are used for all three cases so that only the per-slot costs
# differ.
H200_FRACTION = 0.93
H200_TOTAL = int(130.01 * GIB / H200_FRACTION)
H200_WEIGHTS = int(119.82 * GIB)
H200_CONTEXT = 9216
SPEC = {
    "plain": {},
    "NEXTN-3": dict(speculative_algorithm="NEXTN", speculative_num_steps=3),
    "DSPARK-7": dict(speculative_algorithm="DSPARK",
                     speculative_draft_model_path="ling-3.0-flash-dspark",
                     speculative_dspark_block_size=7),
}


def _requirements(model_path: str, config: ModelConfig, flags: Dict[str, Any],
                  **extra: Any) -> Optional[SpecRequirements]:
    """What the algorithm of ``flags`` asks of the target (None without speculation)."""
    if not flags:
        return None
    args = ServerArgs(model_path=model_path, device="cpu", load_format="dummy", **flags,
                      **extra)
    return get_spec_worker_class(args.speculative_algorithm).requirements(args, config)


def _h200_plan(name: str) -> Tuple[Any, int, int]:
    """(plan, KV slots, span) for the H200 case ``name`` on the ling-3.0-flash preset (35 KDA
    layers of 32 x 128 x 128 fp32 state, 7 MLA layers, bf16 caches)."""
    flash = ModelConfig.from_path("ling-3.0-flash")
    cfg = flash.hf_config
    req = _requirements("ling-3.0-flash", flash, SPEC[name], context_length=H200_CONTEXT,
                        quantization="fp8")
    bf16 = 2
    span = H200_CONTEXT + (req.position_headroom if req else 0)
    cost = request_slot_cost(
        cfg, num_kda_layers=len(cfg.kda_layer_ids), local_heads=cfg.num_attention_heads,
        dtype=torch.bfloat16, span=span, spec_copies=req.kda_scratch_depth if req else 0,
        draft_state_bytes=(req.draft_elems_per_request_slot * bf16
                           + req.draft_bytes_per_request_slot) if req else 0)
    mla = mla_pool_layer_ids(cfg, False, bool(req and req.draft_extra_mla_layers))
    per_token = kv_bytes_per_token(cfg, len(mla), torch.bfloat16) + (
        req.draft_elems_per_kv_slot * bf16 if req else 0)
    plan = plan_request_slots(
        total_bytes=H200_TOTAL, fraction=H200_FRACTION, used_bytes=H200_WEIGHTS, cost=cost,
        bytes_per_token=per_token, min_kv_tokens=span,
        cap=req.max_request_slots if req else AUTO_MAX_RUNNING_REQUESTS)
    n = plan.slots + 1  # + the padding slot of every per-slot buffer
    kv = kv_slots_from_memory(
        total_bytes=H200_TOTAL, fraction=H200_FRACTION, used_bytes=H200_WEIGHTS,
        req_map_bytes=n * cost.req_map_row, state_bytes=n * (cost.total - cost.req_map_row),
        bytes_per_token=per_token, free_bytes=H200_TOTAL, max_total_tokens=plan.slots * span)
    return plan, kv, span


def test_h200_numbers_plain_nextn_dspark():
    plans = {name: _h200_plan(name) for name in SPEC}
    for name, (plan, kv, span) in plans.items():
        assert plan.slots >= 1, name
        assert kv >= span >= H200_CONTEXT, (name, kv)  # one full-context request fits
        assert "set by the state share" in plan.describe(), plan.describe()
    plain, nextn, dspark = (plans[n][0] for n in SPEC)
    assert plain.slots > nextn.slots > dspark.slots > 0
    assert (plain.slots, nextn.slots, dspark.slots) == (67, 12, 6)
    # The speculative part of a slot: 1 + 4 copies of the 72.46 MiB KDA state for NEXTN-3 (its
    # relay holds a vocabulary-sized fp32 distribution, 614 KiB), 1 + 8 for DSPARK-7.
    assert plain.cost.kda_state == nextn.cost.kda_state == 35 * (32 * 128 * 128 * 4
                                                                 + 3 * 32 * 128 * 3 * 2)
    assert (nextn.cost.spec_copies, dspark.cost.spec_copies) == (4, 8)
    assert 600 * 1024 < nextn.cost.draft_state < 640 * 1024
    assert "x (1 + 4 speculative copies)" in nextn.describe()
    # Upstream's fixed 48 slots, what the measured NEXTN-3 launch got, leave no KV cache:
    # 49 x 362.9 MiB = 17.37 GiB of states against the 10.19 GiB the weights leave.
    with pytest.raises(ValueError, match="no memory is left for the KV cache"):
        kv_slots_from_memory(total_bytes=H200_TOTAL, fraction=H200_FRACTION,
                             used_bytes=H200_WEIGHTS, req_map_bytes=0,
                             state_bytes=49 * (nextn.cost.total - nextn.cost.req_map_row),
                             bytes_per_token=9216, free_bytes=H200_TOTAL)


# ---------------------------------------------------------------- the real scheduler, fake budget
def _fake_memory(monkeypatch: pytest.MonkeyPatch, left: int, total: int = GIB) -> None:
    """Plan the pools of a CPU runner as if on a device of ``total`` bytes whose weights left
    ``left`` bytes of the default 0.85 budget (before a draft's weights, which the plan adds)."""
    used = int(total * 0.85) - left
    monkeypatch.setattr(mr, "device_memory",
                        lambda device: DeviceMemory(free=total - used, total=total,
                                                    allocated=used))


def _scheduler(flags: Dict[str, Any]):
    # mem_fraction_static 0.85 and no max_running_requests / max_total_tokens: sized from memory.
    return make_scheduler(MODEL, max_running_requests=None, max_total_tokens=None,
                          mem_fraction_static=0.85, context_length=1024,
                          disable_overlap_schedule=True, **flags)


TINY_SPEC = {
    "plain": {},
    "NEXTN": dict(speculative_algorithm="NEXTN", speculative_num_steps=3),
    "DSPARK": dict(speculative_algorithm="DSPARK"),
}


def test_scheduler_sizes_spec_slots_from_a_fake_budget(monkeypatch, caplog):
    """Plain, NEXTN-3 and DSPARK schedulers on the bundled model with 48 MiB left after the
    weights: the speculative ones get fewer slots, at least one, a KV pool for a full-context
    request, the log line says how, and a request runs to its end."""
    _fake_memory(monkeypatch, left=48 * MIB)
    slots = {}
    for name, flags in TINY_SPEC.items():
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=mr.__name__):
            s = _scheduler(flags)
        runner = s.tp_worker.model_runner
        plan = runner.request_slot_plan
        slots[name] = s.max_running_requests
        assert s.max_running_requests == plan.slots == runner.kda_state_pool.size >= 1
        span = runner.req_to_token_pool.max_context_len
        assert s.max_total_num_tokens >= span >= runner.context_len, name
        line = next(r.getMessage() for r in caplog.records
                    if "request slots sized from memory" in r.getMessage())
        assert "per slot = KDA state" in line and f": {plan.slots} of " in line
        if flags:
            assert plan.cap == SPECULATIVE_MAX_RUNNING_REQUESTS
            assert f"x (1 + {runner.spec_num_draft_tokens} speculative copies)" in line
            assert "speculative worker state" in line and plan.cost.draft_state > 0
        s.submit(TokenizedGenerateReqInput("r", None, list(range(5, 37)),
                                           sampling(s.vocab_size, max_new_tokens=6,
                                                    temperature=0.0)))
        s.run_until_idle()
        got = [i for m in s.outbox if isinstance(m, BatchTokenIDOutput) for i in m.decode_ids[0]]
        assert len(got) == 6, (name, got)
    assert slots["plain"] > slots["NEXTN"] > slots["DSPARK"] >= 1, slots


def test_scheduler_refuses_a_budget_without_room_for_one_slot(monkeypatch):
    """Less left than one NEXTN slot and its draft's weights: the error names the memory."""
    _fake_memory(monkeypatch, left=1 * MIB)
    with pytest.raises(ValueError, match="no memory is left for the KV cache"):
        _scheduler(TINY_SPEC["NEXTN"])


# ---------------------------------------------------------------- TP ranks with unequal memory
def _tp_rank_pools(rank: int, port: int, out_dir: str) -> None:
    """One of two TP ranks on CPU whose fake budgets differ (rank 1 has less left): saves the
    request and KV slot counts it built its pools with."""
    import os

    from sglang.srt.distributed.parallel_state import destroy_distributed_environment

    torch.set_num_threads(1)  # two ranks share two cores
    total = GIB
    used = int(total * 0.85) - (48 - 16 * rank) * MIB
    mr.device_memory = lambda device: DeviceMemory(free=total - used, total=total,
                                                   allocated=used)
    try:
        runner = mr.ModelRunner(ModelConfig.from_path(str(MODEL)), device="cpu",
                                dtype=torch.float32, tp_rank=rank, tp_size=2, nccl_port=port,
                                mem_fraction_static=0.85, context_length=1024)
        torch.save({"slots": runner.max_running_requests,
                    "kv": runner.max_total_num_tokens,
                    "own": runner.request_slot_plan.slots},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        destroy_distributed_environment()


def test_tp_ranks_take_the_smallest_ranks_pool_sizes(tmp_path):
    """Each rank sizes its pools from its own memory, but the ranks schedule the same batches:
    both build the smaller rank's request and KV slot counts."""
    import os

    import torch.multiprocessing as mp

    from sglang.srt.distributed.parallel_state import free_port

    mp.spawn(_tp_rank_pools, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    got = [torch.load(os.path.join(tmp_path, f"rank{r}.pt")) for r in range(2)]
    assert got[0]["own"] > got[1]["own"]  # the fake budgets did differ
    assert got[0]["slots"] == got[1]["slots"] == got[1]["own"]
    assert got[0]["kv"] == got[1]["kv"] > 0
