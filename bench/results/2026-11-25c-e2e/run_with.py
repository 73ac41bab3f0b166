"""python run_with.py TREE script.py args...: run script.py with moeinf imported from TREE (bypassing the editable finder)."""
import runpy, sys
tree = sys.argv[1]
sys.meta_path[:] = [f for f in sys.meta_path if "skbc" not in type(f).__module__ and "editable" not in type(f).__module__.lower()]
sys.path.insert(0, tree)
sys.argv = sys.argv[2:]
import moeinf
assert moeinf.__file__.startswith(tree), moeinf.__file__
runpy.run_path(sys.argv[0], run_name="__main__")
