"""The typed SGLANG_* flag registry: parsing, defaults, errors naming the variable, listing."""
from __future__ import annotations

import pytest

from sglang.srt.environ import (
    EnvField,
    describe_envs,
    env_snapshot,
    envs,
    get_env_field,
    list_env_fields,
    unknown_sglang_env_vars,
)

SEED_FLAGS = (
    "SGLANG_ENABLE_METADATA_GLUE_GRAPH",
    "SGLANG_OPT_FUSED_KDA_VERIFY",
    "SGLANG_ENABLE_FUSED_VERIFY_EXTEND_GRAPH",
)


def test_registry_lists_the_required_flags():
    names = [f.name for f in list_env_fields()]
    assert names == sorted(names)
    for name in SEED_FLAGS + ("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "SGLANG_IS_IN_CI"):
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


def test_seed_command_environment(monkeypatch):
    for name in SEED_FLAGS:
        monkeypatch.setenv(name, "1")
    snap = env_snapshot()
    assert all(snap[name] is True for name in SEED_FLAGS)


def test_lookup_and_unknown_detection():
    assert get_env_field("SGLANG_IS_IN_CI") is envs.SGLANG_IS_IN_CI
    with pytest.raises(KeyError, match="SGLANG_NOPE"):
        get_env_field("SGLANG_NOPE")
    env = {"SGLANG_OPT_FUSED_KDA_VERIFY": "1", "SGLANG_OPT_FUSED_KDA_VERIFYY": "1", "PATH": "/"}
    assert unknown_sglang_env_vars(env) == ["SGLANG_OPT_FUSED_KDA_VERIFYY"]
