"""Server flags: the audit (every flag acts, is refused, or says plainly that it changes
nothing here), the scheduler's CPU thread default, ``--config`` files (unit tests of
``prepare_server_args``), and, through one real server process started from a config file,
``--enable-metrics`` (``/metrics`` after requests), ``/tokenize`` / ``/detokenize``,
``--chat-template`` and ``--log-requests``.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import time
import uuid
from typing import Any, Dict, Iterator

import pytest
import requests
import torch
from prometheus_client.parser import text_string_to_metric_families

from sglang.srt import server_args as server_args_module
from sglang.srt.configs import engine_defaults
from sglang.srt.server_args import NO_OP_FLAGS, ServerArgs, prepare_server_args, warn_compat_flags
from sglang.test.test_utils import TinyServer, launch_tiny_server

ON_CUDA = torch.cuda.is_available()


def _help_of(flag: str) -> str:
    for action in _parser()._actions:
        if flag in action.option_strings:
            return action.help or ""
    raise AssertionError(f"{flag} is not registered")


# ---------------------------------------------------------------- every flag is honest
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def test_every_field_has_exactly_one_flag():
    dests = {a.dest for a in _parser()._actions} - {"help"}
    assert dests == {f.name for f in dataclasses.fields(ServerArgs)}


def test_no_help_says_accepted_without_effect():
    for action in _parser()._actions:
        text = (action.help or "").lower()
        assert "accepted for compatibility" not in text and "no effect" not in text, action.dest


def test_no_op_flags_are_the_documented_four():
    assert set(NO_OP_FLAGS) == {"--trust-remote-code", "--disable-radix-cache",
                                "--flashinfer-allreduce-fusion-backend", "--enable-mixed-chunk"}
    for flag, what in NO_OP_FLAGS.items():
        assert _help_of(flag) == what + "."
    assert "prefix (radix) cache" in NO_OP_FLAGS["--disable-radix-cache"]
    for flag in ("--enable-metrics", "--watchdog-timeout", "--disable-cuda-graph",
                 "--cuda-graph-max-bs", "--cuda-graph-bs", "--disable-overlap-schedule"):
        assert flag not in NO_OP_FLAGS
    assert "/metrics" in _help_of("--enable-metrics")
    assert "exits" in _help_of("--watchdog-timeout")


@pytest.fixture
def fresh_warnings(monkeypatch, caplog):
    """Forget which flags / variables this process already described; capture new lines."""
    from sglang.srt import environ

    monkeypatch.setattr(server_args_module, "_NO_OP_LOGGED", set())
    monkeypatch.setattr(environ, "_COMPAT_WARNED", set())
    monkeypatch.setattr(environ, "_UNKNOWN_WARNED", set())
    for f in environ.compat_env_fields():
        monkeypatch.delenv(f.name, raising=False)
    caplog.set_level(logging.INFO)
    return caplog


def test_misspelt_sglang_variable_is_named_with_the_closest_one(fresh_warnings, monkeypatch):
    from sglang.srt import environ

    monkeypatch.setenv("SGLANG_HEALTH_CHEK_TIMEOUT", "5")  # SGLANG_HEALTH_CHECK_TIMEOUT misspelt
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "5")
    prepare_server_args([])
    prepare_server_args([])
    lines = [r.getMessage() for r in fresh_warnings.records if "CHEK" in r.getMessage()]
    assert len(lines) == 1 and "did you mean SGLANG_HEALTH_CHECK_TIMEOUT?" in lines[0]
    assert environ.set_env_values()["SGLANG_HEALTH_CHECK_TIMEOUT"] == 5.0


def test_retired_sglang_variable_says_what_replaced_it(fresh_warnings, monkeypatch):
    """A retired kernel switch set out of habit is named once, with its replacement, at
    start-up (not with a look-alike variable)."""
    monkeypatch.setenv("SGLANG_TRITON_RMSNORM", "0")
    prepare_server_args([])
    prepare_server_args([])
    lines = [r.getMessage() for r in fresh_warnings.records
             if "SGLANG_TRITON_RMSNORM" in r.getMessage()]
    assert len(lines) == 1 and "was retired" in lines[0] and "KernelChoices(rmsnorm" in lines[0]
    assert "did you mean" not in lines[0]


def _no_op_records(caplog, flag):
    return [r for r in caplog.records if r.getMessage().startswith(f"{flag}: ")]


@pytest.mark.parametrize("argv, flag", [
    (["--trust-remote-code"], "--trust-remote-code"),
    (["--flashinfer-allreduce-fusion-backend", "auto"], "--flashinfer-allreduce-fusion-backend"),
    (["--disable-radix-cache"], "--disable-radix-cache"),
])
def test_no_op_flag_is_described_once_per_process(fresh_warnings, argv, flag):
    a = prepare_server_args(argv)
    prepare_server_args(argv)
    records = _no_op_records(fresh_warnings, flag)
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert records[0].getMessage() == f"{flag}: {NO_OP_FLAGS[flag]}."
    assert warn_compat_flags(a) == [flag]
    assert len(_no_op_records(fresh_warnings, flag)) == 1  # still one


def test_default_args_warn_about_nothing(fresh_warnings):
    a = ServerArgs()
    assert warn_compat_flags(a) == []
    assert not [r for r in fresh_warnings.records if r.levelno >= logging.INFO]


def test_enable_metrics_needs_prometheus_client(monkeypatch):
    pytest.importorskip("prometheus_client")
    assert ServerArgs(enable_metrics=True).enable_metrics
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "prometheus_client" else real(name, *a))
    with pytest.raises(ValueError, match="--enable-metrics needs the prometheus_client package"):
        ServerArgs(enable_metrics=True)
    assert not ServerArgs().enable_metrics  # without the flag the package is not needed


# ---------------------------------------------------------------- scheduler CPU threads
def test_cpu_thread_default_is_a_few_threads_per_rank():
    assert engine_defaults.default_cpu_num_threads(1, 2) == 2
    assert engine_defaults.default_cpu_num_threads(1, 64) == engine_defaults.CPU_MAX_DEFAULT_THREADS
    assert engine_defaults.default_cpu_num_threads(4, 64) == 4
    assert engine_defaults.default_cpu_num_threads(2, 6) == 3
    assert engine_defaults.default_cpu_num_threads(4, 2) == 1  # never zero
    with pytest.raises(ValueError, match="tp_size"):
        engine_defaults.default_cpu_num_threads(0, 8)
    assert 1 <= engine_defaults.available_cpu_cores()


@pytest.mark.skipif(ON_CUDA, reason="checks the CPU defaults")
def test_resolved_cpu_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    default = engine_defaults.default_cpu_num_threads(1, engine_defaults.available_cpu_cores())
    assert ServerArgs().resolved_cpu_num_threads() == default
    assert ServerArgs(cpu_num_threads=7).resolved_cpu_num_threads() == 7
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the caller's choice: torch already follows it
    assert ServerArgs().resolved_cpu_num_threads() is None
    assert ServerArgs(cpu_num_threads=3).resolved_cpu_num_threads() == 3  # the flag wins


# ----------------------------------------------------------------------------- --config
def _config(tmp_path, text: str) -> str:
    path = tmp_path / "server.yaml"
    path.write_text(text)
    return str(path)


def _cli_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        prepare_server_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_config_file_sets_flags_in_every_spelling(tmp_path):
    cfg = _config(tmp_path, """
model: ling-3.0-flash            # an alias of --model-path
load_format: dummy
--tp-size: 1
max-running-requests: 3
cuda-graph-bs: [1, 2]
json-model-override-args: {num_hidden_layers: 2}
mem_fraction_static: 0.5
enable-metrics: true
disable-radix-cache: false
log-requests-level: 1
""")
    a = prepare_server_args(["--config", cfg])
    assert a.model_path == "ling-3.0-flash" and a.load_format == "dummy" and a.tp_size == 1
    assert a.max_running_requests == 3 and a.cuda_graph_bs == [1, 2]
    assert json.loads(a.json_model_override_args) == {"num_hidden_layers": 2}
    assert a.mem_fraction_static == 0.5 and a.enable_metrics and not a.disable_radix_cache
    assert a.log_requests_level == 1
    assert prepare_server_args([f"--config={cfg}"]).max_running_requests == 3


def test_command_line_overrides_the_config_file(tmp_path):
    cfg = _config(tmp_path, "port: 31000\nmax-running-requests: 3\nserved-model-name: file\n")
    a = prepare_server_args(["--port", "32000", "--config", cfg, "--served-model-name", "cli"])
    assert (a.port, a.served_model_name, a.max_running_requests) == (32000, "cli", 3)


def test_empty_config_file_changes_nothing(tmp_path):
    a = prepare_server_args(["--config", _config(tmp_path, "# nothing\n"), "--random-seed", "1"])
    assert a == prepare_server_args(["--random-seed", "1"])


@pytest.mark.parametrize("text, needles", [
    ("tp-sise: 2\n", ("unknown key 'tp-sise'", "did you mean --tp-size")),
    ("port: [1, 2\n", ("invalid YAML",)),
    ("- port\n- 1\n", ("must be a YAML mapping", "list")),
    ("port: 2.5\n", ("key 'port'", "--port must be an integer")),
    ("port: abc\n", ("--port must be an integer", "'abc'")),
    ("port: true\n", ("--port takes a value",)),
    ("enable-metrics: 1\n", ("--enable-metrics is a switch",)),
    ("dtype: int8\n", ("--dtype must be one of",)),
    ("log-requests-level: 7\n", ("--log-requests-level must be one of",)),
    ("cuda-graph-bs: []\n", ("--cuda-graph-bs needs at least one value",)),
    ("host: {a: 1}\n", ("--host takes a single value, got a dict",)),
    ("served-model-name: [a, b]\n", ("--served-model-name takes a single value",)),
    ("tp_size: 2\ntp-size: 4\n", ("set the same flag --tp-size",)),
    ("config: other.yaml\n", ("--config cannot be set from a config file",)),
    ("1: x\n", ("key 1 is not a flag name",)),
])
def test_bad_config_files_name_the_file_and_the_key(tmp_path, capsys, text, needles):
    cfg = _config(tmp_path, text)
    err = _cli_error(["--config", cfg], capsys)
    assert f"--config {cfg}" in err
    for needle in needles:
        assert needle in err, (needle, err)


def test_config_file_values_are_validated_like_flags(tmp_path, capsys):
    err = _cli_error(["--config", _config(tmp_path, "tp-size: 0\n")], capsys)
    assert "--tp-size must be an integer >= 1" in err


@pytest.mark.parametrize("argv, needle", [
    (["--config", "/no/such/server.yaml"], "--config /no/such/server.yaml: no such file"),
    (["--config"], "--config needs the path of a YAML file"),
])
def test_config_flag_errors(argv, needle, capsys):
    assert needle in _cli_error(argv, capsys)


def test_config_given_twice_is_refused(tmp_path, capsys):
    cfg = _config(tmp_path, "port: 1\n")
    assert "--config is given 2 times" in _cli_error(["--config", cfg, "--config", cfg], capsys)


# ----------------------------------------------------------------------------- one server
CHAT_TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<<assistant>>{% endif %}")


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[TinyServer]:
    root = tmp_path_factory.mktemp("flags")
    template = root / "template.jinja"
    template.write_text(CHAT_TEMPLATE)
    cfg = root / "server.yaml"
    cfg.write_text(f"enable_metrics: true\n--log-requests: true\nlog-requests-level: 3\n"
                   f"chat-template: {template}\nrandom-seed: 0\n")
    srv = launch_tiny_server(str(root), ["--config", str(cfg)])
    try:
        yield srv
    finally:
        srv.stop()


def _post(server: TinyServer, path: str, body: Any) -> requests.Response:
    return requests.post(server.base_url + path, json=body, timeout=120)


def _metrics(server: TinyServer) -> Dict[str, float]:
    """``{"name{labels}": value}`` of every sample on /metrics (labels in sorted order)."""
    r = requests.get(server.base_url + "/metrics", timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
            if "le" in s.labels:
                continue  # bucket rows: the _count / _sum rows say enough here
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def _model_label(server: TinyServer) -> str:
    name = requests.get(server.base_url + "/model_info", timeout=30).json()["served_model_name"]
    return f"model_name={name}"


def _stream_generate(server: TinyServer, body: Dict[str, Any]) -> Dict[str, Any]:
    last = None
    with requests.post(server.base_url + "/generate", json={**body, "stream": True},
                       stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                last = json.loads(line[6:])
    return last


def test_metrics_count_a_streamed_and_a_plain_request(server):
    label = _model_label(server)

    def get(m: Dict[str, float], name: str) -> float:
        return m.get(f"sglang:{name}{{{label}}}", 0.0)

    before = _metrics(server)
    out = _stream_generate(server, {"text": "def add(a, b):", "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 6
    mid = _metrics(server)
    assert get(mid, "num_requests_total") - get(before, "num_requests_total") == 1
    assert (get(mid, "prompt_tokens_total") - get(before, "prompt_tokens_total")
            == meta["prompt_tokens"])
    assert get(mid, "generation_tokens_total") - get(before, "generation_tokens_total") == 6
    for name, delta in (("time_to_first_token_seconds_count", 1),
                        ("inter_token_latency_seconds_count", 5),
                        ("time_per_output_token_seconds_count", 1),
                        ("e2e_request_latency_seconds_count", 1)):
        assert get(mid, name) - get(before, name) == delta, name
    e2e_sum = "e2e_request_latency_seconds_sum"
    assert get(mid, e2e_sum) > get(before, e2e_sum)
    # Scheduler gauges, sampled at the scrape: the server is idle again.
    assert get(mid, "num_running_reqs") == 0 and get(mid, "num_queue_reqs") == 0
    assert get(mid, "max_total_num_tokens") > 0 and get(mid, "token_usage") == 0

    r = _post(server, "/generate", {"text": "import os", "sampling_params": {
        "max_new_tokens": 3, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    after = _metrics(server)
    assert get(after, "num_requests_total") - get(mid, "num_requests_total") == 1
    assert get(after, "generation_tokens_total") - get(mid, "generation_tokens_total") == 3
    assert get(after, "e2e_request_latency_seconds_count") - get(
        mid, "e2e_request_latency_seconds_count") == 1
    # Token arrival times of a non-streamed request are not observable: no latency samples.
    assert get(after, "time_to_first_token_seconds_count") == get(
        mid, "time_to_first_token_seconds_count")


def test_health_probes_are_not_counted(server):
    label = _model_label(server)
    before = _metrics(server)[f"sglang:num_requests_total{{{label}}}"]
    assert requests.get(server.base_url + "/health_generate", timeout=60).status_code == 200
    assert _metrics(server)[f"sglang:num_requests_total{{{label}}}"] == before


def test_tokenize_detokenize_round_trip(server):
    text = "def add(a, b):\n    return a + b"
    r = _post(server, "/tokenize", {"prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    context = requests.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]
    assert body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == context["max_model_len"]
    d = _post(server, "/detokenize", {"tokens": body["tokens"]})
    assert d.status_code == 200 and d.json() == {"text": text}
    # Batches, and the /v1 spellings.
    r = _post(server, "/v1/tokenize", {"prompt": [text, "x"], "add_special_tokens": False,
                                       "model": "any"})
    assert r.status_code == 200 and r.json()["count"] == [len(t) for t in r.json()["tokens"]]
    assert r.json()["tokens"][0] == body["tokens"]  # this tokenizer adds no special tokens
    d = _post(server, "/v1/detokenize", {"tokens": r.json()["tokens"]})
    assert d.status_code == 200 and d.json() == {"text": [text, "x"]}
    assert _post(server, "/detokenize", {"tokens": []}).json() == {"text": ""}
    assert _post(server, "/tokenize", {"prompt": []}).json()["tokens"] == []


@pytest.mark.parametrize("path, body, needle", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": ["a", 1]}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/detokenize", {"tokens": ["1"]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/detokenize", {"tokens": [1, [2]]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "token id -1 is outside the vocabulary"),
    ("/detokenize", {"tokens": [[1], [10 ** 9]]}, "tokens[1]: token id 1000000000"),
    ("/v1/detokenize", {"tokens": [1], "skip_special_tokens": 0}, "skip_special_tokens"),
])
def test_tokenize_bad_input_is_a_400(server, path, body, needle):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError" and needle in err["message"]


def test_chat_uses_the_chat_template_flag(server):
    messages = [{"role": "user", "content": "hello"}]
    r = _post(server, "/v1/chat/completions", {"model": "m", "messages": messages,
                                                "max_tokens": 1})
    assert r.status_code == 200, r.text
    rendered = "<<user>>hello<<assistant>>"
    want = _post(server, "/tokenize", {"prompt": rendered, "add_special_tokens": False})
    assert r.json()["usage"]["prompt_tokens"] == want.json()["count"]
    # The tokenizer's own template renders something else, so the count tells them apart.
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(server.model_dir).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert own != rendered


def test_log_requests_logs_input_and_output(server):
    rid = f"logged-{uuid.uuid4().hex}"
    prompt = "class Config:\n    port = 1"
    r = _post(server, "/generate", {"rid": rid, "text": prompt, "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    deadline = time.time() + 10
    while f"Finish: rid={rid}" not in server.log() and time.time() < deadline:
        time.sleep(0.1)
    lines = [ln for ln in server.log().splitlines() if f"rid={rid} " in ln]
    receive = [ln for ln in lines if "Receive: " in ln]
    finish = [ln for ln in lines if "Finish: " in ln]
    assert len(receive) == 1 and len(finish) == 1, lines
    assert f"input={prompt!r}" in receive[0] and "'max_new_tokens': 4" in receive[0]
    assert f"output={r.json()['text']!r}" in finish[0]
    assert "completion_tokens=4" in finish[0] and "e2e_latency=" in finish[0]
    assert not [ln for ln in server.log().splitlines() if "HEALTH_CHECK" in ln]
