"""How many bits a bf16 weight's exponent carries, and what the 4-bit code keeps (run from the repository root)."""
import glob

import numpy as np
import torch
from safetensors.torch import load_file


def stats(t: torch.Tensor, name: str) -> None:
    b = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().astype(np.uint16)
    e = (b >> 7) & 0xFF
    cnt = np.bincount(e, minlength=256).astype(float)
    p = cnt[cnt > 0] / cnt.sum()
    entropy = -(p * np.log2(p)).sum()
    top15 = np.sort(cnt)[::-1][:15].sum() / cnt.sum()
    print(f"{name}: {b.size} weights, exponent entropy {entropy:.2f} bits, the 15 commonest exponents cover "
          f"{top15:.5f} (1 in {1 / max(1 - top15, 1e-9):.0f} escapes); 4-bit code {12 + (1 - top15) * 40:.2f} "
          f"bits a weight, an entropy code at best {8 + entropy:.2f}")


stats(torch.randn(2048 * 1408 * 3, generator=torch.Generator().manual_seed(0)) * 0.02,
      "random N(0, 0.02), one DeepSeek-V2-Lite expert's worth (as `moeinf zoo synth`)")
for path in sorted(glob.glob("moeinf/zoo/weights/*/model.safetensors")):
    weights = load_file(path)
    stats(torch.cat([v.flatten().float() for v in weights.values() if v.numel() > 50000]), f"trained zoo {path}")
