"""The same running-batch job on the main thread and on a thread of its own (moeinf.batch.runner), alternating,
under OMP_WAIT_POLICY=PASSIVE (as the moeinf command sets it): does the model thread still matter?"""
import os, sys, time, json
assert os.environ.get("OMP_WAIT_POLICY") == "PASSIVE"
import torch
from pathlib import Path
from moeinf import OffloadConfig
from moeinf.batch import runner
from moeinf.batch.jobs import Prompt
from moeinf.serve.backend import SamplingParams
from moeinf.serve.loader import load_backend
from moeinf.hf.tokenizer import load_tokenizer
from moeinf.bench.e2e import heldout_texts
torch.set_num_threads(1)
model = Path(os.environ['BENCH_DATA'] + '/e2e-zoo-full-2048x768')
cfg = OffloadConfig(device_cache='25%', offload_dir=os.environ['BENCH_DATA'] + '/e2e-zoo-full-2048x768.moeinf')
tok, _ = load_tokenizer(model)
prompts = sorted([Prompt(i, t[:200]) for i, t in enumerate(heldout_texts(32, 0))], key=lambda p: len(tok.encode(p.prompt)))
params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
for rep in range(2):
    for where in ('thread', 'main'):
        be = load_backend(model, cfg)
        try:
            fn = runner.run_continuous if where == 'thread' else runner._run_continuous
            args = (be.open_batch, tok, prompts, 32, params) + (() if where == 'thread' else (None, None, None))
            t = time.perf_counter(); r = fn(*args); s = time.perf_counter() - t
            st = be.forward.stats()
        finally:
            be.close()
        print(json.dumps({"where": where, "rep": rep, "seconds": round(s, 2), "tok_s": round(r.tokens / s, 2), "prefill_s": round(st["prefill_s"], 2), "decode_s": round(st["decode_s"], 2), "stall_s": round(st["stall_s"], 2)}), flush=True)
