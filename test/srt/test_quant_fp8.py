"""Block fp8 (``--quantization fp8``): quantiser, layer methods, checkpoint loading, flags,
malformed checkpoints, parity with the reference model and the accuracy gate (fp32, CPU).

The reference for the fp8 model is the unquantized math on the dequantised weights: a
checkpoint whose quantised tensors are replaced by ``dequant(quant(w))`` ("fake-quantised"),
run by :class:`ReferenceBailingMoeV3`.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
from typing import Dict, Set

import pytest
import torch
from torch import nn
from safetensors.torch import load_file, save_file

from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR, ModelConfig
from sglang.srt.layers.kernel_choices import KernelChoices
from sglang.srt.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                      ReplicatedLinear, RowParallelLinear)
from sglang.srt.layers.moe.fused_moe_native import fused_moe
from sglang.srt.layers.moe.moe_layer import FusedMoE
from sglang.srt.layers.quantization import (Fp8Config, Fp8LinearMethod, quantization_scope,
                                            resolve_quant_config)
from sglang.srt.layers.quantization.fp8_utils import (FP8_DTYPE, dequantize_block_fp8,
                                                      quantize_block_fp8)
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_loader.loader import CheckpointError, build_model, model_weight_bytes
from sglang.srt.model_loader.weight_utils import LazyWeight
from sglang.test.random_checkpoint import tiny_config, write_random_checkpoint
from sglang.test.runner_utils import greedy_logits
from sglang.train.reference import ReferenceBailingMoeV3

from layer_test_utils import fake_tp

QCFG = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
        "fmt": "e4m3"}
SCALE = "_scale_inv"


def _fake_quant(w: torch.Tensor) -> torch.Tensor:
    q, s = quantize_block_fp8(w)
    return dequantize_block_fp8(q, s, w.dtype)


# --------------------------------------------------------------------------- quantiser
def test_round_trip_ragged_blocks():
    torch.manual_seed(0)
    w = torch.randn(200, 300) * torch.linspace(0.1, 3.0, 300)  # ragged: 200 = 128 + 72 rows
    q, s = quantize_block_fp8(w)
    assert q.dtype == FP8_DTYPE and s.shape == (2, 3) and s.dtype == torch.float32
    # scale = amax / 448 per block, computed by hand on the ragged corner block
    assert torch.equal(s[1, 2], w[128:, 256:].abs().max() / 448.0)
    deq = dequantize_block_fp8(q, s, torch.float32)
    # e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4 of each block's values
    rel = ((deq - w).abs() / w.abs().clamp_min(1e-30))
    assert rel[w.abs() > s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
               * 2 ** -6].max() <= 2 ** -4 + 1e-6
    assert deq.abs().max() <= w.abs().max() * (1 + 1e-6)
    # quantising dequantised values again is exact (idempotent)
    q2, s2 = quantize_block_fp8(deq)
    assert torch.equal(dequantize_block_fp8(q2, s2, torch.float32), deq)
    zero_q, zero_s = quantize_block_fp8(torch.zeros(5, 7))
    assert torch.equal(zero_s, torch.ones(1, 1)) and zero_q.float().abs().sum() == 0


# --------------------------------------------------------------------------- layers
def _lw(name: str, t: torch.Tensor) -> LazyWeight:
    return LazyWeight.from_tensor(name, t)


def test_linear_apply_matches_dequantised_reference():
    torch.manual_seed(1)
    cfg = Fp8Config()
    with quantization_scope(cfg):
        merged = MergedColumnParallelLinear(160, [96, 96], params_dtype=torch.float32)
        row = RowParallelLinear(96, 160, bias=True, params_dtype=torch.float32)
        rep = ReplicatedLinear(160, 40, params_dtype=torch.float32)
    assert isinstance(merged.quant_method, Fp8LinearMethod) and merged.weight.dtype == FP8_DTYPE
    # gate and up on their own grids: 96 rows each -> one scale row each
    assert merged.weight_scale_inv.shape == (2, 2)
    wg, wu, wr, wb, wp = (torch.randn(96, 160), torch.randn(96, 160), torch.randn(160, 96),
                          torch.randn(160), torch.randn(40, 160))
    merged.weight_loader(merged.weight, _lw("g", wg), 0)
    merged.weight_loader(merged.weight, _lw("u", wu), 1)
    row.weight_loader(row.weight, _lw("r", wr))
    row.weight_loader(row.bias, _lw("b", wb))
    rep.weight_loader(rep.weight, _lw("p", wp))
    x = torch.randn(5, 160)
    ref_w = torch.cat([_fake_quant(wg), _fake_quant(wu)])
    torch.testing.assert_close(merged(x), x @ ref_w.t(), rtol=0, atol=0)
    h = torch.randn(5, 96)
    torch.testing.assert_close(row(h), h @ _fake_quant(wr).t() + wb, rtol=0, atol=0)
    torch.testing.assert_close(rep(x), x @ _fake_quant(wp).t(), rtol=0, atol=0)


def test_fused_moe_fp8_gather_and_loop_match_dequantised():
    torch.manual_seed(2)
    e, h, i = 6, 160, 96
    with quantization_scope(Fp8Config()):
        moe = FusedMoE(e, h, i, params_dtype=torch.float32)
    assert moe.w13_weight_scale_inv.shape == (e, 2, 2)  # gate grid + up grid, I = 96
    ref13, ref2 = torch.empty(e, 2 * i, h), torch.empty(e, h, i)
    for x in range(e):
        g, u, d = torch.randn(i, h), torch.randn(i, h), torch.randn(h, i)
        moe.weight_loader(moe.w13_weight, _lw(f"e{x}.g", g), "w1", x)
        moe.weight_loader(moe.w13_weight, _lw(f"e{x}.u", u), "w3", x)
        moe.weight_loader(moe.w2_weight, _lw(f"e{x}.d", d), "w2", x)
        ref13[x] = torch.cat([_fake_quant(g), _fake_quant(u)])
        ref2[x] = _fake_quant(d)
    for t in (3, 40):  # 6 pairs: gather; 80 pairs: loop over active experts
        hidden = torch.randn(t, h)
        ids = torch.randint(0, e, (t, 2))
        wts = torch.rand(t, 2)
        got = moe(hidden, wts, ids)
        want = fused_moe(hidden, ref13, ref2, wts, ids)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_tp2_scale_slicing_and_straddle_error():
    torch.manual_seed(3)
    w = torch.randn(512, 256)
    q, s = quantize_block_fp8(w)
    for rank in range(2):
        with fake_tp(rank, 2), quantization_scope(Fp8Config(True)):
            col = ColumnParallelLinear(256, 512, params_dtype=torch.float32)
        col.weight_loader(col.weight, _lw("c.weight", q))
        col.weight_loader(col.weight_scale_inv, _lw("c.weight_scale_inv", s))
        assert torch.equal(col.weight_scale_inv.data, s[rank * 2:(rank + 1) * 2])
        x = torch.randn(3, 256)
        torch.testing.assert_close(col(x), x @ _fake_quant(w)[rank * 256:(rank + 1) * 256].t(),
                                   rtol=0, atol=0)
    with fake_tp(1, 2), quantization_scope(Fp8Config()):
        bad = ColumnParallelLinear(256, 192, params_dtype=torch.float32)  # 96 rows per rank
    with pytest.raises(ValueError, match=r"bad\.weight.*TP size in \{1\}"):
        bad.weight_loader(bad.weight, _lw("bad.weight", torch.randn(192, 256)))


# --------------------------------------------------------------------------- flags
def test_resolve_and_flag_validation():
    assert resolve_quant_config(None, None) is None
    assert resolve_quant_config("unquant", QCFG) is None
    cfg = resolve_quant_config("fp8", None)
    assert isinstance(cfg, Fp8Config) and not cfg.is_checkpoint_fp8_serialized
    assert resolve_quant_config(None, QCFG).is_checkpoint_fp8_serialized
    with pytest.raises(ValueError, match="fp8.*mxfp4"):
        resolve_quant_config("fp8", {"quant_method": "mxfp4"})
    with pytest.raises(ValueError, match="weight_block_size"):
        resolve_quant_config(None, dict(QCFG, weight_block_size=[64, 64]))
    with pytest.raises(ValueError, match="--quantization must be one of"):
        resolve_quant_config("int4", None)
    from sglang.srt.server_args import ServerArgs

    with pytest.raises(ValueError, match="--quantization"):
        ServerArgs(quantization="awq").check()
    with pytest.raises(ValueError, match="--speculative-draft-model-quantization"):
        ServerArgs(speculative_draft_model_quantization="unquant").check()


# --------------------------------------------------------------------------- checkpoints
def _read_all(path: str) -> Dict[str, torch.Tensor]:
    out: Dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out.update(load_file(f))
    return out


def _write(path: str, tensors: Dict[str, torch.Tensor], config: dict) -> str:
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def _quantized_names(cfg: ModelConfig) -> Set[str]:
    """Checkpoint names the fp8 target and draft store in fp8 (from their slot tables)."""
    names: Set[str] = set()
    for draft in (False, True):
        model = build_model(cfg, dtype=torch.float32, device="meta", is_draft=draft,
                            quantization="fp8")
        names |= {n for n, slot in model.weight_slots().items() if slot.param.dtype == FP8_DTYPE}
    return names


def _derived(src: str, dst: str, mode: str) -> str:
    """``fp8``: the published layout (fp8 + ``weight_scale_inv``, ``quantization_config``);
    ``fake``: the same values dequantised back to the stored dtype (the reference's weights).
    Re-quantising fake-quantised values is exact, so ``fake`` with ``--quantization fp8``
    holds the very fp8 values and scales of ``fp8``."""
    cfg = ModelConfig.from_path(src)
    tensors = _read_all(src)
    out: Dict[str, torch.Tensor] = {}
    qnames = _quantized_names(cfg)
    # MLA's kv_b_proj is fp8 in published checkpoints but kept in the model dtype (split into
    # the absorbed w_kc / w_vc): the loader dequantises it.
    qnames |= {n for n in tensors if n.endswith("kv_b_proj.weight")}
    for name, t in tensors.items():
        if name in qnames:
            q, s = quantize_block_fp8(t)
            if mode == "fp8":
                out[name], out[name + SCALE] = q, s
            else:
                out[name] = dequantize_block_fp8(q, s, t.dtype)
        else:
            out[name] = t
    raw = dict(cfg.raw)
    if mode == "fp8":
        raw["quantization_config"] = QCFG
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):  # tokenizer files travel along
        full = os.path.join(src, f)
        if os.path.isfile(full) and not f.endswith(".safetensors") and f != "config.json" \
                and not f.endswith(".index.json"):
            shutil.copy(full, dst)
    return _write(dst, out, raw)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("bf"))
    write_random_checkpoint(base, tiny_config(), seed=5)
    fp8 = _derived(base, str(tmp_path_factory.mktemp("fp8")), "fp8")
    fake = _derived(base, str(tmp_path_factory.mktemp("fake")), "fake")
    return base, fp8, fake


def _runner(path: str, quantization=None, is_draft=False) -> ModelRunner:
    return ModelRunner(ModelConfig.from_path(path), device="cpu", dtype=torch.float32,
                       max_running_requests=2, max_total_tokens=128, quantization=quantization,
                       is_draft=is_draft)


@torch.no_grad()
def _prefill_logits(runner: ModelRunner, ids: torch.Tensor) -> torch.Tensor:
    """Every position's logits of one fresh request (the pools emptied first)."""
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool_allocator.clear()
    return greedy_logits(runner, ids.tolist(), 0)[0]


def test_fp8_checkpoint_loads_as_quantize_at_load(ckpts):
    _, fp8, fake = ckpts
    ids = torch.randint(3, 500, (19,), generator=torch.Generator().manual_seed(0))
    served = _runner(fp8)  # quantization from the checkpoint's config
    at_load = _runner(fake, "fp8")
    assert served.model.quant_config.is_checkpoint_fp8_serialized
    torch.testing.assert_close(_prefill_logits(served, ids), _prefill_logits(at_load, ids),
                               rtol=0, atol=0)
    # an unquantized run of the fp8 checkpoint dequantises everything at load
    plain = _runner(fp8, "unquant")
    assert plain.model.quant_config is None
    with pytest.raises(ValueError, match="--quantization fp8.*mxfp4"):
        bad = ModelConfig.from_path(fp8)
        bad.raw["quantization_config"] = {"quant_method": "mxfp4"}
        build_model(bad, dtype=torch.float32, device="meta", quantization="fp8")


def test_parity_with_reference_on_dequantised_weights(ckpts):
    """fp8 serving logits vs the reference on the same dequantised values: only fp32 summation
    order differs, so the bound of test_model_parity (1e-5 relative) holds."""
    _, fp8, fake = ckpts
    ref = ReferenceBailingMoeV3.from_pretrained(fake, kda_mode="recurrent").eval()
    served = _runner(fp8)
    for n in (1, 13, 22):
        ids = torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n))
        got = _prefill_logits(served, ids)
        with torch.no_grad():
            want = ref(ids[None])[0][0]
        err = (got - want).abs().max().item()
        assert err <= 1e-5 * want.abs().max().item(), (n, err)


def test_memory_accounting_counts_fp8_bytes(ckpts):
    base, _, _ = ckpts
    cfg = ModelConfig.from_path(base)
    full = model_weight_bytes(cfg, dtype=torch.float32)
    quant = model_weight_bytes(cfg, dtype=torch.float32, quantization="fp8")
    model = build_model(cfg, dtype=torch.float32, device="meta", quantization="fp8")
    fp8_elems = sum(p.numel() for p in model.parameters() if p.dtype == FP8_DTYPE)
    scales = sum(p.numel() * 4 for n, p in model.named_parameters() if n.endswith(SCALE))
    index = sum(b.numel() * b.element_size() for b in model.buffers() if b.dtype == torch.long)
    assert quant == full - 3 * fp8_elems + scales + index


@pytest.mark.parametrize("case", ["missing_scale", "bad_scale_shape", "fp8_without_config"])
def test_malformed_fp8_checkpoint(ckpts, case, tmp_path):
    _, fp8, _ = ckpts
    tensors = _read_all(fp8)
    raw = json.load(open(os.path.join(fp8, "config.json")))
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    if case == "missing_scale":
        del tensors[name + SCALE]
        match = f"missing tensor: {name}{SCALE}"
    elif case == "bad_scale_shape":
        tensors[name + SCALE] = torch.ones(3, 3)
        match = f"shape mismatch: {name}{SCALE}"
    else:
        raw.pop("quantization_config")
        match = "fp8 tensor without quantization_config: model.layers"
    path = _write(str(tmp_path / case), tensors, raw)
    with pytest.raises(CheckpointError, match=match.replace(".", r"\.")):
        _runner(path)


# --------------------------------------------------------------------------- accuracy gate
@pytest.mark.slow
def test_accuracy_gate_bundled_model(tmp_path):
    """Held-out bits/byte and MTP greedy acceptance: dequantised fp8 weights vs the originals
    (the parity test ties the fp8 engine to these dequantised weights), and the same weights
    with every fp8 product's input rounded per token and 128-column group to e4m3 (w8a8,
    ``KernelChoices.moe_fp8_activations`` / ``dense_fp8_activations``; here on every token, where the engine does it above
    the small-M rows only). Measured (fp32, CPU): bits/byte 1.8680 -> 1.8677 (fp8) / 1.8695
    (w8a8, +0.08 %), MTP acceptance 0.4000 -> 0.3970 / 0.3970, NEXTN-3 accept length
    (``1 + p + p^2 + p^3``) 1.624 -> 1.617 / 1.617; bounds: 2 % and 0.1."""
    from sglang.train.data import HELD_OUT_FILES, stdlib_root
    from sglang.train.eval import score_stream
    from sglang.train.tokenizer import load_tokenizer

    src = str(BUNDLED_MODEL_DIR)
    fake = _derived(src, str(tmp_path / "fake"), "fake")
    tok = load_tokenizer(src)
    text = "".join((stdlib_root() / n).read_text(encoding="utf-8")[:6000]
                   for n in HELD_OUT_FILES[:3])
    stream = torch.tensor(tok.encode(text).ids)
    nbytes = len(text.encode("utf-8"))
    dev = torch.device("cpu")
    results = {}
    qnames = _quantized_names(ModelConfig.from_path(src))
    for label, path in (("unquant", src), ("fp8", fake), ("w8a8", fake)):
        model = ReferenceBailingMoeV3.from_pretrained(path, dtype=torch.float32).eval()
        if label == "w8a8":  # w8a8: fp8 inputs to every fp8 product
            assert _fake_quantize_linear_inputs(model, qnames) > 0
        score = score_stream(model, stream, 256, 4, dev, with_mtp=True)
        bpb = score.nats / nbytes / torch.log(torch.tensor(2.0)).item()
        # greedy acceptance per position: the MTP draft equals the target's greedy next token
        # (teacher-forced over the whole held-out stream: thousands of trials, little noise)
        p = score.mtp_agree / score.mtp_tokens
        # NEXTN-3 chain: accepted drafts stop at the first miss -> 1 + p + p^2 + p^3 tokens
        results[label] = (bpb, p, 1 + p + p ** 2 + p ** 3)
    for label in ("fp8", "w8a8"):
        print(f"\nheld-out bits/byte unquant {results['unquant'][0]:.4f} {label} "
              f"{results[label][0]:.4f}; MTP acceptance {results['unquant'][1]:.4f} / "
              f"{results[label][1]:.4f}; NEXTN-3 accept length {results['unquant'][2]:.3f} / "
              f"{results[label][2]:.3f}")
        assert abs(results[label][0] / results["unquant"][0] - 1) <= 0.02
        assert abs(results[label][2] - results["unquant"][2]) <= 0.1


def _fake_quantize_linear_inputs(model: nn.Module, qnames: Set[str]) -> int:
    """Round the input of every ``nn.Linear`` of ``model`` whose weight is stored in fp8
    (``qnames``) to e4m3 per token and 128-column group and back (the w8a8 GEMMs' activations);
    returns how many layers were hooked."""
    from sgl_kernel.fp8_act_quant import group_dequantize, per_token_group_quant_fp8_reference

    def hook(module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        flat = x.reshape(-1, x.shape[-1])
        q, scale = per_token_group_quant_fp8_reference(flat)
        return (group_dequantize(q, scale).to(x.dtype).reshape(x.shape),) + args[1:]

    hooked = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and f"{name}.weight" in qnames:
            module.register_forward_pre_hook(hook)
            hooked += 1
    return hooked


def test_dummy_weights_quantise_at_load(ckpts):
    base, _, _ = ckpts
    runner = ModelRunner(ModelConfig.from_path(base), device="cpu", dtype=torch.float32,
                         max_running_requests=2, max_total_tokens=128, quantization="fp8",
                         load_format="dummy")
    experts = runner.model.model.layers[1].mlp.experts
    assert experts.w13_weight.dtype == FP8_DTYPE
    assert (experts.w13_weight_scale_inv > 0).all()  # written by the weight's dummy hook
    logits = _prefill_logits(runner, torch.arange(3, 12))
    assert torch.isfinite(logits).all() and logits.std() > 0


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs CUDA or TRITON_INTERPRET=1 (test/conftest.py)")
def test_triton_paths_read_fp8_weights(ckpts):
    """The fp8 checkpoint through the Triton kernels (grouped mat-vec with the shared expert as
    pairs, the one-kernel combine, the small-M GEMM for dense layers and the LM head; the block
    scales applied to the fp32 sums) equals its torch reference path (fp32, interpreter on CPU). A
    decode-sized prefill (3 tokens) takes the small-batch paths."""
    from sglang.srt.layers.moe.moe_layer import BailingMoE

    _, fp8, _ = ckpts
    ids = torch.randint(3, 500, (3,), generator=torch.Generator().manual_seed(1))
    ref = _prefill_logits(_runner(fp8), ids)
    # moe_combine follows the Triton MoE runner; the small-M GEMM is on by default for fp8 on
    # CUDA only, so it is forced here.
    runner = ModelRunner(ModelConfig.from_path(fp8), device="cpu", dtype=torch.float32,
                         max_running_requests=2, max_total_tokens=128,
                         moe_runner_backend="triton",
                         kernel_choices=KernelChoices(small_m_gemm=True))
    assert runner.kernel_choices.moe_combine and runner.kernel_choices.small_m_gemm
    moes = [m for m in runner.model.modules() if isinstance(m, BailingMoE)]
    assert moes and all(m.shared_as_pairs() is not None for m in moes)
    assert all(m.shared_as_pairs().w13_scale is not None for m in moes)
    got = _prefill_logits(runner, ids)
    err = (got - ref).abs().max().item()
    assert err <= 1e-5 * ref.abs().max().item(), err


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs CUDA or TRITON_INTERPRET=1 (test/conftest.py)")
def test_dense_scaled_mm_path_in_the_model(ckpts, monkeypatch):
    """``KernelChoices.dense_scaled_mm`` (the CUDA default for fp8 models) through a whole fp8
    model: a 70-token prefill (above the small-M rows, not a multiple of 16) puts every dense
    projection on ``sgl_kernel.fp8_scaled_mm.blockwise_linear``. Where the library refuses
    (torch's CPU ``_scaled_mm`` takes no block scales) every shape falls back to the
    weight-only product without an error and the logits equal the reference path's within fp32
    rounding;
    with the library's contract in plain torch in its place (``scaled_mm_reference``) every
    eligible group runs w8a8 into its columns and the logits come out finite. (Their distance
    to the weight-only logits says nothing here: on this random model two w8a8 paths, this one
    and the tiled Triton GEMM's, differ from each other by 30% of the largest logit, an e4m3
    rounding flipped by a last-bit difference early on growing through the layers; the
    product itself is held to its reference in test/kernels/test_fp8_scaled_mm.py.)"""
    from sgl_kernel import fp8_scaled_mm as fsm

    _, fp8, _ = ckpts
    ids = torch.randint(3, 500, (70,), generator=torch.Generator().manual_seed(2))
    ref = _prefill_logits(_runner(fp8), ids)
    runner = ModelRunner(ModelConfig.from_path(fp8), device="cpu", dtype=torch.float32,
                         max_running_requests=2, max_total_tokens=128,
                         kernel_choices=KernelChoices(small_m_gemm=True, dense_scaled_mm=True))
    layers = [m for m in runner.model.modules() if getattr(m, "dense_scaled_mm", False)]
    assert layers and all(m.scaled_mm_groups is not None for m in layers)
    shapes = {(r1 - r0, m.weight.shape[1]) for m in layers for r0, r1, _ in m.scaled_mm_groups[0]}
    eligible = {sh for sh in shapes if fsm.scaled_mm_eligible(*sh)}
    assert eligible

    def rel(a: torch.Tensor) -> float:
        return (a - ref).abs().max().item() / ref.abs().max().item()

    for library in ("cpu torch", "the contract in plain torch"):
        monkeypatch.setattr(fsm, "_CHECKED", {})
        monkeypatch.setattr(fsm, "_SLICE_OUT", {})
        if library != "cpu torch":
            monkeypatch.setattr(fsm, "_library_scaled_mm", fsm.scaled_mm_reference)
        got = _prefill_logits(runner, ids)
        taken = {fsm.library_status(torch.device("cpu"), n, k, torch.float32)
                 for n, k in eligible}
        if taken == {False}:  # refused everywhere: the weight-only product
            # Within fp32 rounding, not bit for bit: the fallback multiplies each column group
            # apart, and a CPU's BLAS may block a narrower product differently (2.5e-6 on an
            # AMD EPYC machine, 0 elsewhere).
            assert rel(got) <= 1e-5, library
        else:
            assert taken == {True} and rel(got) > 0 and bool(got.isfinite().all()), library
        assert library == "cpu torch" or taken == {True}


def test_draft_quantization_follows_its_flag(ckpts):
    """NEXTN's MTP layer: the target's quantization by default, and
    ``--speculative-draft-model-quantization unquant`` keeps it in the model dtype (the remedy
    for accept length) while the target stays fp8."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.server_args import ServerArgs

    base, _, _ = ckpts
    for draft_q, want in ((None, True), ("unquant", False)):
        args = ServerArgs(model_path=base, device="cpu", dtype="float32", quantization="fp8",
                          speculative_algorithm="NEXTN", speculative_num_steps=2,
                          speculative_draft_model_quantization=draft_q,
                          max_total_tokens=256, max_running_requests=2)
        sched = Scheduler(args)
        assert sched.tp_worker.model_runner.model.quant_config is not None
        draft = sched.draft_worker.draft_runner.model
        assert (draft.quant_config is not None) == want, draft_q
