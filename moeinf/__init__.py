"""moeinf: run Mixture-of-Experts models whose experts live on SSD.

    from moeinf import MoE, OffloadConfig
    with MoE("path/to/hf_model", OffloadConfig(device_cache="25%")) as model:
        out = model.generate(input_ids, max_new_tokens=32)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import ConfigError, OffloadConfig

__version__ = "0.1.0"
__all__ = ["MoE", "OffloadConfig", "ConfigError", "__version__"]

if TYPE_CHECKING:
    from .api import MoE


def __getattr__(name: str) -> Any:
    # `MoE` pulls in torch and transformers; import it on first use so `moeinf --help` stays fast.
    if name == "MoE":
        from .api import MoE

        return MoE
    raise AttributeError(f"module 'moeinf' has no attribute {name!r}")
