"""The bundled tiny BailingMoeV3 (python/sglang/assets/tiny-bailing-v3): default model, tokenizer,
and greedy agreement between the serving engine and the plain-PyTorch reference model."""
from __future__ import annotations

import os

import pytest
import torch

from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR, ModelConfig
from sglang.train.reference import ReferenceBailingMoeV3

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\n\ndef list_files(path):\n    \"\"\"Return",
    "class Stack:\n    def __init__(self):\n        self.",
]
NEW_TOKENS = 24

pytestmark = pytest.mark.skipif(not (BUNDLED_MODEL_DIR / "config.json").exists(),
                                reason="bundled checkpoint not present")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(BUNDLED_MODEL_DIR))


def test_default_model_path_is_bundled():
    cfg = ModelConfig.from_path(None)
    assert os.path.samefile(cfg.model_path, BUNDLED_MODEL_DIR)
    assert cfg.hf_config.num_nextn_predict_layers == 1
    assert cfg.hf_config.kda_layer_ids and cfg.hf_config.full_attention_layer_ids


def test_tokenizer_round_trips_python(tokenizer):
    text = 'def f(x: int) -> str:\n\treturn f"{x!r} → ok"  # ünïcode\r\n'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token is not None and tokenizer.chat_template


def _reference_greedy(model: ReferenceBailingMoeV3, ids: list, n: int) -> list:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(torch.tensor([out]))
            out.append(int(logits[0, -1].argmax()))
    return out[len(ids):]


@pytest.mark.slow  # the reference recomputes the whole sequence for every token
def test_engine_greedy_matches_reference(tokenizer):
    import sglang

    ref = ReferenceBailingMoeV3.from_pretrained(str(BUNDLED_MODEL_DIR), dtype=torch.float32)
    engine = sglang.Engine(device="cpu", dtype="float32", random_seed=0, log_level="warning",
                           max_total_tokens=4096, max_running_requests=4)
    try:
        params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
        outs = engine.generate(PROMPTS, params)
        for prompt, out in zip(PROMPTS, outs):
            ids = tokenizer.encode(prompt, add_special_tokens=False)
            assert out["output_ids"] == _reference_greedy(ref, ids, NEW_TOKENS), prompt
            assert out["meta_info"]["completion_tokens"] == NEW_TOKENS
    finally:
        engine.shutdown()
