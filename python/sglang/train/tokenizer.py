"""Byte-level BPE tokenizer of the bundled model, trained with the ``tokenizers`` library.

Byte-level means every UTF-8 string round-trips exactly (``decode(encode(x)) == x``), which code
needs (indentation, tabs, any Unicode in string literals). The saved directory holds the usual
Hugging Face files (``tokenizer.json``, ``tokenizer_config.json`` with the chat template,
``special_tokens_map.json``), so ``transformers.AutoTokenizer.from_pretrained(dir)`` loads it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Iterable, List, Sequence, Union

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOT_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# Reserved for block drafting (a draft model fills masked positions); never produced by text.
MASK_TOKEN = "<|mask|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# Order fixes the ids: <|endoftext|> = 0, <|pad|> = 1, <|mask|> = 2, roles 3..5.
SPECIAL_TOKENS: List[str] = [EOT_TOKEN, PAD_TOKEN, MASK_TOKEN, *ROLE_TOKENS]
MAX_VOCAB = 8192

# Each turn: role marker, newline, content, end-of-text, newline. The generation prompt opens an
# assistant turn; the model stops at <|endoftext|> (the eos token).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|endoftext|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = MAX_VOCAB,
                    min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE on ``texts`` (deterministic for the same texts in the same order)."""
    if not 256 + len(SPECIAL_TOKENS) < vocab_size <= MAX_VOCAB:
        raise ValueError(
            f"vocab_size must be in ({256 + len(SPECIAL_TOKENS)}, {MAX_VOCAB}], got {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    # No prefix space: code must round-trip byte for byte.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise RuntimeError(f"special token {name!r} did not get id {i}")
    return tok


def special_token_ids(tok: Tokenizer) -> Dict[str, int]:
    """Ids of the special tokens (eot, pad, mask and the role markers) by name."""
    return {name: tok.token_to_id(name) for name in SPECIAL_TOKENS}


def encode_batch(tok: Tokenizer, texts: Sequence[str]) -> List[List[int]]:
    """Token ids of each text (no special tokens are added)."""
    return [e.ids for e in tok.encode_batch(list(texts), add_special_tokens=False)]


def save_tokenizer(tok: Tokenizer, out_dir: Union[str, Path], model_max_length: int) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``.

    The config files are written directly (not through ``transformers``) so that their content
    does not depend on the installed ``transformers`` version.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(name)): {
            "content": name, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for name in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOT_TOKEN,
        "pad_token": PAD_TOKEN,
        "mask_token": MASK_TOKEN,
        "additional_special_tokens": list(ROLE_TOKENS),
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {
        "eos_token": EOT_TOKEN,
        "pad_token": PAD_TOKEN,
        "mask_token": MASK_TOKEN,
        "additional_special_tokens": list(ROLE_TOKENS),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def load_tokenizer(model_dir: Union[str, Path]) -> Tokenizer:
    """Load ``tokenizer.json`` from a model directory; raise a clear error if it is missing."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {str(model_dir)!r}")
    return Tokenizer.from_file(str(path))
