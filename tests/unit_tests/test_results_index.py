"""The benchmarks README's results index says what the result files say."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from benchmarks import results_index


def test_the_readme_s_results_index_matches_the_result_files() -> None:
    # If this fails: python -m benchmarks.results_index --write, and read what changed.
    assert results_index.main(["--check"]) == 0


def test_a_row_says_commit_tree_date_cpu_loads_and_repeats(tmp_path: Path) -> None:
    result = {
        "machine": {"git_commit": "abc1234", "git_dirty": True, "date_utc": "2026-12-02T01:02:03Z",
                    "cpu_isa": "avx2 avx512f", "load_avg_1min": 0.5},
        "settings": {"load_avg_1min_at_start": 1.25},
        "runs": [{"repeat": 0, "load_avg_1min_before": 2.0}, {"repeat": 1}, {"repeat": 2}],
    }  # fmt: skip
    path = tmp_path / "x.json"
    path.write_text(json.dumps(result))
    expected = (
        "| `x.json` | abc1234 (uncommitted changes) | 2026-12-02 01:02:03 | avx2 avx512f "
        "| 0.50-2.00 | 3 |"
    )
    assert results_index.row(path) == expected
    # The oldest format: "<sha>+dirty", a platform string for a machine, no loads or repeats.
    path.write_text(json.dumps({"machine": "x86_64 Linux", "git": "x"}))
    assert results_index.row(path) == (
        "| `x.json` | not recorded | not recorded | not recorded | not recorded | not recorded |"
    )
    path.write_text(json.dumps({"machine": {"git_commit": "0a361af+dirty"}, "repeats": 5}))
    assert "| 0a361af (uncommitted changes) |" in results_index.row(path)
    assert results_index.row(path).endswith("| 5 |")


def test_the_copy_is_found_between_its_markers() -> None:
    text = f"intro\n{results_index.BEGIN}\n| a |\n{results_index.END}\nrest"
    assert results_index.readme_copy(text) == "| a |"
    assert results_index.readme_copy("no markers") is None


def _git(repo: Path, *args: str) -> str:
    out = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_code_changes_name_the_code_changed_since_a_file_s_commit(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    results = repo / "benchmarks" / "results"
    results.mkdir(parents=True)
    (repo / "torchtitan").mkdir()
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "t")
    (repo / "torchtitan" / "train.py").write_text("a = 1\n")
    (repo / "README.md").write_text("old\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "first")
    first = _git(repo, "rev-parse", "--short", "HEAD")
    (results / "measured.json").write_text(json.dumps({"machine": {"git_commit": first}}))
    (results / "no_commit.json").write_text(json.dumps({"machine": "x86_64 Linux"}))
    (results / "unknown.json").write_text(json.dumps({"machine": {"git_commit": "0" * 40}}))
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "results")
    second = _git(repo, "rev-parse", "--short", "HEAD")
    (results / "now.json").write_text(json.dumps({"machine": {"git_commit": second}}))
    # Docs, tests and results are not code; the trainer is.
    (repo / "README.md").write_text("new\n")
    (repo / "torchtitan" / "train.py").write_text("a = 2\n")
    _git(repo, "commit", "-q", "-am", "change")

    lines = results_index.code_changes_report(results).splitlines()
    assert lines[0] == f"measured.json: {first}: code changed since: torchtitan/train.py"
    assert lines[1] == "no_commit.json: no commit recorded"
    assert lines[2] == f"now.json: {second}: code changed since: torchtitan/train.py"
    assert lines[3].startswith(f"unknown.json: {'0' * 40}: git cannot compare")
    _git(repo, "commit", "-q", "--allow-empty", "-m", "nothing")
    (repo / "torchtitan" / "train.py").write_text("a = 1\n")
    _git(repo, "commit", "-q", "-am", "back")
    assert results_index.code_changes(first, repo) == []


def test_a_row_reads_per_repeat_loads_and_a_list_of_repeats(tmp_path: Path) -> None:
    result = {
        "machine": {"git_commit": "abc1234", "load_avg_1min": 1.27},
        "sizes": [{"repeats": [{"load_average": 1.65}, {"load_average": 1.0}]}],
    }  # fmt: skip
    path = tmp_path / "x.json"
    path.write_text(json.dumps(result))
    assert results_index.row(path).endswith("| 1.00-1.65 | 2 |")


def test_a_file_s_code_is_its_script_and_what_that_uses(tmp_path: Path) -> None:
    """A change to a benchmark script that a file's script neither imports nor starts is not a
    change to that file's code; a change to one it uses, or to the trainer, is."""
    repo = tmp_path / "repo"
    bench = repo / "benchmarks"
    (bench / "results").mkdir(parents=True)
    (repo / "torchtitan").mkdir()
    main_block = 'if __name__ == "__main__":\n    main()\n'
    files = {
        "benchmarks/common.py": 'ENTRY = ["-m", "benchmarks.entry"]\n',
        "benchmarks/entry.py": main_block,  # started by common, never imported
        "benchmarks/alpha.py": "from benchmarks import common\n" + main_block,
        "benchmarks/beta.py": "from benchmarks.alpha import x\n" + main_block,
        "benchmarks/gamma.py": "import benchmarks.common\n" + main_block,
        "torchtitan/train.py": "a = 1\n",
    }
    for name, text in files.items():
        (repo / name).write_text(text)
    assert results_index.scripts_not_run_by("alpha", repo) == [
        "benchmarks/beta.py", "benchmarks/gamma.py"
    ]  # fmt: skip
    assert results_index.scripts_not_run_by("beta", repo) == ["benchmarks/gamma.py"]
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "t")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "first")
    first = _git(repo, "rev-parse", "--short", "HEAD")
    for name in ("benchmarks/gamma.py", "benchmarks/entry.py"):
        (repo / name).write_text(files[name] + "# changed\n")
    _git(repo, "commit", "-q", "-am", "change")
    assert results_index.code_changes(first, repo, "alpha") == ["benchmarks/entry.py"]
    assert results_index.code_changes(first, repo, "gamma") == [
        "benchmarks/entry.py", "benchmarks/gamma.py"
    ]  # fmt: skip
    assert results_index.code_changes(first, repo) == [
        "benchmarks/entry.py", "benchmarks/gamma.py"
    ]  # fmt: skip
    assert results_index.script_of({"command": "python -m benchmarks.alpha --x 1"}) == "alpha"
    assert results_index.script_of({"command": ["python", "benchmarks/beta.py"]}) == "beta"
    assert results_index.script_of({"command": "something else"}) is None
