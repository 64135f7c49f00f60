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
