"""Where a benchmark's result file goes, and the one writer that stamps it with where it came
from: the command line, the commit (and whether the tree had uncommitted changes), the CPU,
the load average when it was written, the Python and torch versions, and the date."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
RESULTS_REL = "benchmarks/results"
# A smoke run checks the plumbing; its numbers are no results and never land in RESULTS.
SMOKE_RESULTS = Path(tempfile.gettempdir()) / "torchtitan_benchmark_smoke"


def default_output(file_name: str, smoke: bool) -> Path:
    """Where a result file goes when the command line names none."""
    return (SMOKE_RESULTS if smoke else RESULTS) / file_name


def output_help(file_name: str) -> str:
    """The ``--help`` of an output path whose default is :func:`default_output`."""
    return (
        f"default benchmarks/results/{file_name}; with --smoke, {SMOKE_RESULTS.name} in the "
        "temporary folder"
    )


def command_line(script: str, argv: list[str] | None) -> str:
    """How a benchmark was run: the script and its arguments (``argv``; None: this process's)."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python -m", f"benchmarks.{Path(script).stem}", *map(shlex.quote, args)])


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip()


def _cpuinfo(field: str) -> str | None:
    """The value of ``field`` for the first CPU in /proc/cpuinfo (None: no such file or field)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


#: The vector instruction sets that decide this CPU's matmul speed (fp32: AVX2 or AVX-512;
#: bf16: AVX-512 BF16 or AMX), as /proc/cpuinfo names them.
VECTOR_ISA = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def _cpu_isa() -> str:
    """The ``VECTOR_ISA`` flags this CPU has, e.g. ``"avx2"`` or ``"avx2 avx512f avx512_bf16"``:
    machines sold under one model name ("AMD EPYC") differ there, and so do their speeds."""
    flags = _cpuinfo("flags")
    if flags is None:
        return "unknown"
    present = set(flags.split())
    return " ".join(f for f in VECTOR_ISA if f in present) or "none of " + "/".join(VECTOR_ISA)


def machine() -> dict[str, Any]:
    """What the numbers were measured on, and from which code."""
    import torch

    return {
        "cpu": _cpu_model(),
        "cpu_isa": _cpu_isa(),
        "cores": os.cpu_count(),
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        # Tracked files that differ from the commit: the numbers may not be the commit's. The
        # results folder is left out (a rerun rewrites its own result file as it goes), and so
        # are docs, which no benchmark runs.
        "git_dirty": bool(
            _git(
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                f":(exclude){RESULTS_REL}",
                ":(exclude)*.md",
            )
        ),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_result(path: Path, result: dict[str, Any], command: str) -> Path:
    """Write ``result`` as JSON with its provenance (``command``, ``machine``) after its
    ``benchmark`` name; call it again to update a partial result."""
    stamped = {"benchmark": result.get("benchmark"), "command": command, "machine": machine()}
    stamped.update((k, v) for k, v in result.items() if k not in ("command", "machine"))
    return rewrite_result(path, stamped)


def rewrite_result(path: Path, result: dict[str, Any]) -> Path:
    """Write a result that already carries its provenance (e.g. re-summarized from its own
    file): the numbers still come from the run it names."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
