"""Stage 2 (inside the cgroup): run the captured job; at the first decoded token start py-spy on this process
and snapshot every thread's CPU (/proc/self/task), stop both when generate returns."""
import json, os, signal, subprocess, sys, time
from pathlib import Path
import moeinf.bench.scale as S

job = json.loads(Path(sys.argv[1]).read_text())
out = Path(sys.argv[2])
rate = sys.argv[3] if len(sys.argv) > 3 else "50"

def threads():
    snap = {}
    for t in Path("/proc/self/task").iterdir():
        try:
            comm = (t / "comm").read_text().strip()
            f = (t / "stat").read_text().rsplit(")", 1)[1].split()
            ss = (t / "schedstat").read_text().split()
            snap[t.name] = (comm, int(f[11]) / os.sysconf("SC_CLK_TCK"), int(f[12]) / os.sysconf("SC_CLK_TCK"),
                            int(ss[0]) / 1e9, int(ss[1]) / 1e9)
        except OSError:
            pass
    return snap

state = {}
class Start:
    def __call__(self, input_ids, scores):
        if "t0" not in state:
            state["t0"] = time.perf_counter(); state["cpu0"] = threads()
            state["spy"] = subprocess.Popen(["py-spy", "record", "--pid", str(os.getpid()), "--rate", rate,
                                             "--threads", "--idle", "--nonblocking", "-f", "raw",
                                             "-o", str(out / "pyspy.txt"), "--duration", "3600"],
                                            stdout=open(out / "pyspy.log", "w"), stderr=subprocess.STDOUT)
            state["tok0"] = len(state.setdefault("stamps", []))
        state.setdefault("stamps", []).append(time.perf_counter())
        return scores

orig = S.decode_all
def decode_all(generate, inputs, new_tokens, **kw):
    def gen(*a, **k):
        k["logits_processor"].append(Start())
        r = generate(*a, **k)
        state["t1"] = time.perf_counter(); state["cpu1"] = threads()
        spy = state.get("spy")
        if spy is not None:
            spy.send_signal(signal.SIGINT); spy.wait(timeout=60)
        return r
    return orig(gen, inputs, new_tokens, **kw)
S.decode_all = decode_all
row = S.worker(job)
steps = len(state["stamps"]) - 1
cpu = {}
for tid, (comm, u1, s1, c1, w1) in state["cpu1"].items():
    u0, s0, c0, w0 = state["cpu0"].get(tid, (comm, 0.0, 0.0, 0.0, 0.0))[1:]
    cpu[f"{comm}:{tid}"] = {"user_s": round(u1 - u0, 3), "sys_s": round(s1 - s0, 3),
                            "cpu_s": round(c1 - c0, 3), "runq_s": round(w1 - w0, 3)}
summary = {"decode_wall_s": state["t1"] - state["t0"], "decode_steps": steps, "threads_cpu": cpu,
           "row": {k: v for k, v in row.items() if k not in ("tokens",)}}
(out / "prof.json").write_text(json.dumps(summary, indent=1))
print(json.dumps({k: summary[k] for k in ("decode_wall_s", "decode_steps")}))
