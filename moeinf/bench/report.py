"""The benchmark suite behind `moeinf bench all`: runs every benchmark with its own arguments and writes
DIR/report.md.

Inputs are prepared first under DIR: a raw routing trace of the trained zoo model on held-out prompts
(`moeinf trace --raw-out`, moeinf/zoo/corpus.py HELDOUT_FILES) for the cache, prefetch and eamc
benchmarks, and, unless `--store` names one, a small packed Qwen3-MoE store for io. Each benchmark runs
as its own process (a crash or a failure is recorded and the suite goes on) and writes under DIR/<name>/;
the report gathers the machine, the exact commands, one table per benchmark and links to the plots.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from moeinf.zoo.corpus import HELDOUT_FILES, PROMPTS_DIR

SUITE = ("io", "eamc", "cache", "prefetch", "e2e", "accelerate")


@dataclass
class Step:
    """One command of the suite and what came of it."""

    name: str
    argv: list[str]
    output: Path | None = None  # stdout is saved here (benchmarks that print JSON)
    status: int | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def command(self) -> str:
        return "moeinf " + shlex.join(self.argv)


def add_suite_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small inputs: finishes in minutes")
    parser.add_argument("--out", required=True, metavar="DIR", help="results and report.md go here")
    parser.add_argument("--store", metavar="STORE_DIR",
                        help="expert store for io (default: build one in DIR)")
    parser.add_argument("--zoo", default="full", help="zoo model traced and decoded (default full)")
    parser.add_argument("--only", metavar="NAMES", help=f"comma-separated subset of {','.join(SUITE)}")
    parser.add_argument("--synthetic", action="store_true",
                        help="skip tracing the zoo model: cache/prefetch/eamc use synthetic workloads")


def build_store(out: Path, quick: bool) -> Path:
    """A packed Qwen3-MoE store with random weights (bf16), small enough to build in seconds."""
    from moeinf.hf.tiny import save_tiny
    from moeinf.store import pack

    store = out / "io-store"
    if (store / "moeinf-store.json").is_file():
        return store
    src = out / "io-store.src"
    shutil.rmtree(src, ignore_errors=True)
    layers, experts, hidden, inter = (2, 32, 512, 384) if quick else (4, 64, 1024, 768)
    save_tiny("qwen3_moe", src, dtype="bfloat16", hidden_size=hidden, moe_intermediate_size=inter,
              intermediate_size=2 * inter, num_hidden_layers=layers, num_experts=experts,
              num_experts_per_tok=4)
    pack(src, store, progress=False)
    shutil.rmtree(src)
    return store


TRACE_READERS = {"eamc", "cache", "prefetch"}


def selected(args: argparse.Namespace) -> list[str]:
    names = args.only.split(",") if args.only else list(SUITE)
    unknown = sorted(set(names) - set(SUITE))
    if unknown:
        raise SystemExit(f"moeinf bench all: error: --only names unknown benchmarks {unknown}; "
                         f"choose from {','.join(SUITE)}")
    return names


def traced(args: argparse.Namespace) -> bool:
    """Whether the suite traces the zoo model: some selected benchmark replays the trace."""
    return not args.synthetic and bool(TRACE_READERS & set(selected(args)))


def plan(args: argparse.Namespace, out: Path, zoo_dir: Path | None, store: Path | None) -> list[Step]:
    """The commands of the suite, each benchmark with its own quick or full arguments."""
    quick = args.quick
    raw = out / "traces" / "raw.jsonl"
    traces = ["--traces", str(raw)] if traced(args) else []
    steps: list[Step] = []
    if traced(args):
        steps.append(Step("trace", [
            "trace", str(zoo_dir), "--prompts", *[str(PROMPTS_DIR / f) for f in HELDOUT_FILES],
            "--out", str(out / "traces" / "zoo.eamc"), "--raw-out", str(raw),
            "--limit", "20" if quick else "80", "--max-new-tokens", "32",
            "--capacity", "16" if quick else "60"]))
    size = ["--quick"] if quick else []
    benches = {
        "io": Step("io", ["bench", "io", str(store), "--json",
                          *(["--repeats", "1", "--samples", "5"] if quick else [])], out / "io" / "io.jsonl"),
        "eamc": Step("eamc", ["bench", "eamc", *size, "--out", str(out / "eamc"), *traces,
                              *(["--capacity", "16"] if traces and quick else []),
                              *([] if quick else ["--sweep", "--shift"])]),
        "cache": Step("cache", ["bench", "cache", *size, *traces, "--out", str(out / "cache")]),
        "prefetch": Step("prefetch", ["bench", "prefetch", *size, *traces, "--out", str(out / "prefetch")]),
        "e2e": Step("e2e", ["bench", "e2e", "--model-dir", str(zoo_dir), "--prompts", "2" if quick else "8",
                            "--warmup", "1", "--new-tokens", "16" if quick else "32",
                            "--eamc-prompts", "8" if quick else "40",
                            "--out", str(out / "e2e" / "e2e.jsonl")]),
    }
    # accelerate twice: as a user would run it (page cache warm) and with memory held equal
    accelerate = ["bench", "accelerate", str(zoo_dir), "--cache", "0.25", "--prompts", "2" if quick else "8",
                  "--new-tokens", "16" if quick else "32", "--out", str(out / "accelerate"), "--json"]
    accelerate_steps = [Step("accelerate", accelerate), Step("accelerate", [*accelerate, "--drop-caches"])]
    for name in selected(args):
        steps += accelerate_steps if name == "accelerate" else [benches[name]]
    return steps


def execute(step: Step, out: Path) -> None:
    """Run one step as its own process; stdout goes to its output file or DIR/<name>/stdout.txt."""
    (out / step.name).mkdir(parents=True, exist_ok=True)
    stdout = step.output or out / step.name / "stdout.txt"
    start = time.perf_counter()
    with open(stdout, "a", encoding="utf-8") as f_out, \
            open(out / step.name / "stderr.txt", "a", encoding="utf-8") as f_err:
        step.status = subprocess.call([sys.executable, "-m", "moeinf.cli", *step.argv], stdout=f_out,
                                      stderr=f_err)
    step.seconds = time.perf_counter() - start
    if step.status != 0:
        tail = (out / step.name / "stderr.txt").read_text(encoding="utf-8", errors="replace").strip()
        last = tail.splitlines()[-1] if tail else ""
        step.notes.append(f"failed, exit status {step.status}: {last}")


def machine() -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, str] = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, rest = line.split(":", 1)
        info[key] = rest.strip()
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"), "cpus": os.cpu_count(),
            "ram": info.get("MemTotal"), "free": info.get("MemFree"), "available": info.get("MemAvailable"),
            "load_average": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": sys.version.split()[0]}


def run_suite(args: argparse.Namespace) -> int:
    """`moeinf bench all`: prepare inputs, run every benchmark, write DIR/report.md. 1 if any step failed."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    before = machine()
    names = selected(args)
    notes: list[str] = []
    zoo_dir = None
    if traced(args) or {"e2e", "accelerate"} & set(names):
        from moeinf.zoo import get_model

        zoo_dir = get_model(args.zoo, progress=False)
    store = Path(args.store) if args.store else None
    if "io" in names and store is None:
        store = build_store(out, args.quick)
        notes.append(f"io: no --store given, so a small random-weight Qwen3-MoE store was built and packed "
                     f"in {store}")
    if traced(args):
        notes.append(f"cache, prefetch and eamc replay the raw routing trace of zoo model {args.zoo!r} "
                     f"({zoo_dir}) on held-out prompts (moeinf/zoo/corpus.py HELDOUT_FILES), traced first")
    if {"e2e", "accelerate"} & set(names):
        notes.append(f"e2e and accelerate decode zoo model {args.zoo!r} (not e2e's default 30B-geometry "
                     "checkpoint), both with 25% of the expert bytes as DRAM budget, so their latencies "
                     "compare")
    steps = plan(args, out, zoo_dir, store)
    # results of an earlier suite in the same DIR would mix into the tables (benchmarks append)
    for name in dict.fromkeys(step.name for step in steps):
        shutil.rmtree(out / name, ignore_errors=True)
    from tqdm import tqdm

    # minutes of silence otherwise: one bar over the steps, named by the one running
    bar = tqdm(steps, desc="bench all", unit="step", disable=not sys.stderr.isatty())
    for step in bar:
        bar.set_description(f"bench all: {step.name}")
        execute(step, out)
        if step.name == "trace" and step.status != 0:
            notes.append("tracing failed: the benchmarks that read the raw trace fail too")
    after = machine()
    report = render(steps, out, before, after, notes, time.perf_counter() - started, args.quick)
    (out / "report.md").write_text(report, encoding="utf-8")
    return 1 if any(step.status for step in steps) else 0


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    def cell(value: Any) -> str:
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def cache_table(out: Path) -> str:
    rows = read_jsonl(out / "cache" / "cache.jsonl")
    if not rows:
        return ""
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fractions = sorted({r["cache_fraction"] for r in rows})
    hit = {(r["policy"], r["cache_fraction"]): r["hit_ratio"] for r in rows}
    workload = rows[0].get("workload")
    return (f"Hit ratio per policy and cache size (fraction of all experts), workload {workload}:\n\n"
            + md_table(["cache", *policies], [[f"{f:.0%}", *[hit.get((p, f), "") for p in policies]]
                                              for f in fractions]))


def prefetch_table(out: Path) -> str:
    rows = read_jsonl(out / "prefetch" / "prefetch.jsonl")
    if not rows:
        return ""
    return ("Recall = accesses served in time by a prefetch / accesses:\n\n" + md_table(
        ["sweep", "experts", "GB/s", "policy", "refine", "recall", "precision", "hit ratio"],
        [[r["sweep"], r["num_experts"], r["gbps"], r["policy"], r["refine"], r["recall"], r["precision"],
          r["hit_ratio"]] for r in rows]))


def eamc_table(out: Path) -> str:
    rows = read_jsonl(out / "eamc" / "eamc.jsonl")
    if not rows:
        return ""
    last = rows[-1]
    parts = [md_table(["capacity", "layers", "experts", "match_us (p50)", "match_us (p99)", "full_match_us"],
                      [[m["capacity"], m["layers"], m["experts"], m["match_us"], m["match_p99_us"],
                        m["full_match_us"]] for m in last["matching"]])]
    if "prediction" in last:
        p = last["prediction"]
        keys = [k for k in p if k.startswith("accuracy_")]
        parts.append(f"Prediction accuracy on {p['traces']} ({p['train']} train / {p['test']} test "
                     f"sequences, capacity {p['capacity']}):\n\n" + md_table(keys, [[p[k] for k in keys]]))
    return "\n\n".join(parts)


def io_table(out: Path) -> str:
    rows = read_jsonl(out / "io" / "io.jsonl")
    if not rows:
        return ""
    r = rows[-1]
    keys = [k for k in ("ratio", "ratio_vs_raw_random", "raw_gbps", "engine_gbps", "raw_random_gbps",
                        "demand_p50_ms", "demand_over_ideal", "preempt_p50_ms", "preempt_over_ideal",
                        "meets_targets") if k in r]
    return md_table(keys, [[r[k] for k in keys]])


def e2e_table(out: Path) -> str:
    rows = read_jsonl(out / "e2e" / "e2e.jsonl")
    if not rows:
        return ""
    raw = rows[-1].get("raw_bandwidth") or {}
    note = (f"Median per-token decode latency on {rows[-1].get('model_dir')}; x LRU = on-demand LRU's "
            "ms/token over the configuration's at the same cache size; /bound = ms/token over "
            "max(I/O time, compute time), I/O time = bytes read / raw O_DIRECT bandwidth "
            f"({max(raw.get('random_bps', 0), raw.get('sequential_bps', 0)) / 1e9:.2f} GB/s), compute = "
            "the faster all-in-RAM run; tokens = greedy tokens equal to the unmodified HF model's.\n\n")
    return note + md_table(
        ["config", "cache", "ms/token", "x LRU", "/bound", "MB read/token", "bytes x LRU", "hit ratio",
         "prefetch precision", "prefetch recall", "tokens"],
        [[r["config"], r.get("cache") or "all in RAM", r["median_s"] * 1000, r.get("speedup_vs_lru"),
          r.get("vs_bound"), (r["bytes_read_per_token"] / 1e6) if "bytes_read_per_token" in r else None,
          r.get("bytes_vs_lru"), r.get("hit_ratio"), r.get("prefetch_precision"), r.get("prefetch_recall"),
          r.get("tokens_match")] for r in rows])


def accelerate_table(out: Path) -> str:
    rows = read_jsonl(out / "accelerate" / "accelerate.jsonl")
    if not rows:
        return ""
    return (md_table(["drop caches", "median ms", "p90 ms", "expert layers on disk", "budget MiB",
                      "free MiB before", "free MiB after"],
                     [[r["drop_caches"], r["median_s"] * 1000, r["p90_s"] * 1000,
                       f"{r['plan']['expert_layers_on_disk']}/{r['plan']['expert_layers']}",
                       r["plan"]["max_memory_bytes"] / 2**20, r["memory_before"]["free_mib"],
                       r["memory_after"]["free_mib"]] for r in rows]) + f"\n\nNote: {rows[-1]['note']}.")


TABLES = {"io": io_table, "eamc": eamc_table, "cache": cache_table, "prefetch": prefetch_table,
          "e2e": e2e_table, "accelerate": accelerate_table}


def render(steps: list[Step], out: Path, before: dict[str, Any], after: dict[str, Any], notes: list[str],
           seconds: float, quick: bool) -> str:
    """report.md: machine, commands, one section per benchmark (table, plots, failure)."""
    lines = [f"# moeinf benchmark report ({'quick' if quick else 'full'})", "",
             f"Wall time {seconds / 60:.1f} min. Started {before['date']}, finished {after['date']}.", "",
             "## Machine", "", md_table(["", "start", "end"], [[k, before[k], after[k]] for k in before]), "",
             "The load average counts every process on the machine (other jobs share these CPUs).", ""]
    lines += [f"- {note}" for note in notes]
    lines += ["", "## Commands", "", "```"]
    lines += [f"{step.command}    # exit {step.status}, {step.seconds:.0f} s" for step in steps]
    lines += ["```", ""]
    sections: dict[str, list[Step]] = {}
    for step in steps:
        if step.name != "trace":
            sections.setdefault(step.name, []).append(step)
    for name, group in sections.items():
        lines += [f"## {name}", ""]
        for step in group:
            if step.status:
                lines += [f"**FAILED** (exit status {step.status}): `{step.command}`; see {name}/stderr.txt.",
                          ""]
            lines += [f"- {note}" for note in step.notes]
        table = TABLES[name](out)
        if table:
            lines += ["", table, ""]
        for png in sorted((out / name).glob("*.png")):
            lines.append(f"![{png.stem}]({name}/{png.name})")
        lines.append("")
    return "\n".join(lines)
