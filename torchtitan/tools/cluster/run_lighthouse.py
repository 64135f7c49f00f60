"""Runs torchft's lighthouse as ``torchft_lighthouse`` does, without importing the torchft
package: its ``__init__`` imports torch, seconds of start-up that the lighthouse (a function of
torchft's Rust extension) does not need. The function is the one torchft publishes as its
``torchft_lighthouse`` console script (read from the installed package's entry points, not
named here), loaded from this interpreter's torchft, the one the replica groups run.

    python torchtitan/tools/cluster/run_lighthouse.py --min_replicas 1 --bind 127.0.0.1:PORT

Run it as a script, not with ``-m``: the lighthouse parses the process's arguments after the
first (the interpreter), which are then this file's path and the flags, as for torchft's own
``torchft_lighthouse`` script.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import sys

SCRIPT = "torchft_lighthouse"


def main() -> int:
    found = importlib.metadata.entry_points(group="console_scripts", name=SCRIPT)
    if not found:
        print(f"error: torchft ({SCRIPT}) is not installed for {sys.executable}", file=sys.stderr)
        return 1
    entry = next(iter(found))
    # "package.module": find the module next to its package without running the package's
    # __init__ (which imports torch).
    package_name, _, module_name = entry.module.rpartition(".")
    package = importlib.util.find_spec(package_name) if package_name else None
    locations = list(package.submodule_search_locations or []) if package is not None else None
    spec = importlib.machinery.PathFinder.find_spec(module_name, locations)
    if spec is None or spec.loader is None:
        print(f"error: {entry.value} ({SCRIPT}) cannot be loaded", file=sys.stderr)
        return 1
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    getattr(module, entry.attr)()
    return 0


if __name__ == "__main__":
    sys.exit(main())
