"""``--help`` a user can read, and command lines refused in one clear line.

``python -m sglang.launch_server --help`` lists the flags in upstream's groups with a help text
and the default of each; ``--version`` prints the package version; abbreviations are refused; an
unknown flag (most often an upstream one this engine lacks) is one line and exit code 2, before
torch is imported, with the flag meant when it is a near miss. No model is loaded here.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

import sglang
from sglang.srt.configs.engine_defaults import UPSTREAM_ONLY_FLAGS
from sglang.srt.server_args import NO_OP_FLAGS, ServerArgs, prepare_server_args
from sglang.srt.server_args_cli import FLAG_GROUPS, ServerArgumentParser, shown_default

REPO = Path(__file__).resolve().parents[2]

# The flags of each --help section, by first spelling: every flag in exactly one group.
EXPECTED_GROUPS: Dict[str, set] = {
    "options": {"-h", "--version", "--config"},
    "model and tokenizer": {
        "--model-path", "--tokenizer-path", "--load-format", "--quantization",
        "--json-model-override-args", "--context-length", "--served-model-name",
        "--chat-template"},
    "HTTP server": {"--host", "--port", "--api-key", "--skip-server-warmup"},
    "runtime, memory and scheduling": {
        "--dtype", "--device", "--tp-size", "--random-seed", "--mem-fraction-static",
        "--max-running-requests", "--max-total-tokens", "--chunked-prefill-size",
        "--max-prefill-tokens", "--disable-overlap-schedule", "--watchdog-timeout",
        "--cpu-num-threads"},
    "speculative decoding": {
        "--speculative-algorithm", "--speculative-draft-model-path",
        "--speculative-draft-model-quantization", "--speculative-num-steps",
        "--speculative-eagle-topk", "--speculative-num-draft-tokens",
        "--speculative-dspark-block-size", "--speculative-dspark-sps-table-path",
        "--speculative-dspark-confidence-sts-path", "--speculative-dspark-verify-mode"},
    "kernels and CUDA graphs": {
        "--attention-backend", "--kda-prefill-impl", "--moe-runner-backend",
        "--linear-attn-decode-backend", "--enable-deterministic-inference",
        "--disable-cuda-graph", "--cuda-graph-max-bs",
        "--cuda-graph-bs", "--prefill-cuda-graph-tokens"},
    "logging and metrics": {
        "--log-level", "--stream-interval", "--decode-log-interval", "--enable-metrics",
        "--log-requests", "--log-requests-level"},
    "compatibility-only flags": set(NO_OP_FLAGS),
}


def _launch(*args: str, timeout: float = 60) -> Tuple[subprocess.CompletedProcess, float]:
    """``python -m sglang.launch_server ARGS``: the finished process and its wall time."""
    env = dict(os.environ, COLUMNS="100")
    tic = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "sglang.launch_server", *args],
                          capture_output=True, text=True, env=env, timeout=timeout)
    return proc, time.perf_counter() - tic


@pytest.fixture(scope="module")
def help_text() -> str:
    proc, _ = _launch("--help")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _sections(text: str) -> Dict[str, List[str]]:
    """``{section title: [one entry per option, its wrapped lines joined]}`` of ``--help``."""
    sections: Dict[str, List[str]] = {}
    current = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = line[:-1]
            sections[current] = []
        elif current is not None and line.startswith("  -"):
            sections[current].append(line.strip())
        elif current is not None and line.startswith("   ") and sections[current]:
            sections[current][-1] += " " + line.strip()
    return sections


def _first_flag(entry: str) -> str:
    return entry.split()[0].rstrip(",")


def _server_parser() -> ServerArgumentParser:
    parser = ServerArgumentParser(prog="test")
    ServerArgs.add_cli_args(parser)
    return parser


def _cli_error(argv: List[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        prepare_server_args(argv)
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


# ---------------------------------------------------------------------------- --help
def test_help_lists_the_flags_in_their_groups(help_text):
    sections = _sections(help_text)
    assert list(sections) == ["options", *FLAG_GROUPS]
    got = {title: {_first_flag(e) for e in entries} for title, entries in sections.items()}
    assert got == EXPECTED_GROUPS
    # Each group says what it is about, under its title.
    for title in FLAG_GROUPS:
        assert f"{title}:\n  {FLAG_GROUPS[title].split()[0]}" in help_text


def test_every_flag_has_a_help_text():
    for action in _server_parser()._actions:
        assert action.help and action.help.strip(), action.option_strings


def test_help_shows_every_default(help_text):
    entries = {_first_flag(e): e for es in _sections(help_text).values() for e in es}
    for flag, entry in entries.items():
        if flag in ("-h", "--version", "--config"):
            continue
        assert "(default: " in entry, entry
    assert "(default: None)" not in help_text
    # Plain values as they are, None / auto in words saying what they resolve to.
    for flag, shown in [
        ("--port", "30000"), ("--host", "127.0.0.1"), ("--tp-size", "1"),
        ("--mem-fraction-static", "0.85"), ("--chunked-prefill-size", "8192"),
        ("--log-requests-level", "2"), ("--enable-metrics", "off"),
        ("--dtype", "auto: bfloat16 on CUDA, float32 on CPU"),
        ("--attention-backend", "triton on CUDA, torch_native on CPU"),
        ("--speculative-algorithm", "none: speculative decoding off"),
        ("--flashinfer-allreduce-fusion-backend", "auto"),
    ]:
        assert f"(default: {shown})" in entries[flag], entries[flag]


def test_help_metavars_are_short(help_text):
    entries = {_first_flag(e): e for es in _sections(help_text).values() for e in es}
    assert entries["--port"].startswith("--port INT ")
    assert entries["--model-path"].startswith("--model-path PATH, --model PATH ")
    assert "SPECULATIVE_DSPARK" not in help_text  # not the flag name again in capitals


def test_help_shows_the_defaults_a_config_file_sets(tmp_path, capsys):
    cfg = tmp_path / "server.yaml"
    cfg.write_text("max-running-requests: 7\nenable-metrics: true\n")
    with pytest.raises(SystemExit) as e:
        prepare_server_args(["--config", str(cfg), "--help"])
    assert e.value.code == 0
    entries = {_first_flag(x): x for es in _sections(capsys.readouterr().out).values()
               for x in es}
    assert entries["--max-running-requests"].endswith("(default: 7)")
    assert entries["--enable-metrics"].endswith("(default: on)")


def test_shown_default_of_plain_parsers():
    parser = argparse.ArgumentParser()
    shown = {a.dest: shown_default(a) for a in [
        parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2]),
        parser.add_argument("--rate", type=float, default=0.5),
        parser.add_argument("--off", action="store_false"),
        parser.add_argument("--unset"),
    ]}
    assert shown == {"sizes": "1 2", "rate": "0.5", "off": "off", "unset": None}


def test_script_flags_next_to_the_server_flags_keep_their_own_default_text():
    # A benchmark script's parser: add_cli_args gives it the formatter that shows defaults.
    parser = argparse.ArgumentParser(prog="bench")
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--label", default="", help="run name (default: the mode)")
    parser.add_argument("--name", default="", help="run name")
    text = " ".join(parser.format_help().split())
    assert "--label STR run name (default: the mode) " in text
    assert "--name STR run name (default: '') " in text


# ---------------------------------------------------------------------------- --version
def test_version_prints_the_package_version():
    proc, _ = _launch("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"sglang {sglang.__version__}"
    with open(REPO / "pyproject.toml", "rb") as f:
        assert sglang.__version__ == tomllib.load(f)["project"]["version"]


# ---------------------------------------------------------------------------- refused lines
def test_unknown_upstream_flag_is_one_line_and_fast():
    proc, seconds = _launch("--enable-torch-compile")
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert lines == ["error: unknown flag --enable-torch-compile: an upstream SGLang flag that "
                     "this engine does not implement; remove it (--help lists the flags this "
                     "engine has)"]
    assert seconds < 5, seconds  # about 0.3 s: argparse only, no torch


def test_unknown_flag_is_refused_before_torch_is_imported():
    code = ("import sys\nfrom sglang.launch_server import run_server\n"
            "try:\n    run_server(['--enable-dp-attention'])\n"
            "except SystemExit as e:\n    print(e.code, 'torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.stdout.split() == ["2", "False"], proc.stderr
    assert "--enable-dp-attention" in proc.stderr


def test_abbreviation_is_refused_with_the_flag_meant(capsys):
    err = _cli_error(["--max-running-request", "4"], capsys)
    assert err.splitlines() == ["error: unknown flag --max-running-request: did you mean "
                                "--max-running-requests? (--help lists the flags this engine "
                                "has)"]
    assert "did you mean --config?" in _cli_error(["--conf", "x.yaml"], capsys)


def test_parsers_of_other_scripts_refuse_abbreviations(capsys):
    # The benchmark scripts build a plain parser and add the server flags to it.
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert parser.parse_args(["--max-running-requests", "4"]).max_running_requests == 4
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-running-request", "4"])
    assert "unrecognized arguments: --max-running-request" in capsys.readouterr().err


def test_bench_one_batch_refuses_abbreviations(capsys):
    from sglang import bench_one_batch  # imports torch: a few seconds

    with pytest.raises(SystemExit) as e:
        bench_one_batch.main(["--batch", "1"])
    assert e.value.code == 2
    assert "unknown flag --batch: did you mean --batch-size?" in capsys.readouterr().err


@pytest.mark.parametrize("argv, suggestion", [
    (["--tp-sise", "2"], "--tp-size"),
    (["--disable-cuda-graphs"], "--disable-cuda-graph"),
    (["--enable-metric"], "--enable-metrics"),
    (["--mem-fraction=0.5"], "--mem-fraction-static"),
    (["--speculative-algo", "NEXTN"], "--speculative-algorithm"),
])
def test_misspelled_flag_suggests_the_flag_meant(argv, suggestion, capsys):
    err = _cli_error(argv, capsys)
    flag = argv[0].split("=")[0]
    assert err == (f"error: unknown flag {flag}: did you mean {suggestion}? (--help lists the "
                   "flags this engine has)\n")


def test_upstream_flag_gets_no_look_alike_suggestion(capsys):
    err = _cli_error(["--dp-size", "2"], capsys)
    assert "--dp-size: an upstream SGLang flag" in err and "--tp-size" not in err


def test_several_unknown_flags_are_one_line(capsys):
    err = _cli_error(["--enable-dp-attention", "--dp-size", "2", "--tp-sise", "2",
                      "--frobnicate"], capsys)
    assert err.splitlines() == [
        "error: unknown flags --enable-dp-attention, --dp-size (upstream SGLang flags that this "
        "engine does not implement), --tp-sise (did you mean --tp-size?), --frobnicate (not "
        "implemented here); --help lists the flags this engine has"]


def test_stray_argument_is_one_line(capsys):
    err = _cli_error(["my-model"], capsys)
    assert err.splitlines() == ["error: unexpected argument 'my-model': every option is a "
                                "--flag (--help lists the flags this engine has)"]


@pytest.mark.parametrize("argv, needle", [
    (["--port", "abc"], "argument --port: invalid int value: 'abc'"),
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--tp-size", "0"], "--tp-size must be an integer >= 1, got 0"),
    (["--cuda-graph-bs", "0"], "--cuda-graph-bs must be a non-empty list"),
    (["--prefill-cuda-graph-tokens", "0"], "--prefill-cuda-graph-tokens must be a list of "
                                           "integers >= 1"),
])
def test_bad_values_still_name_the_flag_under_a_short_usage(argv, needle, capsys):
    lines = _cli_error(argv, capsys).splitlines()
    assert len(lines) == 2 and lines[0].startswith("usage: ") and needle in lines[1], lines


def test_upstream_only_flags_are_not_flags_here():
    registered = set(_server_parser()._option_string_actions)
    assert not registered & UPSTREAM_ONLY_FLAGS
    assert all(f.startswith("--") for f in UPSTREAM_ONLY_FLAGS)
