"""The first steps of a user, and the messages that meet a wrong one.

- A Hugging Face repo id as ``--model-path`` is refused with what to do instead: download the
  folder (the command, the files it needs) or use a preset with ``--load-format dummy``.
- ``sglang.Engine`` in a script: with ``if __name__ == "__main__":`` it serves; without it, the
  script stops at once with one line that says to add the guard (not multiprocessing's
  bootstrap traceback from every child, and no hang).
- A model without a tokenizer refuses text in the terms of the endpoint that was called.
- ``/get_server_info`` (and ``Engine.get_server_info``) report the bundled model's folder as
  ``model_path`` rather than ``null``.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from typing import Any, Dict, Iterator

import pytest
import requests

from sglang.srt.configs.model_config import (
    BUNDLED_MODEL_DIR,
    ConfigError,
    ModelConfig,
    list_presets,
)
from sglang.srt.server_args import ServerArgs
from sglang.test.test_utils import (
    DEFAULT_PORT_FOR_SRT_TEST_RUNNER,
    find_available_port,
    kill_process_tree,
    popen_launch_server,
)

from engine_test_utils import write_checkpoint

REPO_ID = "inclusionAI/Ling-3.0-flash"
# What a user needs to act on the refusal: no download, the command, the folder's files, the
# presets with dummy weights.
REPO_ID_NEEDLES = ("never downloads", f"huggingface-cli download {REPO_ID} --local-dir",
                   "config.json", "safetensors", "model.safetensors.index.json",
                   "tokenizer.json", "--load-format dummy", *list_presets())


def _child_env() -> Dict[str, str]:
    """The test's environment for a child Python, one CPU thread (2 shared cores in CI)."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    return env


# ----------------------------------------------------------------------------- repo ids
def test_repo_id_is_refused_with_what_to_do():
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_path(REPO_ID)
    msg = str(info.value)
    for needle in REPO_ID_NEEDLES:
        assert needle in msg, (needle, msg)
    assert "looks like a Hugging Face repo id" in msg


def test_missing_folder_is_not_called_a_repo_id(tmp_path):
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_path(str(tmp_path / "no-such-folder"))
    msg = str(info.value)
    assert "repo id" not in msg and "neither a checkpoint folder nor a preset" in msg
    assert "never downloads" in msg and "--load-format dummy" in msg


def test_launch_server_refuses_a_repo_id_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", REPO_ID],
                          capture_output=True, text=True, timeout=120, env=_child_env())
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    for needle in REPO_ID_NEEDLES:
        assert needle in lines[0], needle


def test_engine_refuses_a_repo_id_before_starting_children():
    import sglang

    with pytest.raises(ConfigError, match="huggingface-cli download"):
        sglang.Engine(model_path=REPO_ID, device="cpu")


# ----------------------------------------------------------------------------- Engine scripts
GUARDED = """
import sglang

if __name__ == "__main__":
    engine = sglang.Engine(device="cpu", max_total_tokens=1024, max_running_requests=2)
    out = engine.generate("def add(a, b):", {"max_new_tokens": 3, "temperature": 0,
                                             "ignore_eos": True})
    print("TOKENS", out["meta_info"]["completion_tokens"])
    print("MODEL_PATH", engine.get_server_info()["model_path"])
    engine.shutdown()
"""

UNGUARDED = """
import sglang

engine = sglang.Engine(device="cpu", max_total_tokens=1024, max_running_requests=2)
print(engine.generate("def add(a, b):", {"max_new_tokens": 3})["text"])
engine.shutdown()
"""


def _run_script(tmp_path, source: str, timeout: float) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=timeout, cwd=str(tmp_path), env=_child_env())


def test_engine_script_with_the_main_guard_runs(tmp_path):
    proc = _run_script(tmp_path, GUARDED, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TOKENS 3" in proc.stdout, proc.stdout
    # Engine.get_server_info reports the bundled model's folder, not None.
    assert f"MODEL_PATH {BUNDLED_MODEL_DIR}" in proc.stdout, proc.stdout


def test_engine_script_without_the_guard_fails_fast_with_one_line(tmp_path):
    from sglang.srt.entrypoints.engine import MAIN_GUARD_MESSAGE

    # subprocess.run's timeout (TimeoutExpired) is the "does not hang" check: the children exit
    # while importing the script, so this takes about two interpreter start-ups.
    proc = _run_script(tmp_path, UNGUARDED, timeout=240)
    assert proc.returncode != 0
    assert 'if __name__ == "__main__":' in MAIN_GUARD_MESSAGE
    assert f"RuntimeError: {MAIN_GUARD_MESSAGE}" in proc.stderr.splitlines(), proc.stderr[-3000:]
    # The children stay quiet: no bootstrap traceback of multiprocessing's, no second error.
    assert "bootstrapping phase" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("RuntimeError:") == 1, proc.stderr[-3000:]


# ----------------------------------------------------------------------------- server info
def test_server_info_reports_the_bundled_models_folder():
    from sglang.srt.entrypoints import http_server

    class _Tm:
        async def get_internal_state(self) -> list:
            return [{}]

    args = ServerArgs(api_key="secret")  # no model_path: the bundled model
    assert args.model_path is None
    saved = http_server._state
    http_server.set_global_state(_Tm(), args, {})
    try:
        info = asyncio.run(http_server.server_info())
    finally:
        http_server._state = saved
    assert info["model_path"] == str(BUNDLED_MODEL_DIR)
    assert info["tokenizer_path"] == str(BUNDLED_MODEL_DIR)
    assert info["api_key"] == "***"
    assert args.model_path is None  # reported, not changed


# ----------------------------------------------------------------------------- no tokenizer
@pytest.fixture(scope="module")
def bare_server(tmp_path_factory) -> Iterator[Dict[str, Any]]:
    """A tiny checkpoint without tokenizer files, served on CPU."""
    root = tmp_path_factory.mktemp("no-tokenizer")
    model_dir = write_checkpoint(str(root / "ckpt"), with_tokenizer=False)
    base_url = f"http://127.0.0.1:{find_available_port(DEFAULT_PORT_FOR_SRT_TEST_RUNNER + 300)}"
    with open(root / "server.log", "w") as log:
        proc = popen_launch_server(model_dir, base_url, timeout=300, env=_child_env(),
                                   other_args=["--device", "cpu", "--max-total-tokens", "2048"],
                                   return_stdout_stderr=(log, log))
    try:
        yield {"url": base_url, "model_dir": model_dir}
    finally:
        kill_process_tree(proc.pid)


def _post(server: Dict[str, Any], path: str, body: Dict[str, Any]) -> requests.Response:
    return requests.post(server["url"] + path, json=body, timeout=60)


def _error(resp: requests.Response) -> str:
    assert resp.status_code == 400, (resp.status_code, resp.text[:500])
    return resp.json()["error"]["message"]


def test_generate_without_tokenizer_names_text_and_input_ids(bare_server):
    msg = _error(_post(bare_server, "/generate",
                       {"text": "hi", "sampling_params": {"max_new_tokens": 1}}))
    assert "no tokenizer" in msg and "'input_ids' instead of 'text'" in msg, msg
    ok = _post(bare_server, "/generate",
               {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2,
                                                            "ignore_eos": True}})
    assert ok.status_code == 200, ok.text
    assert ok.json()["meta_info"]["completion_tokens"] == 2


def test_completions_without_tokenizer_names_the_prompt(bare_server):
    msg = _error(_post(bare_server, "/v1/completions",
                       {"model": "default", "prompt": "hi", "max_tokens": 1}))
    assert "no tokenizer" in msg and "'prompt'" in msg and "list of ints" in msg, msg
    assert "input_ids" not in msg and "'text'" not in msg, msg  # not /generate's fields
    msg = _error(_post(bare_server, "/v1/completions",
                       {"model": "default", "prompt": [1, 2], "max_tokens": 1, "echo": True}))
    assert "'echo'" in msg and "tokenizer" in msg, msg
    ok = _post(bare_server, "/v1/completions",
               {"model": "default", "prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 2


def test_chat_without_tokenizer_says_it_cannot_be_served(bare_server):
    msg = _error(_post(bare_server, "/v1/chat/completions",
                       {"model": "default", "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 1}))
    assert "no tokenizer" in msg and "/v1/chat/completions cannot be served" in msg, msg
    assert "/v1/completions" in msg and "/generate" in msg, msg


def test_server_info_of_a_folder_is_that_folder(bare_server):
    info = requests.get(bare_server["url"] + "/get_server_info", timeout=30).json()
    assert info["model_path"] == bare_server["model_dir"]
