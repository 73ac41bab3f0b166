"""torch's OpenMP threads wait passively in the `moeinf` command (moeinf.kernels.openmp).

A team of spinning OpenMP threads as large as the machine holds every core between torch ops; the model's
passes on the thread that owns it ran several times slower than on a second thread. These tests read the
OpenMP runtime's own settings (libgomp's OMP_DISPLAY_ENV) in a fresh process, not a timing.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from moeinf import api
from moeinf.kernels import openmp

THROUGH_CLI = "from moeinf.cli import main; main(['--version']); "
LOAD_TORCH = "import torch; torch.ones(64, 64) @ torch.ones(64, 64)"


def openmp_settings(code: str, **env: str) -> dict[str, str]:
    """The OpenMP runtime's settings as libgomp prints them when torch loads it in `python -c code`."""
    environ = {k: v for k, v in os.environ.items() if k not in openmp.WAIT_VARIABLES}
    environ.update(env, OMP_DISPLAY_ENV="VERBOSE")
    done = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True,
                          timeout=120, check=True)
    settings = {}
    for line in done.stderr.splitlines():
        name, eq, value = line.strip().partition(" = ")
        if eq:
            settings[name] = value.strip("'")
    if "GOMP_SPINCOUNT" not in settings:
        pytest.skip("torch's OpenMP runtime is not libgomp (no GOMP_SPINCOUNT in OMP_DISPLAY_ENV)")
    return settings


def test_torch_alone_spins_and_the_moeinf_command_makes_it_wait_passively() -> None:
    alone = openmp_settings(LOAD_TORCH)
    assert int(alone["GOMP_SPINCOUNT"]) > 0  # libgomp's default, the slow main thread's
    command = openmp_settings(THROUGH_CLI + LOAD_TORCH)
    assert command["OMP_WAIT_POLICY"] == "PASSIVE"
    assert command["GOMP_SPINCOUNT"] == "0"


def test_the_users_wait_policy_is_kept() -> None:
    chosen = openmp_settings(THROUGH_CLI + LOAD_TORCH, OMP_WAIT_POLICY="ACTIVE", GOMP_SPINCOUNT="1000")
    assert (chosen["OMP_WAIT_POLICY"], chosen["GOMP_SPINCOUNT"]) == ("ACTIVE", "1000")


def test_nothing_changes_once_torch_is_loaded() -> None:
    environ: dict[str, str] = {}
    assert not openmp.prefer_passive_wait(environ)  # torch is loaded in this process: too late
    assert environ == {}


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_spins_long_where_threads_fill_the_cpus_and_no_policy_is_set(threads) -> None:
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch is not built with OpenMP")
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    assert openmp.spins_long({})
    assert not openmp.spins_long({"OMP_WAIT_POLICY": "PASSIVE"})
    if len(os.sched_getaffinity(0)) > 1:
        torch.set_num_threads(1)
        assert not openmp.spins_long({})


def test_the_api_names_the_setting_once(monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(openmp, "spins_long", lambda: True)
    api.warn_if_openmp_spins.cache_clear()
    with caplog.at_level(logging.WARNING, logger="moeinf.api"):
        api.warn_if_openmp_spins()
        api.warn_if_openmp_spins()
    api.warn_if_openmp_spins.cache_clear()
    assert [r.getMessage().count("OMP_WAIT_POLICY=PASSIVE") for r in caplog.records] == [1]
