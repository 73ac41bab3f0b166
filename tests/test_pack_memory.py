"""Packing streams: peak RSS growth stays under twice the largest tensor plus 100 MB (tighter than the
300 MB promised), on a sharded Qwen3-MoE checkpoint several times larger than that bound."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moeinf.hf.tiny import tiny_config
from moeinf.spec import spec_for
from moeinf.store.source import build_skeleton

LAYERS, EXPERTS, HIDDEN, INTERMEDIATE = 4, 32, 512, 1024
SHARD_BYTES = 100 << 20
MB = 1 << 20

# Baseline: the RSS once torch, transformers, the architecture's modeling module (~120 MB of code and
# module state that building the skeleton imports, whatever the model size) and moeinf are imported.
# Writing 5 to /proc/self/clear_refs resets the peak RSS of the address space (VmHWM, KiB) to the current
# RSS, so the import-time peak cannot hide what packing adds. (ru_maxrss cannot be reset: it also keeps
# the peak seen by exited threads.)
MEASURE = """
import json, sys
import torch, transformers
import transformers.models.qwen3_moe.modeling_qwen3_moe
from moeinf.store import pack, verify

def peak():
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(status["VmHWM"].split()[0])

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return peak()

baseline = reset_peak()
pack(sys.argv[1], sys.argv[2], progress=False)
packed = peak()
verify_baseline = reset_peak()
problems = verify(sys.argv[2])
verified = peak() - verify_baseline + baseline
print(json.dumps({"baseline_kib": baseline, "pack_peak_kib": packed, "verify_peak_kib": verified,
                  "problems": len(problems)}))
"""


def checkpoint_shapes(config) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Checkpoint keys of a Qwen3-MoE model as save_pretrained writes them: experts per expert."""
    skeleton = build_skeleton(config, spec_for(config.model_type))
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for key, tensor in skeleton.state_dict().items():
        if key.endswith("mlp.experts.gate_up_proj"):
            experts, rows, cols = tensor.shape
            for e in range(experts):
                for name in ("gate_proj", "up_proj"):
                    shapes[f"{key[:-len('gate_up_proj')]}{e}.{name}.weight"] = ((rows // 2, cols),
                                                                                torch.bfloat16)
        elif key.endswith("mlp.experts.down_proj"):
            for e in range(tensor.shape[0]):
                shapes[f"{key[:-len('down_proj')]}{e}.down_proj.weight"] = (tuple(tensor.shape[1:]),
                                                                            torch.bfloat16)
        else:
            shapes[key] = (tuple(tensor.shape), torch.bfloat16)
    return shapes


def write_sharded(out: Path, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Write a sharded safetensors checkpoint of patterned bytes, one tensor in memory at a time."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, (shape, _) in shapes.items():
        nbytes = 2 * int(torch.Size(shape).numel())
        if size + nbytes > SHARD_BYTES and shards[-1]:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    weight_map = {}
    total = 0
    for number, keys in enumerate(shards):
        name = f"model-{number + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for key in keys:
            nbytes = 2 * int(torch.Size(shapes[key][0]).numel())
            header[key] = {"dtype": "BF16", "shape": list(shapes[key][0]),
                           "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[key] = name
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)
        with open(out / name, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)) + encoded)
            for i, key in enumerate(keys):
                # Small values that are valid bf16 numbers, different per tensor.
                value = torch.full(shapes[key][0], (i % 100) / 100, dtype=torch.bfloat16)
                f.write(value.view(torch.uint8).numpy().tobytes())
        total += offset
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    return total


@pytest.mark.slow
def test_pack_peak_rss_is_bounded(tmp_path: Path) -> None:
    config = tiny_config("qwen3_moe", hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE,
                         num_experts=EXPERTS, num_hidden_layers=LAYERS, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=64, dtype="bfloat16")
    src = tmp_path / "src"
    src.mkdir()
    config.save_pretrained(src)
    shapes = checkpoint_shapes(config)
    total = write_sharded(src, shapes)
    largest = max(2 * int(torch.Size(shape).numel()) for shape, _ in shapes.values())
    bound = 2 * largest + 100 * MB
    assert total > 3 * bound, "the checkpoint must dwarf the bound for the test to mean anything"
    result = subprocess.run([sys.executable, "-c", MEASURE, str(src), str(tmp_path / "store")],
                            capture_output=True, text=True, check=True)
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["problems"] == 0
    pack_growth = (figures["pack_peak_kib"] - figures["baseline_kib"]) * 1024
    verify_growth = (figures["verify_peak_kib"] - figures["baseline_kib"]) * 1024
    print(f"checkpoint {total / MB:.0f} MiB, largest tensor {largest / MB:.1f} MiB, bound {bound / MB:.0f} "
          f"MiB, baseline RSS {figures['baseline_kib'] / 1024:.0f} MiB, peak growth: pack "
          f"{pack_growth / MB:.0f} MiB, verify {verify_growth / MB:.0f} MiB")
    assert pack_growth < bound
    assert verify_growth < bound
