"""Config fields in both transformers layouts: ``rope_parameters`` / ``rope_theta`` and ``dtype``
/ ``torch_dtype``, for the target (and its MTP layer, which shares its config) and a DSpark
draft; RoPE variants the engine cannot honour are refused by name."""
from __future__ import annotations

import pytest

from sglang.srt.configs.bailing_moe_v3 import BailingMoeV3Config, ConfigError
from sglang.srt.configs.dspark import DSparkDraftConfig
from sglang.srt.configs.hf_fields import dtype_of, rope_theta_of
from sglang.test.random_checkpoint import tiny_config
from sglang.test.random_dspark_checkpoint import tiny_dspark_config

TARGET_RAW = tiny_config()


def _without(raw, *keys):
    return {k: v for k, v in raw.items() if k not in keys}


def test_rope_theta_from_either_layout():
    assert rope_theta_of({"rope_theta": 5e5}, 1e4) == 5e5
    assert rope_theta_of({"rope_parameters": {"rope_type": "default", "rope_theta": 6e6}},
                         1e4) == 6e6
    assert rope_theta_of({}, 1e4) == 1e4
    both = {"rope_theta": 6e6, "rope_parameters": {"rope_type": "default", "rope_theta": 6e6}}
    assert rope_theta_of(both, 1e4) == 6e6
    # rope_parameters without a base keeps the top-level one.
    assert rope_theta_of({"rope_theta": 3e5, "rope_parameters": {"rope_type": "default"}},
                         1e4) == 3e5


def test_ling_partial_rotary_factor_is_its_rope_head_dims():
    """Ling's config says partial_rotary_factor 0.5: qk_rope_head_dim 64 of head_dim 128, what
    the engine rotates; accepted at the top level and in rope_parameters, another is not."""
    raw = {**_without(TARGET_RAW, "rope_theta"), "head_dim": 128, "qk_rope_head_dim": 64}
    for where in ({"partial_rotary_factor": 0.5},
                  {"rope_parameters": {"rope_type": "default", "rope_theta": 6e6,
                                       "partial_rotary_factor": 0.5}}):
        assert BailingMoeV3Config.from_dict({**raw, **where}).qk_rope_head_dim == 64
    with pytest.raises(ConfigError, match="partial_rotary_factor 0.25"):
        BailingMoeV3Config.from_dict({**raw, "rope_parameters": {
            "rope_type": "default", "rope_theta": 6e6, "partial_rotary_factor": 0.25}})
    # The transformers 4 layout's top-level factor does not bind: overriding the preset's head
    # dims (as tests and --json-model-override-args do) keeps working.
    assert BailingMoeV3Config.from_dict({**raw, "partial_rotary_factor": 0.25}).head_dim == 128


@pytest.mark.parametrize("params,message", [
    ({"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}, "rope_type 'yarn'"),
    ({"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.3},
     "partial_rotary_factor 0.3"),
    ("not a dict", "rope_parameters must be an object"),
])
def test_unsupported_rope_is_refused_by_name(params, message):
    with pytest.raises(ValueError, match=message):
        rope_theta_of({"rope_parameters": params}, 1e4)
    with pytest.raises(ConfigError, match=message):
        BailingMoeV3Config.from_dict({**TARGET_RAW, "rope_parameters": params})
    with pytest.raises(ConfigError, match=message):
        DSparkDraftConfig.from_dict(
            {**tiny_dspark_config(TARGET_RAW), "rope_parameters": params},
            BailingMoeV3Config.from_dict(TARGET_RAW))


def test_disagreeing_layouts_are_refused():
    raw = {**TARGET_RAW, "rope_theta": 1e4,
           "rope_parameters": {"rope_type": "default", "rope_theta": 6e6}}
    with pytest.raises(ConfigError, match="disagree"):
        BailingMoeV3Config.from_dict(raw)


def test_target_and_draft_read_transformers5_layout():
    raw = _without(TARGET_RAW, "rope_theta", "torch_dtype")
    raw.update(rope_parameters={"rope_type": "default", "rope_theta": 6e6}, dtype="float16")
    target = BailingMoeV3Config.from_dict(raw)
    assert target.rope_theta == 6e6 and target.torch_dtype == "float16"
    draft_raw = _without(tiny_dspark_config(TARGET_RAW), "rope_theta", "torch_dtype")
    draft_raw.update(rope_parameters={"rope_type": "default", "rope_theta": 6e6},
                     dtype="bfloat16")
    draft = DSparkDraftConfig.from_dict(draft_raw, target)
    assert draft.rope_theta == 6e6 and draft.torch_dtype == "bfloat16"
    assert dtype_of({"torch_dtype": "float32"}, "bfloat16") == "float32"
    assert dtype_of({}, "bfloat16") == "bfloat16"
