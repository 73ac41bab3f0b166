"""../2026-11-25b-e2e/timeline.py with this session's variants (a diagnostic, not a benchmark):

- `guess1`: the default with `lookahead_next_token_layers=1` (the next pass's first MoE layer guessed from
  the logits, as before this session); `default` guesses three;
- `switch`, `switchnone`: the default and on-demand LRU with `sys.setswitchinterval(0.0005)` while measuring
  (does the planner thread hold the GIL against the compute thread?);
- `nothread`: the default with `prefetch_plan_thread=False`;
- `pin`, `pinnone`: the default and on-demand LRU with the compute thread pinned to CPU 0 and every other
  thread (I/O, planner) to CPU 1 after the warm-up: does the compute thread lose its core to the others?
  (A diagnostic, not a setting; every variant starts with all CPUs allowed.)

Every row also gets `settle_ms_per_token_all_passes`: the time `Offloader.settle` waited for the planner
thread (wrapped on the class, in this process only).

    python timeline_28.py --cache 25% --variants default,guess1,default,guess1 --raw-gbps 2.7 --out F
"""
import sys
import time
import types
from pathlib import Path

TIMELINE = Path(__file__).resolve().parent.parent / "2026-11-25b-e2e" / "timeline.py"
# the hook's method was renamed this session (guess_first_layer -> guess_next_pass)
src = TIMELINE.read_text().replace("guess_first_layer", "guess_next_pass")
timeline = types.ModuleType("timeline")
timeline.__file__ = str(TIMELINE)
exec(compile(src, timeline.__file__, "exec"), timeline.__dict__)
EAMC = str(timeline.EAMC)
timeline.VARIANTS["nothread"] = (None, {"eamc": EAMC, "prefetch_plan_thread": False})
timeline.VARIANTS["guess1"] = (None, {"eamc": EAMC, "lookahead_next_token_layers": 1})
timeline.VARIANTS["guess2"] = (None, {"eamc": EAMC, "lookahead_next_token_layers": 2})
timeline.VARIANTS["pin"] = (None, {"eamc": EAMC})
timeline.VARIANTS["pinnone"] = (None, {"prefetch": "none", "eviction": "lru"})
timeline.VARIANTS["switch"] = (None, {"eamc": EAMC})
timeline.VARIANTS["switchnone"] = (None, {"prefetch": "none", "eviction": "lru"})
orig_measure = timeline.measure
SETTLE = {"s": 0.0, "n": 0}
from moeinf.runtime import offloader as off
orig_settle = off.Offloader.settle
def timed_settle(self):
    t = time.perf_counter()
    try:
        return orig_settle(self)
    finally:
        SETTLE["s"] += time.perf_counter() - t; SETTLE["n"] += 1
from moeinf import MoE
import os
import threading
orig_reset = MoE.reset_stats


def pinned_reset(self):
    """After the warm-up: the compute thread on CPU 0, every other thread of the process on CPU 1."""
    main = threading.main_thread().native_id
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {0} if int(tid) == main else {1})
    return orig_reset(self)


def measure(workload, cache, knobs, raw_bps, **kw):
    name = CURRENT[0]
    # every variant starts with all CPUs allowed (a pinned one leaves the main thread on CPU 0)
    os.sched_setaffinity(threading.main_thread().native_id, set(range(os.cpu_count())))
    MoE.reset_stats = pinned_reset if name.startswith("pin") else orig_reset
    old = sys.getswitchinterval()
    if name.startswith("switch"):
        sys.setswitchinterval(0.0005)
    SETTLE["s"] = 0.0; SETTLE["n"] = 0
    try:
        row = orig_measure(workload, cache, knobs, raw_bps, **kw)
    finally:
        sys.setswitchinterval(old)
    row["settle_ms_per_token_all_passes"] = round(SETTLE["s"] * 1e3 / row["decode_passes"], 2)
    row.pop("tokens_first", None)
    return row
timeline.measure = measure
CURRENT = [None]
orig_main = timeline.main
VAR = timeline.VARIANTS
class Tracking(dict):
    def __getitem__(self, k):
        CURRENT[0] = k; return dict.__getitem__(self, k)
timeline.VARIANTS = Tracking(VAR)
off.Offloader.settle = timed_settle  # diagnostic only: class attribute in this process
if __name__ == "__main__":
    timeline.main()
