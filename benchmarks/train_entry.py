"""``python -m torchtitan.train`` plus the benchmarks' own Llama 3 flavors.

    .venv/bin/python -m benchmarks.train_entry --model.flavor=bench_1024x8 [--section.field=...]

The flavors are registered in this process only (the config cannot set model dimensions), so
every flag, TOML and the fault-tolerance experiment work as with ``run_train.sh``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from torchtitan.config.model_names import add_flavors
from torchtitan.models.llama3 import TransformerModelArgs, llama3_configs

DEFAULT_CONFIG = "torchtitan/models/llama3/train_configs/debug_model.toml"

# Wide models for the memory benchmark, where parameters and their optimizer state dominate
# the resident set. Byte vocabulary (258), so the embedding is a small part.
BENCH_FLAVORS: dict[str, TransformerModelArgs] = {
    # 94,917,632 parameters (380 MB in fp32).
    "bench_1024x8": TransformerModelArgs(dim=1024, n_layers=8, n_heads=16, n_kv_heads=8),
    # 25,438,720 parameters (102 MB in fp32).
    "bench_512x8": TransformerModelArgs(dim=512, n_layers=8, n_heads=8, n_kv_heads=4),
}


def register_flavors() -> None:
    """Make the flavors above buildable and nameable in a config, in this process."""
    for name, args in BENCH_FLAVORS.items():
        llama3_configs.setdefault(name, args)
    add_flavors("llama3", tuple(BENCH_FLAVORS))


def main() -> int:
    register_flavors()
    from torchtitan.train import main as train_main

    argv = sys.argv[1:]
    if not any(a.startswith("--job.config_file") for a in argv):
        argv = ["--job.config_file", str(Path(__file__).resolve().parents[1] / DEFAULT_CONFIG)]
        argv += sys.argv[1:]
    return train_main(argv)


if __name__ == "__main__":
    sys.exit(main())
