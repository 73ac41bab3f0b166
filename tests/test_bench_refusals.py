"""A benchmark given an impossible count or share refuses at once, in one line naming the option, before it
builds, packs, fits or starts anything (each of these once ran first and failed late, or ran on)."""

from __future__ import annotations

import pytest

from moeinf.commands import bench

CASES = [
    ("soak", ["--bursts", "-1"], "--bursts must be >= 1"),
    ("soak", ["--bad-share", "2"], "--bad-share must lie in [0, 1]"),
    ("quant", ["--rounds", "0"], "--rounds must be >= 1"),
    ("quant", ["--warmup", "-1"], "--warmup must be >= 0"),
    ("ep", ["--new-tokens", "0"], "--new-tokens must be >= 1"),
    ("overhead", ["--prompt-tokens", "0"], "--prompt-tokens must be >= 1"),
    ("overhead", ["--top-k", "40"], "--top-k 40 exceeds --experts 32"),
    ("prefetch", ["--cache-fraction", "3"], "(0%, 100%], got 300%"),
    ("prefetch", ["--gbps", "0"], "--gbps, --expert-mib and --layer-ms must be > 0"),
    ("e2e", ["--cache", "500%"], "0-100%, got '500%'"),  # the old spelling: checked in run, not by argparse
    ("e2e", ["--device-cache", "500%"], "at most 100%"),
    ("exact", ["--device-cache", "min,abc"], "cannot read 'abc'"),
    ("cache", ["--seed", "-1"], "--seed: must be >= 0"),
    ("e2e", ["--seed", "-3"], "--seed: must be >= 0"),
]


@pytest.mark.parametrize("name, argv, why", CASES, ids=[f"{n}{' '.join(a)}" for n, a, _ in CASES])
def test_refused_in_one_line_before_any_work(name: str, argv: list[str], why: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = bench.run_one(name, argv)
        message = capsys.readouterr().err
    except SystemExit as exc:  # a message of its own, or argparse's (exit 2, its line on stderr)
        code = exc.code if isinstance(exc.code, int) else 1
        message = capsys.readouterr().err + ("" if isinstance(exc.code, int) else str(exc.code))
    assert code != 0
    errors = [line for line in message.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"moeinf bench {name}: error:" in errors[0] and why in errors[0], message
    assert "Traceback" not in message


@pytest.mark.parametrize("name", [n for n in bench.BENCHMARKS if n != "io"])
def test_an_out_of_the_wrong_kind_is_refused_at_parsing(name: str, tmp_path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A file where a benchmark writes a folder (or a folder where it appends to a file) failed with
    '[Errno 17] File exists' after the whole run."""
    afile = tmp_path / "notes.md"
    afile.write_text("mine\n")
    wrong, why = (tmp_path, "is a directory") if name in bench.FILE_OUT else (afile, "is a file")
    try:
        module = bench.load(name)
    except bench.MissingBenchmark:
        pytest.skip(f"{name} is not installed")
    with pytest.raises(SystemExit) as exc:
        bench.bench_parser(name, module).parse_args(["--out", str(wrong)])
    assert exc.value.code == 2 and why in capsys.readouterr().err
    assert afile.read_text() == "mine\n"


@pytest.mark.parametrize("name", ["cache", "prefetch", "io"])
def test_an_error_names_the_benchmark(name: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """Errors raised inside a benchmark (not at parsing) said 'moeinf bench: error:' without its name."""
    from moeinf.cli import main

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    argv = [str(tmp_path / "no-store")] if name == "io" else ["--traces", str(empty)]
    try:
        code = main(["bench", name, *argv])
        err = capsys.readouterr().err
    except SystemExit as exc:  # a benchmark's own one-line exit
        code, err = 1, capsys.readouterr().err + str(exc.code)
    assert code != 0 and f"moeinf bench {name}: error:" in err, err
