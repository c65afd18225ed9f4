"""benchmark/batch1/prefill_interference.py against a tiny server: a running request keeps
streaming while a long prompt is prefilled in chunks (a decode step between chunks)."""
from __future__ import annotations

import json
import pathlib

import pytest

from sglang.test.script_loader import load_script

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _module():
    return load_script(ROOT / "benchmark" / "batch1" / "prefill_interference.py")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from sglang.test.test_utils import launch_tiny_server

    srv = launch_tiny_server(str(tmp_path_factory.mktemp("interference")),
                             ["--chunked-prefill-size", "32", "--max-running-requests", "4"])
    try:
        yield srv
    finally:
        srv.stop()


def test_decode_steps_run_between_prefill_chunks(server, tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    row = _module().main(["--base-url", server.base_url, "--decode-prompt-len", "8",
                          "--decode-output-len", "96", "--prefill-len", "256",
                          "--start-after", "4", "--label", "tiny", "--output-file", str(out)])
    # 256 prompt tokens in chunks of 32: eight chunks, and the running request takes a decode
    # step between them instead of waiting for the whole prefill.
    assert row["during_prefill_tokens"] >= 4, row
    assert row["prefill_ttft_ms"] > 0 and row["alone_mean_itl_ms"] > 0
    assert json.loads(out.read_text().splitlines()[-1])["label"] == "tiny"
    assert "A max ITL during B's prefill (ms):" in capsys.readouterr().out


def test_bad_lengths_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        _module().main(["--prefill-len", "0"])
    assert e.value.code == 2 and "--prefill-len must be >= 1" in capsys.readouterr().err
