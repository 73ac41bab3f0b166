"""Split the compute (main) thread's py-spy samples of a decode window into where a token's time goes.

    python classify.py pyspy-default.txt.gz STEPS [RATE]   # raw py-spy output (`py-spy record -f raw --threads --idle`)
"""
import gzip, json, sys
from collections import Counter

def category(stack: str) -> str:
    frames = stack.split(";")
    leaf = frames[-1]
    if "Engine.wait" in leaf:
        return "stall (waiting for reads)"
    if "ExpertOutputs.compute_many" in stack or "GatedKernel" in stack or "rows_into" in stack:
        return "expert products"
    if "expand_kv" in stack:
        return "dense: attention kv expansion (kv_b_proj)"
    if "Attention.forward" in stack:
        return "dense: attention, rest"
    if "ConcatGatedMLP.forward" in stack or "DeepseekV2MLP.forward" in stack:
        return "dense: shared experts / layer-0 MLP" if "Moe.forward" in stack else "dense: layer-0 MLP"
    if "DeepseekV2ForCausalLM.forward" in stack and "Linear.forward" in leaf:
        return "dense: LM head"
    if "rms_norm" in stack or "RMSNorm" in stack:
        return "dense: norms"
    if "OffloadedExperts.forward" in stack or "moeinf/runtime" in stack or "moeinf/policy" in stack \
            or "moeinf/engine" in stack or "moeinf/store" in stack:
        return "runtime (planning, cache, eviction, dispatch)"
    if "Gate" in stack or "gate" in leaf or "router" in stack:
        return "dense: routers"
    return "other (HF generate, Python, embedding)"

path, steps = sys.argv[1], int(sys.argv[2])
rate = float(sys.argv[3]) if len(sys.argv) > 3 else 50.0
cats, other = Counter(), Counter()
for line in (gzip.open(path, "rt") if path.endswith(".gz") else open(path)):
    stack, _, n = line.rstrip().rpartition(" ")
    if "MainThread" not in stack.split(";")[0]:
        continue
    c = category(stack)
    cats[c] += int(n)
    if c.startswith("other") or c.startswith("runtime"):
        other[(c[:5], ";".join(stack.split(";")[-3:]))] += int(n)
total = sum(cats.values())
print(f"main thread: {total} samples at {rate:.0f}/s = {total / rate:.1f} s over {steps} decode steps")
print("| where | samples | share | ms/token |")
print("|---|---|---|---|")
for c, n in cats.most_common():
    print(f"| {c} | {n} | {n / total:.1%} | {n / rate / steps * 1e3:.0f} |")
if "-v" in sys.argv:
    for (c, s), n in other.most_common(25):
        print(n, c, s)
