from __future__ import annotations

from pathlib import Path

import pytest

from moeinf.hf.tiny import save_tiny


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """Factory: tiny_model_dir("qwen3_moe") -> a save_pretrained checkpoint dir, built once per session."""
    cache: dict[tuple, Path] = {}

    def make(family: str, **overrides) -> Path:
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{family}")
            cache[key] = save_tiny(family, out, **overrides)
        return cache[key]

    return make
