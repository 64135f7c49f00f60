"""Runs torchft's lighthouse as ``torchft_lighthouse`` does, without importing the torchft
package: its ``__init__`` imports torch, seconds of start-up the lighthouse (a function of
torchft's Rust extension) does not need. The extension is found in this interpreter's torchft,
the one the replica groups run.

    python torchtitan/tools/cluster/run_lighthouse.py --min_replicas 1 --bind 127.0.0.1:PORT

Run it as a script, not with ``-m``: the lighthouse parses the process's arguments after the
first (the interpreter), which are then this file's path and the flags, as for torchft's own
``torchft_lighthouse`` script.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys


def main() -> int:
    package = importlib.util.find_spec("torchft")  # finds it without running its __init__
    locations = package.submodule_search_locations if package is not None else None
    spec = importlib.machinery.PathFinder.find_spec("_torchft", list(locations or []))
    if spec is None or spec.loader is None:
        print(f"error: torchft's extension is not installed for {sys.executable}", file=sys.stderr)
        return 1
    extension = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(extension)
    extension.lighthouse_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
