"""Helpers for end-to-end tests (SGLang's names): launch a server process, find ports, clean up."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import unittest
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple
from urllib.parse import urlparse

import requests
import torch

from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR

DEFAULT_MODEL_NAME_FOR_TEST = str(BUNDLED_MODEL_DIR)
# Far from the 30000 default so a developer's running server does not collide with tests.
DEFAULT_PORT_FOR_SRT_TEST_RUNNER = 21000
DEFAULT_URL_FOR_TEST = f"http://127.0.0.1:{DEFAULT_PORT_FOR_SRT_TEST_RUNNER + 1000}"
DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH = 600


# ----------------------------------------------------------------------------- processes
# Linux /proc walks: psutil is not a dependency.
def child_pids(pid: int) -> List[int]:
    """Direct children of ``pid``."""
    kids: List[int] = []
    task_dir = f"/proc/{pid}/task"
    try:
        for tid in os.listdir(task_dir):
            try:
                with open(f"{task_dir}/{tid}/children") as f:
                    kids.extend(int(x) for x in f.read().split())
            except OSError:
                continue
    except OSError:
        return []
    return kids


def descendant_pids(pid: int) -> List[int]:
    """Every process below ``pid`` (children, their children, ...)."""
    out: List[int] = []
    stack = [pid]
    while stack:
        for kid in child_pids(stack.pop()):
            if kid not in out:
                out.append(kid)
                stack.append(kid)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # zombies are dead
    except OSError:
        return False


def kill_process_tree(parent_pid: int, include_parent: bool = True, grace_s: float = 5.0) -> None:
    """Stop ``parent_pid`` (if asked) and everything it started; SIGKILL what does not stop.

    The descendants are collected first, so processes re-parented to init when their parent
    exits are still found. The parent gets SIGTERM first and time to shut its children down
    itself (some, like multiprocessing's resource tracker, ignore SIGTERM and just exit once
    the parent is gone); whatever is left then gets SIGTERM and finally SIGKILL.
    """
    me = os.getpid()
    kids = [p for p in descendant_pids(parent_pid) if p != me]
    if include_parent and parent_pid != me:
        _signal_and_wait([parent_pid], signal.SIGTERM, grace_s)
        _wait_gone(kids, min(grace_s, 1.0))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not any(_alive(p) for p in kids):
            break
        _signal_and_wait(kids, sig, grace_s)
    if include_parent and _alive(parent_pid):
        _signal_and_wait([parent_pid], signal.SIGKILL, grace_s)


def _signal_and_wait(pids: List[int], sig: int, timeout: float) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    _wait_gone(pids, timeout)


def _wait_gone(pids: List[int], timeout: float) -> None:
    deadline = time.time() + timeout
    while any(_alive(p) for p in pids) and time.time() < deadline:
        for pid in pids:  # reap our own exited children so they do not stay zombies
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        time.sleep(0.05)


# ----------------------------------------------------------------------------- servers
def is_port_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when nothing listens on ``host:port`` and we could bind it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def find_available_port(base_port: Optional[int] = None) -> int:
    """A free TCP port: ``base_port`` or the next free one above it, else one the OS picks."""
    if base_port is not None:
        for port in range(base_port, min(base_port + 1000, 65536)):
            if is_port_free(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def popen_launch_server(
    model: str,
    base_url: str,
    timeout: float = DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH,
    api_key: Optional[str] = None,
    other_args: Sequence[str] = (),
    env: Optional[Dict[str, str]] = None,
    return_stdout_stderr: Optional[Tuple] = None,
) -> subprocess.Popen:
    """Start ``python -m sglang.launch_server`` and wait until ``/health_generate`` answers 200.

    Raises ``RuntimeError`` (with the exit code) if the process dies first and ``TimeoutError``
    after ``timeout`` seconds; either way no process is left behind.
    """
    url = urlparse(base_url)
    cmd = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", model,
        "--host", url.hostname or "127.0.0.1",
        "--port", str(url.port or 80),
        *[str(a) for a in other_args],
    ]
    if api_key:
        cmd += ["--api-key", api_key]
    out, err = return_stdout_stderr if return_stdout_stderr else (None, None)
    # One CPU thread per server process unless the caller chose: test models are tiny, and
    # several processes each taking every core of a small CI machine slow each other down 5-10x.
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", "1")
    process = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.time() + timeout
    while time.time() < deadline:
        code = process.poll()
        if code is not None:
            raise RuntimeError(f"server process exited with code {code} before it was ready: {cmd}")
        try:
            r = requests.get(f"{base_url}/health_generate", headers=headers, timeout=5)
            if r.status_code == 200:
                return process
        except requests.RequestException:
            pass
        time.sleep(0.5)
    kill_process_tree(process.pid)
    raise TimeoutError(f"server did not become ready within {timeout:.0f}s: {cmd}")


def process_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (``os.kill(pid, 0)`` plus /proc state)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class CustomTestCase(unittest.TestCase):
    """Base class of e2e test cases (a hook point for retries and CI registration upstream)."""


# Text every checkout has, for training the tiny test tokenizer (no downloads).
_TOKENIZER_CORPUS_MODULES = (
    "sglang.srt.server_args", "sglang.srt.configs.bailing_moe_v3", "sglang.srt.environ",
    "sglang.srt.sampling.sampling_params", "sglang.srt.managers.io_struct",
)


def write_tiny_served_model(path: str, vocab_size: int = 384, seed: int = 0,
                            **config_overrides: Any) -> str:
    """A servable tiny random BailingMoeV3 folder: checkpoint + a byte-level BPE tokenizer.

    The tokenizer (with a chat template; EOS ``<|endoftext|>`` = id 0) is trained on the
    package's own sources, and the model's vocabulary is exactly the tokenizer's so that every
    generated id decodes to text.
    """
    import importlib.util

    from sglang.test.random_checkpoint import tiny_config, write_random_checkpoint
    from sglang.train.tokenizer import EOT_TOKEN, PAD_TOKEN, save_tokenizer, train_tokenizer

    texts = []
    for name in _TOKENIZER_CORPUS_MODULES:
        with open(importlib.util.find_spec(name).origin) as f:
            texts.append(f.read())
    tok = train_tokenizer(texts, vocab_size=vocab_size)
    cfg = tiny_config(
        vocab_size=tok.get_vocab_size(),
        eos_token_id=tok.token_to_id(EOT_TOKEN),
        pad_token_id=tok.token_to_id(PAD_TOKEN),
        bos_token_id=None,
        **config_overrides,
    )
    write_random_checkpoint(path, cfg, seed=seed)
    save_tokenizer(tok, path, model_max_length=cfg["max_position_embeddings"])
    return path


@dataclass
class TinyServer:
    """A running test server on a tiny model (see :func:`launch_tiny_server`)."""

    base_url: str
    process: subprocess.Popen
    model_dir: str
    log_path: str

    def log(self) -> str:
        """Everything the server printed so far (stdout and stderr)."""
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        """Kill the server and its children (idempotent)."""
        kill_process_tree(self.process.pid)


def launch_tiny_server(root: str, other_args: Sequence[str] = (), timeout: float = 300,
                       **config_overrides: Any) -> TinyServer:
    """Write a tiny model under ``root``, serve it on CPU at a free port, wait for warmup.

    ``config_overrides`` change the model's config.json (e.g. ``max_position_embeddings``).
    Returns once the server has logged its ready line (so the warmup request is done and the
    scheduler is idle); the server's output goes to ``root/server.log``.
    """
    model_dir = write_tiny_served_model(os.path.join(root, "tiny"), **config_overrides)
    base_url = f"http://127.0.0.1:{find_available_port(DEFAULT_PORT_FOR_SRT_TEST_RUNNER + 100)}"
    log_path = os.path.join(root, "server.log")
    with open(log_path, "w") as log:
        proc = popen_launch_server(model_dir, base_url, timeout=timeout,
                                   other_args=["--device", "cpu", *other_args],
                                   return_stdout_stderr=(log, log))
    server = TinyServer(base_url, proc, model_dir, log_path)
    deadline = time.time() + 120
    while "ready to roll" not in server.log():
        if time.time() > deadline or proc.poll() is not None:
            server.stop()
            raise RuntimeError(f"server never logged its ready line:\n{server.log()[-3000:]}")
        time.sleep(0.2)
    return server


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; p-value from the regularised upper gamma function."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    expected = probs / probs.sum() * counts.sum()
    assert expected.min() >= 20, "cells too small for the chi-square approximation"
    stat = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor(counts.numel() - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))
