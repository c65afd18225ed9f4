"""Model configuration parsing (BailingMoeV3) and shipped presets."""
from sglang.srt.configs.bailing_moe_v3 import BailingMoeV3Config, ConfigError
from sglang.srt.configs.model_config import ModelConfig

__all__ = ["BailingMoeV3Config", "ConfigError", "ModelConfig"]
