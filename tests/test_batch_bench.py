"""`moeinf bench batch-throughput` runs end to end on a tiny model and reports every row it measured."""

from __future__ import annotations

import json
from pathlib import Path

from moeinf.cli import main


def test_batch_throughput_rows_on_a_tiny_model(tiny_model_dir, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MOEINF_CACHE", str(tmp_path / "cache"))
    model = tiny_model_dir("qwen3_moe")
    code = main(
        [
            "bench",
            "batch-throughput",
            "--model",
            str(model),
            "--offload-dir",
            str(tmp_path / "store"),
            "--prompts",
            "6",
            "--new-tokens",
            "3",
            "--prompt-chars",
            "12",
            "--group-prompts",
            "6",
            "--grid",
            "2",
            "--grid-prompts",
            "2",
            "--skip",
            "group",
            "--one-prompts",
            "1",
            "--serve-prompts",
            "3",
            "--accelerate-prompts",
            "0",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert code == 0
    lines = [json.loads(x) for x in (tmp_path / "out" / "batch_throughput.jsonl").read_text().splitlines()]
    header, rows = lines[0], {r["row"]: r for r in lines[1:]}
    assert header["bench"] == "batch-throughput" and header["rates"]["drive_bps"] > 0
    assert set(rows) == {
        "batch-plan",
        "one-at-a-time",
        "serve-continuous",
        "grid-2-pipeline",
        "grid-2-nopipe",
    }
    assert rows["batch-plan"]["tokens"] == 6 * 3 and rows["serve-continuous"]["tokens"] == 3 * 3
    assert rows["one-at-a-time"]["batch_size"] == 1 and rows["grid-2-nopipe"]["pipeline"] is False
    assert all(r["tokens_per_s"] > 0 for r in rows.values())
    assert all(r["predicted_tokens_per_s"] > 0 for name, r in rows.items() if name != "serve-continuous")
