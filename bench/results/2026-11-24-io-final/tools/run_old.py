"""Run the moeinf CLI with the 'before' engine: csrc of commit 2dc7a79 built into /tmp/iow/old, e.g.

    mkdir -p /tmp/iow/old/csrc && for f in $(git ls-files csrc); do git show 2dc7a79:$f > /tmp/iow/old/$f; done
    cd /tmp/iow/old && g++ -O3 -std=c++17 -shared -fPIC $(python -m pybind11 --includes) -Icsrc csrc/*.cpp \\
        -o _engine$(python3-config --extension-suffix) -lpthread
"""

import glob
import importlib.util
import sys

path = glob.glob("/tmp/iow/old/_engine*.so")[0]
spec = importlib.util.spec_from_file_location("moeinf._engine", path)
assert spec is not None and spec.loader is not None
old_engine = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old_engine)
sys.modules["moeinf._engine"] = old_engine

import moeinf  # noqa: E402
import moeinf.engine  # noqa: E402

moeinf._engine = old_engine
assert moeinf.engine._engine is old_engine

from moeinf.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
