"""bench_serving: the metric math on synthetic timings, and a real run against a live server."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from sglang.benchmark.datasets import compute_random_lens, sample_random_ids_requests
from sglang.benchmark.metrics import (
    RequestFuncOutput,
    StreamTimer,
    calculate_metrics,
    format_table,
    peak_buckets,
)


def _replay(start: float, chunks) -> RequestFuncOutput:
    """Feed (arrival time, cumulative tokens) chunks through the client's timer."""
    out = RequestFuncOutput(success=True, start_time=start)
    timer = StreamTimer(out)
    for t, tokens in chunks:
        timer.on_chunk(t, tokens)
        out.output_len = tokens
    out.latency = chunks[-1][0] - start
    return out


def test_itl_split_evenly_inside_multi_token_chunks():
    # First token at +0.5; then a 3-token chunk 0.3 s later, a 1-token chunk 0.1 s later.
    out = _replay(10.0, [(10.5, 1), (10.8, 4), (10.9, 5)])
    assert out.ttft == pytest.approx(0.5)
    assert out.itl == pytest.approx([0.1, 0.1, 0.1, 0.1])
    # A chunk without new tokens is not a token event and does not move the clock.
    out2 = _replay(0.0, [(1.0, 1), (1.5, 1), (2.0, 3)])
    assert out2.itl == pytest.approx([0.5, 0.5])


def test_tpot_excludes_first_token_and_e2e_ttft():
    a = _replay(0.0, [(1.0, 1), (1.5, 3), (2.0, 5)])  # e2e 2.0, ttft 1.0, 5 tokens
    b = _replay(0.5, [(1.0, 1)])  # a single token: no TPOT sample
    failed = RequestFuncOutput(success=False, start_time=0.0, error="boom")
    m = calculate_metrics([7, 3, 100], [a, b, failed], dur_s=4.0)
    assert m.completed == 2
    assert m.total_input == 10 and m.total_output == 6
    assert m.mean_tpot_ms == pytest.approx((2.0 - 1.0) / 4 * 1000)
    assert m.mean_ttft_ms == pytest.approx((1.0 + 0.5) / 2 * 1000)
    assert m.median_e2e_latency_ms == pytest.approx((2.0 + 0.5) / 2 * 1000)
    assert m.output_throughput == pytest.approx(6 / 4.0)
    assert m.request_throughput == pytest.approx(2 / 4.0)
    assert m.total_throughput == pytest.approx(16 / 4.0)
    assert m.concurrency == pytest.approx((2.0 + 0.5) / 4.0)
    assert m.max_itl_ms == pytest.approx(250.0)
    assert m.p99_itl_ms == pytest.approx(250.0)


def test_peak_buckets_count_tokens_and_requests_per_second():
    # Request A: tokens at 0.2, 0.4, 0.6, 1.2; request B starts at 1.1: tokens at 1.3, 1.4, 2.5.
    a = _replay(0.0, [(0.2, 1), (0.4, 2), (0.6, 3), (1.2, 4)])
    b = _replay(1.1, [(1.3, 1), (1.4, 2), (2.5, 3)])
    tokens, requests = peak_buckets([a, b])
    assert tokens == 3.0  # bucket [0,1): 3 tokens; [1,2): 3 tokens; [2,3): 1
    assert requests == 2  # both in flight during second 1
    # 3 tokens of c (one chunk of 1, one of 2) join A's 3 in bucket 0
    c = _replay(0.0, [(0.1, 1), (0.2, 3)])
    assert peak_buckets([a, c])[0] == 6.0
    assert peak_buckets([RequestFuncOutput(success=False)]) == (0.0, 0)


def test_empty_and_bad_inputs():
    m = calculate_metrics([5], [RequestFuncOutput(success=False)], dur_s=1.0)
    assert m.completed == 0 and m.mean_ttft_ms == 0.0 and m.max_output_tokens_per_s == 0.0
    with pytest.raises(ValueError, match="duration"):
        calculate_metrics([1], [RequestFuncOutput()], dur_s=0.0)
    with pytest.raises(ValueError, match="prompt lengths"):
        calculate_metrics([1, 2], [RequestFuncOutput()], dur_s=1.0)


def test_table_labels_in_order_and_accept_length_only_when_truthy():
    out = _replay(0.0, [(0.1, 1), (0.2, 2)])
    m = calculate_metrics([4], [out], dur_s=1.0, accept_length=None)
    table = format_table(m, "sglang", float("inf"), None, 1.0)
    labels = [
        "Backend:", "Traffic request rate:", "Max request concurrency:", "Successful requests:",
        "Benchmark duration (s):", "Total input tokens:", "Total input text tokens:",
        "Total generated tokens:", "Total generated tokens (retokenized):",
        "Request throughput (req/s):", "Input token throughput (tok/s):",
        "Output token throughput (tok/s):", "Peak output token throughput (tok/s):",
        "Peak concurrent requests:", "Total token throughput (tok/s):", "Concurrency:",
        "End-to-End Latency", "Mean E2E Latency (ms):", "P99 E2E Latency (ms):",
        "Time to First Token", "Mean TTFT (ms):", "Time per Output Token (excl. 1st token)",
        "Mean TPOT (ms):", "Inter-Token Latency", "Mean ITL (ms):", "Max ITL (ms):",
    ]
    pos = [table.index(label) for label in labels]
    assert pos == sorted(pos)
    assert "{:=^50}".format(" Serving Benchmark Result ") in table
    assert "not set" in table and "Accept length:" not in table
    m2 = calculate_metrics([4], [out], dur_s=1.0, accept_length=2.5)
    table2 = format_table(m2, "sglang", 1.0, 4, 1.0)
    assert "Accept length:                           2.50" in table2


def test_random_lengths_and_ids():
    np.random.seed(0)
    lens = compute_random_lens(100, 0.5, 1000)
    assert lens.min() >= 50 and lens.max() <= 100
    assert (compute_random_lens(8, 1.0, 5) == 8).all()
    with pytest.raises(ValueError, match="range-ratio"):
        compute_random_lens(8, 1.5, 5)

    class Tok:
        vocab_size = 50

    rows = sample_random_ids_requests(Tok(), 3, 10, 4, 1.0)
    for i, row in enumerate(rows):
        assert len(row.prompt) == 10 and row.prompt_len == 10 and row.output_len == 4
        assert all(0 <= t < 50 for t in row.prompt)
        # (offset + i + j) mod vocab: consecutive ids wrap around the vocabulary
        assert all((b - a) % 50 == 1 for a, b in zip(row.prompt, row.prompt[1:]))


# ----------------------------------------------------------------------------- against a server
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from sglang.test.test_utils import launch_tiny_server

    srv = launch_tiny_server(str(tmp_path_factory.mktemp("bench")), ["--max-running-requests", "4"])
    try:
        yield srv
    finally:
        srv.stop()


TABLE_LABELS = [
    "Backend:", "Traffic request rate:", "Max request concurrency:", "Successful requests:",
    "Benchmark duration (s):", "Total input tokens:", "Total generated tokens:",
    "Output token throughput (tok/s):", "Peak output token throughput (tok/s):",
    "Peak concurrent requests:", "Concurrency:", "Mean E2E Latency (ms):", "Mean TTFT (ms):",
    "Mean TPOT (ms):", "Mean ITL (ms):", "Max ITL (ms):",
]
JSONL_KEYS = [
    "backend", "dataset_name", "request_rate", "max_concurrency", "random_input_len",
    "random_output_len", "random_range_ratio", "server_info", "duration", "completed",
    "total_input_tokens", "total_output_tokens", "request_throughput", "input_throughput",
    "output_throughput", "total_throughput", "concurrency", "accept_length",
    "max_output_tokens_per_s", "max_concurrent_requests",
] + [f"{s}_{n}_ms" for n in ("e2e_latency", "ttft", "tpot", "itl")
     for s in ("mean", "median", "std", "p90", "p95", "p99")]


def test_cli_prints_table_and_appends_jsonl(server, tmp_path):
    import subprocess
    import sys

    out_file = tmp_path / "result.jsonl"
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
           "--base-url", server.base_url, "--dataset-name", "random", "--num-prompts", "6",
           "--random-input-len", "16", "--random-output-len", "8", "--random-range-ratio", "1.0",
           "--max-concurrency", "2", "--output-file", str(out_file), "--seed", "1"]
    for _ in range(2):  # the second run appends a second line
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout
    pos = [table.index(label) for label in TABLE_LABELS]
    assert pos == sorted(pos), table
    assert "Successful requests:                     6" in table
    assert "Total generated tokens:                  48" in table
    assert "Accept length:" not in table  # no speculation
    lines = out_file.read_text().splitlines()
    assert len(lines) == 2
    result = json.loads(lines[-1])
    assert all(k in result for k in JSONL_KEYS), [k for k in JSONL_KEYS if k not in result]
    assert result["completed"] == 6 and result["total_output_tokens"] == 48
    assert result["max_concurrency"] == 2 and result["server_info"]["internal_states"]
    assert result["mean_tpot_ms"] > 0 and result["mean_itl_ms"] > 0 and result["duration"] > 0
    assert result["max_concurrent_requests"] >= 1 and result["max_output_tokens_per_s"] >= 1
    assert math.isinf(result["request_rate"])


@pytest.mark.parametrize("backend,dataset,extra", [
    ("sglang-oai", "random-ids", ["--request-rate", "20", "--flush-cache"]),
    ("sglang-oai-chat", "random", ["--disable-stream"]),
    ("sglang", "random-ids", ["--disable-stream", "--warmup-requests", "0"]),
])
def test_backends_count_tokens_exactly(server, tmp_path, backend, dataset, extra):
    from sglang.benchmark.serving import build_parser, run_benchmark

    args = build_parser().parse_args([
        "--backend", backend, "--base-url", server.base_url, "--dataset-name", dataset,
        "--num-prompts", "3", "--random-input-len", "12", "--random-output-len", "5",
        "--random-range-ratio", "1.0", "--output-file", str(tmp_path / "r.jsonl"),
        "--disable-tqdm", *extra,
    ])
    result = run_benchmark(args)
    assert result["completed"] == 3 and result["total_output_tokens"] == 15
    if "--disable-stream" in extra:
        assert result["mean_itl_ms"] == 0.0  # one chunk per request: TTFT == E2E
    else:
        assert result["mean_itl_ms"] > 0.0


def test_profile_endpoints_and_bench_serving_profile(server, tmp_path, monkeypatch):
    """/start_profile and /stop_profile: state errors and bad bodies are 400 JSON; bench_serving
    --profile traces the run's scheduler steps into the client's SGLANG_TORCH_PROFILER_DIR; a
    profile with num_steps ends (and writes its trace) by itself."""
    import gzip

    import requests

    from sglang.benchmark.serving import build_parser, run_benchmark

    url = server.base_url
    assert requests.post(f"{url}/stop_profile").status_code == 400  # nothing running
    for body in ({"activities": ["TPU"]}, {"num_steps": 0}, {"profile_by_stage": True}, [1]):
        bad = requests.post(f"{url}/start_profile", json=body)
        assert bad.status_code == 400 and "/start_profile" in bad.json()["error"]["message"]

    monkeypatch.setenv("SGLANG_TORCH_PROFILER_DIR", str(tmp_path / "bench"))
    run_benchmark(build_parser().parse_args([
        "--backend", "sglang", "--base-url", url, "--dataset-name", "random-ids",
        "--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "4",
        "--random-range-ratio", "1.0", "--output-file", str(tmp_path / "r.jsonl"),
        "--disable-tqdm", "--profile"]))
    (trace,) = (tmp_path / "bench").glob("*-TP-0.trace.json.gz")
    names = [e.get("name", "") for e in json.load(gzip.open(trace))["traceEvents"]]
    assert any("forward_batch_generation" in n for n in names)  # the scheduler's own steps

    auto = tmp_path / "auto"
    started = requests.post(f"{url}/start_profile", json={
        "num_steps": 2, "output_dir": str(auto), "activities": ["CPU"], "with_stack": False,
        "profile_prefix": "two-"})
    assert started.status_code == 200 and started.text.startswith("Start profiling")
    assert requests.post(f"{url}/start_profile").status_code == 400  # already running
    # The 4-token request outlives the 2 profiled steps, so the trace exists when it returns.
    requests.post(f"{url}/generate", json={"input_ids": [5, 6, 7],
                                           "sampling_params": {"max_new_tokens": 4}})
    assert len(list(auto.glob("two-*-TP-0.trace.json.gz"))) == 1
    assert requests.post(f"{url}/stop_profile").status_code == 400  # it ended by itself




def test_random_ids_against_a_model_without_tokenizer(tmp_path):
    """A dummy-weight preset has no tokenizer: random-ids still runs and counts tokens by ids."""
    from sglang.benchmark.serving import build_parser, run_benchmark
    from sglang.test.test_utils import find_available_port, kill_process_tree, popen_launch_server

    shrink = {"num_hidden_layers": 2, "hidden_size": 64, "num_experts": 16, "n_group": 4,
              "topk_group": 2, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
              "intermediate_size": 128, "num_attention_heads": 2, "head_dim": 32,
              "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
              "v_head_dim": 16, "vocab_size": 1024}
    port = find_available_port(31900)
    proc = popen_launch_server(
        "ling-3.0-flash", f"http://127.0.0.1:{port}", timeout=120,
        other_args=["--load-format", "dummy", "--json-model-override-args", json.dumps(shrink),
                    "--device", "cpu", "--max-total-tokens", "2048", "--skip-server-warmup"])
    try:
        args = build_parser().parse_args([
            "--backend", "sglang", "--port", str(port), "--dataset-name", "random-ids",
            "--random-input-len", "16", "--random-output-len", "6", "--random-range-ratio", "1",
            "--num-prompts", "2", "--max-concurrency", "1", "--warmup-requests", "0",
            "--output-file", str(tmp_path / "out.jsonl")])
        result = run_benchmark(args)
    finally:
        kill_process_tree(proc.pid)
    assert result["completed"] == 2 and result["total_output_tokens"] == 12
    assert result["mean_ttft_ms"] > 0 and result["mean_tpot_ms"] > 0


# ----------------------------------------------------------------------------- datasets, offline
class WordTokenizer:
    """A whitespace tokenizer: one token per word, ids assigned on first sight. It pretends the
    server adds one special token (BOS) so that the text-mode length reduction is visible."""

    all_special_ids: list = []
    vocab_size = 1000

    def __init__(self):
        self.ids = {}
        self.words = []

    def encode(self, text, add_special_tokens=True):
        out = []
        for word in text.split():
            if word not in self.ids:
                self.ids[word] = len(self.words)
                self.words.append(word)
            out.append(self.ids[word])
        return out

    def decode(self, ids):
        return " ".join(self.words[i] if i < len(self.words) else f"w{i}" for i in ids)

    def num_special_tokens_to_add(self):
        return 1


def _write_sharegpt(path, conversations) -> str:
    """A ShareGPT-shaped file: ``conversations`` is a list of (human, gpt) or (human,) tuples."""
    data = [{"id": f"c{i}", "conversations": [
        {"from": speaker, "value": text} for speaker, text in zip(("human", "gpt"), turns)]}
        for i, turns in enumerate(conversations)]
    with open(path, "w") as f:
        json.dump(data, f)
    return str(path)


def _words(prefix: str, n: int) -> str:
    return " ".join(f"{prefix}{k}" for k in range(n))


SHAREGPT_CONVERSATIONS = [
    (_words("a", 6), _words("r", 5)),
    (_words("b", 3), _words("s", 4)),
    (_words("c", 1), _words("t", 9)),  # a 1-token prompt: pruned
    (_words("d", 4), _words("u", 1)),  # a 1-token reply: pruned (unless the output is fixed)
    (_words("e", 30), _words("v", 30)),  # 60 tokens: pruned by a context length of 40
    (_words("f", 2),),  # one turn only: dropped
]


def test_sharegpt_sampling_as_upstream(tmp_path):
    import random

    from sglang.benchmark.datasets import get_dataset, sample_sharegpt_requests

    path = _write_sharegpt(tmp_path / "sg.json", SHAREGPT_CONVERSATIONS)
    tok = WordTokenizer()
    random.seed(3)
    rows = sample_sharegpt_requests(path, 100, tok, context_len=40)
    # First turn as prompt, the reply's token count as output length; short/long pairs pruned.
    assert sorted((r.prompt, r.prompt_len, r.output_len) for r in rows) == [
        (_words("a", 6), 6, 5), (_words("b", 3), 3, 4)]
    random.seed(3)
    fixed = sample_sharegpt_requests(path, 100, tok, fixed_output_len=8)
    assert {r.prompt_len: r.output_len for r in fixed} == {6: 8, 3: 8, 4: 8, 30: 8}
    random.seed(3)
    assert len(get_dataset("sharegpt", tok, 2, 0, 0, 0.0, dataset_path=path)) == 2
    # The shuffle follows Python's random (seeded by --seed): same seed, same order.
    orders = []
    for _ in range(2):
        random.seed(11)
        orders.append([r.prompt for r in sample_sharegpt_requests(path, 3, tok)])
    assert orders[0] == orders[1]
    with pytest.raises(ValueError, match="sharegpt-output-len"):
        sample_sharegpt_requests(path, 1, tok, fixed_output_len=3)
    with pytest.raises(ValueError, match="needs --dataset-path"):
        sample_sharegpt_requests("", 1, tok)


def test_random_is_sharegpt_tokens_repeated_to_drawn_lengths(tmp_path):
    import random

    from sglang.benchmark.datasets import get_dataset

    path = _write_sharegpt(tmp_path / "sg.json", SHAREGPT_CONVERSATIONS)
    tok = WordTokenizer()
    random.seed(0)
    np.random.seed(0)
    rows = get_dataset("random", tok, 5, 40, 20, 0.5, dataset_path=path)
    assert len(rows) == 5
    for row in rows:
        # Drawn in [20, 40], less the one special token the server adds back.
        assert 19 <= row.prompt_len <= 39 and 10 <= row.output_len <= 20
        words = row.prompt.split()
        assert len(words) == row.prompt_len
        # One first turn, repeated from its start and cut at the length.
        base = words[0][0]
        period = {"a": 6, "b": 3, "c": 1, "d": 4, "e": 30}[base]
        assert words == [f"{base}{k % period}" for k in range(row.prompt_len)]
    ratio_one = get_dataset("random", tok, 3, 12, 7, 1.0, dataset_path=path)
    assert [(r.prompt_len, r.output_len) for r in ratio_one] == [(11, 7)] * 3
    # Without a file (nothing is downloaded): random vocabulary, same length rules.
    synthetic = get_dataset("random", tok, 4, 10, 6, 0.5)
    assert all(4 <= r.prompt_len <= 9 and 3 <= r.output_len <= 6 for r in synthetic)


def test_peak_concurrency_counts_overlap_not_seconds():
    from sglang.benchmark.metrics import peak_in_flight

    # Back to back inside one second (what --max-concurrency 1 produces): never two at once.
    serial = [_replay(0.1 * k, [(0.1 * k + 0.05, 1), (0.1 * k + 0.1, 2)]) for k in range(5)]
    assert peak_in_flight(serial) == 1 and peak_buckets(serial)[1] == 1
    # Two overlapping, a third after both.
    mixed = [_replay(0.0, [(0.5, 1)]), _replay(0.2, [(0.7, 1)]), _replay(0.8, [(0.9, 1)])]
    assert peak_in_flight(mixed) == 2


def test_default_port_and_output_file_name():
    from sglang.benchmark.serving import build_parser, default_output_file, resolve_base_url

    parse = build_parser().parse_args
    assert resolve_base_url(parse(["--backend", "vllm"])) == "http://0.0.0.0:8000"
    assert resolve_base_url(parse(["--backend", "sglang-oai"])) == "http://0.0.0.0:30000"
    assert resolve_base_url(parse(["--base-url", "http://h:1/"])) == "http://h:1"
    args = parse(["--num-prompts", "7"])
    assert args.dataset_name == "sharegpt"  # upstream's default
    assert default_output_file(args).endswith("_7_sharegpt.jsonl")
    args = parse(["--dataset-name", "random", "--random-input-len", "5",
                  "--random-output-len", "6", "--backend", "vllm", "--num-prompts", "7"])
    assert default_output_file(args).startswith("vllm_")
    assert default_output_file(args).endswith("_7_5_6.jsonl")


# ----------------------------------------------------------------------------- errors, fast
def _one_line_error(capsys, argv, match: str, max_s: float = 3.0) -> None:
    import time

    from sglang.benchmark.serving import main

    t0 = time.monotonic()
    code = main(argv)
    elapsed = time.monotonic() - t0
    err = capsys.readouterr().err.strip()
    assert code == 2 and elapsed < max_s, (code, elapsed, err)
    assert "\n" not in err and err.startswith("bench_serving: error:") and match in err, err


def test_unreachable_server_fails_at_once_in_one_line(capsys):
    from sglang.test.test_utils import find_available_port

    port = find_available_port(29500)
    _one_line_error(capsys, ["--host", "127.0.0.1", "--port", str(port), "--num-prompts", "1",
                             "--dataset-name", "random"],
                    f"not reachable at http://127.0.0.1:{port}", max_s=1.5)


def test_server_never_ready_fails_after_ready_timeout(capsys):
    import http.server
    import threading

    class Busy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # a server that is up but warming up forever
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        _one_line_error(capsys, ["--base-url", url, "--ready-timeout", "1", "--dataset-name",
                                 "random", "--num-prompts", "1"], "not ready after 1s")
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_sharegpt_without_path_fails_before_contacting_the_server(capsys):
    _one_line_error(capsys, ["--port", "1", "--num-prompts", "1"], "needs --dataset-path")


# ----------------------------------------------------------------------------- sharegpt, live
@pytest.fixture(scope="module")
def sharegpt_file(tmp_path_factory) -> str:
    """Real prose (tokenized by the tiny model's own tokenizer) in the ShareGPT shape."""
    conversations = [
        ("Explain how a radix cache shares prefixes between requests.",
         "It stores token ids in a tree so requests with a common prefix reuse the KV cache."),
        ("Write a haiku about a scheduler.", "Batches come and go, the queue is never empty."),
        ("What does a tokenizer do with text?",
         "It splits the text into pieces and maps each piece to an integer id."),
        ("x", "too short to keep"),
    ]
    return _write_sharegpt(tmp_path_factory.mktemp("sharegpt") / "sg.json", conversations)


@pytest.mark.parametrize("backend", ["sglang", "sglang-oai", "sglang-oai-chat", "vllm"])
def test_sharegpt_on_every_backend(server, sharegpt_file, tmp_path, backend):
    from sglang.benchmark.serving import build_parser, run_benchmark

    out_file = tmp_path / "r.jsonl"
    result = run_benchmark(build_parser().parse_args([
        "--backend", backend, "--base-url", server.base_url, "--dataset-name", "sharegpt",
        "--dataset-path", sharegpt_file, "--num-prompts", "2", "--sharegpt-output-len", "4",
        "--output-file", str(out_file), "--disable-tqdm", "--seed", "5"]))
    assert result["completed"] == 2 and result["total_output_tokens"] == 8
    assert result["backend"] == backend and result["dataset_name"] == "sharegpt"
    assert result["sharegpt_output_len"] == 4
    # Streaming: TTFT at the first content chunk, then one ITL per further token.
    assert result["mean_ttft_ms"] > 0 and result["mean_itl_ms"] > 0
    assert result["mean_ttft_ms"] <= result["mean_e2e_latency_ms"]
    assert json.loads(out_file.read_text().splitlines()[-1]) == result


def test_random_with_sharegpt_source_at_concurrency_one(server, sharegpt_file, tmp_path):
    """Live: the drawn lengths hold (the server generates exactly the drawn output lengths),
    the JSON line has upstream's fields, and at --max-concurrency 1 the peak is 1."""
    from sglang.benchmark.serving import build_parser, run_benchmark

    out_file = tmp_path / "r.jsonl"
    result = run_benchmark(build_parser().parse_args([
        "--backend", "sglang", "--base-url", server.base_url, "--dataset-name", "random",
        "--dataset-path", sharegpt_file, "--num-prompts", "4", "--random-input-len", "24",
        "--random-output-len", "6", "--random-range-ratio", "0.5", "--max-concurrency", "1",
        "--output-file", str(out_file), "--output-details", "--disable-tqdm",
        "--warmup-requests", "2"]))
    line = json.loads(out_file.read_text())
    assert all(k in line for k in JSONL_KEYS + ["sharegpt_output_len", "max_itl_ms"])
    assert line["completed"] == 4  # the warm-up requests are not counted
    assert all(3 <= n <= 6 for n in line["output_lens"])
    assert line["total_output_tokens"] == sum(line["output_lens"])
    assert all(12 <= n <= 24 for n in line["input_lens"])
    assert line["max_concurrency"] == 1 and line["max_concurrent_requests"] == 1
    assert result["concurrency"] <= 1.0 + 1e-9
