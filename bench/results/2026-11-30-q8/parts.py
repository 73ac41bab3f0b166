import sys, json, torch
from pathlib import Path
from moeinf import OffloadConfig
from moeinf.config import resolve_bytes
from moeinf.store import Store
from moeinf.bench.quant import speed_inputs
from moeinf.bench.decode_profile import profile_decode
torch.set_num_threads(1)
M = Path("/work/bench-data/e2e-zoo-full-2048x768")
budget = resolve_bytes(sys.argv[2] if len(sys.argv) > 2 else "25%", Store(M.with_name(M.name + ".moeinf")).expert_bytes, field="c")
inputs = speed_inputs(M, 5)
extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
for quant in sys.argv[1].split(","):
    store = M.with_name(M.name + (".moeinf" if quant == "none" else f".moeinf-{quant}"))
    cfg = OffloadConfig.from_dict({"offload_dir": str(store), "device_cache": budget, **extra})
    r = profile_decode(M, cfg, inputs[:2], inputs[2:], 16)
    print(quant, {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items() if k not in ("stats", "tokens")})
