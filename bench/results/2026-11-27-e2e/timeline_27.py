"""bench/results/2026-11-25b-e2e/timeline.py with this session's variant `nothread`: the default with
`prefetch_plan_thread=False` (planning on the compute thread at every layer, as before this session).

    python timeline_27.py --cache 25% --variants none,default,nothread,default,nothread --raw-gbps 2.6 --out F

With the planner thread on, the `plan_*` columns time the planner thread's work (off the compute thread at
the layers whose experts were all resident), not the compute thread's.
"""
import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("timeline", HERE.parent / "2026-11-25b-e2e" / "timeline.py")
timeline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(timeline)
timeline.VARIANTS["nothread"] = (None, {"eamc": str(timeline.EAMC), "prefetch_plan_thread": False})
if __name__ == "__main__":
    sys.exit(timeline.main())
