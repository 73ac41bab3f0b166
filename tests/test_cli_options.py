"""The shared flags: sizes need a unit or %, the default device cache fits the memory available."""

from __future__ import annotations

import argparse
from collections import namedtuple
from pathlib import Path

import pytest

from moeinf.commands import options

Memory = namedtuple("Memory", "available total")


@pytest.mark.parametrize("text", ["4GiB", "512MB", "25%", "100%", "0", " 2 GiB "])
def test_sizes_with_a_unit_or_percent(text: str) -> None:
    assert options.size(text) == text.strip()


@pytest.mark.parametrize("text, hint", [("1", "'1GiB' or '1%'"), ("0.25", "'25%'"), ("4096", "'4096GiB'"),
                                        ("lots", "cannot read"), ("200%", "at most 100%")])
def test_bare_numbers_and_nonsense_are_refused(text: str, hint: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=hint):
        options.size(text)


def test_default_device_cache_offloads_as_the_demo_does(tmp_path: Path, monkeypatch) -> None:
    """Without --device-cache a model that fits in memory is still offloaded (a quarter of its experts
    resident), as `moeinf demo` runs; the old default kept the whole checkpoint."""
    import psutil

    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory(available=10**9, total=2 * 10**9))
    budget, why = options.auto_device_cache(tmp_path)
    assert budget == options.DEFAULT_DEVICE_CACHE == "25%" and "moeinf demo" in why


def test_default_device_cache_is_half_the_available_memory_when_less(tmp_path: Path, monkeypatch) -> None:
    import psutil

    (tmp_path / "model.safetensors").write_bytes(b"\0" * 10_000)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory(available=1200, total=10**9))
    budget, why = options.auto_device_cache(tmp_path)
    assert budget == 600 and "50% of the" in why


def test_offload_config_prints_the_chosen_default(tmp_path: Path, monkeypatch, capsys) -> None:
    parser = argparse.ArgumentParser()
    options.add_offload_arguments(parser)
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 4096)
    config = options.offload_config(parser.parse_args([]), tmp_path)
    assert config.device_cache == "25%"
    assert capsys.readouterr().err.startswith("device cache: 25% (the default: 25% of the experts")
    assert options.offload_config(parser.parse_args(["--cache", "25%"]), tmp_path).device_cache == "25%"


def test_quant_dense_flag_reaches_the_config(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    options.add_offload_arguments(parser)
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 4096)
    args = ["--cache", "25%", "--quant", "int4"]
    assert options.offload_config(parser.parse_args(args), tmp_path).quant_dense == "shared-experts+lm-head"
    flags = [*args, "--quant-dense", "shared-experts"]
    config = options.offload_config(parser.parse_args(flags), tmp_path)
    assert config.quant == "int4" and config.quant_dense == "shared-experts"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quant-dense", "attention"])


@pytest.mark.parametrize("command, flags, named", [
    (["generate", "demo", "--prompt", "hi"], ["--device-cache", "10%", "--eviction", "lru"],
     "--device-cache, --eviction have no effect with --no-offload, which loads the whole model with "
     "transformers on the CPU;"),
    (["serve", "demo"], ["--dtype", "bfloat16"], "--dtype has no effect with --no-offload, which loads the "
     "whole model with transformers on the CPU in float32;"),
    (["replay", "demo"], ["--io-threads", "2"], "--io-threads has no effect"),
    (["chat", "demo"], ["--device", "cuda"], "--device has no effect"),
])
def test_offloading_flags_with_no_offload_are_refused_not_dropped(command: list[str], flags: list[str],
                                                                 named: str, capsys) -> None:
    from moeinf.cli import main

    assert main([*command, "--no-offload", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"moeinf {command[0]}: error: {named}"), err


def test_no_offload_alone_and_generate_dtype_pass_the_check() -> None:
    from moeinf.cli import build_parser

    parser = build_parser()
    for argv in (["generate", "demo", "--prompt", "hi", "--no-offload", "--dtype", "bfloat16"],
                 ["serve", "demo", "--no-offload"], ["chat", "demo", "--no-offload"],
                 ["replay", "demo", "--no-offload"], ["generate", "demo", "--prompt", "hi", "--device-cache",
                                                      "10%"]):
        args = parser.parse_args(argv)
        options.check_no_offload(args, parser.commands[args.command])


def test_more_threads_than_cpus_warns_and_is_still_applied(monkeypatch, caplog) -> None:
    import os

    import torch

    applied: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", applied.append)  # the session's own threads stay
    cpus = len(os.sched_getaffinity(0))
    options.resolve_model_args(argparse.Namespace(threads=cpus))
    assert applied == [cpus] and "--threads" not in caplog.text
    options.resolve_model_args(argparse.Namespace(threads=cpus + 3))
    assert applied == [cpus, cpus + 3]
    assert f"--threads {cpus + 3} is more than the {cpus} CPUs this process may use" in caplog.text
