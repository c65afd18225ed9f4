"""Architecture name -> model class (dispatch on ``architectures[0]``, docs/model.md §1.1).

Draft models: as in SGLang, any Bailing architecture loaded as a draft resolves to the MTP
class ``BailingMoeForCausalLMNextN``.
"""
from __future__ import annotations

from typing import Dict, Type

from torch import nn

__all__ = ["get_model_class", "supported_architectures"]


def _target_classes() -> Dict[str, Type[nn.Module]]:
    from sglang.srt.models.bailing_moe_v3 import BailingMoeV3ForCausalLM

    return {"BailingMoeV3ForCausalLM": BailingMoeV3ForCausalLM}


def _draft_classes() -> Dict[str, Type[nn.Module]]:
    from sglang.srt.models.bailing_moe_v3_nextn import BailingMoeForCausalLMNextN
    from sglang.srt.models.dspark import EntryClass as dspark_classes

    table: Dict[str, Type[nn.Module]] = {
        "BailingMoeV3ForCausalLM": BailingMoeForCausalLMNextN,
        "BailingMoeForCausalLMNextN": BailingMoeForCausalLMNextN,
    }
    # DSpark drafts are built from their own config (models/dspark.py, load_dspark_draft).
    table.update({cls.__name__: cls for cls in dspark_classes})
    return table


def supported_architectures(is_draft: bool = False) -> list:
    """Architecture names :func:`get_model_class` accepts."""
    return sorted(_draft_classes() if is_draft else _target_classes())


def get_model_class(architecture: str, is_draft: bool = False) -> Type[nn.Module]:
    """The model class serving ``architecture`` (as a draft model when ``is_draft``)."""
    table = _draft_classes() if is_draft else _target_classes()
    if architecture not in table:
        kind = "draft" if is_draft else "target"
        raise ValueError(f"unsupported {kind} architecture {architecture!r}; supported: "
                         f"{', '.join(sorted(table))}")
    return table[architecture]
