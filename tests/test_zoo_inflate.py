"""The inflated zoo model computes what the small one does: same greedy tokens, padded coordinates zero."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moeinf import zoo
from moeinf.cli import main
from moeinf.zoo.inflate import inflate


@pytest.fixture(scope="module")
def tiny_zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return zoo.get_model("tiny", cache_dir=tmp_path_factory.mktemp("zoo-cache"), threads=1, progress=False)


def generate(model_dir: Path, dtype: torch.dtype, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """Greedy tokens [1, P+N], logits [N, V] and the last hidden state of the prompt [P, H]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=24, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        hidden = model(ids, output_hidden_states=True).hidden_states[-2][0]
    return out.sequences, torch.cat(out.logits), hidden


# hidden x4: the norm factor sqrt(1/4) is a power of two, every scaling exact; x2 rounds sqrt(1/2) once.
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("hidden_factor", [4, 2])
def test_inflated_model_generates_the_small_models_tokens(tiny_zoo: Path, tmp_path: Path, dtype: str,
                                                          hidden_factor: int) -> None:
    config = json.loads((tiny_zoo / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["moe_intermediate_size"]
    big = inflate(tiny_zoo, tmp_path / "big", hidden=hidden * hidden_factor, moe_intermediate=inter * 3,
                  dtype=dtype)
    torch_dtype = getattr(torch, dtype)
    ids = torch.randint(3, config["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(0))
    small_tokens, small_logits, small_hidden = generate(tiny_zoo, torch_dtype, ids)
    big_tokens, big_logits, big_hidden = generate(big, torch_dtype, ids)
    assert torch.equal(small_tokens, big_tokens)
    # Padded coordinates stay exactly zero; the real ones differ only by the order of additions inside
    # kernels of another width (bit-identical logits are not promised: GEMM/mean blocking depends on K).
    assert big_hidden.shape[-1] == hidden * hidden_factor
    assert torch.count_nonzero(big_hidden[:, hidden:]) == 0
    tolerance = 1e-4 if dtype == "float32" else 5e-2
    torch.testing.assert_close(big_logits, small_logits, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(big_hidden[:, :hidden], small_hidden, atol=tolerance, rtol=tolerance)


def test_inflated_checkpoint_has_big_experts_and_adjusted_config(tiny_zoo: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    big = inflate(tiny_zoo, tmp_path / "big", hidden=128, moe_intermediate=96)
    small_config = json.loads((tiny_zoo / "config.json").read_text())
    config = json.loads((big / "config.json").read_text())
    assert (config["hidden_size"], config["moe_intermediate_size"]) == (128, 96)
    assert config["rms_norm_eps"] == pytest.approx(small_config["rms_norm_eps"] * 32 / 128)
    index = json.loads((big / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert index[name] == "experts-001.safetensors"
    with safe_open(str(big / index[name]), "pt") as f:
        down = f.get_tensor(name)
    assert down.shape == (128, 96) and down.dtype == torch.bfloat16
    assert torch.count_nonzero(down[32:]) == 0 and torch.count_nonzero(down[:, 32:]) == 0
    assert (big / "tokenizer.json").is_file()


def test_inflate_refuses_shrinking_and_a_non_empty_destination(tiny_zoo: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot shrink"):
        inflate(tiny_zoo, tmp_path / "a", hidden=16, moe_intermediate=64)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("")
    with pytest.raises(ValueError, match="not empty"):
        inflate(tiny_zoo, tmp_path / "b", hidden=64, moe_intermediate=64)


def test_cli_inflates_and_reports_mistakes_in_one_line(tiny_zoo: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "big"
    argv = ["zoo", "inflate", str(tiny_zoo), str(out), "--hidden", "64", "--moe-intermediate", "64"]
    assert main(argv) == 0
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 64
    assert main(["zoo", "inflate", str(tmp_path / "nowhere"), str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("moeinf zoo inflate: error:")
    assert "neither a directory nor a zoo variant" in err[-1]


def test_cli_destination_a_file_or_unwritable_is_one_line(tiny_zoo: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "a-file"
    afile.write_text("")
    sizes = ["--hidden", "64", "--moe-intermediate", "64"]
    assert main(["zoo", "inflate", str(tiny_zoo), str(afile), *sizes]) == 2
    assert "is a file" in capsys.readouterr().err.strip().splitlines()[-1]
    assert main(["zoo", "inflate", str(tiny_zoo), str(afile / "below"), *sizes]) == 1  # a file as a parent
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("moeinf zoo inflate: error:") and "Traceback" not in line
