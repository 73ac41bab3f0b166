"""Design only: run `moeinf replay` with RunningBatch.join/step and backend.generate timed; writes passes.jsonl."""
import json, sys, time
from moeinf.serve import running
from moeinf.cli import main

out = open(sys.argv[1], "w")
T0 = [None]

def wrap(name):
    orig = getattr(running.RunningBatch, name)
    def f(self, *a, **k):
        t = time.monotonic()
        r = orig(self, *a, **k)
        d = time.monotonic() - t
        rec = {"op": name, "t": t, "d": d, "rows_before": len(self._rows) - (len(a[0]) if name == "join" else 0)}
        if name == "join":
            rec["n"] = len(a[1]); rec["width"] = max(len(p) for p in a[1]); rec["real"] = sum(len(p) for p in a[1])
        out.write(json.dumps(rec) + "\n")
        return r
    setattr(running.RunningBatch, name, f)

wrap("join"); wrap("step")
code = main(sys.argv[2:])
out.close()
sys.exit(code)
