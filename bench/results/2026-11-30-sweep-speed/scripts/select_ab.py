"""Old against new victim choice in one process, alternating calls: `python select_ab.py OLD_KERNELS NEW_KERNELS`
(two copies of moeinf/policy/kernels.py, e.g. `git show bbecf43:moeinf/policy/kernels.py > old.py`). The old
one is handed the float64 copy of the EAM the old policy made; the new one the float32 EAM as it is."""
import importlib.util
import os
import sys
import tempfile
import time

os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp()  # the copies must not write into moeinf's kernel cache
import numpy as np  # noqa: E402


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


A = load("ka", sys.argv[1])
B = load("kb", sys.argv[2])
from moeinf.bench.cache import VICTIM_SHAPE
from moeinf.policy import EvictionContext
from moeinf.policy.fitted import FittedEviction, Setting
L, E, cached = VICTIM_SHAPE
def make():
    rng = np.random.default_rng(0)
    policy = FittedEviction(L, E, top_k=8); policy.use(Setting(shape=1.0, follow=0.5, carry=0.1))
    resident = rng.choice(L * E, size=cached, replace=False)
    for index in resident: policy.on_insert(policy.key(index))
    for index in rng.choice(resident, size=4 * cached): policy.on_access(policy.key(index))
    eam = rng.poisson(0.5, size=(L, E)).astype(np.float32)
    blocked = policy._blocked.copy(); blocked[resident[:8]] = True
    return policy, eam, blocked, int(resident[0]) // E
pa, eam, blocked_a, layer = make(); pb, _, blocked_b, _ = make()
def call(K, p, blocked, conv):
    e = np.ascontiguousarray(eam, dtype=np.float64).reshape(-1) if conv else np.ascontiguousarray(eam).reshape(-1)
    out = np.empty(1, dtype=np.int64)
    K.select(p.kind, p.params, L, p._resident_members(), p.stamp, p.count, blocked, e, layer, p._no_future, p.alphas, p.loglik, p.running, p.layer_state, p.transition, p.flags, p._layer_counts(), out)
    return out[0]
assert call(A, pa, blocked_a, True) == call(B, pb, blocked_b, False)
ta, tb = [], []
for _ in range(20000):
    t = time.perf_counter(); call(A, pa, blocked_a, True); ta.append(time.perf_counter() - t)
    t = time.perf_counter(); call(B, pb, blocked_b, False); tb.append(time.perf_counter() - t)
print("old (float64 copy + per-key scan)", round(np.median(ta) * 1e6, 2), "new", round(np.median(tb) * 1e6, 2))
