"""One budget: a memory size means the same bytes, and the same slots, in the API and in every command; it is
resolved once (`Budget.resolve`) and the engine, cache, offloader and kernels read that resolution."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from pathlib import Path

import pytest

from moeinf import MoE, OffloadConfig
from moeinf.builder import budget_of
from moeinf.cli import COMMANDS
from moeinf.commands import options
from moeinf.config import SECTIONS, Budget, ConfigError
from moeinf.store import Store, pack

GEOMETRY = dict(expert_bytes=64 * 1000, slot_bytes=1000, experts=64, top_k=2)


@pytest.mark.parametrize("size", ["25%", 0.25, "0.25", 16000, "16KB"])
def test_a_share_is_of_the_stores_expert_bytes_and_bytes_are_bytes(size: object) -> None:
    budget = Budget.resolve(OffloadConfig(device_cache=size), **GEOMETRY)
    assert (budget.device_bytes, budget.slots, budget.host_slots) == (16000, 16, 0)
    assert budget.window == 4  # prefetch_window: a quarter of the slots
    assert not budget.holds_all and budget.engine_slots == 16


def test_the_budget_holds_all_and_names_the_field_it_refuses() -> None:
    assert Budget.resolve(OffloadConfig(device_cache="100%"), **GEOMETRY).holds_all
    assert Budget.resolve(OffloadConfig(device_cache="1GiB"), **GEOMETRY).slots == 64
    with pytest.raises(ConfigError, match="device_cache: 1000 bytes hold 1 experts.*top_k=2"):
        Budget.resolve(OffloadConfig(device_cache=1000), **GEOMETRY)
    with pytest.raises(ConfigError, match="host_cache: 0 bytes hold no expert"):
        Budget.resolve(OffloadConfig(device="cuda", device_cache="50%"), **GEOMETRY)
    host = Budget.resolve(OffloadConfig(device_cache="25%", host_cache="50%"), **GEOMETRY)
    assert (host.host_slots, host.engine_slots, host.slots) == (32, 32, 16)
    window = Budget.resolve(OffloadConfig(device_cache="25%", prefetch_window=1.0), **GEOMETRY).window
    assert window == 16


def test_every_field_is_in_exactly_one_section() -> None:
    fields = [f.name for f in dataclasses.fields(OffloadConfig)]
    sectioned = [name for names in SECTIONS.values() for name in names]
    assert sorted(sectioned) == sorted(fields)
    assert OffloadConfig(device_cache="10%").section("cache")["device_cache"] == "10%"
    with pytest.raises(ConfigError, match="sections"):
        OffloadConfig().section("misc")


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """The parser of every command that takes --device-cache."""
    parsers = {}
    for name in sorted(COMMANDS):
        parser = argparse.ArgumentParser()
        importlib.import_module(f"moeinf.commands.{name}").add_arguments(parser)
        if any("--device-cache" in action.option_strings for action in parser._actions):
            parsers[name] = parser
    return parsers


def test_commands_turn_device_cache_into_the_apis_config(tiny_model_dir, tmp_path: Path) -> None:
    """The flag reaches `OffloadConfig.device_cache` as written, so a command resolves it with the same
    `Budget.resolve` as the API: the same bytes, the same slots."""
    model_dir = tiny_model_dir("qwen3_moe")
    parsers = command_parsers()
    assert {"generate", "serve", "chat"} <= set(parsers)
    for name, parser in parsers.items():
        action = next(a for a in parser._actions if "--device-cache" in a.option_strings)
        assert action.type(" 25% ") in ("25%", " 25% ", 0.25), name
        args = argparse.Namespace(**{a.dest: a.default for a in parser._actions if a.dest != "help"})
        args.device_cache = action.type("25%")
        # (replay takes several policies, one config each: one of them here)
        config = options.offload_config(args, str(model_dir), prefetch="hybrid", eviction="lru")
        assert Budget.resolve(config, **GEOMETRY).device_bytes == 16000, name


def test_the_api_runs_on_the_budget_it_resolved_once(tiny_model_dir, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("qwen3_moe")
    config = OffloadConfig(offload_dir=str(tmp_path / "store"), device_cache="50%")
    pack(model_dir, tmp_path / "store", progress=False)
    store = Store(tmp_path / "store")
    want = budget_of(config, store)
    assert want.device_bytes == store.expert_bytes // 2
    with MoE(model_dir, config) as moe:
        runtime = moe._runtime
        assert runtime.offloader.budget == want
        assert runtime.cache.tier.capacity == want.slots
        assert runtime.cache.window == want.window
