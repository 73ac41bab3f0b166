"""How torch's OpenMP threads wait between parallel regions, and the one setting moeinf makes to it.

torch splits a CPU op across a team of OpenMP threads. Between regions, libgomp (the runtime of torch's
Linux wheels) keeps the team's threads spinning for GOMP_SPINCOUNT = 300000 pauses (milliseconds) unless
the process has more OpenMP threads than CPUs, when it spins 100. A team as large as the machine's CPUs
therefore holds every core after each op, against whatever else should run there: moeinf's I/O threads
and kernel helpers (`gemv.workers`), other processes. The same model passes then run several times
slower, and a product far slower, on the thread that owns that team (the main thread) than on a second
thread: the second thread's own team takes the process over the CPU count and throttles every spin.

The policy is read once, when the OpenMP runtime loads with torch, from OMP_WAIT_POLICY (the standard
variable, read by libgomp, LLVM's and Intel's runtimes) and GOMP_SPINCOUNT / KMP_BLOCKTIME. The `moeinf`
command calls `prefer_passive_wait` before anything imports torch; an application that loads torch itself
sets OMP_WAIT_POLICY=PASSIVE in its environment (`MoE` says so once where `spins_long` holds).
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
"""Variables that set how OpenMP threads wait; where the user set one, moeinf leaves the policy alone."""
PASSIVE = "PASSIVE"


def prefer_passive_wait(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE for the OpenMP runtime torch will load (idle team threads sleep at once),
    unless the user chose a policy (`WAIT_VARIABLES`) or torch, hence the runtime, is already loaded.
    Whether the runtime will wait passively because of this call."""
    if "torch" in sys.modules or any(name in environ for name in WAIT_VARIABLES):
        return False
    environ["OMP_WAIT_POLICY"] = PASSIVE
    return True


def spins_long(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Whether torch's OpenMP threads (already loaded) spin for long between regions where it hurts: an
    OpenMP build, no wait policy chosen (`WAIT_VARIABLES`), and intra-op threads for every CPU this
    process may run on (with fewer, the spinning threads leave cores free)."""
    import torch

    openmp = "ATen parallel backend: OpenMP" in torch.__config__.parallel_info()
    if not openmp or any(name in environ for name in WAIT_VARIABLES):
        return False
    return torch.get_num_threads() >= len(os.sched_getaffinity(0))
