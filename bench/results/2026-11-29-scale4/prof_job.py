"""Stage 1: the job bench scale would run for one row (replayed, 8 GiB), written to a file with its EAMC."""
import argparse, json, shutil, sys
from pathlib import Path
import moeinf.bench.scale as S

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
def capture(cap, job, *, name, timeout, drop):
    if job.get("eamc"):
        src = Path(job["eamc"]).parent
        shutil.copytree(src, out / "eamc", dirs_exist_ok=True)
        job["eamc"] = str(out / "eamc" / Path(job["eamc"]).name)
    job["cap"] = cap
    (out / "job.json").write_text(json.dumps(job))
    return {"ok": False, "error": "captured", "peak_bytes": 0, "killed": False}
S.run_capped = capture
p = argparse.ArgumentParser(); S.add_arguments(p)
args = p.parse_args(sys.argv[2:])
S.drive(args)
