from __future__ import annotations

import json

import numpy as np
import pytest

from moeinf.api import MoE
from moeinf.cli import main
from moeinf.config import OffloadConfig
from moeinf.policy.fitted import EvictionFit, FittedEviction, fit_path
from moeinf.store.fingerprint import fingerprint
from moeinf.trace.eamc import EAMC, EAMCMismatchError
from moeinf.trace.rawtrace import read_raw


@pytest.fixture
def prompt_files(tmp_path):
    math = tmp_path / "math.jsonl"
    chat = tmp_path / "chat.jsonl"
    math.write_text("".join(json.dumps({"id": f"m{i}", "task": "math", "prompt": f"What is {i} + {i}?"})
                            + "\n" for i in range(4)))
    chat.write_text("".join(json.dumps({"id": f"c{i}", "task": "chat", "prompt": f"Tell me about {w}."})
                            + "\n" for i, w in enumerate(["cats", "rain", "tea", "maps"])))
    return [str(math), str(chat)]


def test_trace_builds_an_eamc_and_raw_trace(tiny_model_dir, prompt_files, tmp_path, capsys) -> None:
    model_dir = tiny_model_dir("olmoe")
    out, raw = tmp_path / "t.eamc", tmp_path / "raw.jsonl"
    status = main(["trace", str(model_dir), "--prompts", *prompt_files, "--limit", "3", "--out", str(out),
                   "--capacity", "4", "--max-new-tokens", "3", "--batch-size", "4", "--raw-out", str(raw),
                   "--json", "--lookahead-depth", "0"])  # the look-ahead fit: tests/test_lookahead.py
    assert status == 0
    result = json.loads(capsys.readouterr().out)
    assert result["num_sequences"] == 6 and result["capacity"] == 4
    assert (result["layers"], result["experts"], result["top_k"]) == (3, 8, 2)
    assert result["tokenizer"] == "byte-fallback" and result["out"] == str(out)
    eamc = EAMC.load(out, fingerprint=fingerprint(model_dir))
    assert eamc.eams.shape == (4, 3, 8)
    assert eamc.meta["datasets"] == ["chat.jsonl", "math.jsonl"] and eamc.meta["num_sequences"] == 6
    assert eamc.meta["top_k"] == 2 and eamc.meta["seed"] == 0
    traces = list(read_raw(raw))
    assert [t.id for t in traces] == ["m0", "m1", "m2", "c0", "c1", "c2"]
    eams = np.stack([t.eam() for t in traces])
    for entry in eamc.eams:  # every entry is the EAM of a traced sequence
        assert any(np.array_equal(entry, e) for e in eams)
    for trace in traces:  # prompt + 2 fed-back tokens (the 3rd generated token is never fed back) x top-k
        prompt_tokens = trace.step_counts()[0, 0].sum() / 2
        assert trace.eam()[0].sum() == (prompt_tokens + len(trace.steps) - 1) * 2
    with pytest.raises(EAMCMismatchError, match="moeinf trace"):
        EAMC.load(out, fingerprint=fingerprint(tiny_model_dir("qwen3_moe")))
    # the eviction policy fitted to the traced routing, beside the EAMC, where the runtime reads it
    assert result["eviction"]["out"] == str(fit_path(out)) and result["eviction"]["requests"] == 6
    fit = EvictionFit.load(fit_path(out))
    assert (fit.num_layers, fit.num_experts, fit.top_k) == (3, 8, 2.0)
    assert len(fit.settings) == len(fit.fractions) > 0
    config = OffloadConfig(offload_dir=str(tmp_path / "store"), eamc=str(out), eviction="fitted",
                           device_cache=0.5, prefetch="none")
    with MoE(model_dir, config) as moe:
        policy = moe._runtime.cache.eviction
        assert isinstance(policy, FittedEviction) and policy.online is None
        assert policy.fit.to_json() == fit.to_json()
        assert policy.setting == fit.setting_for(policy.capacity)  # the row of the cache's own size


def test_capacity_above_sequences_is_clamped(tiny_model_dir, prompt_files, tmp_path, capsys, caplog) -> None:
    out = tmp_path / "s.eamc"
    status = main(["trace", str(tiny_model_dir("switch_transformers")), "--prompts", prompt_files[0],
                   "--limit", "2", "--out", str(out), "--capacity", "50", "--max-new-tokens", "2",
                   "--no-eviction-fit", "--lookahead-depth", "0"])
    assert status == 0
    text = capsys.readouterr().out
    assert "byte-level fallback" in text and "EAMC of 2 entries" in text
    assert "capacity 50 exceeds the 2 distinct sequences" in caplog.text
    assert "more --prompts files" in caplog.text
    meta = EAMC.load(out).meta
    assert meta["capacity"] == 2 and meta["capacity_requested"] == 50 and meta["num_layers"] == 4


def test_bad_prompt_file_names_the_line(tiny_model_dir, tmp_path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "task": "t", "prompt": "x"}\n{"id": "b"}\n')
    model = tiny_model_dir("qwen3_moe")
    capsys.readouterr()  # what building the tiny model printed
    assert main(["trace", str(model), "--prompts", str(bad), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.jsonl:2" in err[0] and '"prompt" string' in err[0]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert main(["trace", str(model), "--prompts", str(empty), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no prompt in" in err[0] and not (tmp_path / "x").exists()


def test_prompt_lines_need_only_a_prompt(tiny_model_dir, tmp_path, capsys) -> None:
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"prompt": "one two three"}\n{"prompt": "four five", "id": 7}\n')
    out = tmp_path / "plain.eamc"
    assert main(["trace", str(tiny_model_dir("qwen3_moe")), "--prompts", str(plain), "--out", str(out),
                 "--max-new-tokens", "2", "--capacity", "2", "--lookahead-depth", "0",
                 "--raw-out", str(tmp_path / "raw.jsonl.gz")]) == 0
    assert [t.id for t in read_raw(tmp_path / "raw.jsonl.gz")] == ["plain.jsonl:1", "7"]


def test_trace_uses_the_model_tokenizer_when_present(tiny_model_dir, prompt_files, tmp_path, capsys) -> None:
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir("qwen3_moe"), model_dir)
    words = ["<pad>", "<s>", "</s>", "[UNK]", "What", "is", "+", "?", "Tell", "me", "about", "."]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="</s>",
                            unk_token="[UNK]").save_pretrained(model_dir)
    assert main(["trace", str(model_dir), "--prompts", prompt_files[0], "--limit", "2", "--out",
                 str(tmp_path / "m.eamc"), "--capacity", "2", "--max-new-tokens", "2", "--json",
                 "--no-eviction-fit", "--lookahead-depth", "0"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokenizer"] == "model"
    # "What is 0 + 0?" -> 6 word-level tokens ("0" unknown); each entry counts them and the generated token
    # fed back (none if the first one was EOS), top-2, over 3 layers.
    totals = EAMC.load(tmp_path / "m.eamc").eams.sum(axis=(1, 2))
    assert set(totals.tolist()) <= {6 * 2 * 3, 7 * 2 * 3}


def test_outputs_that_would_fail_or_destroy_a_file_are_refused_before_tracing(tiny_model_dir, prompt_files,
                                                                             tmp_path, capsys) -> None:
    model = str(tiny_model_dir("qwen3_moe"))
    notes = tmp_path / "notes.md"
    notes.write_text("my notes\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    capsys.readouterr()
    cases = [(["--out", str(tmp_path)], "is a directory"),
             (["--out", str(notes)], "exists and is not an EAMC"),
             (["--out", str(blocker / "x.eamc")], "cannot be written"),
             (["--out", str(tmp_path / "t.eamc"), "--raw-out", str(notes)], "is not a raw routing trace"),
             (["--out", str(tmp_path / "t.eamc"), "--raw-out", str(tmp_path / "t.eamc")], "both name")]
    for extra, message in cases:
        assert main(["trace", model, "--prompts", *prompt_files, "--lookahead-depth", "0", *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert notes.read_text() == "my notes\n" and not (tmp_path / "t.eamc").exists()
    out, raw = tmp_path / "t.eamc", tmp_path / "raw.jsonl"
    argv = ["trace", model, "--prompts", *prompt_files, "--lookahead-depth", "0", "--max-new-tokens", "2",
            "--out", str(out), "--raw-out", str(raw)]
    assert main(argv) == 0 and main(argv) == 0  # its own outputs are replaced by a new trace
    EAMC.load(out)
    assert len(list(read_raw(raw))) == 8


def test_answers_longer_than_the_context_are_refused_before_tracing(tiny_model_dir, prompt_files, tmp_path,
                                                                    capsys) -> None:
    from moeinf.commands.options import context_length

    model_dir = tiny_model_dir("olmoe")
    limit = context_length(model_dir)
    assert limit is not None and limit > 8
    out = tmp_path / "t.eamc"
    base = ["trace", str(model_dir), "--prompts", *prompt_files, "--out", str(out)]
    assert main([*base, "--max-prompt-tokens", "8", "--max-new-tokens", str(limit - 7)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(f"with prompts of up to 8 tokens (--max-prompt-tokens) exceeds the model's "
                            f"context of {limit} tokens; use --max-new-tokens {limit - 8} or less"), err
    # a --max-prompt-tokens at the context means no cut: only the answers' length is checked
    assert main([*base, "--max-prompt-tokens", str(limit), "--max-new-tokens", str(limit)]) == 2
    assert "leaves no room for a prompt" in capsys.readouterr().err
    assert not out.exists()
