"""One line instead of a traceback when a command of this package runs without its
dependencies (``python3 -m torchtitan.train`` outside the project's ``.venv``)."""

from __future__ import annotations

import importlib.util
import sys

#: What every command imports (``pyproject.toml``'s dependencies).
REQUIRED = ("torch", "tyro", "torchft")
#: What to type instead, per module run with ``python -m``.
INSTEAD = {
    "torchtitan.train": "./run_train.sh [--section.field=value ...]",
    "torchtitan.experiments.fault_tolerance.launch.launcher": (
        "./run_launcher.sh [options] -- [flags]"
    ),
    "torchtitan.experiments.fault_tolerance.plan": (
        ".venv/bin/python -m torchtitan.experiments.fault_tolerance.plan --help"
    ),
}
FALLBACK = "./run_train.sh, ./run_launcher.sh, or .venv/bin/python -m {module}"


def module_run(orig_argv: list[str], argv0: str) -> str | None:
    """The module of ``python -m MODULE`` when it is one of this package's and is being located
    now (Python sets ``sys.argv[0]`` to ``"-m"`` meanwhile, and ``orig_argv`` holds the
    interpreter's own command line, whose first ``-m`` ends its options)."""
    if argv0 != "-m" or "-m" not in orig_argv[:-1]:
        return None
    module = orig_argv[orig_argv.index("-m") + 1]
    return module if module.split(".")[0] == "torchtitan" else None


def missing(required: tuple[str, ...] = REQUIRED) -> list[str]:
    return [name for name in required if importlib.util.find_spec(name) is None]


def exit_if_missing() -> None:
    """When a ``torchtitan`` module is run as a command and a dependency is missing, exit with
    one line naming what is missing and what to run instead. Imports from other programs are
    left alone: they get Python's ``ModuleNotFoundError`` as usual."""
    module = module_run(sys.orig_argv, sys.argv[0])
    if module is None:
        return
    absent = missing()
    if absent:
        instead = INSTEAD.get(module, FALLBACK.format(module=module))
        sys.exit(
            f"{module}: {', '.join(absent)} not installed for {sys.executable}; run {instead} "
            f"from the repository's root (scripts/setup.sh creates .venv)"
        )
