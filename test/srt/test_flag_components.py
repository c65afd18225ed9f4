"""The pieces behind the server flags, in-process: ``--chat-template`` loading
(``template_manager``), ``--log-requests`` lines (``request_logger``), the Prometheus collectors
(``metrics.collector``), the ``/metrics`` and ``/tokenize`` handlers (``http_extra_routes``) and
the ``--watchdog-timeout`` thread (``scheduler_watchdog``). test_server_flags.py runs the same
flags through a real server."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from types import SimpleNamespace
from typing import Any, Dict, List

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from prometheus_client.parser import text_string_to_metric_families

from sglang.srt.entrypoints import http_extra_routes
from sglang.srt.entrypoints.http_extra_routes import TokenizeRequest, metrics_endpoint, tokenize
from sglang.srt.environ import envs
from sglang.srt.managers.request_logger import PARTIAL_CHARS, RequestLogger
from sglang.srt.managers.scheduler_watchdog import SchedulerWatchdog
from sglang.srt.managers.template_manager import (
    BUILTIN_CHAT_TEMPLATES,
    apply_chat_template_override,
    check_chat_template,
    load_chat_template,
)
from sglang.srt.metrics.collector import ServerMetrics

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": " hi "}]


def _render(template: str, **kwargs: Any) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=MESSAGES, **kwargs)


# ----------------------------------------------------------------------------- chat templates
def test_builtin_chat_templates_render_their_formats():
    assert _render(BUILTIN_CHAT_TEMPLATES["chatml"], add_generation_prompt=True) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n hi <|im_end|>\n"
        "<|im_start|>assistant\n")
    assert _render(BUILTIN_CHAT_TEMPLATES["llama-3-instruct"], bos_token="<|begin_of_text|>",
                   add_generation_prompt=True) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nbe brief<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    for name in BUILTIN_CHAT_TEMPLATES:
        assert check_chat_template(name) == BUILTIN_CHAT_TEMPLATES[name]


def test_chat_template_file_and_its_errors(tmp_path):
    good = tmp_path / "t.jinja"
    good.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert load_chat_template(str(good)) == good.read_text()
    bad = tmp_path / "bad.jinja"
    bad.write_text("line one\n{% for m in messages %}{{ m }}")  # the for is never closed
    with pytest.raises(ValueError, match=r"--chat-template .*bad.jinja: invalid Jinja template"):
        check_chat_template(str(bad))
    empty = tmp_path / "empty.jinja"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="the file is empty"):
        load_chat_template(str(empty))
    with pytest.raises(ValueError, match="is a directory"):
        load_chat_template(str(tmp_path))
    with pytest.raises(ValueError, match=r"not a built-in template name \(built-in: chatml"):
        load_chat_template("chat-ml")


def test_chat_template_override_installs_the_template():
    tok = SimpleNamespace(chat_template="own")
    apply_chat_template_override(tok, None)
    assert tok.chat_template == "own"
    apply_chat_template_override(tok, "chatml")
    assert tok.chat_template == BUILTIN_CHAT_TEMPLATES["chatml"]
    with pytest.raises(ValueError, match="--chat-template chatml: the model has no tokenizer"):
        apply_chat_template_override(None, "chatml")


# ----------------------------------------------------------------------------- request log
def _req(text: Any = "a\nb", **extra: Any) -> SimpleNamespace:
    return SimpleNamespace(rid="r1", text=text, stream=False, log_metrics=True,
                           sampling_params={"max_new_tokens": 4}, **extra)


def test_request_log_levels():
    out = {"text": "out", "meta_info": {"prompt_tokens": 3, "completion_tokens": 2,
                                        "finish_reason": {"type": "length", "length": 2},
                                        "e2e_latency": 0.25}}
    lines = [RequestLogger(level).received_line(_req(), [1, 2, 3]) for level in range(4)]
    assert lines[0] == "Receive: rid=r1 prompt_tokens=3 stream=False"
    assert lines[1] == lines[0] + " sampling_params={'max_new_tokens': 4}"
    assert lines[2] == lines[1] + " input='a\\nb'" == lines[3]  # one line: the newline escaped
    assert RequestLogger(2).received_line(_req(text=None), [5, 6]).endswith("input=[5, 6]")
    finish = RequestLogger(0).finished_line("r1", out)
    assert finish == ("Finish: rid=r1 prompt_tokens=3 completion_tokens=2 finish_reason="
                      "{'type': 'length', 'length': 2} e2e_latency=0.250s")
    assert RequestLogger(2).finished_line("r1", out) == finish + " output='out'"
    with pytest.raises(ValueError, match="--log-requests-level"):
        RequestLogger(4)


def test_request_log_level_2_cuts_and_3_keeps_everything():
    long = "x" * (PARTIAL_CHARS * 2)
    cut = RequestLogger(2).received_line(_req(text=long), [1])
    assert cut.endswith(f"... ({len(long) + 2} characters in all)")
    assert len(cut) < PARTIAL_CHARS + 200
    assert RequestLogger(3).received_line(_req(text=long), [1]).endswith(f"input={long!r}")


def test_health_probes_are_not_logged(caplog):
    caplog.set_level(logging.INFO)
    RequestLogger(0).log_received(_req(), [1])
    RequestLogger(0).log_received(SimpleNamespace(**{**vars(_req()), "log_metrics": False}), [1])
    assert len([r for r in caplog.records if r.getMessage().startswith("Receive:")]) == 1


# ----------------------------------------------------------------------------- metrics
def _samples(metrics: ServerMetrics) -> Dict[str, float]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if "le" not in s.labels:
                assert s.labels.get("model_name") == "m", s
                out[s.name] = s.value
    return out


def test_request_metrics_of_a_streamed_request():
    m = ServerMetrics("m")
    t = m.tokenizer
    t.on_request("a", created=10.0, prompt_tokens=7, stream=True)
    t.on_output("a", 1, 0, None, now=10.5)  # first token: TTFT 0.5
    t.on_output("a", 3, 0, None, now=10.7)  # two tokens in 0.2 s: two gaps of 0.1
    t.on_output("a", 4, 0, {"type": "length", "length": 4}, now=10.8)
    s = _samples(m)
    assert s["sglang:prompt_tokens_total"] == 7 and s["sglang:generation_tokens_total"] == 4
    assert s["sglang:num_requests_total"] == 1 and s["sglang:num_aborted_requests_total"] == 0
    assert s["sglang:time_to_first_token_seconds_count"] == 1
    assert s["sglang:time_to_first_token_seconds_sum"] == pytest.approx(0.5)
    assert s["sglang:inter_token_latency_seconds_count"] == 3
    assert s["sglang:inter_token_latency_seconds_sum"] == pytest.approx(0.3)
    assert s["sglang:time_per_output_token_seconds_sum"] == pytest.approx(0.1)  # 0.3 s / 3
    assert s["sglang:e2e_request_latency_seconds_sum"] == pytest.approx(0.8)
    assert t.num_tracked() == 0


def test_request_metrics_of_plain_aborted_and_probe_requests():
    m = ServerMetrics("m")
    t = m.tokenizer
    t.on_request("plain", created=0.0, prompt_tokens=2, stream=False)
    t.on_output("plain", 5, 1, {"type": "stop", "matched": 0}, now=1.0)
    t.on_request("gone", created=0.0, prompt_tokens=3, stream=True)
    t.on_output("gone", 0, 0, {"type": "abort", "message": "aborted"}, now=2.0)
    t.on_request("probe", created=0.0, prompt_tokens=1, stream=True, log_metrics=False)
    t.on_output("probe", 1, 0, {"type": "length"}, now=0.1)
    t.on_request("unsent", created=0.0, prompt_tokens=9, stream=True)
    t.forget("unsent")
    t.on_output("unknown", 3, 0, {"type": "length"}, now=0.1)
    s = _samples(m)
    assert s["sglang:num_requests_total"] == 2 and s["sglang:num_aborted_requests_total"] == 1
    assert s["sglang:prompt_tokens_total"] == 5 and s["sglang:generation_tokens_total"] == 5
    assert s["sglang:cached_tokens_total"] == 1
    assert s["sglang:e2e_request_latency_seconds_count"] == 2
    assert s["sglang:time_to_first_token_seconds_count"] == 0  # neither streamed a token
    assert t.num_tracked() == 0


def test_scheduler_gauges_from_the_internal_state():
    m = ServerMetrics("m")
    m.scheduler.log_internal_state({
        "num_running_reqs": 2, "num_waiting_reqs": 5, "last_gen_throughput": 12.5,
        "max_total_num_tokens": 100, "memory_usage": {"kv_tokens_used": 25, "token_usage": 0.25},
        "avg_spec_accept_length": True})  # a bool is no number: left alone
    s = _samples(m)
    assert (s["sglang:num_running_reqs"], s["sglang:num_queue_reqs"]) == (2, 5)
    assert s["sglang:gen_throughput"] == 12.5 and s["sglang:token_usage"] == 0.25
    assert s["sglang:num_used_tokens"] == 25 and s["sglang:max_total_num_tokens"] == 100
    assert "sglang:spec_accept_length" not in s
    ServerMetrics("m")  # a second registry in the same process does not clash


def _set_manager(monkeypatch, tm: Any) -> None:
    monkeypatch.setattr(http_extra_routes, "_tokenizer_manager", lambda: tm)


def test_metrics_endpoint_is_404_without_the_flag(monkeypatch):
    _set_manager(monkeypatch, SimpleNamespace(metrics=None))
    resp = asyncio.run(metrics_endpoint())
    assert resp.status_code == 404
    assert json.loads(resp.body) == {"error": {
        "message": "/metrics is served only when the server is started with --enable-metrics",
        "type": "NotFoundError", "code": 404}}


def test_metrics_endpoint_serves_counters_when_the_scheduler_cannot_answer(monkeypatch):
    async def no_state(timeout: float) -> List[dict]:
        raise RuntimeError("the engine is not healthy")

    metrics = ServerMetrics("m")
    _set_manager(monkeypatch, SimpleNamespace(metrics=metrics, get_internal_state=no_state))
    resp = asyncio.run(metrics_endpoint())
    assert resp.status_code == 200 and b"sglang:num_requests_total" in resp.body


def test_tokenize_caps_prompts_before_the_tokenizer_runs():
    class NoTokenizer:
        def encode(self, *args: Any, **kwargs: Any) -> List[int]:
            raise AssertionError("tokenized a prompt over the character limit")

    tm = SimpleNamespace(tokenizer=NoTokenizer(), context_len=8)
    with envs.SGLANG_MAX_PROMPT_CHARS.override(10):
        with pytest.raises(ValueError, match=r"prompt\[1\] has 11 characters"):
            tokenize(tm, TokenizeRequest(prompt=["short", "x" * 11]))
    with pytest.raises(ValueError, match="no tokenizer, so /tokenize is unavailable"):
        tokenize(SimpleNamespace(tokenizer=None, context_len=8), TokenizeRequest(prompt="a"))


# ----------------------------------------------------------------------------- watchdog
class _FakeScheduler:
    def __init__(self, busy: bool) -> None:
        self.busy, self.forward_ct, self.tp_rank = busy, 0, 0
        self.running_batch, self.waiting_queue = None, [object()]

    def has_work(self) -> bool:
        return self.busy


def _watch(scheduler: _FakeScheduler, seconds: float) -> List[str]:
    fired: List[str] = []
    dog = SchedulerWatchdog(scheduler, timeout_s=0.3, on_timeout=fired.append, poll_s=0.02)
    dog.start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not fired:
        if scheduler.busy == "progress":
            scheduler.forward_ct += 1
        time.sleep(0.02)
    dog.stop()
    dog.join(timeout=2)
    return fired


def test_watchdog_fires_on_a_stuck_scheduler_with_work():
    fired = _watch(_FakeScheduler(busy=True), seconds=5)
    assert len(fired) == 1
    assert "finished no forward" in fired[0] and "--watchdog-timeout 0.3" in fired[0]
    assert "1 waiting" in fired[0]


@pytest.mark.parametrize("busy", [False, "progress"])
def test_watchdog_spares_idle_and_progressing_schedulers(busy):
    assert _watch(_FakeScheduler(busy=busy), seconds=1.0) == []


def test_watchdog_rejects_a_bad_timeout():
    with pytest.raises(ValueError, match="--watchdog-timeout"):
        SchedulerWatchdog(_FakeScheduler(busy=False), timeout_s=0)
