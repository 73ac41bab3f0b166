"""Grouped vs per-expert products by tokens per expert (EPS-MoE's kernel choice), as a measured table.

For one expert geometry (hidden H, intermediate I, dtype) and a wave of `WAVE` experts, the table holds
the time per expert of
- `per_expert`: each expert's own products on its tokens (`kernels.moe`'s loop: `F.linear`, and the
  runtime's one-row kernel `kernels.bf16_rows.linear` for a single token), and
- `grouped`: the experts' weights stacked and one `bmm` per projection over tokens padded to the
  wave's largest count (`ExpertKernel.many`), stacking copy included,
at tokens per expert 1, 2, 4, ... `MAX_TOKENS`. At few tokens the products are bound by reading the
weights and grouping saves the per-call overhead; at many tokens the copy matters less than the GEMM.
Where the crossover lies depends on the shapes and the CPU, so it is measured, stored as JSON (like
vLLM's tuned fused-MoE configs, one file per shape, dtype and thread count) and looked up: shipped
tables in `moeinf/batch/tables/`, else `$MOEINF_CACHE/batch/`, else measured now and cached there.
"""

from __future__ import annotations

import json
import math
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

TABLES_DIR = Path(__file__).parent / "tables"
WAVE = 8
"""Experts per measured wave (a batch step's resident experts of one layer run in waves)."""
MAX_TOKENS = 256
REPEATS = 5
"""The fastest of this many runs (the machine may be shared: the minimum is the least disturbed)."""


@dataclass(frozen=True)
class KernelRow:
    tokens: int
    """Tokens per expert."""
    per_expert_s: float
    """Seconds per expert, each expert's own products."""
    grouped_s: float
    """Seconds per expert, stacked weights and one bmm per projection."""


@dataclass(frozen=True)
class KernelTable:
    hidden: int
    intermediate: int
    dtype: str
    threads: int
    machine: str
    rows: list[KernelRow]

    def seconds(self, tokens: float, kernel: str) -> float:
        """Seconds per expert at `tokens` tokens per expert (log-linear between measured points, linear in
        tokens beyond the last)."""
        points = sorted(self.rows, key=lambda r: r.tokens)
        value = (lambda r: r.per_expert_s) if kernel == "per_expert" else (lambda r: r.grouped_s)
        tokens = max(tokens, 1.0)
        if tokens >= points[-1].tokens:
            return value(points[-1]) * tokens / points[-1].tokens
        for low, high in zip(points, points[1:], strict=False):
            if low.tokens <= tokens <= high.tokens:
                w = (math.log(tokens) - math.log(low.tokens)) / (math.log(high.tokens) - math.log(low.tokens))
                return value(low) * (1 - w) + value(high) * w
        return value(points[0])

    def best(self, tokens: float) -> str:
        """'grouped' or 'per_expert': the faster at `tokens` tokens per expert."""
        grouped = self.seconds(tokens, "grouped") < self.seconds(tokens, "per_expert")
        return "grouped" if grouped else "per_expert"

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n")
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> KernelTable:
        data = json.loads(path.read_text())
        return cls(**{**data, "rows": [KernelRow(**r) for r in data["rows"]]})


def table_name(hidden: int, intermediate: int, dtype: str, threads: int) -> str:
    return f"experts-H{hidden}-I{intermediate}-{dtype}-t{threads}.json"


def measure(hidden: int, intermediate: int, dtype: str, *, max_tokens: int = MAX_TOKENS) -> KernelTable:
    """Time both kernels on random weights of this geometry. The repeats sweep all token counts in turn
    (a burst of load then spoils one point of each sweep, not every repeat of one point), each point keeps
    its fastest run, and a point slower than a larger token count's is lowered to it (more tokens never
    cost less)."""
    from moeinf.kernels.bf16_rows import linear as row_linear

    torch_dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    gate_up = [torch.randn(2 * intermediate, hidden, generator=g).to(torch_dtype) for _ in range(WAVE)]
    down = [torch.randn(hidden, intermediate, generator=g).to(torch_dtype) for _ in range(WAVE)]
    counts = [1 << i for i in range(max_tokens.bit_length()) if 1 << i <= max_tokens]
    inputs = {t: torch.randn(WAVE, t, hidden, generator=g).to(torch_dtype) for t in counts}

    def per_expert(x: torch.Tensor) -> None:
        product = row_linear if x.shape[1] == 1 else F.linear
        for e in range(WAVE):
            h = product(x[e], gate_up[e])  # [t, 2I]
            gate, up = h.chunk(2, dim=-1)
            product(F.silu(gate) * up, down[e])  # [t, H]

    def grouped(x: torch.Tensor) -> None:
        h = torch.bmm(x, torch.stack(gate_up).transpose(1, 2))  # [G, t, 2I]
        gate, up = h.chunk(2, dim=-1)
        torch.bmm(F.silu(gate) * up, torch.stack(down).transpose(1, 2))  # [G, t, H]

    best = {(t, k): math.inf for t in counts for k in ("per_expert", "grouped")}
    with torch.inference_mode():
        for _ in range(REPEATS):
            for t in counts:
                for kind, fn in (("per_expert", per_expert), ("grouped", grouped)):
                    start = time.perf_counter()
                    fn(inputs[t])
                    best[t, kind] = min(best[t, kind], (time.perf_counter() - start) / WAVE)
    for kind in ("per_expert", "grouped"):
        for small, large in zip(reversed(counts[:-1]), reversed(counts[1:]), strict=True):
            best[small, kind] = min(best[small, kind], best[large, kind])
    rows = [KernelRow(t, best[t, "per_expert"], best[t, "grouped"]) for t in counts]
    return KernelTable(hidden, intermediate, dtype, torch.get_num_threads(), platform.processor() or
                       platform.machine(), rows)


def lookup(hidden: int, intermediate: int, dtype: str, cache_dir: Path, *,
           measure_missing: bool = True) -> KernelTable | None:
    """The table of this geometry at the current thread count: shipped, cached, or measured and cached."""
    name = table_name(hidden, intermediate, dtype, torch.get_num_threads())
    for path in (TABLES_DIR / name, cache_dir / name):
        if path.is_file():
            return KernelTable.load(path)
    if not measure_missing:
        return None
    table = measure(hidden, intermediate, dtype)
    table.save(cache_dir / name)
    return table
