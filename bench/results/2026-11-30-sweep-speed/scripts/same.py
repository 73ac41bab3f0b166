"""Whether every sweep of data/ replays the same hits as the run before the speed-ups (../2026-11-30-fit-search,
code 71d68b6): per trace, the (policy, capacity, hits, misses) of all 36 rows, and the fitted table."""

import json
import sys
from pathlib import Path

here = Path(__file__).resolve().parents[1]
before = here.parent / "2026-11-30-fit-search" / "data"
keys = ("policy", "capacity", "hits", "misses", "hit_ratio", "cache_fraction")
differ = 0
for path in sorted((here / "data").glob("*-seed?.jsonl")):
    if not (before / path.name).exists():
        continue
    now = [json.loads(line) for line in path.open()]
    then = [json.loads(line) for line in (before / path.name).open()]
    same = [tuple(r[k] for k in keys) for r in now] == [tuple(r[k] for k in keys) for r in then]
    same = same and now[0]["fit"]["rows"] == then[0]["fit"]["rows"]
    print(f"{path.stem}: {'same' if same else 'DIFFERENT'} ({len(now)} rows); sweep {then[0]['seconds']} -> "
          f"{now[0]['seconds']} s, fit {then[0]['fit_seconds']} -> {now[0]['fit_seconds']} s")
    differ += not same
print(f"{differ} differ")
sys.exit(1 if differ else 0)
