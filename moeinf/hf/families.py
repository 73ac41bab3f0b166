"""The MoE families of the installed transformers, and what moeinf does with each.

A model_type is a MoE family when its config class (or, for a composite model, one of its sub-configs)
declares a number of experts and its modeling module defines experts: a class with transformers' experts
interface, or a sparse-MoE / experts class by name. This is read from transformers itself, not from a
list, so a new transformers release shows the families it added: `status` then says for each one whether
moeinf offloads it (`moeinf.spec.spec_for`) or refuses it and why (`moeinf.spec.REFUSED`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from ..spec import UnsupportedModelError, detect_experts_interface, package_source, refusal, spec_for

EXPERT_COUNT = re.compile(r"\b(num_experts|num_local_experts|n_routed_experts|moe_num_experts)\b")
"""Config fields that state a number of routed experts."""
MOE_CLASS = re.compile(r"^class \w*(SparseMoe|SparseMoE|MoE|Moe|Experts?)\w*\(", re.MULTILINE)
"""Modeling classes that hold experts, by transformers' naming."""


@dataclass(frozen=True)
class FamilyStatus:
    """What moeinf does with one MoE model_type: `supported` (offloaded) or `refused` with the reason."""

    model_type: str
    status: Literal["supported", "refused", "unknown"]
    reason: str = ""


def _class_source(source: str, name: str) -> str:
    found = re.search(rf"^class {name}\(.*?(?=^class |\Z)", source, re.MULTILINE | re.DOTALL)
    return found.group(0) if found else ""


def _config_declares_experts(model_type: str, config_class: str) -> bool:
    """Whether the config class (or a sub-config it names) has a number-of-experts field, from its source."""
    source = package_source(model_type, "configuration")
    block = _class_source(source, config_class)
    subs = re.search(r"sub_configs\w*\s*=\s*\{([^}]*)\}", block)
    names = re.findall(r"\b(\w+Config)\b", subs.group(1)) if subs else []
    return any(EXPERT_COUNT.search(_class_source(source, name)) for name in [config_class, *names])


def is_moe_family(model_type: str) -> bool:
    """Whether `model_type` of the installed transformers is a mixture-of-experts model."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    config_class = CONFIG_MAPPING_NAMES.get(model_type)
    if config_class is None or not _config_declares_experts(model_type, config_class):
        return False
    modeling = package_source(model_type, "modeling")
    return bool(detect_experts_interface(model_type) or MOE_CLASS.search(modeling))


@lru_cache(maxsize=1)
def moe_model_types() -> tuple[str, ...]:
    """Every MoE model_type of the installed transformers, sorted."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return tuple(sorted(t for t in CONFIG_MAPPING_NAMES if is_moe_family(t)))


def status(model_type: str) -> FamilyStatus:
    """Whether moeinf offloads `model_type`, refuses it with a reason, or knows nothing of it."""
    try:
        spec_for(model_type)
    except UnsupportedModelError:
        reason = refusal(model_type)
        if reason is None:
            return FamilyStatus(model_type, "unknown")
        return FamilyStatus(model_type, "refused", reason)
    return FamilyStatus(model_type, "supported")
