"""A model bigger than the machine: every system under the same memory cap (a cgroup v1 memory cgroup).

  moeinf zoo synth deepseek-v2-lite DIR
  moeinf bench scale DIR --memory-cap 8GiB,16GiB --routing-trace FILE --prompts 2 --new-tokens 16 --json

Each row runs in its own process inside a fresh memory cgroup (`/sys/fs/cgroup/memory/<name>/`) whose
`memory.limit_in_bytes` is the cap: the limit covers the process and the page cache it fills, so a system
that maps or caches more than the cap is reclaimed (or killed) as on a machine of that size. The pages of
the files a row reads are dropped from the page cache before it starts (no row inherits another's reads).

Rows, per cap:
- `default`: moeinf's default OffloadConfig, its expert cache (`device_cache`) the cap less the dense
  weights less --overhead (the process, KV cache, buffers);
- `on-demand-lru`: the same cache, no prefetch, LRU eviction (the baseline the default must beat);
- `int8`, `int4`: the default on the int8 / int4 store where --int8-store / --int4-store name one;
- `accelerate`: HuggingFace + accelerate disk offload (experts beyond the same budget on "disk"), own
  routing only, --accelerate-tokens tokens; its greedy tokens are HF's, against which the exact rows'
  tokens of the first prompt are checked (`tokens_match_hf`). Its disk offload writes the offloaded weights
  (about the checkpoint's expert bytes beyond the budget) to a folder next to DIR, removed after the row;
  the row is skipped, saying so, when the disk has not that much free.
- `llamacpp-bf16`, `llamacpp-q8_0`, `llamacpp-q4_0`: llama.cpp's `llama-bench` on a bf16 / Q8_0 / Q4_0 GGUF
  of DIR (beside the exact / int8 / int4 stores), reading it through mmap under the same cap and threads,
  own routing only; skipped, saying how to get it, without llama-bench (--llama-bench, $LLAMA_BENCH or
  PATH) or the GGUF (--gguf-bf16 / --gguf-q8_0 / --gguf-q4_0, default DIR.llamacpp/model-BF16.gguf etc.,
  as `moeinf bench llamacpp` names them).

With --routing-trace, moeinf's rows run twice: on the checkpoint's own routing (like-for-like with
accelerate) and replaying the trace (position p of request i routed as the trace did, every MoE layer;
moeinf/bench/trace_routing.py); `routing` says which. A replayed row detaches moeinf's router look-ahead
(`router_lookahead_detached`): the checkpoint's routers predict the checkpoint's routing, not the trace's,
so every prefetch they planned would be wasted; the rest of the default planning is kept, and the look-ahead
predicts from the routing alone: expert transitions counted on the trace's other requests, written beside
their EAMC as `moeinf trace` of the real model would give them (`--no-trace-eamc`: neither).
Replayed prompts are as long as the trace requests'
prefill (requests with fewer than --new-tokens later positions are skipped); own-routing prompts are the
held-out prompt texts, at most --max-prompt-tokens tokens.

Per row: `ms_per_token` (median decode step, prefill excluded), `ttft_s` (median time to first token),
`peak_bytes` (the cgroup's memory.max_usage_in_bytes: process + page cache), `bytes_per_token` (expert
bytes read per decoded token), `stall_ms_per_token` (decode time spent waiting for reads),
`cpu_ms_per_token` (CPU time of all the process's threads per decode step), `hit_ratio`, `load_s`,
`killed` (the cap's OOM killer ended it) and the
generated tokens. Rows are printed as a table, or as JSON with --json; --out DIR also writes scale.jsonl.

Disk: the checkpoint (DIR) and its store (--store, else packed once into DIR.moeinf, about the checkpoint's
size again: 31.4 GB each for deepseek-v2-lite) at the same time; the pack says so before writing when the
disk cannot hold the store.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeinf.bench.common import count_problem, offload_settings

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
ROWS = ("default", "on-demand-lru", "int8", "int4", "llamacpp-bf16", "llamacpp-q8_0", "llamacpp-q4_0",
        "accelerate")
LLAMA_ROWS = {"llamacpp-bf16": "BF16", "llamacpp-q8_0": "Q8_0", "llamacpp-q4_0": "Q4_0"}
KNOBS: dict[str, dict[str, Any]] = {"default": {}, "on-demand-lru": {"prefetch": "none", "eviction": "lru"},
                                    "int8": {}, "int4": {}}
WORKER_FLAG = "--scale-worker"
PROMPT_FILES = ("mt_bench.jsonl", "gsm8k_test.jsonl", "mmlu_dev.jsonl", "self_instruct_seed.jsonl")


class ScaleError(RuntimeError):
    """The benchmark cannot run as asked (no writable cgroup, missing store, bad size)."""


def parse_bytes(text: str) -> int:
    """'8GiB', '512MiB', '8G', or bytes."""
    units = {"": 1, "B": 1, "K": 2**10, "KB": 10**3, "KIB": 2**10, "M": 2**20, "MB": 10**6, "MIB": 2**20,
             "G": 2**30, "GB": 10**9, "GIB": 2**30, "T": 2**40, "TB": 10**12, "TIB": 2**40}
    value = text.strip().upper()
    number = value.rstrip("KMGTIB")
    unit = value[len(number):]
    try:
        if unit not in units:
            raise ValueError
        return int(float(number) * units[unit])
    except ValueError:
        raise ScaleError(f"cannot parse size {text!r}; use e.g. 8GiB, 512MiB or a number of bytes") from None


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


# --- cgroups ------------------------------------------------------------------------------------------
@dataclass
class MemoryCgroup:
    """A cgroup v1 memory cgroup made for one run; `close` moves its charges to the parent and removes it."""

    path: Path

    @classmethod
    def create(cls, name: str, limit: int, root: Path = CGROUP_ROOT) -> MemoryCgroup:
        if not (root / "cgroup.procs").is_file():
            raise ScaleError(f"no cgroup v1 memory hierarchy at {root}: the memory cap needs one (mount the "
                             "memory controller there, or run where cgroup v1 is in use)")
        path = root / name
        try:
            path.mkdir(exist_ok=True)
            (path / "memory.limit_in_bytes").write_text(str(limit))
            (path / "memory.max_usage_in_bytes").write_text("0")
        except OSError as exc:
            raise ScaleError(f"cannot create a memory cgroup at {path} ({exc.strerror}): run as a user who "
                             "may "
                             "write to the cgroup hierarchy (e.g. root)") from None
        return cls(path)

    def attach(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def read(self, name: str) -> int:
        return int((self.path / name).read_text().split()[0])

    @property
    def peak(self) -> int:
        return self.read("memory.max_usage_in_bytes")

    @property
    def oom_kills(self) -> int:
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def close(self) -> None:
        try:
            (self.path / "memory.force_empty").write_text("0")
        except OSError:
            pass
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def cgroups_writable(root: Path = CGROUP_ROOT) -> str | None:
    """None when a memory cgroup can be made here, else why not (one line)."""
    try:
        MemoryCgroup.create(f"moeinf-probe-{os.getpid()}", 1 << 30, root).close()
    except ScaleError as exc:
        return str(exc)
    return None


def drop_page_cache(paths: list[Path]) -> None:
    """Evict the clean cached pages of `paths` (files, or every file under a directory)."""
    from moeinf.zoo.synth import drop_file_cache

    for path in paths:
        files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
        for file in files:
            drop_file_cache(file)


def run_capped(cap: int, job: dict[str, Any], *, name: str, timeout: float,
               drop: list[Path]) -> dict[str, Any]:
    """Run one row (`job`, see `worker`) in a fresh cgroup capped at `cap` bytes; its JSON result plus the
    cgroup's peak and whether the OOM killer ended it."""
    import tempfile

    drop_page_cache(drop)
    cgroup = MemoryCgroup.create(name, cap)
    started = time.perf_counter()
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="moeinf-scale-job-") as job_file:
        json.dump(job, job_file)
        job_file.flush()
        return _run_in(cgroup, job_file.name, timeout, started)


def _run_in(cgroup: MemoryCgroup, job_path: str, timeout: float, started: float) -> dict[str, Any]:
    try:
        proc = subprocess.Popen([sys.executable, "-m", "moeinf.bench.scale", WORKER_FLAG, job_path],
                                stdout=subprocess.PIPE, text=True,
                                preexec_fn=lambda: cgroup.attach(os.getpid()))
        try:
            out, _ = proc.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            timed_out = True
        except BaseException:  # interrupted: the worker must not outlive its cgroup's removal
            proc.kill()
            proc.wait()
            raise
        row: dict[str, Any] = {}
        for line in reversed(out.splitlines()):
            if line.startswith("{"):
                row = json.loads(line)
                break
        row.update(peak_bytes=cgroup.peak, killed=cgroup.oom_kills > 0, returncode=proc.returncode,
                   timed_out=timed_out, wall_s=round(time.perf_counter() - started, 1))
        if not row.get("ok"):
            why = ("killed by the memory cap" if row["killed"] else
                   f"timed out after {timeout:.0f} s" if timed_out else f"exit status {proc.returncode}")
            row.setdefault("error", why)
        return row
    finally:
        cgroup.close()


# --- prompts --------------------------------------------------------------------------------------------
def prompt_texts(count: int) -> list[str]:
    root = Path(__file__).resolve().parent.parent / "data" / "prompts"
    texts: list[str] = []
    for file in PROMPT_FILES:
        with open(root / file) as f:
            texts.extend(json.loads(line)["prompt"] for line in f if line.strip())
    per_file = len(texts) // len(PROMPT_FILES)
    return [texts[(i % len(PROMPT_FILES)) * per_file + i // len(PROMPT_FILES)] for i in range(count)]


def own_prompts(model_dir: Path, count: int, max_tokens: int) -> list[list[int]]:
    """Chat-formatted held-out prompts in the checkpoint's tokenizer, at most `max_tokens` ids each."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    out = []
    for text in prompt_texts(count):
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        out.append(list(ids)[-max_tokens:])
    return out


# --- the worker (runs inside the cgroup) ------------------------------------------------------------------
class StepClock:
    """A logits processor stamping each step (the first stamp ends the prefill)."""

    def __init__(self, probe: Any = None) -> None:
        self.stamps: list[float] = []
        self.cpu: list[float] = []
        self.samples: list[tuple[float, ...]] = []
        self.probe = probe

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self.stamps.append(time.perf_counter())
        self.cpu.append(time.process_time())  # every thread of the process: compute, I/O, checksums
        if self.probe is not None:
            self.samples.append(self.probe())
        return scores


def decode_all(generate: Any, inputs: list[list[int]], new_tokens: int, *, start: Any = None,
               probe: Any = None) -> dict[str, Any]:
    import torch
    from transformers import LogitsProcessorList

    latencies, ttfts, tokens = [], [], []
    growth: list[float] = []
    cpu = 0.0
    for i, ids in enumerate(inputs):
        if start is not None:
            start(i)
        clock = StepClock(probe)
        began = time.perf_counter()
        out = generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, logits_processor=LogitsProcessorList([clock]))
        ttfts.append(clock.stamps[0] - began)
        latencies.extend(b - a for a, b in zip(clock.stamps, clock.stamps[1:], strict=False))
        tokens.append(out[0, len(ids):].tolist())
        cpu += clock.cpu[-1] - clock.cpu[0]
        if probe is not None and len(clock.samples) > 1:
            growth = [g + b - a for g, a, b in zip(growth or [0.0] * len(clock.samples[0]), clock.samples[0],
                                                   clock.samples[-1], strict=True)]
        print(f"scale: prompt {i + 1}/{len(inputs)}: {len(ids)} prompt tokens, ttft {ttfts[-1]:.1f} s, "
              f"{statistics.median(latencies) * 1e3 if latencies else float('nan'):.0f} ms/token so far",
              file=sys.stderr, flush=True)
    return {"latencies": latencies, "ttfts": ttfts, "tokens": tokens, "decode_growth": growth, "cpu_s": cpu}


def worker(job: dict[str, Any]) -> dict[str, Any]:
    if job["row"] in LLAMA_ROWS:
        return llama_row(job)
    import torch

    torch.set_num_threads(job["threads"])
    model_dir = Path(job["model_dir"])
    inputs: list[list[int]] = job["inputs"]
    started = time.perf_counter()
    if job["row"] == "accelerate":
        return accelerate_row(job, model_dir, inputs, started)
    from moeinf import MoE, OffloadConfig

    from .replay_routing import Routing, RoutingCursor
    from .trace_routing import detach_router_lookahead, install_trace_replay

    config = OffloadConfig(device_cache=job["device_cache"], offload_dir=job["store"], eamc=job.get("eamc"),
                           **KNOBS.get(job["row"], {}), **(job.get("settings") or {}))
    with MoE(model_dir, config) as moe:
        load_s = time.perf_counter() - started
        start = None
        detached = False
        if job.get("routings"):
            routings = [Routing(torch.tensor(r["ids"]), r["prompt_length"], torch.tensor(r["index"]),
                                torch.tensor(r["weights"])) for r in job["routings"]]
            cursor = RoutingCursor(routings)
            install_trace_replay(moe.model, cursor)
            detached = detach_router_lookahead(moe)
            start = cursor.start
        lookahead = getattr(getattr(getattr(moe, "_runtime", None), "offloader", None), "lookahead", None)
        transitions = getattr(lookahead, "transitions", None) is not None

        def probe() -> tuple[float, ...]:
            stats = moe.stats()
            return float(stats["bytes_read"]), float(stats["stall_s"]), *os_counters()

        result = decode_all(moe.generate, inputs, job["new_tokens"], start=start, probe=probe)
        stats = moe.stats()
    steps = max(len(result["latencies"]), 1)
    growth = result["decode_growth"] or [0.0] * 7
    return {"ok": True, "load_s": round(load_s, 1), **summary(result),
            "bytes_per_token": growth[0] / steps,
            "stall_ms_per_token": growth[1] / steps * 1e3,
            # what the runtime does not count: page faults that read from the drive (a mapped file the cap
            # evicted), all the process's reads, and time its threads waited for a CPU
            "major_faults_per_token": growth[2] / steps,
            "os_read_bytes_per_token": growth[3] / steps,
            "runqueue_ms_per_token": growth[4] / steps * 1e3,
            "compute_thread_cpu_ms_per_token": growth[5] / steps * 1e3,
            "compute_thread_runqueue_ms_per_token": growth[6] / steps * 1e3,
            "hit_ratio": stats["hit_rate"], "bytes_read": stats["bytes_read"],
            "router_lookahead_detached": detached, "lookahead_transitions": transitions,
            "runtime_stats": {k: v for k, v in stats.items() if isinstance(v, (int, float))},
            "prefetch_precision": stats.get("prefetch_precision"),
            "prefetch_recall": stats.get("prefetch_recall")}


def os_counters() -> tuple[float, float, float, float, float]:
    """(major page faults, bytes read from storage, seconds its threads waited on a run queue, CPU seconds
    and run-queue seconds of the calling thread: the one that computes) of this process so far
    (getrusage; /proc/self/io; /proc/self/task/*/schedstat of the live threads)."""
    import resource

    faults = float(resource.getrusage(resource.RUSAGE_SELF).ru_majflt)
    read = 0.0
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                read = float(line.split()[1])
    except OSError:
        pass
    waited = own_cpu = own_wait = 0.0
    me = str(threading.get_native_id())
    for task in Path("/proc/self/task").iterdir():
        try:
            cpu, wait = (int(v) / 1e9 for v in (task / "schedstat").read_text().split()[:2])
        except (OSError, ValueError):
            continue
        waited += wait
        if task.name == me:
            own_cpu, own_wait = cpu, wait
    return faults, read, waited, own_cpu, own_wait


def summary(result: dict[str, Any]) -> dict[str, Any]:
    lat = result["latencies"]
    return {"ms_per_token": statistics.median(lat) * 1e3 if lat else None,
            "ttft_s": statistics.median(result["ttfts"]), "decode_steps": len(lat),
            "cpu_ms_per_token": result["cpu_s"] / max(len(lat), 1) * 1e3,
            "latencies_ms": [round(x * 1e3, 1) for x in lat], "tokens": result["tokens"]}


def accelerate_row(job: dict[str, Any], model_dir: Path, inputs: list[list[int]], started: float
                   ) -> dict[str, Any]:
    """HF + accelerate: experts on "disk" beyond the budget (moeinf/bench/accelerate_baseline.py's plan)."""
    from transformers import AutoModelForCausalLM

    from .accelerate_baseline import plan_device_map

    device_map, plan = plan_device_map(model_dir, job["expert_fraction"])
    folder = Path(job["offload_folder"])
    folder.mkdir(parents=True, exist_ok=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), device_map=device_map,
                                                     offload_folder=str(folder)).eval()
        load_s = time.perf_counter() - started
        import torch

        with torch.inference_mode():
            result = decode_all(model.generate, inputs, job["new_tokens"])
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    return {"ok": True, "load_s": round(load_s, 1), **summary(result), "bytes_per_token": None,
            "hit_ratio": None, "plan": plan}


def llama_row(job: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's `llama-bench` on the GGUF, read through mmap without repacking inside the cap: a prefill of
    the first prompt's length, then --new-tokens decoded tokens, `threads` threads. llama-bench feeds
    random token ids (routing is the checkpoint's own either way) and reports each test's mean time, so
    `ms_per_token` is the mean decode step (moeinf's rows: the median) and `ttft_s` the prefill's time."""
    import resource

    prompt = len(job["inputs"][0])
    started = time.perf_counter()
    done = subprocess.run([job["llama_bench"], "-m", job["gguf"], "-t", str(job["threads"]),
                           "-p", str(prompt), "-n", str(job["new_tokens"]), "-r", "1", "-o", "json",
                           # weights read through the mapping, none copied (repacked) into anonymous memory
                           "-lm", "mmap", "--repack", "0"],
                          capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        return {"ok": False, "error": f"llama-bench exit status {done.returncode}: "
                                      f"{done.stderr.strip()[-300:]}"}
    tests = json.loads(done.stdout)
    decode = next(t for t in tests if t["n_gen"] > 0)
    prefill = next((t for t in tests if t["n_prompt"] > 0), None)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"ok": True, "load_s": None, "wall_s_llama": round(wall, 1),
            "ms_per_token": decode["avg_ns"] / decode["n_gen"] / 1e6,
            "ttft_s": prefill["avg_ns"] / 1e9 if prefill else None, "decode_steps": decode["n_gen"],
            "cpu_ms_per_token": None, "bytes_per_token": None, "hit_ratio": None,
            # read from the drive by the whole run (load, warm-up, prefill, decode), 512-byte blocks
            "bytes_read_run": usage.ru_inblock * 512, "gguf": job["gguf"],
            "llama_build": decode.get("build_commit"), "tokens": None}


def llama_setup(args: argparse.Namespace, model_dir: Path, row: str) -> tuple[dict[str, Any], str | None]:
    """The job fields of a llama.cpp row, or why it is skipped (one line: how to get what is missing)."""
    import shutil

    tool = args.llama_bench or os.environ.get("LLAMA_BENCH") or shutil.which("llama-bench")
    if not tool or not Path(tool).is_file():
        return {}, ("llama-bench not found: build it from llama.cpp (cmake -B build && cmake --build build "
                    "--target llama-bench) and put it on PATH, or pass --llama-bench FILE")
    name = LLAMA_ROWS[row]
    given = getattr(args, "gguf_" + name.lower())
    gguf = Path(given) if given else model_dir.with_name(model_dir.name + ".llamacpp") / f"model-{name}.gguf"
    if not gguf.is_file():
        return {}, (f"no {name} GGUF at {gguf}: convert the checkpoint with llama.cpp's "
                    "convert_hf_to_gguf.py "
                    f"(as `moeinf bench llamacpp` does) or pass --gguf-{name.lower()} FILE")
    return {"llama_bench": str(tool), "gguf": str(gguf)}, None


# --- the driver ------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="DIR", help="HF checkpoint (e.g. from `moeinf zoo synth`)")
    parser.add_argument("--memory-cap", required=True, help="comma-separated caps, e.g. 8GiB,16GiB")
    parser.add_argument("--routing-trace", default=None, help="moeinf-rawtrace file whose routing moeinf's "
                        "rows also replay")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per row (default 2)")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens decoded per prompt (default 16)")
    parser.add_argument("--max-prompt-tokens", type=int, default=256,
                        help="longest prompt, own routing and trace prefill alike (default 256)")
    parser.add_argument("--store", default=None, help="exact store (default DIR.moeinf; packed if absent)")
    parser.add_argument("--int8-store", default=None, help="int8 store: adds the int8 row")
    parser.add_argument("--int4-store", default=None, help="int4 store: adds the int4 row")
    parser.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench (default: $LLAMA_BENCH, "
                        "else on PATH); the llama.cpp rows are skipped, saying so, without one")
    parser.add_argument("--gguf-bf16", default=None, help="bf16 GGUF of DIR (default DIR.llamacpp/"
                        "model-BF16.gguf)")
    parser.add_argument("--gguf-q8_0", default=None, help="Q8_0 GGUF of DIR (default DIR.llamacpp/"
                        "model-Q8_0.gguf, where `moeinf bench llamacpp` converts it)")
    parser.add_argument("--gguf-q4_0", default=None, help="Q4_0 GGUF of DIR (default DIR.llamacpp/"
                        "model-Q4_0.gguf)")
    parser.add_argument("--rows", default=",".join(ROWS),
                        help="rows to run, of " + ",".join(ROWS))
    parser.add_argument("--overhead", default="1.5GiB", help="memory kept out of the expert cache besides "
                        "the dense weights: process, KV cache, buffers (default 1.5GiB)")
    parser.add_argument("--accelerate-tokens", type=int, default=3, help="tokens accelerate decodes (3)")
    parser.add_argument("--no-trace-eamc", action="store_true",
                        help="replayed rows learn online from nothing, as without `moeinf trace` (default: "
                             "they get an EAMC of the trace's other requests, as `moeinf trace` of the real "
                             "model would give)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an OffloadConfig setting of the default, int8 and int4 rows (repeatable; the "
                             "value is read as JSON, else as a string), e.g. prefetch_min_probability=0.5")
    parser.add_argument("--no-trace-transitions", action="store_true",
                        help="replayed rows get the EAMC but not the expert transitions of the trace's other "
                             "requests: their look-ahead predicts nothing (the runtime before transitions)")
    parser.add_argument("--lookahead-depth", type=int, default=3,
                        help="MoE layers ahead that the replayed rows' expert transitions predict (default "
                             "3, OffloadConfig.lookahead_depth's default)")
    parser.add_argument("--rows-routing", default="own,replayed",
                        help="with --routing-trace, which routings moeinf's rows run: own, replayed or both "
                             "(default own,replayed)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of every row (default 1: on a busy 2-core machine a second "
                             "OpenMP thread spins against the I/O threads and other processes)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a row may take (default 1800)")
    parser.add_argument("--hf-reference", default=None, metavar="JSONL",
                        help="a previous run's scale.jsonl whose accelerate row (same cap) gives HF's "
                             "tokens for `tokens_match_hf` when this run has no accelerate row (accelerate's "
                             "offload folder and the exact store may not fit on the disk together)")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON object")
    parser.add_argument("--out", default=None, help="also write DIR/scale.jsonl")


def dense_bytes(store: Path) -> int:
    from moeinf.store.index import StoreIndex

    index = StoreIndex.load(store)
    return (store / index.dense).stat().st_size


def expert_bytes(store: Path) -> int:
    from moeinf.store.index import StoreIndex

    return sum(e.memory_size for e in StoreIndex.load(store).experts)


def check_trace(args: argparse.Namespace, model_dir: Path) -> None:
    """Refuse, before anything is packed or run, a routing trace that cannot serve this run: not a trace, of
    another geometry than the model's, or with fewer than --prompts requests long enough."""
    from moeinf.spec import UnsupportedModelError

    from .replay_routing import ReplayError

    try:
        trace_requests(args, model_dir, [0], [])
    except UnsupportedModelError:
        raise
    except (ValueError, ReplayError, OSError) as exc:
        raise ScaleError(f"--routing-trace: {' '.join(str(exc).split())}") from None


def trace_requests(args: argparse.Namespace, model_dir: Path, prompt_ids: list[int],
                   chosen: list[str]) -> tuple[list[Any], Any, Any, int]:
    """(the trace's routings of --prompts requests that fit the run, the model's config, its spec, its MoE
    layer count); the chosen requests' ids are appended to `chosen`."""
    from transformers import AutoConfig

    from moeinf.spec import spec_for
    from moeinf.store.source import build_skeleton

    from .trace_routing import moe_blocks, trace_routings

    config = AutoConfig.from_pretrained(str(model_dir))
    spec = spec_for(config.model_type)
    layers = len(moe_blocks(build_skeleton(config, spec)))  # on the meta device: no weights
    routings = trace_routings(args.routing_trace, num_layers=layers, num_experts=spec.num_experts(config),
                              top_k=spec.top_k(config), count=args.prompts, positions=args.new_tokens,
                              prompt_ids=prompt_ids, max_prompt=args.max_prompt_tokens, chosen=chosen)
    return routings, config, spec, layers


def replay_jobs(args: argparse.Namespace, model_dir: Path, prompt_ids: list[int], store: Path,
                eamc_path: Path | None) -> list[dict[str, Any]]:
    """The trace's routing of --prompts requests that fit the run, as JSON for the workers; with
    `eamc_path`, an EAMC of the trace's other requests written there (`trace_eamc`)."""
    from .trace_routing import trace_eamc

    chosen: list[str] = []
    routings, config, spec, layers = trace_requests(args, model_dir, prompt_ids, chosen)
    if eamc_path is not None:
        from moeinf.store.fingerprint import fingerprint

        eamc = trace_eamc(args.routing_trace, set(chosen), fingerprint=fingerprint(store),
                          top_k=spec.top_k(config))
        eamc.save(eamc_path)
        what = f"EAMC of the trace's other requests ({eamc.capacity} entries)"
        if not args.no_trace_transitions:
            transitions = trace_transitions(args.routing_trace, set(chosen), fingerprint=fingerprint(store),
                                            eamc_path=eamc_path, num_layers=layers,
                                            num_experts=spec.num_experts(config), depth=args.lookahead_depth)
            what += f" and their expert transitions ({transitions.depth} layers ahead)"
        print(f"scale: {what} for the replayed rows", file=sys.stderr, flush=True)
    return [{"ids": r.token_ids.tolist(), "prompt_length": r.prompt_length, "index": r.index.tolist(),
             "weights": r.weights.tolist()} for r in routings]


def trace_transitions(path: str | Path, exclude: set[str], *, fingerprint: str, eamc_path: Path,
                      num_layers: int, num_experts: int, depth: int) -> Any:
    """The expert transitions (moeinf/policy/lookahead.py) of the trace's requests but `exclude`, written
    beside the EAMC at `eamc_path`, where the runtime's look-ahead loads them: from the routing alone, the
    prediction the replayed rows keep once the model's own routers are detached."""
    from moeinf.policy.lookahead import JOINED, Transitions
    from moeinf.runtime.lookahead import save_transitions, transitions_path
    from moeinf.trace.rawtrace import read_raw

    from .trace_routing import trace_positions

    routings = [trace_positions(trace)[1] for trace in read_raw(path) if trace.id not in exclude]
    # counts JOINED - 1 layers deeper, so that a prediction `depth` ahead still joins JOINED layers
    transitions = Transitions.fit(routings, num_layers, num_experts, depth + JOINED - 1, sources=JOINED)
    save_transitions(transitions, transitions_path(eamc_path), fingerprint=fingerprint)
    return transitions


def worker_main(job_path: str) -> int:
    """The child of `run_capped`: run the row described in `job_path`, print its result as one JSON line."""
    try:
        row = worker(json.loads(Path(job_path).read_text()))
    except Exception as exc:  # reported in the row: the driver goes on with the next one
        row = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(row), flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    import signal

    def terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # unwinds through run_capped: the worker is killed, the cgroup removed

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        return drive(args)
    except ScaleError as exc:
        print(f"moeinf bench scale: error: {exc}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)


def drive(args: argparse.Namespace) -> int:
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        raise ScaleError(f"{model_dir} has no config.json; pass a checkpoint directory (moeinf zoo synth)")
    caps = [parse_bytes(c) for c in args.memory_cap.split(",") if c.strip()]
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        raise ScaleError(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    if args.routing_trace and not Path(args.routing_trace).is_file():
        raise ScaleError(f"--routing-trace {args.routing_trace}: no such file")
    counts = ("prompts", "new_tokens", "max_prompt_tokens", "accelerate_tokens", "threads")
    problem = count_problem(args, positive=counts, non_negative=("lookahead_depth",))
    if problem:
        raise ScaleError(problem)
    if not caps or min(caps) < 1 << 30:
        raise ScaleError(f"--memory-cap {args.memory_cap}: give caps of 1GiB or more (a process holding a "
                         "model's dense weights needs at least that)")
    if args.routing_trace:
        check_trace(args, model_dir)
    why = cgroups_writable()
    if why is not None:
        raise ScaleError(why)
    store = Path(args.store) if args.store else model_dir.with_name(model_dir.name + ".moeinf")
    stores = {"default": store, "on-demand-lru": store, "int8": args.int8_store, "int4": args.int4_store}
    overhead = parse_bytes(args.overhead)
    if any(row in ("default", "on-demand-lru") for row in rows):
        if not (store / "moeinf-store.json").is_file():
            print(f"scale: packing {model_dir} into {store}", file=sys.stderr, flush=True)
            from moeinf.store import pack

            pack(model_dir, store)
        dense, experts = dense_bytes(store), expert_bytes(store)
    else:  # accelerate or quantised rows only: the sizes from the checkpoint's skeleton, no exact store
        from .accelerate_baseline import plan_device_map

        plan = plan_device_map(model_dir, 0.0)[1]
        dense, experts = plan["dense_bytes"], plan["expert_bytes"]
    inputs = own_prompts(model_dir, args.prompts, args.max_prompt_tokens)
    eamc_dir = Path(tempfile.mkdtemp(prefix="moeinf-scale-eamc-"))
    try:
        return _drive(args, model_dir, caps, rows, store, stores, overhead, dense, experts, inputs, eamc_dir)
    finally:
        shutil.rmtree(eamc_dir, ignore_errors=True)


def _drive(args: argparse.Namespace, model_dir: Path, caps: list[int], rows: list[str], store: Path,
           stores: dict[str, Any], overhead: int, dense: int, experts: int, inputs: list[list[int]],
           eamc_dir: Path) -> int:
    eamc_path = None if args.no_trace_eamc else eamc_dir / "trace.eamc"
    packed = [Path(p) for p in (store, stores["int8"], stores["int4"])
              if p and (Path(p) / "moeinf-store.json").is_file()]
    routings = (replay_jobs(args, model_dir, inputs[0], packed[0] if packed else model_dir, eamc_path)
                if args.routing_trace else None)
    results: list[dict[str, Any]] = []
    chosen = settings(args.set)
    header = {"model_dir": str(model_dir), "store": str(store), "dense_bytes": dense, "expert_bytes": experts,
              "prompts": args.prompts, "new_tokens": args.new_tokens, "threads": args.threads,
              "routing_trace": args.routing_trace, "overhead_bytes": overhead,
              "trace_eamc": bool(routings) and eamc_path is not None,
              "settings": chosen,
              "trace_transitions": bool(routings) and eamc_path is not None and not args.no_trace_transitions}
    for cap in caps:
        budget = cap - dense - overhead
        if budget <= 0:
            print(f"scale: cap {gib(cap)} leaves nothing for experts beside {gib(dense)} of dense weights "
                  f"and {gib(overhead)} overhead; skipped", file=sys.stderr)
            continue
        for row in rows:
            own_only = row == "accelerate" or row in LLAMA_ROWS
            routing_modes = ["own"] + (["replayed"] if routings and not own_only else [])
            if not own_only and routings:
                routing_modes = [m for m in routing_modes if m in args.rows_routing.split(",")]
            if row in ("int8", "int4") and not stores[row]:
                continue
            for routing in routing_modes:
                job = {"row": row, "model_dir": str(model_dir), "store": str(stores.get(row) or store),
                       "device_cache": int(budget), "threads": args.threads, "new_tokens": args.new_tokens,
                       "inputs": inputs}
                if row in ("default", "int8", "int4") and chosen:
                    job["settings"] = chosen
                if row == "accelerate":
                    job.update(new_tokens=args.accelerate_tokens, inputs=inputs[:1],
                               expert_fraction=min(budget / experts, 1.0),
                               offload_folder=str(model_dir.with_name(f"{model_dir.name}.accelerate-offload")))
                if routing == "replayed":
                    job.update(routings=routings, inputs=[r["ids"][: r["prompt_length"]] for r in routings])
                    if eamc_path is not None:
                        job["eamc"] = str(eamc_path)
                short = None
                if row in LLAMA_ROWS:
                    fields, short = llama_setup(args, model_dir, row)
                    job.update(fields, inputs=inputs[:1])
                print(f"scale: {row} ({routing} routing) under {gib(cap)}", file=sys.stderr, flush=True)
                if row == "accelerate":
                    short = disk_shortfall(job, experts, budget)
                if short is not None:
                    result = {"ok": False, "skipped": True, "error": short, "peak_bytes": 0, "killed": False}
                else:
                    drop = [Path(job["gguf"])] if row in LLAMA_ROWS else [model_dir, Path(job["store"])]
                    result = run_capped(cap, job, name=f"moeinf-scale-{os.getpid()}", timeout=args.timeout,
                                        drop=drop)
                result = {"config": row, "cap_bytes": cap, "routing": routing,
                          "device_cache_bytes": int(budget) if row != "accelerate" else None, **result}
                results.append(result)
                if args.out:  # each row as it lands: a long run stopped midway keeps what it measured
                    folder = Path(args.out)
                    folder.mkdir(parents=True, exist_ok=True)
                    with open(folder / "scale.partial.jsonl", "a") as f:
                        f.write(json.dumps({**header, **result}) + "\n")
                print(f"scale: {row} ({routing}) {gib(cap)}: {fmt(result.get('ms_per_token'), '.0f')} "
                      "ms/token, "
                      f"ttft {fmt(result.get('ttft_s'), '.1f')} s, peak {gib(result['peak_bytes'])}"
                      + (f", error: {result['error']}" if not result.get("ok") else ""),
                      file=sys.stderr, flush=True)
    annotate(results, hf_reference(args.hf_reference))
    if args.out:
        folder = Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "scale.jsonl", "w") as f:
            for row in results:
                f.write(json.dumps({**header, **row}) + "\n")
        plot(folder / "scale.png", results)
        (folder / "scale.partial.jsonl").unlink(missing_ok=True)
    if args.json:
        print(json.dumps({**header, "results": results}))
    else:
        print(table(results))
    return 0


def settings(pairs: list[str]) -> dict[str, Any]:
    """--set KEY=VALUE pairs as OffloadConfig fields (values parsed as JSON where they parse)."""
    try:
        return offload_settings(pairs)
    except ValueError as exc:
        raise ScaleError(f"--set {exc}") from None


def disk_shortfall(job: dict[str, Any], experts: int, budget: int) -> str | None:
    """Why accelerate cannot run here (its offload folder would not fit on the disk), or None.

    transformers fuses per-expert checkpoint tensors at load, so accelerate writes every expert layer it
    offloads to its folder: about the expert bytes beyond the budget."""
    import shutil

    folder = Path(job["offload_folder"])
    need = int((experts - budget) * 1.05)
    free = shutil.disk_usage(folder.parent).free
    if free >= need:
        return None
    return (f"accelerate would write ~{need / 1e9:.1f} GB of offloaded experts to {folder}, and "
            f"{free / 1e9:.1f} GB are free there: free disk or drop the row (--rows)")


def hf_reference(path: str | None) -> list[dict[str, Any]]:
    """The accelerate rows of a previous run's scale.jsonl (--hf-reference), marked as coming from there."""
    if path is None:
        return []
    if not Path(path).is_file():
        raise ScaleError(f"--hf-reference {path}: no such file")
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    found = [{**r, "hf_reference": str(path)} for r in rows
             if r.get("config") == "accelerate" and r.get("ok")]
    if not found:
        raise ScaleError(f"--hf-reference {path}: no accelerate row that ran")
    return found


def annotate(results: list[dict[str, Any]], reference: list[dict[str, Any]] | None = None) -> None:
    """`tokens_match_hf`: the exact rows' first-prompt tokens against accelerate's (HF's) of the same cap,
    from this run or else from `reference` (--hf-reference: a previous run's accelerate rows)."""
    accelerate = [r for r in results if r["config"] == "accelerate" and r.get("ok")]
    for row in results:
        if row["config"] in ("default", "on-demand-lru") and row["routing"] == "own" and row.get("ok"):
            ref = next((r for r in accelerate + list(reference or []) if r["cap_bytes"] == row["cap_bytes"]),
                       None)
            if ref is not None:
                n = len(ref["tokens"][0])
                row["tokens_match_hf"] = row["tokens"][0][:n] == ref["tokens"][0]
                if "hf_reference" in ref:
                    row["hf_reference"] = ref["hf_reference"]


def plot(path: Path, results: list[dict[str, Any]]) -> None:
    """ms/token against the cap, one line per system (config and routing); killed or failed rows left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[str, list[tuple[float, float]]] = {}
    for row in results:
        if row.get("ok") and row.get("ms_per_token") is not None:
            label = f"{row['config']} ({row['routing']} routing)"
            lines.setdefault(label, []).append((row["cap_bytes"] / 2**30, row["ms_per_token"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in sorted(lines.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.set_xlabel("memory cap (GiB, process + page cache)")
    ax.set_ylabel("decode ms/token (median)")
    ax.set_yscale("log")
    ax.set_title("a model bigger than the machine, under a memory cgroup")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(results: list[dict[str, Any]]) -> str:
    lines = [f"{'config':<14} {'routing':<9} {'cap':>8} {'ms/token':>9} {'ttft s':>7} {'peak':>9} "
             f"{'MB/token':>9} {'hit':>5}  note"]
    for r in results:
        bpt = r.get("bytes_per_token")
        lines.append(f"{r['config']:<14} {r['routing']:<9} {gib(r['cap_bytes']):>8} "
                     f"{fmt(r.get('ms_per_token'), '.0f'):>9} {fmt(r.get('ttft_s'), '.1f'):>7} "
                     f"{gib(r['peak_bytes']):>9} {fmt(bpt / 1e6 if bpt is not None else None, '.0f'):>9} "
                     f"{fmt(r.get('hit_ratio'), '.2f'):>5}  {r.get('error', '')}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == WORKER_FLAG:
        sys.exit(worker_main(sys.argv[2]))
    parser = argparse.ArgumentParser(prog="moeinf bench scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
