"""The engine's tokenizer loading (``sglang.srt.managers.utils.load_tokenizer``): a folder whose
tokenizer_config names transformers' fast tokenizer is loaded by that class directly, and gives
the tokenizer AutoTokenizer gives; any other folder goes through AutoTokenizer."""
import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from sglang.srt.configs.model_config import resolve_model_path
from sglang.srt.managers import utils
from sglang.srt.server_args import ServerArgs

BUNDLED = resolve_model_path(None)
TEXTS = ["Hello world, 12 + 30 = 42.", "<|user|>hi<|endoftext|>", "  spaces\tand\nlines  ", ""]


def test_bundled_folder_is_loaded_directly_and_equals_autotokenizer(monkeypatch):
    assert utils.names_fast_tokenizer(BUNDLED)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        lambda *a, **k: pytest.fail("AutoTokenizer used for a fast folder"))
    tok = utils.load_tokenizer(ServerArgs(model_path=BUNDLED, device="cpu"))
    monkeypatch.undo()
    ref = AutoTokenizer.from_pretrained(BUNDLED)
    assert type(tok) is type(ref)
    assert tok.eos_token_id == ref.eos_token_id and len(tok) == len(ref)
    assert tok.all_special_ids == ref.all_special_ids
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert ids == ref(text)["input_ids"]
        assert tok.decode(ids) == ref.decode(ids)
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    chat = [{"role": "user", "content": "2 + 2?"}]
    assert (tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


@pytest.mark.parametrize("edit", [
    {"tokenizer_class": "GPT2TokenizerFast"},
    {"auto_map": {"AutoTokenizer": ["x.Tok", None]}},
    None,  # no tokenizer_class at all
])
def test_other_folders_go_through_autotokenizer(tmp_path, monkeypatch, edit):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(Path(BUNDLED) / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    if edit is None:
        config.pop("tokenizer_class")
    else:
        config.update(edit)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert not utils.names_fast_tokenizer(str(tmp_path))
    seen = []
    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        lambda path, **k: seen.append(path) or "auto")
    assert utils.load_tokenizer(ServerArgs(model_path=str(tmp_path), device="cpu")) == "auto"
    assert seen == [str(tmp_path)]


def test_unreadable_config_is_left_to_autotokenizer(tmp_path):
    shutil.copy(Path(BUNDLED) / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    assert not utils.names_fast_tokenizer(str(tmp_path))
