"""llama.cpp beside moeinf on the same checkpoint, prompts, token counts and threads.

The checkpoint is converted to GGUF by llama.cpp's own converter (`convert_hf_to_gguf.py` of a llama.cpp
source tree, --llama-cpp-dir; the llama-cpp-python sdist vendors one) in bf16, then quantised to Q8_0 and
Q4_0 by llama.cpp (`llama_model_quantize`). Both systems are fed the same token ids (the model's own
tokenizer, chat-formatted held-out prompts) and decode greedily; a token's time is one decode step
(llama.cpp: one `eval` of the previous token; moeinf: the gap between consecutive decode steps of
`generate`), prefill excluded, medians reported.

(a) all in RAM: llama.cpp bf16 / Q8_0 / Q4_0 against moeinf's exact / int8 / int4 stores with every
    expert resident (device_cache 100%). Both stay open and decode the prompts in turn, --rounds times; each
    round's ratio is taken within the round (a shared machine's speed drifts), the median round reported.
(b) equal DRAM, at each --budgets share of the bf16 expert bytes (--budget-basis store: of the quantised
    store's own expert bytes, so "25%" of an int4 model is 25% of that model): llama.cpp reads its GGUF
    through mmap while a helper process mlocks all of the machine's available memory but the budget (and
    llama.cpp's own buffers), so the page cache can hold only what moeinf may hold; moeinf gets the same
    budget in bytes. llama.cpp loads with `--no-repack` here (`NoRepackLlama`): by default its CPU backend
    copies Q4_0 weights into anonymous memory at load, which no page-cache bound limits (--repack-in-b keeps
    that default). The lock lives only while llama.cpp decodes (and at most --hold-timeout seconds). Where
    memory cannot be locked (mlock not permitted, or less available memory than the budget) the benchmark
    refuses (b) with a message and runs (a) only.

llama-cpp-python is an optional extra: pip install 'moeinf[llamacpp]' (it compiles llama.cpp).

  moeinf bench llamacpp full --llama-cpp-dir ~/src/llama.cpp --prompts 4 --new-tokens 32 --threads 2
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from .common import machine, write_jsonl

# precision -> (GGUF file type name, llama.cpp ftype constant name, moeinf store quantisation)
PRECISIONS: dict[str, tuple[str, str, str]] = {
    "bf16": ("BF16", "", "none"),
    "int8": ("Q8_0", "LLAMA_FTYPE_MOSTLY_Q8_0", "int8"),
    "int4": ("Q4_0", "LLAMA_FTYPE_MOSTLY_Q4_0", "int4"),
}
# Run in a subprocess: llama.cpp's converter, told to accept a pre-tokenizer it does not know. Both systems
# are fed token ids, so llama.cpp's text tokenisation (what the pre-tokenizer decides) is never used.
#
# DeepSeek without q-LoRA (q_lora_rank null: one q_proj, as in DeepSeek-V2-Lite and the zoo model): the
# converter then writes no `deepseek2.attention.q_lora_rank`, and llama.cpp's loader
# (src/models/deepseek2.cpp, load_arch_hparams) requires that key unless the model has 26 or 27 layers
# (how it recognises the "lite" models), so any other depth fails to load ("key not found in model:
# deepseek2.attention.q_lora_rank"), and the quantiser, which loads the same way, fails too. Its tensor
# loader and graph already take the plain q_proj when the rank is 0 (`q_lora_rank > 0`, `layers[il].wq`),
# so the converter is made to write the key as 0. And transformers' DeepSeek-V3 config carries no
# `scoring_func`, so the converter writes no gating function and llama.cpp falls back to softmax routing;
# DeepSeek-V3 routes by sigmoid (plus the correction bias), which is written for it.
CONVERT = """
import sys
root = sys.argv[1]
sys.path[:0] = [root, root + "/gguf-py"]
import convert_hf_to_gguf
from conversion import base, deepseek
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
parameters = deepseek.DeepseekV2Model.set_gguf_parameters
def set_gguf_parameters(self):
    parameters(self)
    if self.hparams.get("q_lora_rank") is None:
        self.gguf_writer.add_q_lora_rank(0)
    if self.hparams.get("model_type") == "deepseek_v3" and "scoring_func" not in self.hparams:
        self.gguf_writer.add_expert_gating_func(deepseek.gguf.ExpertGatingFuncType.SIGMOID)
deepseek.DeepseekV2Model.set_gguf_parameters = set_gguf_parameters
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert_hf_to_gguf.main()
"""
MISSING = ("llama-cpp-python is not installed; install the extra with pip install 'moeinf[llamacpp]' "
           "(it compiles llama.cpp: several minutes)")


BUDGET_BASES = ("bf16", "store")
"""What a (b) budget is a share of: the exact store's expert bytes, or the measured store's own."""


class Refusal(Exception):
    """The benchmark cannot run (a part of it) as asked; the message says why and what to change."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL",
                        help="zoo variant (full, quick...) or a checkpoint directory")
    parser.add_argument("--llama-cpp-dir", default=os.environ.get("LLAMA_CPP_DIR"),
                        help="llama.cpp source tree holding convert_hf_to_gguf.py (default: $LLAMA_CPP_DIR)")
    parser.add_argument("--work-dir", default=None,
                        help="where the GGUF files go (default: MODEL_DIR.llamacpp)")
    parser.add_argument("--store-root", default=None,
                        help="directory of moeinf's exact/int8/int4 stores, named as the runtime names them "
                             "(MODEL.moeinf, MODEL.moeinf-int8, MODEL.moeinf-int4; default: beside MODEL, so "
                             "the stores of bench quant and bench e2e are shared); packed when missing")
    parser.add_argument("--precisions", default="bf16,int8,int4", help="comma-separated subset of "
                                                                       f"{','.join(PRECISIONS)}")
    parser.add_argument("--budgets", default="25%,10%",
                        help="(b) DRAM budgets, shares of the bf16 expert bytes ('' skips (b))")
    parser.add_argument("--budget-basis", choices=BUDGET_BASES, default=BUDGET_BASES[0],
                        help="(b) what --budgets are shares of: bf16 (the exact store's expert bytes, the "
                             "same bytes at every precision) or store (each precision's own store's expert "
                             "bytes: 25%% of an int4 model is 25%% of its int4 experts)")
    parser.add_argument("--skip-all-in-ram", action="store_true", help="skip (a), run (b) only")
    parser.add_argument("--prompts", type=int, default=4, help="measured prompts")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up prompts (unmeasured)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--max-prompt-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="threads of both systems")
    parser.add_argument("--rounds", type=int, default=3,
                        help="(a): rounds of both systems decoding the measured prompts in turn, each "
                             "round's ratio within the round; the median round is reported")
    parser.add_argument("--repack-in-b", action="store_true",
                        help="(b): load llama.cpp as it loads by default, repacking the weights its CPU "
                             "backend can repack (Q4_0 with AVX2/AVX-512) into anonymous memory that mmap "
                             "does not bound; default: --no-repack (llama_model_params.use_extra_bufts = "
                             "False), so every weight is read through the mapping the hold bounds")
    parser.add_argument("--hold-timeout", type=float, default=600.0,
                        help="(b) the memory-locking helper exits after this many seconds whatever happens")
    parser.add_argument("--moeinf-config", default="{}", metavar="JSON",
                        help="OffloadConfig fields for moeinf beside the benchmark's own (offload_dir, "
                             "quant, device_cache), e.g. '{\"attention_linears\": \"model\"}' to measure "
                             "without a default; a JSON list of such objects runs moeinf once per object in "
                             "(a), beside the same llama.cpp figures ((b) takes the first); recorded in each "
                             "row")
    parser.add_argument("--out", default=None, help="also write the JSON lines to this file")


# --- GGUF --------------------------------------------------------------------------------------------
def convert(model_dir: Path, work: Path, precisions: list[str], llama_cpp_dir: str | None,
            threads: int) -> dict[str, Path]:
    """The GGUF file of each precision, converted (bf16) and quantised (Q8_0, Q4_0) when missing."""
    import llama_cpp

    bf16 = work / "model-BF16.gguf"
    # The converter writes bf16 and Q8_0 itself; Q4_0 comes from llama.cpp's quantiser.
    for name in ("BF16", "Q8_0") if "int8" in precisions else ("BF16",):
        path = work / f"model-{name}.gguf"
        if path.is_file():
            continue
        if not llama_cpp_dir or not (Path(llama_cpp_dir) / "convert_hf_to_gguf.py").is_file():
            raise Refusal("--llama-cpp-dir must name a llama.cpp source tree with convert_hf_to_gguf.py (the "
                          "llama-cpp-python sdist has one under vendor/llama.cpp)")
        print(f"converting {model_dir} to {path}...", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, "-c", CONVERT, llama_cpp_dir, str(model_dir), "--outtype",
                               name.lower(), "--outfile", str(path)], capture_output=True, text=True)
        if done.returncode != 0:
            raise Refusal(f"llama.cpp's converter failed on {model_dir}: {done.stderr.strip()[-400:]}")
    files = {}
    for precision in precisions:
        name, ftype, _ = PRECISIONS[precision]
        path = work / f"model-{name}.gguf"
        if ftype and not path.is_file():
            print(f"quantising {bf16.name} to {name}...", file=sys.stderr, flush=True)
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = getattr(llama_cpp, ftype)
            params.nthread = threads
            if llama_cpp.llama_model_quantize(str(bf16).encode(), str(path).encode(), ctypes.byref(params)):
                raise Refusal(f"llama.cpp could not quantise {bf16} to {name}")
        files[precision] = path
    return files


def dense_bytes(path: Path) -> int:
    """Bytes of the GGUF's tensors that are not routed experts (`*_exps`): attention, norms, routers,
    shared experts, embeddings; moeinf keeps their counterparts in RAM outside its budget."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors if "_exps" not in t.name)


def drop_page_cache(path: Path) -> None:
    """Evict `path` from the page cache, so a run starts cold."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _open(path: Path, context: int, threads: int, **extra: Any) -> Any:
    """llama.cpp on `path` as both measurements use it: mmap (no mlock), `threads` for decode and prompt."""
    import llama_cpp

    return llama_cpp.Llama(model_path=str(path), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                           use_mmap=True, use_mlock=False, verbose=False, seed=0, **extra)


class NoRepackLlama:
    """llama.cpp on `path` loaded as `_open` loads it, but with `llama_model_params.use_extra_bufts = False`
    (llama.cpp's `--no-repack`): the weights are computed from the mapped GGUF where they lie, not copied
    out into the CPU backend's repacked layout (anonymous memory that mmap does not bound; with AVX-512 it
    takes every Q4_0 tensor). What a llama.cpp user on a small-memory machine does. `llama_cpp.Llama`
    0.3.36 has no argument for the field and fills its model parameters inside its constructor, so this
    loads through llama.cpp's C API (llama-cpp-python's bindings, nothing patched) and offers the part of
    `Llama` that `decode_open` uses: `reset`, `eval`, `ctx`, `n_vocab`, `close`. The context is set as
    `Llama(...)` in `_open` sets it (its defaults: batch 512, no flash attention, the same YaRN values)."""

    def __init__(self, path: Path, context: int, threads: int) -> None:
        import logging

        import llama_cpp

        # llama.cpp's log goes through this logger; `Llama(verbose=False)` sets the same level
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        self._api = llama_cpp
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0
        params.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP
        params.use_extra_bufts = False
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise Refusal(f"llama.cpp could not load {path}")
        self.n_batch = min(context, 512)
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = context, self.n_batch, self.n_batch
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.yarn_attn_factor, cparams.yarn_beta_fast, cparams.yarn_beta_slow = 1.0, 32.0, 1.0
        cparams.no_perf = False
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            raise Refusal(f"llama.cpp could not make a context of {context} tokens for {path}")

    def n_vocab(self) -> int:
        return int(self._api.llama_vocab_n_tokens(self._api.llama_model_get_vocab(self.model)))

    def reset(self) -> None:
        self._api.llama_memory_clear(self._api.llama_get_memory(self.ctx), True)

    def eval(self, ids: list[int]) -> None:
        """Decode `ids` after what the context holds; the last position's logits are then in the context."""
        api = self._api
        for start in range(0, len(ids), self.n_batch):
            chunk = ids[start:start + self.n_batch]
            tokens = (api.llama_token * len(chunk))(*chunk)
            if api.llama_decode(self.ctx, api.llama_batch_get_one(tokens, len(chunk))) != 0:
                raise RuntimeError(f"llama_decode failed on {len(chunk)} tokens")

    def close(self) -> None:
        if self.ctx:
            self._api.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            self._api.llama_model_free(self.model)
            self.model = None


def open_llama(path: Path, context: int, threads: int, *, repack: bool) -> Any:
    """llama.cpp on `path` with llama.cpp's default loading (`repack`: weights the CPU backend can repack
    are copied into its layout at load) or with `--no-repack` (`NoRepackLlama`)."""
    return _open(path, context, threads) if repack else NoRepackLlama(path, context, threads)


def decode_context(prompts: list[list[int]], new_tokens: int) -> int:
    return max(len(p) for p in prompts) + new_tokens + 8


def llama_decode(path: Path, prompts: list[list[int]], warmup: int, new_tokens: int,
                 threads: int, *, repack: bool = True) -> tuple[list[float], list[list[int]]]:
    """Per-token decode seconds of the measured prompts (after `warmup`), and every prompt's greedy tokens."""
    llm = open_llama(path, decode_context(prompts, new_tokens), threads, repack=repack)
    try:
        return decode_open(llm, prompts, warmup, new_tokens)
    finally:
        llm.close()


def decode_open(llm: Any, prompts: list[list[int]], warmup: int,
                new_tokens: int) -> tuple[list[float], list[list[int]]]:
    """`llama_decode` with a llama.cpp model already open (`open_llama`, a context of at least
    `decode_context(prompts, new_tokens)` tokens)."""
    import llama_cpp
    import numpy as np

    vocab = llm.n_vocab()

    def top() -> int:
        # llama-cpp-python keeps `scores` only with logits_all; the last position's logits are in the context
        logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(vocab,))))

    latencies, outputs = [], []
    for i, ids in enumerate(prompts):
        llm.reset()
        llm.eval(ids)
        token = top()
        generated = [token]
        for _ in range(new_tokens - 1):
            start = time.perf_counter()
            llm.eval([token])
            if i >= warmup:
                latencies.append(time.perf_counter() - start)
            token = top()
            generated.append(token)
        outputs.append(generated)
    return latencies, outputs


def llama_top1_agreement(path: Path, prompts: list[list[int]], reference: list[list[int]],
                         threads: int) -> float:
    """Teacher-forced: fed each prompt and `reference`'s continuation, the share of continuation positions
    where llama.cpp's top token is the reference token (unlike greedy agreement, one early difference
    does not make the rest diverge)."""
    import numpy as np

    context = max(len(p) + len(r) for p, r in zip(prompts, reference, strict=True)) + 8
    llm = _open(path, context, threads, logits_all=True)
    same = total = 0
    try:
        for ids, ref in zip(prompts, reference, strict=True):
            llm.reset()
            llm.eval(ids + ref[:-1])
            top = np.argmax(llm.scores[len(ids) - 1: len(ids) - 1 + len(ref)], axis=1)
            same += int((top == np.asarray(ref)).sum())
            total += len(ref)
    finally:
        llm.close()
    return same / total


# --- holding DRAM equal ------------------------------------------------------------------------------
# What the first hold leaves out besides the budget and the GGUF's dense bytes: llama.cpp's own buffers
# (KV cache, compute), the code and data pages of every process running (hundreds of MiB, which a hold of
# all but the budget evicts, to everyone's harm), and room for other processes to grow (a hold of all but
# the budget plus 1 GiB was OOM-killed on the shared machine). Generous on purpose: loading the GGUF
# populates its mapping, so the first calibration round sees the excess and locks it.
HOLD_MARGIN = 2 << 30
# Calibration: warm-up prompts run under the hold, each followed by moving the hold by how far the GGUF's
# resident bytes are from the target (budget + the GGUF's dense bytes), until within the tolerance.
CALIBRATION_ROUNDS = 12
# When a round's extra lock took almost nothing from the GGUF (the kernel reclaimed other, colder page cache
# first), the next round locks the excess times a factor that doubles up to this: in the int4 25% row with
# --no-repack six rounds of excess-sized steps left the GGUF at 1.37 GB against a target of 1.25 GB.
CALIBRATION_BOOST_MAX = 8
# Free memory the calibration never locks, for other processes' allocations: locking all of it got the hold
# OOM-killed in both int4 rows (where the Q4_0 file is barely larger than the target, so little of the
# lock comes out of the GGUF's pages). The same reserve bounds every lock by what the kernel can still
# free (`reclaimable_bytes`: free memory and file pages, the GGUF's included): the calibration steps of the
# int4 10% row asked the hold for 22.4-23.0 GiB of the machine's 23.5, more than page cache and free memory
# together, and the hold faulted its pages in until the OOM killer took it (dmesg, 2026-11-25 05:06 and
# 05:07 UTC). (MemAvailable is no such bound: it counts only part of the page cache, less than the GGUF
# alone held, so a cap by it refused every row of a first try.)
HOLD_RESERVE = 256 << 20
CALIBRATION_TOLERANCE = 0.05
# The helper locks and releases on request ("+N" / "-N" bytes on stdin, answering "locked TOTAL"), and makes
# itself the OOM killer's first choice: if another process needs memory during the hold, the hold dies
# (and the row is refused) instead of the other process. It never locks more than free memory and file
# pages less the reserve given as its argument (answering "short RECLAIMABLE" instead), so a request it
# cannot meet from free memory and page cache is refused rather than OOM-killed.
HOLD = """
import ctypes, mmap, sys
libc = ctypes.CDLL(None, use_errno=True)
reserve = int(sys.argv[1])
with open("/proc/self/oom_score_adj", "w") as f:
    f.write("1000")
def available():
    with open("/proc/meminfo") as f:
        fields = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in f}
    return fields["MemFree"] + fields["Active(file)"] + fields["Inactive(file)"]
regions = []  # [mmap, address, locked bytes]
for line in sys.stdin:  # until the parent closes stdin or dies; `timeout` bounds the lifetime anyway
    n = int(line) // mmap.PAGESIZE * mmap.PAGESIZE
    if n > 0 and n > available() - reserve:
        print("short", available(), flush=True)
        continue
    if n > 0:
        region = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        address = ctypes.addressof(ctypes.c_char.from_buffer(region))
        if libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(n)) != 0:
            print("error", ctypes.get_errno(), flush=True)
            sys.exit(1)
        regions.append([region, address, n])
    n = -n
    while n > 0 and regions:
        region, address, size = regions[-1]
        cut = min(n, size)
        libc.munlock(ctypes.c_void_p(address + size - cut), ctypes.c_size_t(cut))
        libc.madvise(ctypes.c_void_p(address + size - cut), ctypes.c_size_t(cut), 4)  # MADV_DONTNEED
        regions[-1][2] -= cut
        n -= cut
        if regions[-1][2] == 0:
            regions.pop()
    print("locked", sum(r[2] for r in regions), flush=True)
"""


def check_mlock(size: int = 64 << 20) -> None:
    """Refuse (b) where this process cannot lock `size` bytes."""
    libc = ctypes.CDLL(None, use_errno=True)
    region = mmap.mmap(-1, size)
    buffer = ctypes.c_char.from_buffer(region)
    address = ctypes.c_void_p(ctypes.addressof(buffer))
    if libc.mlock(address, ctypes.c_size_t(size)) != 0:
        errno = ctypes.get_errno()
        del buffer
        region.close()
        raise Refusal(f"mlock of {size >> 20} MiB is not permitted here ({os.strerror(errno)}; "
                      f"RLIMIT_MEMLOCK {_memlock_limit()}): the page cache cannot be held to the budget, so "
                      "llama.cpp's mmap "
                      "would get more DRAM than moeinf")
    libc.munlock(address, ctypes.c_size_t(size))
    del buffer
    region.close()


def _memlock_limit() -> str:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft >> 20} MiB"


def available_bytes(field: str = "MemAvailable") -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise Refusal(f"no {field} in /proc/meminfo: cannot size the memory hold")


def reclaimable_bytes() -> int:
    """Memory the kernel can give a new lock without killing a process: free memory and file pages (clean
    page cache, the GGUF's included) less the high watermarks it keeps free."""
    file_pages = available_bytes("Active(file)") + available_bytes("Inactive(file)")
    return max(0, available_bytes("MemFree") + file_pages - high_watermarks())


def high_watermarks() -> int:
    """The kernel's high watermarks summed over zones: free memory it keeps (reclaiming above it)."""
    high = 0
    with open("/proc/zoneinfo") as f:
        for line in f:
            words = line.split()
            if len(words) == 2 and words[0] == "high":
                high += int(words[1]) * mmap.PAGESIZE
    return high


def free_slack() -> int:
    """Free memory above the kernel's high watermarks: what the page cache can still grow into before the
    kernel evicts anything (the GGUF's pages included)."""
    return max(0, available_bytes("MemFree") - high_watermarks())


class MemoryHold:
    """A helper process that mlocks `size` bytes (then more or fewer on request, `adjust`) for at most
    `timeout` seconds (context manager)."""

    def __init__(self, size: int, timeout: float) -> None:
        self.size, self.timeout = size, timeout
        self.locked = 0
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> MemoryHold:
        self.process = subprocess.Popen(["timeout", str(int(self.timeout)), sys.executable, "-c", HOLD,
                                         str(HOLD_RESERVE)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            self.adjust(self.size)
        except Refusal:
            self.__exit__()
            raise
        return self

    def adjust(self, delta: int) -> None:
        """Lock `delta` more bytes (release -delta when negative)."""
        assert self.process is not None
        try:
            self.process.stdin.write(f"{int(delta)}\n")
            self.process.stdin.flush()
            answer = self.process.stdout.readline().strip()
        except BrokenPipeError:
            answer = ""
        if answer.startswith("short "):
            raise Refusal(f"the memory hold would not lock {int(delta) >> 20} MiB more (it holds "
                          f"{self.locked >> 20} MiB): only {int(answer.split()[1]) >> 20} MiB can be freed "
                          f"and {HOLD_RESERVE >> 20} MiB must stay for the processes; memory cannot be held "
                          "equal")
        if not answer.startswith("locked "):
            code = self.process.wait(timeout=30) if not answer else None
            killed = "killed (OOM killer?)" if code in (-9, 137) else f"exit {code}"
            raise Refusal(f"the helper could not lock {(self.locked + delta) >> 20} MiB "
                          f"({answer or killed}); memory cannot be held equal")
        self.locked = int(answer.split()[1])

    @property
    def pid(self) -> int:
        """The helper's process id (the Python under `timeout`)."""
        assert self.process is not None
        try:
            children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        except OSError:  # a kernel without CONFIG_PROC_CHILDREN: `timeout`'s own figures
            return self.process.pid
        return int(children[0]) if children else self.process.pid

    def check(self) -> None:
        """Refuse the measurement if the helper died (OOM-killed or timed out) before it was released."""
        if self.process is None or self.process.poll() is not None:
            code = None if self.process is None else self.process.returncode
            raise Refusal(f"the memory hold ended early (exit {code}: OOM-killed or past --hold-timeout), so "
                          "llama.cpp may have had more than the budget")

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            try:
                self.process.stdin.close()
            except BrokenPipeError:
                pass
            self.process.wait(timeout=60)
            self.process.stdout.close()
            self.process = None


def resident_bytes(path: Path) -> int:
    """Bytes of `path` in the page cache now (mincore over a read-only mapping, which faults nothing in)."""
    import numpy as np

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
    try:
        vector = np.zeros(pages, dtype=np.uint8)
        if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size),
                        vector.ctypes.data_as(ctypes.c_void_p)) != 0:
            raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
        return int((vector & 1).sum()) * mmap.PAGESIZE
    finally:
        libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(size))


class ResidencySampler:
    """Samples `resident_bytes(path)` every `interval` seconds in a thread (context manager)."""

    def __init__(self, path: Path, interval: float = 0.5) -> None:
        self.path, self.interval = path, interval
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append(resident_bytes(self.path))

    def __enter__(self) -> ResidencySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(resident_bytes(self.path))


def calibrate(hold: MemoryHold, llm: Any, gguf: Path, target: int, prompts: list[list[int]],
              new_tokens: int) -> list[dict[str, int]]:
    """Decode one prompt at a time with `llm` (open on `gguf`) under `hold`, moving the hold after each by
    how far the GGUF's resident bytes are from `target`, until they are within CALIBRATION_TOLERANCE; the
    rounds (locked, resident, free slack, reclaimable, this process's and the hold's anonymous bytes); each
    step bounded by `lock_step`. The GGUF loses pages only once free memory is gone, so the free
    slack is locked too. `llm` stays open throughout (and for the measurement after): the free memory is
    measured with llama.cpp's own buffers allocated. (Reopening it for each round, as first written, let
    the hold lock memory the next load needed: with Q4_0 repacked into 1.3 GB of anonymous memory at
    every load, that got the hold OOM-killed in the int4 10% row.)"""
    rounds = []
    boost, last_excess = 1, 0
    for i in range(CALIBRATION_ROUNDS):
        decode_open(llm, prompts[i % len(prompts):][:1], 1, new_tokens)
        hold.check()  # a dead hold frees its memory: the slack below would be all of it
        resident, slack, reclaimable = resident_bytes(gguf), free_slack(), reclaimable_bytes()
        rounds.append({"locked": hold.locked, "resident": resident, "free_slack": slack,
                       "reclaimable": reclaimable, "anon": anonymous_bytes(),
                       "hold_anon": anonymous_bytes(hold.pid)})
        tolerance = CALIBRATION_TOLERANCE * target
        excess = resident - target
        # still above target after the last round barely moved it: other page cache went first
        stuck = excess > tolerance and last_excess > 0 and last_excess - excess < last_excess / 2
        boost = min(2 * boost, CALIBRATION_BOOST_MAX) if stuck else 1
        step = lock_step(excess, slack, reclaimable, target, tolerance, boost)
        if step is None:
            break
        hold.adjust(step)
        last_excess = excess
    return rounds


def lock_step(excess: int, slack: int, reclaimable: int, target: int, tolerance: float,
              boost: int) -> int | None:
    """How much more the hold should lock (less when negative) after a calibration round that left the GGUF
    `excess` bytes above `target` with `slack` bytes of free memory and `reclaimable` bytes the kernel can
    still free (`reclaimable_bytes`); None when the GGUF is on target. Never more than the kernel can free
    less HOLD_RESERVE (a larger lock is OOM-killed); refuses when that room is gone above target."""
    # the target is the calibration's goal, not a bound: a lock that takes the GGUF below it is released
    # next round; only memory nothing can free is a danger (the OOM killer)
    room = reclaimable - HOLD_RESERVE
    if abs(excess) <= tolerance and (slack <= tolerance + HOLD_RESERVE or room <= 0):
        return None  # on target, and no free memory left for the page cache to grow into
    step = excess * (boost if excess > 0 else 1) + max(0, slack - HOLD_RESERVE)
    if step > 0 and room <= 0:
        if excess <= tolerance:
            return None  # at or below target: what is still free is the reserve
        raise Refusal(f"the GGUF keeps {excess >> 20} MiB above its target of {target >> 20} MiB but only "
                      f"{reclaimable >> 20} MiB can be freed and {HOLD_RESERVE >> 20} MiB must stay for the "
                      "processes; memory cannot be held equal")
    return min(step, room)


def anonymous_bytes(pid: int | str = "self") -> int:
    """A process's anonymous resident bytes (RssAnon) and page tables (VmPTE): its memory that is not page
    cache, which a hold must leave room for."""
    total = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "VmPTE:")):
                    total += int(line.split()[1]) * 1024
    except FileNotFoundError:
        raise Refusal(f"process {pid} (the memory hold) ended early, so llama.cpp may have had more than the "
                      "budget") from None
    return total


# --- moeinf ------------------------------------------------------------------------------------------
def moeinf_decode(model_dir: Path, store_dir: Path, quant: str, budget: int | float,
                  inputs: list[torch.Tensor], warmup: int, new_tokens: int,
                  overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """`overrides`: further OffloadConfig fields (`--moeinf-config`)."""
    from moeinf import OffloadConfig

    from .decode_profile import profile_decode

    config = OffloadConfig.from_dict({**(overrides or {}), "offload_dir": str(store_dir), "quant": quant,
                                      "device_cache": budget})
    return profile_decode(model_dir, config, inputs[:warmup], inputs[warmup:], new_tokens)


def moeinf_overrides(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The `--moeinf-config` variants (one object or a list of them), each checked against OffloadConfig
    (a ValueError names the bad field)."""
    from moeinf import OffloadConfig

    try:
        values = json.loads(args.moeinf_config)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--moeinf-config: not JSON ({exc})") from None
    variants = values if isinstance(values, list) else [values]
    if not variants or not all(isinstance(v, dict) for v in variants):
        raise ValueError("--moeinf-config: give a JSON object of OffloadConfig fields, or a list of them")
    for variant in variants:
        reserved = sorted(set(variant) & {"offload_dir", "quant", "device_cache"})
        if reserved:
            raise ValueError(f"--moeinf-config: {reserved} are set by the benchmark itself")
        OffloadConfig.from_dict(variant)
    return variants


def prompt_ids(model_dir: Path, count: int, max_tokens: int) -> list[list[int]]:
    """Chat-formatted held-out prompts, tokenised by the model's tokenizer."""
    from moeinf.hf.tokenizer import chat_prompt, load_tokenizer
    from moeinf.zoo.corpus import HELDOUT_FILES, heldout_prompts

    tokenizer, _ = load_tokenizer(model_dir)
    examples = heldout_prompts(-(-count // len(HELDOUT_FILES)), seed=0)[:count]
    return [tokenizer.encode(chat_prompt(tokenizer, [{"role": "user", "content": ex.prompt}]))[:max_tokens]
            for ex in examples]


def run(args: argparse.Namespace) -> int:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print(f"moeinf bench llamacpp: error: {MISSING}", file=sys.stderr)
        return 2
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    unknown = sorted(set(precisions) - set(PRECISIONS))
    if unknown or not precisions:
        print(f"moeinf bench llamacpp: error: --precisions: choose from {','.join(PRECISIONS)}",
              file=sys.stderr)
        return 2
    if args.rounds < 1:
        print(f"moeinf bench llamacpp: error: --rounds must be at least 1, got {args.rounds}",
              file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    from moeinf.hub import resolve_model

    try:
        overrides = moeinf_overrides(args)
        model_dir = resolve_model(args.model).path
        work = Path(args.work_dir) if args.work_dir else model_dir.with_name(f"{model_dir.name}.llamacpp")
        work.mkdir(parents=True, exist_ok=True)
        ggufs = convert(model_dir, work, precisions, args.llama_cpp_dir, args.threads)
    except (Refusal, ValueError) as exc:
        print(f"moeinf bench llamacpp: error: {exc}", file=sys.stderr)
        return 2
    stores = store_dirs(model_dir, precisions, args.store_root)
    prompts = prompt_ids(model_dir, args.warmup + args.prompts, args.max_prompt_tokens)
    inputs = [torch.tensor([p]) for p in prompts]
    rows: list[dict[str, Any]] = []
    if not args.skip_all_in_ram:
        rows += all_in_ram(model_dir, stores, ggufs, precisions, prompts, inputs, overrides, args)
    budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    if budgets:
        rows += equal_dram(model_dir, stores, ggufs, precisions, budgets, prompts, inputs, args)
    header = {"bench": "llamacpp", "machine": machine(), "threads": args.threads, "model": str(model_dir),
              "prompts": args.prompts, "new_tokens": args.new_tokens,
              "llama_cpp_python": llama_cpp.__version__,
              "torch": torch.__version__}
    if args.out:
        write_jsonl(Path(args.out), rows, header)
    for row in rows:
        print(json.dumps({**header, **row}))
    print(f"\nmedian ms per decoded token ({args.threads} threads, {args.prompts} prompts x "
          f"{args.new_tokens} tokens):")
    for row in rows:
        print(_line(row))
    return 0


def all_in_ram(model_dir: Path, stores: dict[str, Path], ggufs: dict[str, Path], precisions: list[str],
               prompts: list[list[int]], inputs: list[torch.Tensor], overrides: list[dict[str, Any]],
               args: argparse.Namespace) -> list[dict[str, Any]]:
    """(a): at each precision (and `--moeinf-config` variant) llama.cpp and moeinf, every expert resident,
    each opened and warmed up once, decode the measured prompts in turn for `--rounds` rounds. A round's
    ratio compares the two systems' medians within that round, so the machine's drifting speed (up to 2x
    within an hour on a shared VM) mostly cancels; the row is the median round's (the lower middle one of
    an even count), with every round's figures beside it."""
    from moeinf import OffloadConfig

    from .decode_profile import decoder

    rows = []
    warm, measured = prompts[:args.warmup], prompts[args.warmup:]
    for precision in precisions:
        quant = PRECISIONS[precision][2]
        for variant in overrides:
            config = OffloadConfig.from_dict({**variant, "offload_dir": str(stores[precision]),
                                              "quant": quant, "device_cache": 1.0})
            rounds = []
            llm = open_llama(ggufs[precision], decode_context(prompts, args.new_tokens), args.threads,
                             repack=True)
            try:
                with decoder(model_dir, config, inputs[:args.warmup], args.new_tokens) as measure:
                    decode_open(llm, warm, len(warm), args.new_tokens)
                    for _ in range(args.rounds):
                        llama, llama_tokens = decode_open(llm, measured, 0, args.new_tokens)
                        ours = measure(inputs[args.warmup:])
                        rounds.append((ours["median_ms"] / (statistics.median(llama) * 1e3), llama,
                                       llama_tokens, ours))
            finally:
                llm.close()
            _, llama, llama_tokens, ours = sorted(rounds, key=lambda r: r[0])[(len(rounds) - 1) // 2]
            top1 = llama_top1_agreement(ggufs[precision], measured, ours["tokens"], args.threads)
            per_round = [{"llamacpp_ms": statistics.median(r[1]) * 1e3, "moeinf_ms": r[3]["median_ms"],
                          "moeinf_vs_llamacpp": r[0]} for r in rounds]
            rows.append(_row("a-all-in-ram", precision, "100%", llama, ours, ggufs[precision],
                             llamacpp_repack=True, moeinf_config=variant, rounds=per_round,
                             **agreement(llama_tokens, ours["tokens"]), top1_agreement=top1))
            print(_line(rows[-1]), file=sys.stderr, flush=True)
    return rows


def budget_reference(basis: str, exact: int | None, own: int) -> int:
    """The bytes a (b) budget is a share of: the exact store's expert bytes (`exact`; the measured store's
    when there is no exact store) for `basis` "bf16", the measured store's own (`own`) for "store"."""
    if basis not in BUDGET_BASES:
        raise ValueError(f"--budget-basis must be one of {BUDGET_BASES}, got {basis!r}")
    return own if basis == "store" or exact is None else exact


def equal_dram(model_dir: Path, stores: dict[str, Path], ggufs: dict[str, Path], precisions: list[str],
               budgets: list[str], prompts: list[list[int]], inputs: list[torch.Tensor],
               args: argparse.Namespace) -> list[dict]:
    """(b): each budget and precision, llama.cpp under a memory hold, moeinf with the same bytes.

    The budget is a share of the exact store's expert bytes (the same bytes at every precision, as in `bench
    quant`), or with `--budget-basis store` of the precision's own store's expert bytes. moeinf holds its
    dense weights in RAM beside the budget; llama.cpp reads them from the mapped GGUF, so llama.cpp's target
    is the budget plus the GGUF's non-expert tensor bytes (at that precision) resident in the page cache:
    the hold starts at all available memory but the target and HOLD_MARGIN, the warm-up prompts calibrate it
    (`calibrate`), and the resident bytes sampled during the measured decode are reported beside the target.
    """
    from moeinf.builder import default_offload_dir
    from moeinf.config import resolve_bytes
    from moeinf.store import Store

    try:
        check_mlock()
    except Refusal as exc:
        print(f"moeinf bench llamacpp: (b) refused: {exc}", file=sys.stderr)
        return [{"part": "b-equal-dram", "refused": str(exc)}]
    exact_dir = (Path(args.store_root) / default_offload_dir(model_dir, "none").name if args.store_root
                 else default_offload_dir(model_dir, "none"))
    exact = Store(exact_dir).expert_bytes if exact_dir.is_dir() else None
    overrides = moeinf_overrides(args)[0]
    rows = []
    for budget_text in budgets:
        for precision in precisions:
            quant = PRECISIONS[precision][2]
            own_bytes = Store(stores[precision]).expert_bytes
            reference = budget_reference(args.budget_basis, exact, own_bytes)
            budget = resolve_bytes(budget_text, reference, field="--budgets")
            gguf = ggufs[precision]
            dense = dense_bytes(gguf)
            target = budget + dense
            lock = available_bytes() - target - HOLD_MARGIN
            if lock <= 0:
                rows.append({"part": "b-equal-dram", "precision": precision, "budget": budget_text,
                             "budget_basis": args.budget_basis,
                             "refused": "less memory available than the budget"})
                continue
            drop_page_cache(gguf)
            try:
                with MemoryHold(lock, args.hold_timeout) as hold:
                    llm = open_llama(gguf, decode_context(prompts, args.new_tokens), args.threads,
                                     repack=args.repack_in_b)
                    try:
                        rounds = calibrate(hold, llm, gguf, target, prompts, args.new_tokens)
                        with ResidencySampler(gguf) as sampler:
                            llama, llama_tokens = decode_open(llm, prompts, args.warmup, args.new_tokens)
                    finally:
                        llm.close()
                    hold.check()
            except Refusal as exc:
                rows.append({"part": "b-equal-dram", "precision": precision, "budget": budget_text,
                             "budget_basis": args.budget_basis, "refused": str(exc)})
                continue
            ours = moeinf_decode(model_dir, stores[precision], quant, budget, inputs, args.warmup,
                                 args.new_tokens, overrides)
            resident = sampler.samples
            rows.append(_row("b-equal-dram", precision, budget_text, llama, ours, gguf, budget_bytes=budget,
                             budget_basis=args.budget_basis, budget_reference_bytes=reference,
                             llamacpp_repack=args.repack_in_b, moeinf_config=overrides,
                             gguf_dense_bytes=dense, target_resident_bytes=target, calibration=rounds,
                             locked_bytes=hold.locked, gguf_resident_median=int(statistics.median(resident)),
                             gguf_resident_max=max(resident),
                             **agreement(llama_tokens[args.warmup:], ours["tokens"])))
            print(_line(rows[-1]), file=sys.stderr, flush=True)
    return rows


def store_dirs(model_dir: Path, precisions: list[str], store_root: str | None) -> dict[str, Path]:
    """moeinf's store of each precision, named as the runtime names them, packed when missing."""
    from moeinf.builder import default_offload_dir
    from moeinf.store import pack
    from moeinf.store.quant import Quantization

    dirs = {}
    for precision in precisions:
        quant = PRECISIONS[precision][2]
        path = default_offload_dir(model_dir, quant)
        path = Path(store_root) / path.name if store_root else path
        print(f"packing the {quant} store of {model_dir} (if missing)...", file=sys.stderr, flush=True)
        pack(model_dir, path, quant=None if quant == "none" else Quantization.of(quant),
             progress=sys.stderr.isatty())
        dirs[precision] = path
    return dirs


def agreement(llama: list[list[int]], ours: list[list[int]]) -> dict[str, float]:
    """Greedy-token agreement of the two systems on the same prompts: the share of positions with the same
    token, and the mean length of the common prefix (once a token differs, the continuations diverge)."""
    same = total = prefix = 0
    for a, b in zip(llama, ours, strict=True):
        same += sum(x == y for x, y in zip(a, b, strict=False))
        total += max(len(a), len(b))
        prefix += next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return {"token_agreement": same / total if total else 0.0,
            "common_prefix": prefix / len(llama) if llama else 0.0}


def _row(part: str, precision: str, budget: str, llama: list[float], ours: dict[str, Any], gguf: Path,
         **extra: Any) -> dict[str, Any]:
    llama_ms = statistics.median(llama) * 1e3
    return {"part": part, "precision": precision, "gguf_type": PRECISIONS[precision][0], "budget": budget,
            "gguf_bytes": gguf.stat().st_size, "llamacpp_ms": llama_ms, "moeinf_ms": ours["median_ms"],
            "moeinf_vs_llamacpp": ours["median_ms"] / llama_ms, "moeinf_parts_ms": ours["parts_ms"],
            "moeinf_cpu_ms": ours["median_cpu_ms"], "moeinf_cpu_parts_ms": ours["cpu_parts_ms"],
            "moeinf_stats": ours["stats"], "moeinf_expert_bytes": ours["expert_bytes"], **extra}


def _line(row: dict[str, Any]) -> str:
    basis = " of the store" if row.get("budget_basis") == "store" else ""
    if "refused" in row:
        return (f"  {row['part']} {row.get('precision', '')} {row.get('budget', '')}{basis}: refused: "
                f"{row['refused']}")
    top1 = f", teacher-forced top-1 {row['top1_agreement']:.0%}" if "top1_agreement" in row else ""
    if len(row.get("rounds", ())) > 1:
        top1 += ", rounds " + " ".join(f"x{r['moeinf_vs_llamacpp']:.2f}" for r in row["rounds"])
    top1 += f", moeinf config {json.dumps(row['moeinf_config'])}" if row.get("moeinf_config") else ""
    return (f"  {row['part']:>13} {row['precision']:>5} ({row['gguf_type']}) @ {row['budget']:>4}{basis}: "
            f"llama.cpp {row['llamacpp_ms']:7.2f}  moeinf {row['moeinf_ms']:7.2f} "
            f"(CPU {row['moeinf_cpu_ms']:.2f})  "
            f"(moeinf x{row['moeinf_vs_llamacpp']:.2f}; same greedy tokens {row['token_agreement']:.0%}, "
            f"common prefix {row['common_prefix']:.1f}{top1})")
