"""Tests of the bundled-model pipeline (sglang.train: data, tokenizer, target, eval) on CPU.

Everything runs on small slices: the tokenizer is trained on a few files, the model is a
two-layer toy, training takes a few dozen steps.
"""
from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch

from sglang.srt.configs.bailing_moe_v3 import BailingMoeV3Config
from sglang.train import data as D
from sglang.train import eval as E
from sglang.train import target as TG
from sglang.train import tokenizer as TK

SAMPLE = 'def f(x):\n\tif x:\n        return "π ≈ 3.14 — ok"  # über\n    return None\r\n\n'


@pytest.fixture(scope="module")
def corpus() -> D.Corpus:
    return D.load_corpus()


@pytest.fixture(scope="module")
def small(corpus) -> D.Corpus:
    return D.slice_corpus(corpus, max_train_files=12, max_held_out_files=4)


@pytest.fixture(scope="module")
def tok(small):
    return TK.train_tokenizer(small.train_texts(), vocab_size=512)


# ---------------------------------------------------------------------------- corpus
def test_corpus_split_is_deterministic_and_disjoint(corpus):
    again = D.load_corpus()
    assert [f.path for f in again.train] == [f.path for f in corpus.train]
    assert D.corpus_fingerprint(again) == D.corpus_fingerprint(corpus)
    train_paths = [f.path for f in corpus.train]
    assert train_paths == sorted(train_paths)
    assert tuple(f.path for f in corpus.held_out) == D.HELD_OUT_FILES
    assert not set(train_paths) & set(D.HELD_OUT_FILES)
    held_hashes = {hashlib.sha256(f.text.encode()).hexdigest() for f in corpus.held_out}
    train_hashes = [hashlib.sha256(f.text.encode()).hexdigest() for f in corpus.train]
    assert not held_hashes & set(train_hashes)
    assert len(train_hashes) == len(set(train_hashes))  # de-duplicated
    for p in train_paths:
        parts = p.split("/")
        assert not {"test", "tests", "site-packages", "encodings"} & set(parts[:-1]), p
    assert len(corpus.train) > 300


def test_corpus_rules_on_a_fake_stdlib(tmp_path):
    files = {
        "b.py": "x = 1\n",
        "a.py": "x = 1\n",  # same content as b.py: only a.py (first in order) stays
        "pkg/mod.py": "def g():\n    pass\n",
        "held.py": "y = 2\n",
        "copy_of_held.py": "y = 2\n",  # equals a held-out file: never trained on
        "test/test_a.py": "assert True\n",
        "site-packages/lib.py": "z = 3\n",
        "_sysconfigdata_x.py": "build = {}\n",
        "notes.txt": "not python\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    c = D.load_corpus(tmp_path, held_out=("held.py",))
    assert [f.path for f in c.train] == ["a.py", "pkg/mod.py"]
    assert [f.path for f in c.held_out] == ["held.py"]
    with pytest.raises(FileNotFoundError, match="missing.py"):
        D.load_corpus(tmp_path, held_out=("held.py", "missing.py"))


def test_packing_and_windows():
    stream = D.pack_token_stream([[5, 6], [7]], eot_id=0)
    assert stream.tolist() == [0, 5, 6, 0, 7, 0]
    seqs = D.PackedSequences(torch.arange(11), seq_len=3)
    assert seqs.num_sequences == 3
    assert seqs.window(torch.tensor([0, 2])).tolist() == [[0, 1, 2, 3], [6, 7, 8, 9]]
    first = [b.tolist() for b in seqs.batches(2, seed=1, epoch=0)]
    assert first == [b.tolist() for b in seqs.batches(2, seed=1, epoch=0)]
    for b in seqs.batches(2, seed=1, epoch=3):
        assert b.shape == (2, 4)
        assert (b[:, 1:] - b[:, :-1] == 1).all()  # windows are contiguous stream slices
    with pytest.raises(ValueError, match="too short"):
        D.PackedSequences(torch.arange(3), seq_len=8)


# ---------------------------------------------------------------------------- tokenizer
def test_tokenizer_round_trip_and_specials(small, tok):
    for text in [SAMPLE, *small.held_out_texts()]:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert TK.special_token_ids(tok) == {name: i for i, name in enumerate(TK.SPECIAL_TOKENS)}
    assert tok.encode("a<|mask|>b").ids[1] == tok.token_to_id(TK.MASK_TOKEN)
    # Byte lengths of tokens add up to the UTF-8 size of the text (bits-per-byte depends on it).
    ids = torch.tensor(tok.encode(SAMPLE).ids)
    assert int(E.token_byte_lengths(tok)[ids].sum()) == len(SAMPLE.encode("utf-8"))


def test_tokenizer_training_is_deterministic(small, tok):
    again = TK.train_tokenizer(small.train_texts(), vocab_size=512)
    assert again.to_str() == tok.to_str()
    assert tok.get_vocab_size() == 512
    with pytest.raises(ValueError, match="vocab_size"):
        TK.train_tokenizer(["x"], vocab_size=9000)


def test_auto_tokenizer_loads_and_renders_chat(tmp_path, tok):
    from transformers import AutoTokenizer

    TK.save_tokenizer(tok, tmp_path, model_max_length=2048)
    # A config.json with the (transformers-unknown) model type must not break loading.
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["BailingMoeV3ForCausalLM"], "model_type": "bailing_hybrid"}))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.eos_token == TK.EOT_TOKEN and hf.eos_token_id == 0
    assert hf.pad_token_id == 1
    assert hf.convert_tokens_to_ids("<|assistant|>") == 5
    assert hf.decode(hf(SAMPLE)["input_ids"]) == SAMPLE
    text = hf.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f():"}],
        tokenize=False, add_generation_prompt=True)
    assert text == ("<|system|>\nBe brief.<|endoftext|>\n<|user|>\ndef f():<|endoftext|>\n"
                    "<|assistant|>\n")
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == TK.CHAT_TEMPLATE


# ---------------------------------------------------------------------------- recipe
def test_default_config_fits_the_size_budget():
    from sglang.train.reference import ReferenceBailingMoeV3

    raw = TG.tiny_config(TK.MAX_VOCAB, eos_token_id=0, pad_token_id=1)
    cfg = BailingMoeV3Config.from_dict(raw)
    assert cfg.layer_types == ["linear_attention"] * 5 + ["full_attention"]
    assert cfg.is_moe_layer(1) and not cfg.is_moe_layer(0)
    with torch.device("meta"):
        model = ReferenceBailingMoeV3(raw, init=False)
    nbytes = sum(t.numel() * (4 if name.endswith("expert_bias") else 2)
                 for name, t in model.state_dict().items())
    tokenizer_and_logs = 1_500_000  # tokenizer.json ~0.55 MB, log + plot well under 1 MB
    assert nbytes + tokenizer_and_logs <= TG.SIZE_LIMIT_BYTES


def test_lr_schedule():
    assert TG.lr_at(0.0, 1.0, 0.1, 0.1) == pytest.approx(0.01)
    assert TG.lr_at(0.1, 1.0, 0.1, 0.1) == pytest.approx(1.0)
    assert TG.lr_at(1.0, 1.0, 0.1, 0.1) == pytest.approx(0.1)
    mid = TG.lr_at(0.55, 1.0, 0.1, 0.1)
    assert 0.1 < mid < 1.0


def test_unigram_baseline_matches_hand_computation():
    train = torch.tensor([0, 1, 1, 2])
    nats = E.unigram_nats(train, torch.tensor([1, 3]), vocab_size=4)
    # counts + 1 = [2, 3, 2, 1], total 8
    assert nats == pytest.approx(-(math.log(3 / 8) + math.log(1 / 8)))


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(SystemExit):
        TG.main(["--out", str(tmp_path), "--steps", "0"])
    with pytest.raises(SystemExit):
        TG.main(["--out", str(tmp_path), "--mtp-distill", "2"])


TINY_ARGS = ["--hidden-size", "64", "--num-layers", "2", "--layer-group-size", "2",
             "--num-heads", "2", "--head-dim", "16", "--num-experts", "8",
             "--moe-intermediate-size", "32", "--intermediate-size", "64",
             "--vocab-size", "384", "--seq-len", "64", "--batch-size", "4",
             "--steps", "30", "--mtp-steps", "12", "--max-train-files", "3",
             "--eval-windows", "2", "--eval-interval", "10", "--device", "cpu",
             "--lr", "1e-2", "--mtp-lr", "1e-2", "--seed", "0"]


@pytest.fixture
def one_thread():
    # Tiny ops: one intra-op thread is faster, and much faster on a loaded 2-core CI machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_short_training_run_lowers_the_loss(tmp_path, small, one_thread):
    from transformers import AutoTokenizer

    from sglang.train.reference import ReferenceBailingMoeV3

    out = tmp_path / "ckpt"
    log = TG.main(["--out", str(out), *TINY_ARGS])
    target, mtp = log["phases"]["target"], log["phases"]["mtp"]
    assert target["num_steps"] == 30 and mtp["num_steps"] == 12
    first, last = sum(target["loss"][:5]) / 5, sum(target["loss"][-5:]) / 5
    assert last < first - 0.5, (first, last)
    ev = target["eval"]
    assert ev[-1]["heldout_loss"] < min(ev[0]["heldout_loss"] + 0.05, math.log(384))
    assert mtp["loss"][-1] < mtp["loss"][0]
    # The MTP phase left the target untouched: its held-out loss is unchanged.
    assert mtp["eval"][-1]["heldout_loss"] == pytest.approx(ev[-1]["heldout_loss"], rel=1e-3)
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json", "train_log.json"):
        assert (out / name).is_file(), name
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        (out / "loss_curve.png").unlink()
        TG.main(["--out", str(out), "--replot"])
        assert (out / "loss_curve.png").stat().st_size > 1000
    saved = json.loads((out / "train_log.json").read_text())
    assert saved["corpus"]["max_train_files"] == 3 and saved["device"] == "cpu"
    model = ReferenceBailingMoeV3.from_pretrained(str(out))
    assert model.config.num_nextn_predict_layers == 1 and model.config.vocab_size == 384
    assert model.model.word_embeddings.weight.dtype == torch.float32
    assert AutoTokenizer.from_pretrained(str(out)).eos_token_id == model.config.eos_token_id

    result = E.evaluate_model(str(out), "cpu", batch_size=4, max_windows=2, max_new_tokens=4,
                              corpus=small)
    assert result["heldout_tokens"] == 2 * 64
    assert 0 < result["heldout_bits_per_byte"] < 16
    assert result["unigram_bits_per_byte"] > 0
    assert 0 <= result["mtp_agreement"] <= 1 and len(result["samples"]) == len(E.PROMPTS)
    assert "held-out bits/byte" in E.format_table(result)
