"""MTP retraining with the acceptance-aware loss (python -m sglang.train.mtp).

* the step-1 pass equals ``mtp_forward``; the batched K-step chain equals running the MTP layer
  causally, step after step, over each anchor's own sequence of pairs (the order a NEXTN round
  drafts in: real pairs up to the anchor, then its own chain states);
* the chained alpha are in [0, 1], K per anchor, valid as a prefix; ``--alpha-accept 0`` is the
  MTP phase's loss exactly, and ``> 0`` adds ``alpha * acceptance_loss``; the chain's gradient
  reaches only the MTP layer;
* the command on a tiny random checkpoint: finite losses, only MTP tensors change, the folder
  loads with ModelConfig and ModelRunners (target + NEXTN draft) that reproduce the reference
  on the saved weights; ``--steps 0`` copies, ``--init fresh`` re-initialises the MTP layer only;
  refusals name the flag.
"""
from __future__ import annotations

import json

import pytest
import torch

from engine_test_utils import write_checkpoint
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_executor.forward_batch_info import (CaptureHiddenMode, ForwardBatch,
                                                          ForwardMode)
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.test.random_checkpoint import tiny_config
from sglang.test.runner_utils import draft_runner_on
from sglang.train.dspark_losses import acceptance_loss
from sglang.train.mtp import (LOG_NAME, chain_alpha, chain_target_logits, main,
                              mtp_accept_loss, mtp_chain, mtp_real_pass, sample_anchors)
from sglang.train.reference import ReferenceBailingMoeV3
from sglang.train.reference_io import read_state_dict
from sglang.train.target import mtp_loss

MTP_PREFIX = "model.layers.6."  # tiny_config: 6 decoder layers, the MTP block is layer 6
SMALL_RUN = ["--batch-size", "2", "--seq-len", "32", "--max-train-files", "2",
             "--eval-windows", "2", "--eval-prompts", "0", "--chain-anchors", "8",
             "--num-threads", "1", "--device", "cpu"]


@pytest.fixture(scope="module")
def model():
    return ReferenceBailingMoeV3(tiny_config(), kda_mode="chunk", seed=3).eval()


@pytest.fixture(scope="module")
def batch():
    return torch.randint(3, 512, (2, 13), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("mtp_src")), with_tokenizer=True)


@pytest.fixture(scope="module")
def trained(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("mtp_out") / "d"
    log = main(["--model-path", ckpt, "--output-dir", str(out), "--steps", "3",
                "--alpha-accept", "1.0", *SMALL_RUN])
    return out, log


@torch.no_grad()
def test_real_pass_equals_mtp_forward(model, batch):
    t = batch.shape[1] - 1
    _, hidden = model(batch[:, :-1])
    real = mtp_real_pass(model, hidden[:, :t - 1], batch[:, 1:t])
    logits, out = model.mtp_forward(hidden[:, :t - 1], batch[:, 1:t])
    torch.testing.assert_close(real.logits, logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(real.hidden, out, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_chain_equals_the_nextn_drafting_order(model, batch):
    """Chain step k at anchor t == the last row of mtp_forward over the pairs
    (h_0, x_1) .. (h_t, x_{t+1}), (g_1, x_{t+2}) .. (g_{k-1}, x_{t+k}) (causal attention)."""
    t_len = batch.shape[1] - 1
    n = t_len - 1
    k_steps = 3
    _, hidden = model(batch[:, :-1])
    real = mtp_real_pass(model, hidden[:, :n], batch[:, 1:t_len])
    anchors = torch.tensor([[0, 4, 9, 10], [2, 5, 8, 10]])
    logits, valid = mtp_chain(model, real, batch[:, :-1], anchors, k_steps)
    assert logits.shape == (2, 4, k_steps, model.config.vocab_size)
    assert valid.tolist()[0][2:] == [[True, True, False], [True, False, False]]
    assert valid.tolist()[1][3] == [True, False, False]
    checked = 0
    for b in range(2):
        for a in range(anchors.shape[1]):
            t = int(anchors[b, a])
            hs, ids = hidden[b:b + 1, :t + 1], batch[b:b + 1, 1:t + 2]
            for k in range(k_steps):
                if not valid[b, a, k]:
                    break
                ref, g = model.mtp_forward(hs, ids)
                torch.testing.assert_close(logits[b, a, k], ref[0, -1], rtol=1e-4, atol=1e-4)
                checked += 1
                hs = torch.cat([hs, g[:, -1:]], dim=1)
                ids = torch.cat([ids, batch[b:b + 1, t + k + 2:t + k + 3]], dim=1)
    assert checked == int(valid.sum())


def test_alpha_accept_zero_is_the_mtp_phase_loss(model, batch):
    gen = torch.Generator().manual_seed(0)
    terms = mtp_accept_loss(model, batch, 0.5, 0.0, 3, 4, gen)
    assert set(terms) == {"loss", "mtp"}
    torch.testing.assert_close(terms["loss"], mtp_loss(model, batch, 0.5), rtol=1e-6, atol=1e-6)
    with_accept = mtp_accept_loss(model, batch, 0.5, 2.0, 3, 4, gen)
    torch.testing.assert_close(with_accept["mtp"], terms["mtp"], rtol=1e-6, atol=1e-6)
    assert -1.0 <= float(with_accept["accept"].detach()) < 0.0
    torch.testing.assert_close(with_accept["loss"],
                               with_accept["mtp"] + 2.0 * with_accept["accept"])
    assert 1.0 <= float(with_accept["expected_accept"]) <= 4.0


@pytest.mark.parametrize("k_steps", [1, 2, 4])
def test_chained_alpha_in_unit_interval_with_k_steps(model, batch, k_steps):
    t_len = batch.shape[1] - 1
    with torch.no_grad():
        logits, hidden = model(batch[:, :-1])
        real = mtp_real_pass(model, hidden[:, :t_len - 1], batch[:, 1:t_len])
        anchors = sample_anchors(2, t_len - 1, 0)
        draft, valid = mtp_chain(model, real, batch[:, :-1], anchors, k_steps)
        alpha = chain_alpha(draft, chain_target_logits(logits, anchors, k_steps))
    assert alpha.shape == valid.shape == (2, t_len - 1, k_steps)
    assert bool(((alpha >= 0) & (alpha <= 1)).all())
    # valid is a prefix per anchor: the last anchors lose their tail steps.
    assert bool((valid.long().diff(dim=-1) <= 0).all())
    assert int(valid[:, -1].sum()) == 2 and bool(valid[:, : t_len - k_steps].all())
    assert -1.0 <= float(acceptance_loss(alpha, valid)) <= 0.0


def test_chain_gradient_reaches_only_the_mtp_layer(batch):
    m = ReferenceBailingMoeV3(tiny_config(), kda_mode="chunk", seed=4)
    terms = mtp_accept_loss(m, batch, 0.5, 1.0, 3, 4, torch.Generator().manual_seed(0))
    terms["accept"].backward()
    grads = {n: p.grad for n, p in m.named_parameters()}
    assert all(g is None for n, g in grads.items() if not n.startswith(MTP_PREFIX)
               and n != "lm_head.weight" and n != "model.word_embeddings.weight")
    assert any(g is not None and float(g.abs().sum()) > 0 for n, g in grads.items()
               if n.startswith(MTP_PREFIX + "attention.") or n.startswith(MTP_PREFIX + "eh_"))


def test_sample_anchors():
    gen = torch.Generator().manual_seed(0)
    a = sample_anchors(3, 10, 4, gen)
    assert a.shape == (3, 4) and bool((a.diff(dim=-1) > 0).all()) and int(a.max()) < 10
    assert sample_anchors(2, 5, 0).tolist() == [list(range(5))] * 2
    assert sample_anchors(1, 5, 9).tolist() == [list(range(5))]
    with pytest.raises(ValueError, match="pair"):
        sample_anchors(1, 0, 2)


def test_command_trains_only_the_mtp_layer(ckpt, trained):
    out, log = trained
    saved = json.loads((out / LOG_NAME).read_text())
    assert saved["train"]["num_steps"] == log["train"]["num_steps"] == 3
    for key in ("loss", "mtp", "accept", "expected_accept"):
        assert len(saved["train"][key]) == 3
        assert all(torch.isfinite(torch.tensor(saved["train"][key])))
    for when in ("before", "after"):
        ev = saved[f"heldout_chain_{when}"]
        assert len(ev["alpha"]) == len(ev["agreement"]) == 3 and ev["anchors"] > 0
        assert 1.0 <= ev["greedy_accept_length"] <= 4.0
    src, dst = read_state_dict(ckpt), read_state_dict(str(out))
    assert src.keys() == dst.keys()
    changed = {k for k in src if not torch.equal(src[k], dst[k])}
    assert changed and all(k.startswith(MTP_PREFIX) for k in changed)
    assert any(".attention." in k for k in changed)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).is_file()


def test_output_folder_serves(trained):
    out, _ = trained
    cfg = ModelConfig.from_path(str(out))
    target = ModelRunner(cfg, device="cpu", dtype=torch.float32, max_running_requests=2,
                         max_total_tokens=256, draft_extra_mla_layers=True)
    draft = draft_runner_on(target, cfg)
    ids = torch.randint(3, 512, (20,), generator=torch.Generator().manual_seed(2))
    req = target.req_to_token_pool.alloc(1)[0]
    target.kda_state_pool.clear_slots([req])
    loc = target.token_to_kv_pool_allocator.alloc(len(ids))
    target.req_to_token_pool.write(req, 0, loc)
    res = target.forward(ForwardBatch.for_extend(ids, [req], [0], [len(ids)], loc,
                                                 capture_hidden_mode=CaptureHiddenMode.FULL))
    nxt = res.next_token_logits.argmax(-1)
    draft_ids = torch.cat([ids[1:], nxt])
    d = draft.forward(ForwardBatch.for_extend(draft_ids, [req], [0], [len(ids)], loc,
                                              forward_mode=ForwardMode.DRAFT_EXTEND),
                      hidden_states=res.hidden_states)
    ref = ReferenceBailingMoeV3.from_pretrained(str(out), kda_mode="recurrent").eval()
    with torch.no_grad():
        logits, hidden = ref(ids[None])
        mtp_logits, _ = ref.mtp_forward(hidden, draft_ids[None])
    torch.testing.assert_close(res.next_token_logits[0], logits[0, -1], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(d.next_token_logits[0], mtp_logits[0, -1], rtol=1e-3, atol=1e-3)


def test_steps_zero_copies_and_fresh_init(ckpt, tmp_path):
    main(["--model-path", ckpt, "--output-dir", str(tmp_path / "copy"), "--steps", "0",
          *SMALL_RUN])
    src = read_state_dict(ckpt)
    same = read_state_dict(str(tmp_path / "copy"))
    assert all(torch.equal(src[k], same[k]) for k in src)
    log = json.loads((tmp_path / "copy" / LOG_NAME).read_text())
    assert log["train"]["num_steps"] == 0 and "heldout_chain_after" not in log
    main(["--model-path", ckpt, "--output-dir", str(tmp_path / "fresh"), "--steps", "0",
          "--init", "fresh", "--seed", "7", *SMALL_RUN])
    fresh = read_state_dict(str(tmp_path / "fresh"))
    changed = {k for k in src if not torch.equal(src[k], fresh[k])}
    assert changed and all(k.startswith(MTP_PREFIX) for k in changed)


@pytest.mark.parametrize("flags, match", [
    (["--chain", "0"], "--chain"),
    (["--alpha-accept", "-1"], "--alpha-accept"),
    (["--seq-len", "1"], "--seq-len"),
    (["--mtp-distill", "1.5"], "--mtp-distill"),
    (["--chain-anchors", "-2"], "--chain-anchors"),
])
def test_bad_flags_are_refused(ckpt, tmp_path, flags, match):
    with pytest.raises(SystemExit, match=match):
        main(["--model-path", ckpt, "--output-dir", str(tmp_path / "x"), *flags])


def test_bad_folders_are_refused(ckpt, tmp_path):
    with pytest.raises(SystemExit, match="overlap"):
        main(["--model-path", ckpt, "--output-dir", ckpt])
    with pytest.raises(SystemExit, match="overlap"):
        main(["--model-path", ckpt, "--output-dir", f"{ckpt}/inner"])
    with pytest.raises(SystemExit, match="no config.json"):
        main(["--model-path", str(tmp_path / "empty"), "--output-dir", str(tmp_path / "y")])
    no_mtp = write_checkpoint(str(tmp_path / "no_mtp"), with_tokenizer=True,
                              num_nextn_predict_layers=0)
    with pytest.raises(SystemExit, match="no MTP layer"):
        main(["--model-path", no_mtp, "--output-dir", str(tmp_path / "z"), *SMALL_RUN])
