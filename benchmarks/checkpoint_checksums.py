"""What checkpoint checksums cost: save and load with them against plain DCP, same states.

    .venv/bin/python -m benchmarks.checkpoint_checksums           # the README's figures
    .venv/bin/python -m benchmarks.checkpoint_checksums --smoke   # seconds; the plumbing only

The states are the trainer's: a Llama 3 model, its AdamW (one step taken, so both moments
exist), the LR schedule and the train state, in one process. Each repeat saves and loads them
with ``CheckpointManager`` twice, in alternating order, each into a fresh folder: once as it was
before checksums (``without_checksums``: DCP's plain writer, no manifest, no check) and once as
it is (an XXH3-64 digest of every item after the save; before the load a check of every file's
size and of ``.metadata``'s digest, then each item hashed as it is read, in a thread that runs
ahead of DCP's reads). The load of each kind reads files it has just written (page cache), so
the check's cost is the hashing, not the disk; with ``--cold`` the page cache is emptied before
each load (root only), and both kinds of load read the disk. Three sizes: the debug model
(``debugmodel``), ``bench_512x8`` and ``bench_1024x8``, so that the cost per byte can be
compared across sizes.

Reported, not judged: save and load times move with the disk and the page cache by more than
the checksums cost (interleaved repeats of the same states gave -11 % to +84 %).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks import provenance
from benchmarks.ft_common import load_average
from benchmarks.train_entry import register_flavors

FLAVORS = ("debugmodel", "bench_512x8", "bench_1024x8")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="the small flavor, 1 repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--flavors", nargs="+", default=list(FLAVORS))
    p.add_argument(
        "--cold",
        action="store_true",
        help="empty the page cache before each load (root only), so that loads read the disk",
    )
    p.add_argument("--out", type=Path, help=provenance.output_help("checkpoint_checksums.json"))
    args = p.parse_args(argv)
    if args.smoke:
        args.repeats, args.flavors = 1, ["debugmodel_small"]
    args.out = args.out or provenance.default_output("checkpoint_checksums.json", args.smoke)
    return args


def build_states(flavor: str) -> tuple[dict[str, Any], int]:
    """The trainer's registry of states for ``flavor`` (after one AdamW step), and its bytes."""
    import torch

    from torchtitan.components.lr_scheduler import build_lr_scheduler
    from torchtitan.components.optimizer import OptimizerState
    from torchtitan.config.job_config import JobConfig
    from torchtitan.models import get_train_spec
    from torchtitan.trainer import ModelState, TrainState

    config = JobConfig()
    spec = get_train_spec("llama3")
    torch.manual_seed(0)
    model = spec.model_cls(spec.model_args[flavor])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    states = {
        "model": ModelState(model),
        "optimizer": OptimizerState(model, optimizer),
        "lr_scheduler": build_lr_scheduler(optimizer, config),
        "train_state": TrainState(),
    }
    nbytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    return states, nbytes


@contextlib.contextmanager
def without_checksums() -> Iterator[None]:
    """``CheckpointManager`` as it was before checksums: DCP's plain writer, no manifest, no
    check at load; everything else (events, the metadata read, the barrier) the same."""
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from torchtitan.components import checksums

    class PlainWriter(FileSystemWriter):
        written: dict[str, checksums.FileEntry] = {}

    saved = {name: getattr(checksums, name) for name in STUBBED}
    checksums.begin = lambda folder: folder.mkdir(parents=True, exist_ok=True)
    checksums.ChecksummingWriter = PlainWriter
    checksums.write_manifest = lambda folder, written: None
    checksums.verify = lambda folder: None
    checksums.state = lambda folder: "checksummed"  # complete on .metadata; no note at load
    checksums.reader = lambda folder: FileSystemReader(folder)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(checksums, name, value)


STUBBED = ("begin", "ChecksummingWriter", "write_manifest", "verify", "state", "reader")


def drop_page_cache() -> None:
    """Write everything out and empty the page cache (root only), so that a load reads the
    disk."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def one_repeat(
    states: dict[str, Any], scratch: Path, order: list[str], cold: bool = False
) -> dict[str, float]:
    """Save and load once per kind, in ``order``; seconds of each (``cold``: the load after
    the page cache was emptied)."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.config.job_config import JobConfig

    seconds: dict[str, float] = {}
    for kind in order:
        folder = scratch / kind
        shutil.rmtree(folder, ignore_errors=True)
        config = JobConfig()
        config.job.dump_folder = str(folder)
        config.checkpoint.enable = True
        manager = CheckpointManager(config, states)
        with without_checksums() if kind == "plain" else contextlib.nullcontext():
            start = time.perf_counter()
            manager.save(1)
            middle = time.perf_counter()
            if cold:
                drop_page_cache()
                middle = time.perf_counter()
            assert manager.load() == 1
        end = time.perf_counter()
        seconds[f"{kind}_save_s"], seconds[f"{kind}_load_s"] = middle - start, end - middle
        shutil.rmtree(folder, ignore_errors=True)
    return seconds


def summarize(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    import warnings

    args = parse_args(argv)
    register_flavors()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    result: dict[str, Any] = {
        "benchmark": "checkpoint_checksums",
        "target": None,
        "cold_loads": args.cold,
        "sizes": [],
    }
    with tempfile.TemporaryDirectory(prefix="ckpt_checksums_") as tmp:
        scratch = Path(tmp)
        for flavor in args.flavors:
            states, nbytes = build_states(flavor)
            one_repeat(states, scratch, ["plain", "checksummed"])  # warm-up, not counted
            repeats = []
            for i in range(args.repeats):
                order = ["plain", "checksummed"] if i % 2 == 0 else ["checksummed", "plain"]
                load = load_average()
                seconds = one_repeat(states, scratch, order, args.cold)
                repeats.append({**seconds, "load_average": load})
            size: dict[str, Any] = {"flavor": flavor, "state_bytes": nbytes, "repeats": repeats}
            for what in ("save", "load"):
                plain = [r[f"plain_{what}_s"] for r in repeats]
                summed = [r[f"checksummed_{what}_s"] for r in repeats]
                overhead = [s / p - 1 for s, p in zip(summed, plain, strict=True)]
                extra_per_gb = [
                    (s - p) / (nbytes / 1e9) for s, p in zip(summed, plain, strict=True)
                ]
                size[what] = {
                    "plain_s": summarize(plain),
                    "checksummed_s": summarize(summed),
                    "overhead": summarize(overhead),
                    "extra_s_per_gb": summarize(extra_per_gb),
                }
            result["sizes"].append(size)
            print(
                f"{flavor} ({nbytes / 2**20:.0f} MiB of states): save "
                f"{size['save']['plain_s']['median']:.3f}s -> "
                f"{size['save']['checksummed_s']['median']:.3f}s "
                f"({size['save']['overhead']['median']:+.1%}), load "
                f"{size['load']['plain_s']['median']:.3f}s -> "
                f"{size['load']['checksummed_s']['median']:.3f}s "
                f"({size['load']['overhead']['median']:+.1%})",
                flush=True,
            )
    path = provenance.write_result(args.out, result, provenance.command_line(__file__, argv))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
