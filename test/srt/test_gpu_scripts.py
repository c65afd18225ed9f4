"""The GPU-host entry points under scripts/: every shell script parses, and gpu_call.sh checks all
of its stages before it runs the first one (a malformed stage must not cost device time)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "scripts").glob("*.sh"))

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_shell_script_parses(script):
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("stages, message", [
    (["5 gpu_prefill.sh STAGE=gates", "x gpu_prefill.sh"], "must start with seconds"),
    (["5 gpu_prefill.sh STAGE=gates", "5 gpu_nosuch.sh STAGE=a"], "no scripts/gpu_nosuch.sh"),
])
def test_gpu_call_refuses_a_bad_stage_before_running_any(tmp_path, stages, message):
    scratch = tmp_path / "scratch"
    out = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_call.sh"), *stages],
                         capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"),
                              "SCRATCH": str(scratch)})
    assert out.returncode == 2 and message in out.stdout, out.stdout + out.stderr
    assert "==" not in out.stdout  # no stage started
    assert not any(scratch.iterdir())


def _gpu_call_in(tmp_path, *stages: str, **env: str) -> subprocess.CompletedProcess:
    """``gpu_call.sh`` run from ``tmp_path`` with its outputs, scratch and Triton cache there and
    no carried cache unpacked (``TRITON_CACHE_IN`` names a file that does not exist, not the
    repository's); ``env`` adds variables."""
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_call.sh"), *stages],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                               "OUT": str(tmp_path / "out"), "SCRATCH": str(tmp_path / "scratch"),
                               "TRITON_CACHE_DIR": str(tmp_path / "triton"),
                               "TRITON_CACHE_IN": str(tmp_path / "none.txz"), **env})


def test_gpu_call_survives_a_stage_that_names_served_variant(tmp_path):
    """After each stage gpu_call.sh kills the servers it may have left; a stage whose own
    words name ``benchmark/batch1/served_variant.py`` (``SERVE_MAIN=...``) must not match
    gpu_call.sh itself, so the next stage still runs and the logs are packed."""
    stage = "20 gpu_prefill.sh STAGE=none SERVE_MAIN=benchmark/batch1/served_variant.py"
    out = _gpu_call_in(tmp_path, stage, "20 gpu_prefill.sh STAGE=none")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("== gpu_prefill.sh STAGE=none") == 2, out.stdout
    assert "packed" in out.stdout and (tmp_path / "out" / "logs.tgz").exists()


@pytest.mark.skipif(shutil.which("xz") is None, reason="needs xz")
def test_gpu_call_returns_the_triton_cache_as_xz(tmp_path):
    """``TRITON_CACHE_OUT=1``: the cache comes back as ``triton_cache.txz``, whose unpacked
    files equal the cache's (the form a later call carries as ``.triton_cache.txz``)."""
    cache = tmp_path / "triton" / "abc123"
    cache.mkdir(parents=True)
    (cache / "k.cubin").write_bytes(bytes(range(256)) * 64)
    (cache / "__grp__k.json").write_text('{"child_paths": {}}')
    out = _gpu_call_in(tmp_path, "20 gpu_prefill.sh STAGE=none", TRITON_CACHE_OUT="1")
    assert out.returncode == 0 and "Triton cache:" in out.stdout, out.stdout + out.stderr
    back = tmp_path / "back"
    back.mkdir()
    subprocess.run(["tar", "xf", str(tmp_path / "out" / "triton_cache.txz"), "-C", str(back)],
                   check=True, env={"PATH": "/usr/bin:/bin"})
    assert (back / "abc123" / "k.cubin").read_bytes() == (cache / "k.cubin").read_bytes()
    assert (back / "abc123" / "__grp__k.json").read_text() == '{"child_paths": {}}'


@pytest.mark.parametrize("script", ["gpu_graphs.sh", "gpu_prefill.sh", "gpu_guide.sh"])
def test_entry_points_refuse_settings_given_as_arguments(tmp_path, script):
    """``bash scripts/gpu_graphs.sh STAGE=served`` would run the default stage (the settings are
    environment variables): the entry point stops at once, before installing or starting
    anything, and says how to pass them."""
    out = subprocess.run(["bash", f"scripts/{script}", "STAGE=served"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")})
    assert out.returncode == 2, out.stdout + out.stderr
    assert "settings are environment variables" in out.stderr and "STAGE=served" in out.stderr
    assert not (tmp_path / "out").exists()  # refused before anything ran
