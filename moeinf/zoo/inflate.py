"""Inflate a trained zoo model to big-model expert geometry by zero padding, for honest benchmarks.

A zoo model's routing, hidden states and tokens are real, but its experts are tiny (hidden 128 x
intermediate 48), so reading and running them costs nothing next to a 30B-A3B expert. Padding hidden size
H -> H' and expert intermediate I -> I' with zeros gives a checkpoint whose every expert is as large as the
big model's (2048 x 768: 9.4 MB in bf16) while computing exactly what the small model computes:

- every weight gets zero rows/columns where the padding meets it (embedding columns, attention input
  columns and output rows, router columns, expert and shared-expert rows/columns), so the padded
  coordinates of the residual stream stay exactly zero and the real ones see the same sums;
- RMSNorm over the hidden size divides by sqrt(mean(x^2) + eps), and the mean now runs over H' coordinates
  of which H' - H are zero: it shrinks by r = H/H'. With eps -> eps * r the denominator shrinks by sqrt(r)
  exactly, and norm weights scaled by sqrt(r) undo it;
- transformers gives every RMSNorm of the model the one `rms_norm_eps`, including the norms over the
  (unpadded) LoRA ranks of MLA attention (`kv_a_layernorm`, `q_a_layernorm`). An RMSNorm is invariant to
  scaling its input by c when eps scales by c^2, so the rows of `kv_a_proj_with_mqa` (resp. `q_a_proj`)
  that feed it are scaled by sqrt(r) and those norms compute what they did.

When sqrt(r) is a power of two (H'/H = 4, 16, 64...; the full zoo model's 128 -> 2048 is 16) every scaling
is exact in floating point and the inflated model computes the same numbers up to the order of additions
inside kernels (see tests/test_zoo_inflate.py); other ratios round the scaled weights once.

The checkpoint is written streaming, one layer's experts at a time (the small source is read whole: it is
the big output that must never be held twice), as safetensors shards with an index.
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("deepseek_v3",)
META_FILE = "moeinf-inflate.json"
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".pt")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class Padding:
    """The target sizes and the factors that keep the real coordinates unchanged."""

    hidden: int
    hidden_to: int
    intermediate: int
    intermediate_to: int

    @property
    def ratio(self) -> float:
        """r = H / H': how much the mean of x^2 over the hidden size shrinks."""
        return self.hidden / self.hidden_to

    @property
    def norm_scale(self) -> float:
        """sqrt(r): the factor on hidden-size norm weights and on inputs of the LoRA-rank norms."""
        return math.sqrt(self.ratio)


def pad_to(tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`tensor` in the top-left corner of a zero tensor of `shape`."""
    if tuple(tensor.shape) == shape:
        return tensor
    out = tensor.new_zeros(shape)
    out[tuple(slice(0, n) for n in tensor.shape)] = tensor
    return out


# How each tensor of a DeepSeek-V3 checkpoint is inflated: (regex on the name, rule). A rule receives the
# tensor, the padding and the config and returns the inflated tensor. A name no rule matches is refused.
Rule = Callable[[torch.Tensor, Padding, dict], torch.Tensor]


def _cols(t: torch.Tensor, p: Padding, c: dict) -> torch.Tensor:  # [N, H] -> [N, H']
    return pad_to(t, (t.shape[0], p.hidden_to))


def _rows(t: torch.Tensor, p: Padding, c: dict) -> torch.Tensor:  # [H, N] -> [H', N]
    return pad_to(t, (p.hidden_to, t.shape[1]))


def _hidden_norm(t: torch.Tensor, p: Padding, c: dict) -> torch.Tensor:  # [H] -> [H'], times sqrt(r)
    return pad_to(t * p.norm_scale, (p.hidden_to,))


def _lora_input(rank_key: str) -> Rule:
    """[rank (+ rope), H] -> [.., H'] with the first `rank` rows (the ones its norm sees) times sqrt(r)."""

    def rule(t: torch.Tensor, p: Padding, c: dict) -> torch.Tensor:
        t = t.clone()
        t[: c[rank_key]] *= p.norm_scale
        return _cols(t, p, c)

    return rule


def _expert_in(width: Callable[[Padding, dict], int]) -> Rule:  # gate/up [I, H] -> [I', H']
    return lambda t, p, c: pad_to(t, (width(p, c), p.hidden_to))


def _expert_out(width: Callable[[Padding, dict], int]) -> Rule:  # down [H, I] -> [H', I']
    return lambda t, p, c: pad_to(t, (p.hidden_to, width(p, c)))


def _routed(p: Padding, c: dict) -> int:
    return p.intermediate_to


def _shared(p: Padding, c: dict) -> int:
    return p.intermediate_to * c["n_shared_experts"]


def _dense(p: Padding, c: dict) -> int:
    return c["intermediate_size"]


def _keep(t: torch.Tensor, p: Padding, c: dict) -> torch.Tensor:
    return t


RULES: list[tuple[re.Pattern[str], Rule]] = [(re.compile(pattern), rule) for pattern, rule in [
    (r"^(model\.embed_tokens|lm_head)\.weight$", _cols),
    (r"^model\.norm\.weight$", _hidden_norm),
    (r"\.(input_layernorm|post_attention_layernorm)\.weight$", _hidden_norm),
    (r"\.self_attn\.q_proj\.weight$", _cols),
    (r"\.self_attn\.q_a_proj\.weight$", _lora_input("q_lora_rank")),
    (r"\.self_attn\.kv_a_proj_with_mqa\.weight$", _lora_input("kv_lora_rank")),
    (r"\.self_attn\.(q_a_layernorm|kv_a_layernorm|q_b_proj|kv_b_proj)\.weight$", _keep),
    (r"\.self_attn\.o_proj\.weight$", _rows),
    (r"\.mlp\.gate\.weight$", _cols),
    (r"\.mlp\.gate\.e_score_correction_bias$", _keep),
    (r"\.mlp\.experts\.\d+\.(gate_proj|up_proj)\.weight$", _expert_in(_routed)),
    (r"\.mlp\.experts\.\d+\.down_proj\.weight$", _expert_out(_routed)),
    (r"\.mlp\.shared_experts\.(gate_proj|up_proj)\.weight$", _expert_in(_shared)),
    (r"\.mlp\.shared_experts\.down_proj\.weight$", _expert_out(_shared)),
    (r"\.mlp\.(gate_proj|up_proj)\.weight$", _expert_in(_dense)),
    (r"\.mlp\.down_proj\.weight$", _expert_out(_dense)),
]]
EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.")


def inflate_tensor(name: str, tensor: torch.Tensor, padding: Padding, config: dict) -> torch.Tensor:
    """The inflated `tensor` named `name` (computed in float32, so the scaling rounds once)."""
    for pattern, rule in RULES:
        if pattern.search(name):
            return rule(tensor.float(), padding, config)
    raise ValueError(f"cannot inflate tensor {name!r}: no padding rule for it (only {SUPPORTED_MODEL_TYPES} "
                     "checkpoints trained by moeinf.zoo are supported)")


def _source_tensors(src: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{src} holds no .safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def _groups(names: list[str]) -> Iterator[tuple[str, list[str]]]:
    """(shard file name, tensor names): the routed experts of each layer in their own shard, the rest in
    one: at most one layer's inflated experts are in memory at a time."""
    by_layer: dict[int, list[str]] = {}
    dense = []
    for name in names:
        match = EXPERT_RE.match(name)
        if match:
            by_layer.setdefault(int(match.group(1)), []).append(name)
        else:
            dense.append(name)
    yield "dense.safetensors", dense
    for layer in sorted(by_layer):
        yield f"experts-{layer:03d}.safetensors", by_layer[layer]


def inflate(src: str | Path, dst: str | Path, *, hidden: int, moe_intermediate: int,
            dtype: str = "bfloat16", progress: Callable[[str], None] | None = None) -> Path:
    """Write the zero-padded inflation of the checkpoint `src` (a zoo model directory) to `dst`.

    `hidden`/`moe_intermediate`: the target hidden size and routed-expert intermediate size (>= the
    source's). `dtype`: of the written weights. Tokenizer and other non-weight files are copied; the
    config gets the new sizes and `rms_norm_eps * H/H'`. Refuses a non-empty `dst`.
    """
    src, dst = Path(src), Path(dst)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    config_path = src / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{src} is not a checkpoint directory (no config.json)")
    config = json.loads(config_path.read_text())
    if config.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{src} is a {config.get('model_type')!r} model; inflate supports "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)} (the zoo models)")
    padding = Padding(config["hidden_size"], hidden, config["moe_intermediate_size"], moe_intermediate)
    if hidden < padding.hidden or moe_intermediate < padding.intermediate:
        raise ValueError(f"cannot shrink: the source has hidden {padding.hidden} and moe_intermediate "
                         f"{padding.intermediate}, the targets are {hidden} and {moe_intermediate}")
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"{dst} is a file; name a directory to write the inflated checkpoint into")
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"{dst} exists and is not empty; remove it or name another directory")
    dst.mkdir(parents=True, exist_ok=True)

    from safetensors.torch import save_file

    tensors = _source_tensors(src)
    weight_map: dict[str, str] = {}
    out_dtype = DTYPES[dtype]
    for file_name, names in _groups(sorted(tensors)):
        shard = {name: inflate_tensor(name, tensors[name], padding, config).to(out_dtype).contiguous()
                 for name in names}
        save_file(shard, str(dst / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
        if progress is not None:
            progress(f"wrote {file_name} ({sum(t.nbytes for t in shard.values()) / 1e6:.0f} MB)")
        del shard
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")

    config.update(hidden_size=hidden, moe_intermediate_size=moe_intermediate,
                  rms_norm_eps=config["rms_norm_eps"] * padding.ratio, dtype=dtype)
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for file in sorted(src.iterdir()):
        if file.is_file() and file.name != "config.json" and not file.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(file, dst / file.name)
    meta = {"source": str(src), "hidden": [padding.hidden, hidden],
            "moe_intermediate": [padding.intermediate, moe_intermediate], "dtype": dtype,
            "norm_scale": padding.norm_scale, "exact_scaling": math.log2(padding.norm_scale).is_integer()}
    (dst / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    log.info("inflated %s -> %s: %s", src, dst, meta)
    return dst
