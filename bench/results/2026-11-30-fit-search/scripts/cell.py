"""Scratch: one trace's evaluation split as `moeinf bench cache` makes it, shared by fitvar.py and probe.py."""

import os
from pathlib import Path

from moeinf.bench.cache import load_workload, split
from moeinf.policy.fitted import access_counts, request_counts
from moeinf.policy.simulate import Accesses

SH = os.environ["SHARED"] + "/data/traces/"
RES = Path(__file__).resolve().parents[2] / "2026-11-30-first-use"
FILES = {
    "dsv2lite": SH + "dsv2lite-puffin-700.jsonl.gz",
    "gptoss20b": SH + "gptoss20b-fingerprint-400.jsonl.gz",
}


def load_cell(trace, top1, seed):
    """(workload, replayed traces, EAMC-side traces, counts, first uses, replayed accesses, keys)."""
    wl = load_workload(FILES[trace], quick=False, seed=seed, top1=top1)
    ev, hist = split(len(wl.traces), 0.25, seed)
    rep = [wl.traces[i] for i in ev]
    H = [wl.traces[i] for i in hist]
    return wl, rep, H, access_counts(H), request_counts(H), Accesses.of(rep), wl.num_layers * wl.num_experts
