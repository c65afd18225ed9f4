"""The scheduler's log lines tell the truth: start-up names what was resolved (device, dtype,
quantization, backends), each prefill batch logs upstream's ``Prefill batch.`` line, decode lines
appear only while requests run, and an idle scheduler logs nothing at all."""
from __future__ import annotations

import logging
from typing import List

import pytest
import torch

from engine_test_utils import make_scheduler, request, write_checkpoint

SCHED_LOGGER = "sglang.srt.managers.scheduler"


pytestmark = pytest.mark.usefixtures("one_thread")  # test/srt/conftest.py


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("log_ckpt")))


def _lines(caplog: pytest.LogCaptureFixture, prefix: str) -> List[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == SCHED_LOGGER and r.getMessage().startswith(prefix)]


def test_startup_logs_device_dtype_and_backends_once(ckpt, caplog):
    caplog.set_level(logging.INFO, logger=SCHED_LOGGER)
    make_scheduler(ckpt)
    lines = _lines(caplog, "Model ")
    assert len(lines) == 1, caplog.text
    line = lines[0]
    for part in ("device cpu", "dtype float32", "quantization none", "attention backend ",
                 "MoE runner backend ", "KDA backend prefill ", "speculative algorithm none"):
        assert part in line, line


def test_prefill_logs_its_line_and_idle_logs_no_decode_lines(ckpt, caplog):
    # Interval 1: every decode round that ran for a request is eligible to log.
    sched = make_scheduler(ckpt, decode_log_interval=1)
    caplog.set_level(logging.INFO, logger=SCHED_LOGGER)
    sched.submit(request("a", [5, 6, 7, 8, 9], max_new_tokens=4, temperature=0.0))
    sched.submit(request("b", [10, 11, 12], max_new_tokens=3, temperature=0.0))
    sched.run_until_idle()

    prefill = _lines(caplog, "Prefill batch.")
    assert prefill == ["Prefill batch. #new-seq: 2, #new-token: 8, #cached-token: 0, "
                       "token usage: 0.00, #running-req: 0, #queue-req: 0"], caplog.text
    decode = _lines(caplog, "Decode batch.")
    assert decode, caplog.text  # requests did decode, with the interval at 1
    assert not [d for d in decode if "#running-req: 0," in d], decode

    # Idle: the loop keeps stepping with nothing to do, and must stay silent.
    caplog.clear()
    for _ in range(50):
        assert not sched.step()
    sched.on_idle()
    assert not [r for r in caplog.records if r.name == SCHED_LOGGER], caplog.text
