"""Run `moeinf` from another checkout (the old code of an old-against-new pair) with this venv's compiled
extensions: `python wtrun.py CHECKOUT bench cache ...`. The editable install's import redirect is removed so
that `moeinf` comes from CHECKOUT (link the venv's _engine/_kernels .so files into CHECKOUT/moeinf first)."""
import sys

sys.meta_path[:] = [f for f in sys.meta_path if "skbc" not in type(f).__module__ and "skbc" not in repr(f)]
root = sys.argv.pop(1)
sys.path.insert(0, root)
import moeinf  # noqa: E402

assert moeinf.__file__.startswith(root), moeinf.__file__
from moeinf.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
