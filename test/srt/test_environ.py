"""The typed SGLANG_* flag registry: parsing, defaults, errors naming the variable, listing,
compatibility-only variables."""
from __future__ import annotations

import logging

import pytest

from sglang.srt import environ
from sglang.srt.environ import (
    EnvField,
    compat_env_fields,
    describe_envs,
    env_snapshot,
    envs,
    get_env_field,
    list_env_fields,
    unknown_sglang_env_vars,
    warn_compat_envs,
)

# Variables of the published upstream launch commands for Ling-3.0-flash.
UPSTREAM_LAUNCH_FLAGS = (
    "SGLANG_ENABLE_METADATA_GLUE_GRAPH",
    "SGLANG_OPT_FUSED_KDA_VERIFY",
    "SGLANG_ENABLE_FUSED_VERIFY_EXTEND_GRAPH",
)


def test_registry_lists_the_required_flags():
    names = [f.name for f in list_env_fields()]
    assert names == sorted(names)
    for name in UPSTREAM_LAUNCH_FLAGS + ("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "SGLANG_IS_IN_CI"):
        assert name in names
        assert getattr(envs, name).name == name  # attribute name == variable name


@pytest.mark.parametrize("raw, value", [("1", True), ("true", True), ("YES", True),
                                        ("0", False), ("False", False), ("no", False)])
def test_bool_parsing(monkeypatch, raw, value):
    monkeypatch.setenv("SGLANG_OPT_FUSED_KDA_VERIFY", raw)
    assert envs.SGLANG_OPT_FUSED_KDA_VERIFY.get() is value


def test_unset_and_empty_mean_default(monkeypatch):
    monkeypatch.delenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", raising=False)
    assert envs.SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION.get() is True
    monkeypatch.setenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "")
    assert envs.SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION.get() is True
    assert not envs.SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION.is_set()


def test_bad_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("SGLANG_ENABLE_METADATA_GLUE_GRAPH", "ture")
    with pytest.raises(ValueError, match="SGLANG_ENABLE_METADATA_GLUE_GRAPH"):
        envs.SGLANG_ENABLE_METADATA_GLUE_GRAPH.get()
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="SGLANG_HEALTH_CHECK_TIMEOUT"):
        envs.SGLANG_HEALTH_CHECK_TIMEOUT.get()
    assert "invalid" in describe_envs()  # the listing reports it instead of crashing


def test_typed_int_float_str():
    f_int = EnvField("SGLANG_TEST_INT_FLAG", int, 3, "test")
    f_str = EnvField("SGLANG_TEST_STR_FLAG", str, "a", "test")
    with f_int.override(12):
        assert f_int.get() == 12
    assert f_int.get() == 3
    with f_str.override("xyz"):
        assert f_str.get() == "xyz"
    with pytest.raises(TypeError):
        EnvField("SGLANG_TEST_BAD", list, [], "test")


def test_override_restores_previous_value(monkeypatch):
    monkeypatch.setenv("SGLANG_IS_IN_CI", "yes")
    with envs.SGLANG_IS_IN_CI.override(False):
        assert envs.SGLANG_IS_IN_CI.get() is False
    assert envs.SGLANG_IS_IN_CI.get() is True


def test_upstream_command_environment(monkeypatch):
    for name in UPSTREAM_LAUNCH_FLAGS:
        monkeypatch.setenv(name, "1")
    snap = env_snapshot()
    assert all(snap[name] is True for name in UPSTREAM_LAUNCH_FLAGS)


def test_lookup_and_unknown_detection():
    assert get_env_field("SGLANG_IS_IN_CI") is envs.SGLANG_IS_IN_CI
    with pytest.raises(KeyError, match="SGLANG_NOPE"):
        get_env_field("SGLANG_NOPE")
    env = {"SGLANG_OPT_FUSED_KDA_VERIFY": "1", "SGLANG_OPT_FUSED_KDA_VERIFYY": "1", "PATH": "/"}
    assert unknown_sglang_env_vars(env) == ["SGLANG_OPT_FUSED_KDA_VERIFYY"]


# ---------------------------------------------------------------- compatibility-only variables
COMPAT_NAMES = {"SGLANG_OPT_FUSED_KDA_VERIFY", "SGLANG_ENABLE_FUSED_VERIFY_EXTEND_GRAPH",
                "SGLANG_IS_IN_CI"}


@pytest.fixture
def fresh_warnings(monkeypatch, caplog):
    """Forget the warnings already logged in this process and unset every compat variable."""
    monkeypatch.setattr(environ, "_COMPAT_WARNED", set())
    for f in compat_env_fields():
        monkeypatch.delenv(f.name, raising=False)
    caplog.set_level(logging.WARNING, logger="sglang.srt.environ")
    return caplog


def _warnings_naming(caplog, name):
    return [r for r in caplog.records if name in r.getMessage() and "no effect" in r.getMessage()]


def test_compat_variables_are_listed_with_a_reason():
    assert {f.name for f in compat_env_fields()} == COMPAT_NAMES
    assert all(f.compat for f in compat_env_fields())
    glue = envs.SGLANG_ENABLE_METADATA_GLUE_GRAPH
    assert glue.compat is None and "no effect" not in glue.doc  # it is an opt-in
    assert "docs/performance.md" in glue.doc
    assert describe_envs().count("Accepted for compatibility") == len(COMPAT_NAMES)


def test_compat_variable_warns_once_on_first_read(fresh_warnings, monkeypatch):
    monkeypatch.setenv("SGLANG_IS_IN_CI", "1")
    assert envs.SGLANG_IS_IN_CI.get() is True
    assert envs.SGLANG_IS_IN_CI.get() is True
    assert len(_warnings_naming(fresh_warnings, "SGLANG_IS_IN_CI")) == 1


def test_compat_variable_at_its_default_does_not_warn(fresh_warnings, monkeypatch):
    monkeypatch.setenv("SGLANG_OPT_FUSED_KDA_VERIFY", "0")
    assert envs.SGLANG_OPT_FUSED_KDA_VERIFY.get() is False
    assert warn_compat_envs() == []
    assert not _warnings_naming(fresh_warnings, "SGLANG_OPT_FUSED_KDA_VERIFY")


def test_warn_compat_envs_names_each_set_variable_once(fresh_warnings, monkeypatch):
    monkeypatch.setenv("SGLANG_ENABLE_FUSED_VERIFY_EXTEND_GRAPH", "1")
    monkeypatch.setenv("SGLANG_OPT_FUSED_KDA_VERIFY", "true")
    monkeypatch.setenv("SGLANG_ENABLE_METADATA_GLUE_GRAPH", "1")  # opt-in: never warned about
    expected = ["SGLANG_ENABLE_FUSED_VERIFY_EXTEND_GRAPH", "SGLANG_OPT_FUSED_KDA_VERIFY"]
    assert warn_compat_envs() == expected
    assert warn_compat_envs() == expected
    for name in expected:
        assert len(_warnings_naming(fresh_warnings, name)) == 1
    assert not _warnings_naming(fresh_warnings, "SGLANG_ENABLE_METADATA_GLUE_GRAPH")


# ---------------------------------------------------------------- retired variables
# The retired kernel switches, and what replaced each (environ.RETIRED_ENV_VARS).
RETIRED_KERNEL_SWITCHES = (
    "SGLANG_TRITON_RMSNORM", "SGLANG_TRITON_ROUTER", "SGLANG_TRITON_MOE_COMBINE",
    "SGLANG_TRITON_MLA_ROPE", "SGLANG_TRITON_SMALL_M_GEMM", "SGLANG_KDA_NORM_IN_O_PROJ",
    "SGLANG_PDL_WEIGHT_PREFETCH", "SGLANG_MOE_GROUPED_MM",
)
# The retired graph / verify switches: a flag, a constructor or a benchmark parameter now.
RETIRED_OTHER = {
    "SGLANG_RAGGED_VERIFY_MODE": "--speculative-dspark-verify-mode",
    "SGLANG_FUSED_ROUND_PREP": "FutureMap(fused_prep=",
    "SGLANG_GRAPH_FULL_REFILL": "refill_mode='full'",
    "SGLANG_ROUND_GRAPH_PER_PHASE": "per_phase=True",
}


def test_retired_variables_are_not_declared():
    declared = {f.name for f in list_env_fields()}
    assert set(RETIRED_KERNEL_SWITCHES) <= set(environ.RETIRED_ENV_VARS)
    assert not declared & set(environ.RETIRED_ENV_VARS)
    assert not hasattr(envs, "SGLANG_TRITON_RMSNORM")


@pytest.mark.parametrize("name", RETIRED_KERNEL_SWITCHES)
def test_retired_variable_warns_once_with_its_replacement(monkeypatch, caplog, name):
    """Setting a retired variable logs one line saying it was retired and what replaced it
    (a KernelChoices field, named in the line), instead of the closest declared name."""
    monkeypatch.setattr(environ, "_UNKNOWN_WARNED", set())
    caplog.set_level(logging.WARNING, logger="sglang.srt.environ")
    env = {name: "1", "PATH": "/"}
    assert environ.warn_unknown_sglang_env_vars(env) == [name]
    assert environ.warn_unknown_sglang_env_vars(env) == [name]
    lines = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"{name} was retired and is ignored" in lines[0]
    assert "KernelChoices(" in lines[0] and "did you mean" not in lines[0]
    assert "\n" not in lines[0]


@pytest.mark.parametrize("name", sorted(RETIRED_OTHER))
def test_retired_graph_variable_names_its_replacement(monkeypatch, caplog, name):
    monkeypatch.setattr(environ, "_UNKNOWN_WARNED", set())
    caplog.set_level(logging.WARNING, logger="sglang.srt.environ")
    assert environ.warn_unknown_sglang_env_vars({name: "1"}) == [name]
    lines = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert len(lines) == 1 and f"{name} was retired and is ignored" in lines[0]
    assert RETIRED_OTHER[name] in lines[0]
