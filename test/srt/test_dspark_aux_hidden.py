"""Target auxiliary hidden states for a DSpark draft (BailingMoeV3ForCausalLM
.set_dspark_layers_to_capture).

On a tiny random target: the captured states (raw residual stream after the chosen layers, in
the given order, every token) equal a layer-by-layer recomputation with the plain reference
model, for a batched prefill, a chunk after a cached prefix and a TARGET_VERIFY; logits are
unchanged by capturing, and nothing is returned when capture is off.
"""
from __future__ import annotations

from typing import List, Tuple

import pytest
import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.rounds.chain import build_verify_forward_batch
from sglang.test.random_checkpoint import tiny_config, write_random_checkpoint
from sglang.train.reference import ReferenceBailingMoeV3

RTOL = 1e-5
LAYERS = [3, 0, 2, 5]  # out of order; KDA (0, 3) and MLA (2, 5) layers, the last layer too
VERIFY_WIDTH = 4


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    err = float((got - ref).abs().max())
    scale = float(ref.abs().max())
    assert err <= RTOL * scale, f"{name}: max abs err {err:.3e} > {RTOL:g} * {scale:.3e}"


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Tuple[ModelRunner, ReferenceBailingMoeV3]:
    path = str(tmp_path_factory.mktemp("aux_ck"))
    write_random_checkpoint(path, tiny_config(), seed=5)
    runner = ModelRunner(ModelConfig.from_path(path), device="cpu", dtype=torch.float32,
                         max_running_requests=4, max_total_tokens=256,
                         spec_num_draft_tokens=VERIFY_WIDTH)
    ref = ReferenceBailingMoeV3.from_pretrained(path, kda_mode="recurrent").eval()
    yield runner, ref
    runner.model.set_dspark_layers_to_capture(None)


@torch.no_grad()
def reference_layers(ref: ReferenceBailingMoeV3, ids: torch.Tensor, layers: List[int]
                     ) -> torch.Tensor:
    """``[T, len(layers) * d]``: the reference's residual stream after each listed layer."""
    h = ref.model.word_embeddings(ids[None])
    after = []
    for layer in ref.model.layers[:ref.config.num_hidden_layers]:
        h = layer(h, ref.kda_mode, ref.kda_chunk_size)
        after.append(h[0])
    return torch.cat([after[i] for i in layers], dim=-1)


def prompts(seed: int, lens) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen) for n in lens]


def extend(runner: ModelRunner, reqs: List[int], ids: List[torch.Tensor], prefix: List[int]):
    lens = [len(x) for x in ids]
    locs = []
    for r, s, n in zip(reqs, prefix, lens):
        loc = runner.token_to_kv_pool_allocator.alloc(n)
        runner.req_to_token_pool.write(r, s, loc)
        locs.append(loc)
    fb = ForwardBatch.for_extend(torch.cat(ids), reqs, prefix, lens, torch.cat(locs),
                                 return_full_logits=True,
                                 capture_hidden_mode=CaptureHiddenMode.FULL)
    return runner.forward(fb)


def fresh(runner: ModelRunner, n: int) -> List[int]:
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool_allocator.clear()
    reqs = runner.req_to_token_pool.alloc(n)
    runner.kda_state_pool.clear_slots(reqs)
    return reqs


def test_off_by_default_and_logits_unchanged(setup):
    runner, _ = setup
    model = runner.model
    model.set_dspark_layers_to_capture(None)
    assert model.dspark_layers_to_capture == ()
    ids = prompts(0, (7, 3))
    plain = extend(runner, fresh(runner, 2), ids, [0, 0])
    assert plain.aux_hidden_states is None
    model.set_dspark_layers_to_capture(LAYERS)
    captured = extend(runner, fresh(runner, 2), ids, [0, 0])
    assert captured.aux_hidden_states.shape == (10, len(LAYERS) * model.config.hidden_size)
    # Capturing reads the residual stream; the forward itself is the same computation.
    assert torch.equal(plain.next_token_logits, captured.next_token_logits)
    assert torch.equal(plain.hidden_states, captured.hidden_states)
    model.set_dspark_layers_to_capture([])
    assert extend(runner, fresh(runner, 2), ids, [0, 0]).aux_hidden_states is None


def test_prefill_and_chunk_match_layer_by_layer_reference(setup):
    runner, ref = setup
    runner.model.set_dspark_layers_to_capture(LAYERS)
    first, second = prompts(1, (9, 1)), prompts(2, (4, 5))
    # The reference is causal: one pass over each whole sequence serves both chunks.
    full = [reference_layers(ref, torch.cat([p, s]), LAYERS) for p, s in zip(first, second)]
    reqs = fresh(runner, 2)
    out = extend(runner, reqs, first, [0, 0])
    start = 0
    for i, p in enumerate(first):
        assert_close(f"prefill req {i}", out.aux_hidden_states[start:start + len(p)],
                     full[i][:len(p)])
        start += len(p)
    # A second chunk on top of the cached prefix (MLA cache + KDA state).
    out = extend(runner, reqs, second, [len(p) for p in first])
    start = 0
    for i, (p, s) in enumerate(zip(first, second)):
        assert_close(f"chunk req {i}", out.aux_hidden_states[start:start + len(s)],
                     full[i][len(p):])
        start += len(s)


def test_target_verify_matches_reference(setup):
    """A verify window (anchor + drafts) after a prefill: one row per window token."""
    runner, ref = setup
    layers = [4, 1]
    runner.model.set_dspark_layers_to_capture(layers)
    prompt, window = prompts(3, (6,))[0], prompts(4, (VERIFY_WIDTH,))[0]
    reqs = fresh(runner, 1)
    extend(runner, reqs, [prompt], [0])
    n = len(window)
    loc = runner.token_to_kv_pool_allocator.alloc(n)
    fb = build_verify_forward_batch(window.view(1, n), torch.tensor(reqs),
                                    torch.tensor([len(prompt)]), loc.view(1, n),
                                    seq_lens_upper_bound=len(prompt) + n)
    out = runner.forward(fb)
    full = reference_layers(ref, torch.cat([prompt, window]), layers)
    assert out.aux_hidden_states.shape == (n, 2 * runner.model.config.hidden_size)
    assert_close("verify", out.aux_hidden_states, full[len(prompt):])


def test_bad_layer_ids(setup):
    model = setup[0].model
    n = model.config.num_hidden_layers
    for ids, match in (([n], r"layer_ids\[0\] = 6"), ([0, -1], r"layer_ids\[1\] = -1"),
                       ([1, 1], "repeat"), ([True], r"layer_ids\[0\] = True"),
                       ([1.0], r"layer_ids\[0\] = 1.0")):
        with pytest.raises(ValueError, match=match):
            model.set_dspark_layers_to_capture(ids)
    model.set_dspark_layers_to_capture([2])
    with pytest.raises(ValueError):
        model.set_dspark_layers_to_capture([2, 9])
    assert model.dspark_layers_to_capture == (2,)  # a refused call changes nothing
