"""What each result file says about how it was made: one markdown row per JSON in
``benchmarks/results/``, from the provenance every benchmark stamps on its file.

    .venv/bin/python -m benchmarks.results_index            # print the tables
    .venv/bin/python -m benchmarks.results_index --check    # exit 1 if benchmarks/README.md's
                                                            # copies differ (CI runs the check)
    .venv/bin/python -m benchmarks.results_index --write    # rewrite them; redraw the charts

The README holds two generated tables: this index and the headline (``headline.py``: every
figure, its target and verdict); ``--write`` also redraws the charts (``charts.py``).

Columns: the file; the commit its numbers come from (``machine.git_commit``), marked
"uncommitted changes" when ``machine.git_dirty`` says the tree differed; when it was written
(``machine.date_utc``, the last write of a run); the CPU's vector instruction sets
(``machine.cpu_isa``: one model name covers CPUs of different speeds); the range of every
1-minute load average the file records (before each run, at its start, at the write); and the
repeats it records (the count of distinct ``repeat`` numbers where a file numbers its runs
instead). The README's preamble holds the table between two markers, so that it says what the
files say.

    .venv/bin/python -m benchmarks.results_index --code-changes

prints, per file, the code that changed between its commit and HEAD (git, in the clone): what
the trainer, launcher and benchmarks run (``CODE``), not docs, tests or other results. "none"
means the file's numbers come from the code HEAD holds. Of the benchmark scripts, only the one
that wrote the file (named in its ``command``) and those it imports count: a script that nothing
imports or starts (``recovery.py`` for ``wan.json``) runs only when a user starts it.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks import charts, headline
from benchmarks.provenance import RESULTS

README = RESULTS.parent / "README.md"
BEGIN, END = "<!-- results-index: begin -->", "<!-- results-index: end -->"
HEADLINE_BEGIN, HEADLINE_END = "<!-- headline: begin -->", "<!-- headline: end -->"
# What a benchmark runs: a change here can change a figure. Docs, tests, the results, this
# reader of them, the test runner and the checks that no benchmark runs (the GPU check, the
# mutation check) cannot.
CODE = [
    "torchtitan", "benchmarks", "scripts", "run_train.sh", "pyproject.toml",
    ":(exclude)*.md", ":(exclude)benchmarks/results", ":(exclude)benchmarks/results_index.py",
    ":(exclude)benchmarks/headline.py", ":(exclude)benchmarks/charts.py",
    ":(exclude)scripts/test.sh", ":(exclude)scripts/gpu_check.*",
    ":(exclude)scripts/mutation_check.py",
]  # fmt: skip
HEADER = [
    "| file | commit | written (UTC) | CPU vector ISA | 1-min load (min-max) | repeats |",
    "| --- | --- | --- | --- | --- | --- |",
]


def _walk(value: Any, key: str = "") -> Iterator[tuple[str, Any]]:
    """Every (key, value) of a JSON document, nested ones included."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield k, v
            yield from _walk(v, k)
    elif isinstance(value, list):
        for v in value:
            yield from _walk(v, key)


def row(path: Path) -> str:
    """The file's row of the table."""
    data = json.loads(path.read_text())
    found = list(_walk(data))
    machine = data.get("machine")
    machine = machine if isinstance(machine, dict) else {}  # the oldest files: a platform string
    commit = machine.get("git_commit") or "not recorded"
    if machine.get("git_dirty") or commit.endswith("+dirty"):  # older files: "<sha>+dirty"
        commit = commit.removesuffix("+dirty") + " (uncommitted changes)"
    date = (machine.get("date_utc") or "not recorded").replace("T", " ").rstrip("Z")
    loads = [
        v for k, v in found
        if k.startswith(("load_avg", "load_average")) and isinstance(v, int | float)
    ]  # fmt: skip
    load = f"{min(loads):.2f}-{max(loads):.2f}" if loads else "not recorded"
    # A count, or the list of the repeats themselves.
    repeats = sorted(
        {v if isinstance(v, int) else len(v) for k, v in found
         if k == "repeats" and isinstance(v, int | list)}
    )  # fmt: skip
    if not repeats:  # files that number their runs' repeats instead
        numbered = {v for k, v in found if k == "repeat" and isinstance(v, int)}
        repeats = [len(numbered)] if numbered else []
    count = "/".join(map(str, repeats)) if repeats else "not recorded"
    isa = machine.get("cpu_isa") or "not recorded"
    return f"| `{path.name}` | {commit} | {date} | {isa} | {load} | {count} |"


def script_of(result: dict[str, Any]) -> str | None:
    """The benchmark script that wrote ``result`` (``wan`` for ``python -m benchmarks.wan``)."""
    command = result.get("command")
    if isinstance(command, list):
        command = " ".join(map(str, command))
    found = re.search(r"benchmarks[./](\w+)", command) if isinstance(command, str) else None
    return found.group(1) if found else None


def _uses(path: Path) -> set[str]:
    """The ``benchmarks`` modules ``path`` imports (``from benchmarks import a``,
    ``from benchmarks.a import x``, ``import benchmarks.a``) or names in a string, as a process
    it starts does (``"-m", "benchmarks.train_entry"``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "benchmarks":
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [
                a.name for a in node.names
            ]  # fmt: skip
            found.update(n.split(".")[1] for n in names if n.startswith("benchmarks."))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.update(re.findall(r"benchmarks[./](\w+)", node.value))
    return found


def scripts_not_run_by(script: str, repo: Path = RESULTS.parents[1]) -> list[str]:
    """The benchmark scripts (modules of ``benchmarks/`` with a ``__main__`` block) that
    ``script`` neither imports nor starts, directly or through the modules it uses: their code
    cannot change its figures."""
    folder = repo / "benchmarks"
    sources = {p.stem: p for p in sorted(folder.glob("*.py"))}
    reached, todo = {script}, [script]
    while todo:
        name = todo.pop()
        if name in sources:
            for used in _uses(sources[name]) - reached:
                reached.add(used)
                todo.append(used)
    return [
        f"benchmarks/{path.name}"
        for name, path in sources.items()
        if name not in reached and '__name__ == "__main__"' in path.read_text()
    ]


def code_changes(
    commit: str, repo: Path = RESULTS.parents[1], script: str | None = None
) -> list[str]:
    """The code files (``CODE``) that differ between ``commit`` and HEAD in ``repo``; with
    ``script``, the benchmark scripts it does not run left out."""
    skipped = [f":(exclude){path}" for path in scripts_not_run_by(script, repo)] if script else []
    out = subprocess.run(
        ["git", "diff", "--name-only", commit, "HEAD", "--", *CODE, *skipped],
        cwd=repo, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return out.stdout.split()


def code_changes_report(folder: Path = RESULTS) -> str:
    """One line per result file: its commit and the code changed since, or why unknown."""
    lines = []
    for path in sorted(folder.glob("*.json")):
        result = json.loads(path.read_text())
        machine = result.get("machine")
        commit = machine.get("git_commit") if isinstance(machine, dict) else None
        if not commit:
            lines.append(f"{path.name}: no commit recorded")
            continue
        commit = commit.removesuffix("+dirty")
        try:
            changed = code_changes(commit, folder.parents[1], script_of(result))
        except subprocess.CalledProcessError as e:
            lines.append(f"{path.name}: {commit}: git cannot compare ({e.stderr.strip()})")
            continue
        lines.append(f"{path.name}: {commit}: code changed since: {', '.join(changed) or 'none'}")
    return "\n".join(lines)


def table(folder: Path = RESULTS) -> str:
    return "\n".join([*HEADER, *(row(p) for p in sorted(folder.glob("*.json")))])


def readme_copy(text: str, begin: str = BEGIN, end: str = END) -> str | None:
    """The table between the markers of ``text`` (None: no markers)."""
    if begin not in text or end not in text:
        return None
    return text.split(begin, 1)[1].split(end, 1)[0].strip()


def tables(folder: Path = RESULTS) -> dict[tuple[str, str], str]:
    """The README's generated tables, by their markers: this index and the headline."""
    return {(BEGIN, END): table(folder), (HEADLINE_BEGIN, HEADLINE_END): headline.table(folder)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true",
                   help=f"compare with the copy in {README.name} (1 if it differs)")  # fmt: skip
    p.add_argument("--write", action="store_true", help=f"replace the copy in {README.name}")
    p.add_argument("--code-changes", action="store_true",
                   help="per file, the code changed between its commit and HEAD (git)")  # fmt: skip
    args = p.parse_args(argv)
    if args.code_changes:
        print(code_changes_report())
        return 0
    now = tables()
    if args.write:
        text = README.read_text()
        for (begin, end), copy in now.items():
            if readme_copy(text, begin, end) is None:
                print(f"{README}: no {begin} ... {end} markers", file=sys.stderr)
                return 1
            head, rest = text.split(begin, 1)
            text = f"{head}{begin}\n{copy}\n{end}{rest.split(end, 1)[1]}"
        README.write_text(text)
        print("\n".join(charts.draw_all()))
        return 0
    if args.check:
        text = README.read_text()
        if any(readme_copy(text, begin, end) != copy for (begin, end), copy in now.items()):
            print(f"{README}'s results index or headline differs from the files; run "
                  "python -m benchmarks.results_index --write", file=sys.stderr)  # fmt: skip
            return 1
        return 0
    print("\n\n".join(now.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
