"""What each result file says about how it was made: one markdown row per JSON in
``benchmarks/results/``, from the provenance every benchmark stamps on its file.

    .venv/bin/python -m benchmarks.results_index            # print the table
    .venv/bin/python -m benchmarks.results_index --check    # exit 1 if benchmarks/README.md's
                                                            # copy differs (CI runs the check)

Columns: the file; the commit its numbers come from (``machine.git_commit``), marked
"uncommitted changes" when ``machine.git_dirty`` says the tree differed; when it was written
(``machine.date_utc``, the last write of a run); the CPU's vector instruction sets
(``machine.cpu_isa``: one model name covers CPUs of different speeds); the range of every
1-minute load average the file records (before each run, at its start, at the write); and the
repeats it records (the count of distinct ``repeat`` numbers where a file numbers its runs
instead). The README's preamble holds the table between two markers, so that it says what the
files say.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.provenance import RESULTS

README = RESULTS.parent / "README.md"
BEGIN, END = "<!-- results-index: begin -->", "<!-- results-index: end -->"
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
    loads = [v for k, v in found if k.startswith("load_avg") and isinstance(v, int | float)]
    load = f"{min(loads):.2f}-{max(loads):.2f}" if loads else "not recorded"
    repeats = sorted({v for k, v in found if k == "repeats" and isinstance(v, int)})
    if not repeats:  # files that number their runs' repeats instead
        numbered = {v for k, v in found if k == "repeat" and isinstance(v, int)}
        repeats = [len(numbered)] if numbered else []
    count = "/".join(map(str, repeats)) if repeats else "not recorded"
    isa = machine.get("cpu_isa") or "not recorded"
    return f"| `{path.name}` | {commit} | {date} | {isa} | {load} | {count} |"


def table(folder: Path = RESULTS) -> str:
    return "\n".join([*HEADER, *(row(p) for p in sorted(folder.glob("*.json")))])


def readme_copy(text: str) -> str | None:
    """The table between the markers of ``text`` (None: no markers)."""
    if BEGIN not in text or END not in text:
        return None
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true",
                   help=f"compare with the copy in {README.name} (1 if it differs)")  # fmt: skip
    p.add_argument("--write", action="store_true", help=f"replace the copy in {README.name}")
    args = p.parse_args(argv)
    now = table()
    if args.write:
        text = README.read_text()
        if readme_copy(text) is None:
            print(f"{README}: no {BEGIN} ... {END} markers", file=sys.stderr)
            return 1
        head, rest = text.split(BEGIN, 1)
        README.write_text(f"{head}{BEGIN}\n{now}\n{END}{rest.split(END, 1)[1]}")
        return 0
    if args.check:
        copy = readme_copy(README.read_text())
        if copy != now:
            print(f"{README}'s results index differs from the files; run "
                  "python -m benchmarks.results_index --write", file=sys.stderr)  # fmt: skip
            return 1
        return 0
    print(now)
    return 0


if __name__ == "__main__":
    sys.exit(main())
