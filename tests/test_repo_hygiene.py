"""The repository stays a product with its lab beside it: no patches, no host paths, no run history in package
code, a README a user reads in five minutes, and every benchmark run described and indexed."""

from __future__ import annotations

import functools
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
SKIPPED_DIRS = {".git", ".venv", "build", "dist", "node_modules", "__pycache__", ".pytest_cache",
                ".ruff_cache"}
# Spelt in pieces so that this file does not match itself.
HOST_PATH = re.compile(r"(?<![\w.~$-])/(?:" + "|".join(["wo" + "rk", "ro" + "ot", "ho" + "me"]) + r")/")
RESULTS_CITATION = "bench/" + "results"


def repo_files() -> list[Path]:
    """Tracked and untracked-but-not-ignored files of the checkout (every file outside build output when
    this is not a git checkout)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=REPO, capture_output=True, check=True).stdout
        names = sorted({n for n in out.decode().split("\0") if n})
        return [REPO / n for n in names if (REPO / n).is_file()]
    except (OSError, subprocess.CalledProcessError):
        return sorted(p for p in REPO.rglob("*")
                      if p.is_file() and not SKIPPED_DIRS.intersection(p.relative_to(REPO).parts))


def text_of(path: Path) -> str | None:
    """The file's text, or None for a binary file."""
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


@functools.cache
def load_index() -> ModuleType:
    """bench/index.py (a script beside the results, not part of the package)."""
    spec = importlib.util.spec_from_file_location("bench_index", REPO / "bench" / "index.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_no_patch_files() -> None:
    patches = [p.relative_to(REPO).as_posix() for p in repo_files() if p.suffix in (".patch", ".diff")]
    assert patches == [], "patches of reverted designs belong to git history, not the tree"


def test_no_absolute_host_paths() -> None:
    found = []
    for path in repo_files():
        text = text_of(path)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if HOST_PATH.search(line):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()[:120]}")
    hint = "write $BENCH_DATA, $MOEINF_CACHE, $REPO or a relative path:\n"
    assert found == [], hint + "\n".join(found[:40])


def test_host_path_pattern() -> None:
    root = "/" + "ro" + "ot/"
    assert HOST_PATH.search(f"model at {root}.cache/x")
    assert HOST_PATH.search(f'"{root}x"')
    assert not HOST_PATH.search("$BENCH_DATA/e2e and ~/.cache/moeinf and ./work/x")


def test_no_bench_results_citation_in_package_code() -> None:
    found = []
    code = [p for root in ("moeinf", "csrc") for p in (REPO / root).rglob("*")]
    for path in sorted(code):
        if path.suffix in (".py", ".pyi", ".cpp", ".hpp", ".h", ".c") and path.is_file():
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if RESULTS_CITATION in line:
                    found.append(f"{path.relative_to(REPO)}:{number}")
    assert found == [], ("docstrings state what is true now; figures and their runs go to "
                         "docs/benchmarks.md:\n" + "\n".join(found))


def test_readme_is_short() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250
    long = [n for n, line in enumerate(lines, 1) if len(line) > 400]
    assert long == [], f"README.md lines over 400 characters: {long}"


def test_readme_links_exist() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#:]+)\)", text)
    missing = [t for t in targets if not (REPO / t).exists()]
    assert targets and missing == []


def test_every_run_has_a_readme_with_its_index_fields() -> None:
    index = load_index()
    folders = index.run_folders()
    assert folders, "bench/results holds no run"
    results = REPO / "bench" / "results"
    strays = [p.name for p in results.iterdir() if p.is_dir() and p not in folders]
    assert strays == [], f"folders of bench/results not named <date>-<name>: {strays}"
    for folder in folders:
        run = index.read_run(folder)  # raises naming the folder and the missing README or field
        assert run.benchmarks, f"{folder.name}: no benchmark named"
        assert re.match(r"^[0-9a-f]{7,40} \(\d{4}-\d{2}-\d{2}\)$", run.fields["Added"]), folder.name


def test_index_is_current() -> None:
    index = load_index()
    written = (REPO / "bench" / "results" / "INDEX.md").read_text(encoding="utf-8")
    assert written == index.build(), "bench/results/INDEX.md is stale: run `python bench/index.py`"


def write_run(results: Path, name: str, benchmarks: str, extra: str = "") -> None:
    (results / name).mkdir(parents=True)
    (results / name / "README.md").write_text(
        f"# {name}\n\ntext\n{extra}\n## Index\n\n- Headline: {name} figure\n- Machine: m\n"
        f"- Command: `moeinf bench x`\n- Benchmarks: {benchmarks}\n- Added: abc1234 (2026-11-22)\n",
        encoding="utf-8")


def test_index_marks_the_latest_run_of_each_benchmark_current(tmp_path: Path) -> None:
    index = load_index()
    results = tmp_path / "bench" / "results"
    write_run(results, "2026-11-22-e2e", "e2e, io")
    write_run(results, "2026-11-22-e2e-final", "e2e")
    write_run(results, "2026-11-23b-io", "io")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "benchmarks.md").write_text("see bench/results/2026-11-22-e2e-final.\n",
                                                     encoding="utf-8")
    text = index.build(results, tmp_path)
    rows = {line.split("]")[0][3:]: line for line in text.splitlines() if line.startswith("| [")}
    first, final = rows["2026-11-22-e2e"], rows["2026-11-22-e2e-final"]
    assert ("e2e: superseded by [2026-11-22-e2e-final](2026-11-22-e2e-final/); "
            "io: superseded by [2026-11-23b-io](2026-11-23b-io/)") in first
    assert "e2e: current" in final and "`docs/benchmarks.md`" in final
    assert first.endswith("| - |")  # a longer name is another run, not a citation
    assert "| e2e | [2026-11-22-e2e-final]" in text and "| io | [2026-11-23b-io]" in text


def test_index_refuses_a_run_without_its_fields(tmp_path: Path) -> None:
    index = load_index()
    results = tmp_path / "results"
    (results / "2026-11-22-io").mkdir(parents=True)
    with pytest.raises(ValueError, match="2026-11-22-io: no README.md"):
        index.build(results, tmp_path)
    readme = results / "2026-11-22-io" / "README.md"
    readme.write_text("# io\n\n## Index\n\n- Headline: h\n", encoding="utf-8")
    with pytest.raises(ValueError, match="lacks Machine, Command, Benchmarks, Added"):
        index.build(results, tmp_path)
