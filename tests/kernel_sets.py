"""The ATen CPU kernel sets this host can run, to try what groups on other CPUs would compute.

ATen picks its vectorized kernels once, when torch is imported, from ``ATEN_CPU_CAPABILITY``
(``default``: the portable kernels, as on a CPU family whose vector code differs; ``avx2``;
``avx512``), capped at what the CPU supports. A process started with the variable set computes
as a host of that kind would.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

#: The repository's root, where the processes below run (``tests`` is importable there).
ROOT = Path(__file__).resolve().parents[1]

#: The variable ATen reads at import.
VARIABLE = "ATEN_CPU_CAPABILITY"


@functools.cache
def best() -> str:
    """The kernel set torch picks on this host when nothing is asked for (lower case: the
    variable's spelling), e.g. ``avx512``."""
    env = {k: v for k, v in os.environ.items() if k != VARIABLE}
    found = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return found.stdout.strip().lower()


def kernel_sets() -> list[str]:
    """``default``, ``avx2`` where the CPU has it, and the host's best, each once."""
    found = ["default"]
    if best() in ("avx2", "avx512"):
        found.append("avx2")
    if best() not in found:
        found.append(best())
    return found


def with_kernels(kernel_set: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) for a process that computes with ``kernel_set``."""
    return {**(os.environ if env is None else env), VARIABLE: kernel_set}


def run_python(
    kernel_set: str, args: list[str], timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` at the repository's root on ``kernel_set``, its output captured."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=with_kernels(kernel_set),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
