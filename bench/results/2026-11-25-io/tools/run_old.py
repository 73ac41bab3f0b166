"""Run the moeinf CLI with the 'before' engine: csrc of 1b4dba9 (the engine as committed before this session;
bfcbff4 changed only the GIL handling of the bindings) built into /tmp/io25/old with g++ -O3 (as
bench/results/2026-11-24-io-final/tools/run_old.py says) and loaded in place of the installed one. The old
raw_read has no buffer_bytes, so the shim answers the pool-sized raw reference with NaN (not measured in
'before' runs); the baseline raw_gbps is the same code in both."""

import glob
import importlib.util
import math
import sys
import types

path = glob.glob("/tmp/io25/old/_engine*.so")[0]
spec = importlib.util.spec_from_file_location("moeinf._engine", path)
assert spec is not None and spec.loader is not None
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)


def raw_read(path, ranges, chunk_bytes, direct=True, buffer_bytes=0):
    result = old.raw_read(path, ranges, chunk_bytes, direct)
    if buffer_bytes:
        result["seconds"] = math.nan
    return result


shim = types.ModuleType("moeinf._engine")
for k in dir(old):
    if not k.startswith("__"):
        setattr(shim, k, getattr(old, k))
shim.Engine = old.Engine
shim.raw_read = raw_read
sys.modules["moeinf._engine"] = shim

import moeinf  # noqa: E402
import moeinf.engine  # noqa: E402

moeinf._engine = shim
assert moeinf.engine._engine is shim

from moeinf.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
