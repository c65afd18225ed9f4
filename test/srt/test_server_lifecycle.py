"""Server lifecycle through real ``python -m sglang.launch_server`` processes on the bundled model
(CPU): the port check before the model loads, ``/health`` only after the warmup, and the graceful
shutdown on SIGTERM / SIGINT (in-flight work finishes, new requests get 503, what is left after
the grace period is aborted, and a streaming client that stopped reading cannot keep the process
alive).

Each server is started in its own session, so that a signal can also go to its whole process
group, as a terminal's Ctrl-C or a service manager's stop does.
"""
from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional

import pytest
import requests

from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR
from sglang.srt.entrypoints.server_lifecycle import (
    ABORT_SETTLE_S,
    DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S,
    PortInUseError,
    check_port_free,
    graceful_shutdown_timeout,
)
from sglang.srt.environ import envs
from sglang.test.test_utils import (
    child_pids,
    descendant_pids,
    find_available_port,
    kill_process_tree,
    process_alive,
)

pytestmark = pytest.mark.skipif(not (BUNDLED_MODEL_DIR / "config.json").exists(),
                                reason="bundled checkpoint not present")

READY_LINE = "ready to roll"
# One intra-op thread per server: the CI machine's two cores are shared with the test process
# (and other tests), and oversubscribed OpenMP threads spin, slowing the tiny model many-fold.
SERVER_ENV = {"OMP_NUM_THREADS": "1"}
STUCK_GRACE_S = 5.0  # longer than ABORT_SETTLE_S: an exit without the grace period shows


# ----------------------------------------------------------------------------- helpers
@dataclass
class Server:
    """A launched server process (maybe not ready yet) and where its output goes."""

    process: subprocess.Popen
    base_url: str
    port: int
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def get(self, path: str, timeout: float = 30) -> requests.Response:
        return requests.get(self.base_url + path, timeout=timeout)

    def post(self, path: str, body: Any, timeout: float = 120, **kw: Any) -> requests.Response:
        return requests.post(self.base_url + path, json=body, timeout=timeout, **kw)


def _start(root: str, env: Optional[Dict[str, str]] = None, args: List[str] = ()) -> Server:
    """Launch the bundled model on CPU at a free port; returns at once (see :func:`_wait_ready`)."""
    port = find_available_port()  # an OS-picked port: tests running in parallel do not collide
    log_path = os.path.join(root, "server.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sglang.launch_server", "--device", "cpu", "--port", str(port),
             "--random-seed", "0", *args],
            stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, **SERVER_ENV, **(env or {})}, start_new_session=True)
    return Server(proc, f"http://127.0.0.1:{port}", port, log_path)


@pytest.fixture
def launch(tmp_path_factory) -> Iterator[Any]:
    """``launch(env, args)`` starts a server; whatever is still running at the end is killed."""
    started: List[Server] = []

    def run(env: Optional[Dict[str, str]] = None, args: List[str] = ()) -> Server:
        srv = _start(str(tmp_path_factory.mktemp("lifecycle")), env, list(args))
        started.append(srv)
        return srv

    yield run
    for srv in started:
        kill_process_tree(srv.process.pid)


def _wait_ready(srv: Server, timeout: float = 300) -> None:
    """Until /health answers 200 and the ready line is logged (fails if the process exits)."""
    deadline = time.time() + timeout
    while True:
        assert srv.process.poll() is None, f"server exited early:\n{srv.log()[-3000:]}"
        try:
            if srv.get("/health", timeout=5).status_code == 200 and READY_LINE in srv.log():
                return
        except requests.RequestException:
            pass
        assert time.time() < deadline, f"server not ready:\n{srv.log()[-3000:]}"
        time.sleep(0.2)


def _wait_until(cond: Any, timeout: float, what: str, step: float = 0.05) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(step)


def _assert_all_gone(pids: List[int], timeout: float = 10.0) -> None:
    _wait_until(lambda: not any(process_alive(p) for p in pids), timeout,
                f"child processes to exit: {[p for p in pids if process_alive(p)]}", 0.1)


def _running(srv: Server) -> int:
    return srv.get("/server_info").json()["internal_states"][0]["num_running_reqs"]


def _greedy(n: int) -> Dict[str, Any]:
    return {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}


def _stream_events(srv: Server, body: Dict[str, Any]) -> List[Any]:
    """Read a /generate stream to its end: the JSON events, then "[DONE]"."""
    events: List[Any] = []
    with srv.post("/generate", {**body, "stream": True}, stream=True) as resp:
        assert resp.status_code == 200, resp.text
        for line in resp.iter_lines():
            if line:
                payload = line[len(b"data: "):]
                events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


def _assert_shutting_down_503(srv: Server) -> None:
    """Once the drain has begun, a new request gets 503 in the one error shape."""
    def refused() -> bool:
        r = srv.post("/generate", {"text": "hi", "sampling_params": _greedy(1)}, timeout=30)
        if r.status_code != 503:
            assert r.status_code == 200, r.text  # sent before the drain began: served
            return False
        err = r.json()["error"]
        assert err["code"] == 503 and err["type"] == "ServiceUnavailableError"
        assert "shutting down" in err["message"]
        return True

    _wait_until(refused, 10, "new requests to be refused with 503")
    assert srv.get("/health").status_code == 503


def _detokenizer_pid(srv: Server) -> Optional[int]:
    """The detokenizer: of the two spawned children (TP=1), the one started second."""
    kids = []
    for pid in child_pids(srv.process.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spawn_main" not in f.read():
                    continue  # multiprocessing's resource tracker
            with open(f"/proc/{pid}/stat") as f:
                start = int(f.read().rsplit(")", 1)[1].split()[19])
        except OSError:
            continue
        kids.append((start, pid))
    return sorted(kids)[1][1] if len(kids) == 2 else None


def _server_send_queue(port: int) -> int:
    """Bytes the server has queued but the client has not taken (largest over its connections)."""
    best = 0
    with open("/proc/net/tcp") as f:
        for line in f.read().splitlines()[1:]:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] == "01":  # ESTABLISHED, server side
                best = max(best, int(fields[4].split(":")[0], 16))
    return best


# ----------------------------------------------------------------------------- port and env
def test_check_port_free_names_the_address():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"127.0.0.1:{port} is already in use"):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # closed again: free (the check itself holds nothing)
    check_port_free("127.0.0.1", port)
    with pytest.raises(RuntimeError, match="cannot listen on 192.0.2.1:"):
        check_port_free("192.0.2.1", port)  # a documentation address: not one of this host's


def test_port_in_use_is_reported_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        tic = time.time()
        proc = subprocess.run(
            [sys.executable, "-m", "sglang.launch_server", "--device", "cpu", "--port", str(port)],
            capture_output=True, text=True, timeout=120)
        elapsed = time.time() - tic
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert f"127.0.0.1:{port} is already in use" in proc.stderr and "--port" in proc.stderr
    assert "Traceback" not in out
    # No child started: nothing was loaded (the scheduler logs its weights and pools).
    assert "loaded" not in out and "pools:" not in out, out
    assert elapsed < 30, elapsed  # imports only; a model load and warmup would come on top


def test_graceful_shutdown_timeout_is_validated(monkeypatch):
    monkeypatch.delenv("SGLANG_GRACEFUL_SHUTDOWN_TIMEOUT", raising=False)
    assert graceful_shutdown_timeout() == DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S
    assert DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S == envs.SGLANG_GRACEFUL_SHUTDOWN_TIMEOUT.default
    monkeypatch.setenv("SGLANG_GRACEFUL_SHUTDOWN_TIMEOUT", "0")
    assert graceful_shutdown_timeout() == 0.0
    for bad in ("-1", "nan", "inf", "soon"):
        monkeypatch.setenv("SGLANG_GRACEFUL_SHUTDOWN_TIMEOUT", bad)
        with pytest.raises(ValueError, match="SGLANG_GRACEFUL_SHUTDOWN_TIMEOUT"):
            graceful_shutdown_timeout()
    # Through the CLI: one line and exit code 2, before anything starts.
    proc = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--device", "cpu"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SGLANG_GRACEFUL_SHUTDOWN_TIMEOUT": "-5"})
    assert proc.returncode == 2, proc.stderr
    assert "SGLANG_GRACEFUL_SHUTDOWN_TIMEOUT" in proc.stderr and "Traceback" not in proc.stderr
    assert math.isfinite(DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S)


# ----------------------------------------------------------------------------- warmup + SIGTERM
def test_health_is_503_until_the_warmup_is_done_and_signals_drain(launch):
    # Without its generation probe /health would answer 200 as soon as HTTP is up: any 503
    # seen here comes from the warmup gate.
    srv = launch({"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0",
                  "SGLANG_GRACEFUL_SHUTDOWN_TIMEOUT": "60"})
    # Hold the warmup back: with the detokenizer stopped no output (the warmup's included)
    # reaches the HTTP process, while the scheduler loads and HTTP comes up as usual.
    _wait_until(lambda: _detokenizer_pid(srv) is not None or srv.process.poll() is not None,
                120, "the detokenizer process", 0.01)
    detok = _detokenizer_pid(srv)
    assert detok is not None, srv.log()[-3000:]
    os.kill(detok, signal.SIGSTOP)
    try:
        def http_up() -> bool:
            assert srv.process.poll() is None, srv.log()[-3000:]
            try:
                return srv.get("/model_info", timeout=5).status_code == 200
            except requests.RequestException:
                return False

        _wait_until(http_up, 300, "HTTP to come up", 0.1)
        for _ in range(2):
            for path in ("/health", "/health_generate", "/ready"):
                tic = time.time()
                assert srv.get(path).status_code == 503, path
                assert time.time() - tic < 5, path  # the gate answers, not a timed-out probe
            time.sleep(0.5)
        assert READY_LINE not in srv.log()
    finally:
        os.kill(detok, signal.SIGCONT)
    _wait_ready(srv)
    for path in ("/health", "/health_generate", "/ready"):
        assert srv.get(path).status_code == 200, path

    # SIGTERM to the whole process group (as a service manager sends it) with two short
    # requests and a long one in flight: the short ones finish in full, new ones get 503; a
    # second signal (SIGINT, a Ctrl-C to the group) ends the grace period: the long one is
    # aborted and the process exits.
    kids = descendant_pids(srv.process.pid)
    n = 64
    with ThreadPoolExecutor(3) as pool:
        plain = pool.submit(srv.post, "/generate", {"text": "def f(x):",
                                                    "sampling_params": _greedy(n)})
        streamed = pool.submit(_stream_events, srv, {"text": "import os",
                                                     "sampling_params": _greedy(n)})
        long = pool.submit(srv.post, "/generate", {"text": "class A:",
                                                   "sampling_params": _greedy(3000)})
        _wait_until(lambda: _running(srv) >= 3, 60, "the three requests to run")
        os.killpg(srv.process.pid, signal.SIGTERM)
        _assert_shutting_down_503(srv)
        resp = plain.result(timeout=120)
        events = streamed.result(timeout=120)
        assert resp.status_code == 200, resp.text
        meta = resp.json()["meta_info"]
        assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == n
        assert events[-1] == "[DONE]"
        last = events[-2]["meta_info"]
        assert last["finish_reason"]["type"] == "length" and last["completion_tokens"] == n
        assert srv.process.poll() is None and not long.done()  # still within its grace period
        tic = time.time()
        os.killpg(srv.process.pid, signal.SIGINT)
        cut = long.result(timeout=60)
    assert cut.status_code == 200, cut.text
    meta = cut.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 3000
    assert srv.process.wait(timeout=60) == 0
    assert time.time() - tic < 15  # right after the abort, not at the end of the 60 s grace
    _assert_all_gone(kids)
    assert "aborting 1 request(s) still in flight" in srv.log()


@pytest.mark.slow  # ~30 s of grace periods; the drain itself is in the fast SIGTERM test
def test_sigterm_with_a_client_that_stopped_reading_exits_after_the_grace_period(launch):
    # --skip-server-warmup: /health answers 200 as soon as the server is up.
    srv = launch({"SGLANG_GRACEFUL_SHUTDOWN_TIMEOUT": str(STUCK_GRACE_S)},
                 ["--skip-server-warmup"])
    _wait_ready(srv)
    kids = descendant_pids(srv.process.pid)
    # Big events (every one repeats the prompt's top logprobs) and a tiny receive window: the
    # server's writes soon block for good, since this client never reads.
    body = json.dumps({
        "text": "def add(a, b):\n    return a + b\n" * 25, "stream": True,
        "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 20,
        "return_text_in_logprobs": True, "sampling_params": _greedy(3000)}).encode()
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect(("127.0.0.1", srv.port))
    try:
        client.sendall(b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                       + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        # The server's send queue stops growing while it still generates: it is full, and the
        # response's next write waits for a reader that never comes.
        history: List[int] = []

        def stuck() -> bool:
            history.append(_server_send_queue(srv.port))
            recent = history[-20:]  # two seconds of samples
            return len(recent) == 20 and recent[0] > 65536 and len(set(recent)) == 1
        _wait_until(stuck, 120, "the server's writes to block", 0.1)
        assert _running(srv) == 1

        tic = time.time()
        srv.process.send_signal(signal.SIGTERM)
        assert srv.process.wait(timeout=STUCK_GRACE_S + 60) == 0
        elapsed = time.time() - tic
    finally:
        client.close()
    log = srv.log()
    assert elapsed >= STUCK_GRACE_S - 0.5, elapsed  # the request was given its grace period
    assert elapsed <= STUCK_GRACE_S + ABORT_SETTLE_S + 8, elapsed
    assert "aborting 1 request(s) still in flight" in log, log[-2000:]
    # The stuck response was cancelled after the settle time instead of being waited for.
    assert "timeout graceful shutdown exceeded" in log, log[-2000:]
    _assert_all_gone(kids)
