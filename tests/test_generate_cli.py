from __future__ import annotations

import json
from pathlib import Path

from moeinf.cli import main


def test_generate_prints_json_text_and_stats(tiny_model_dir, tmp_path: Path, capsys) -> None:
    model_dir = tiny_model_dir("qwen3_moe")
    code = main(["generate", str(model_dir), "--prompt", "Hello", "--max-new-tokens", "4", "--cache", "30%",
                 "--offload-dir", str(tmp_path / "store"), "--eviction", "lru", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["ids"]) == 4
    assert isinstance(report["text"], str)
    assert report["stats"]["tokens"] == 4
    assert report["stats"]["hits"] + report["stats"]["misses"] == report["stats"]["accesses"]


def test_generate_refuses_a_tiny_cache_naming_the_flag(tiny_model_dir, tmp_path: Path, capsys) -> None:
    code = main(["generate", str(tiny_model_dir("qwen3_moe")), "--prompt", "Hi", "--device-cache", "1KiB",
                 "--offload-dir", str(tmp_path / "store")])
    assert code == 2
    assert "--device-cache >=" in capsys.readouterr().err
