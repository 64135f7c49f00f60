"""One async DiLoCo sync point's host work, as a ratio to one memcpy of the same shard.

    .venv/bin/python -m benchmarks.outer_step --baseline 54143db   # the README's figures (~4 min)
    .venv/bin/python -m benchmarks.outer_step --smoke              # seconds; the plumbing only

With the outer state on the host (``outer_state_device=cpu``, async DiLoCo's default) a sync
point is host work while the accelerator waits: the outer step of the fragment whose average
arrived, the local copy following the global copy, the next pseudo-gradient, the eager start
of the next period, and the digests the trainer takes (the agreement digest, the heal
history's basis of the sync and the checksum of what it delivered). This times exactly that
(``AsyncDiLoCo.sync_point``, the heal history's entry included: the code the trainer runs) on
a shard of ``--numel`` fp32 values split into 16 parameters, eager update, Nesterov momentum, in a
process started with one torch thread as torchrun starts it (``OMP_NUM_THREADS=1``), the model
on ``--device``, nothing on the wire (one group: what arrives is its own sum).

The unit is one ``memcpy`` of the shard (``dst.copy_(src)``, fp32, one thread) timed in the same
process right before each sync point, so that the figure does not move with the machine's
speed. Target (issue 47): at most 6 memcpy equivalents per sync point. The code under test is
timed twice: with the threads it takes itself (``fault_tolerance.outer_step_threads=0``: this
rank's share of the host's cores, ``cores`` in the JSON) and with one (``this_1_thread``).
The checksum and the sum of squares of the delivered result, which newer code takes on the
transport's thread while the next period computes (``Delivered.kept``,
``SyncTransport.squares``), are timed apart (``checksum_memcpy``): host work too, but not at
the sync point. ``--baseline REV`` times the code of another commit the same
way, in turns with this one (a subprocess each, on a clean copy of that commit made with
``git archive``), so that every figure comes from one run.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PARAMS = 16
TARGET_MEMCPY = 6.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=float, default=1e8, help="fp32 values in the shard")
    p.add_argument("--repeats", type=int, default=5, help="timed sync points per subprocess")
    p.add_argument("--turns", type=int, default=3, help="subprocesses per code version, in turns")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="the model's device")
    p.add_argument("--baseline", default="", help="a commit whose code is timed the same way")
    p.add_argument("--smoke", action="store_true", help="a small shard, two repeats, one turn")
    p.add_argument(
        "--no-one-thread", action="store_true", help="leave out the 1-thread run of this code"
    )
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        help="default benchmarks/results/outer_step.json; with --smoke, in the temporary folder",
    )
    # For the subprocesses: time one version of the code, with this many pass threads.
    p.add_argument("--measure-one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--outer-step-threads", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- one measurement, in a process whose sys.path starts at the code being timed -------------


class _Arrived:
    def wait(self) -> None:
        pass


class OneGroup:
    """The sync quorum as async DiLoCo uses it, for a group alone: every quorum is this group,
    every all-reduce has arrived (its sum is its own values), every sync commits, and the
    committed sync's result is kept for the heal history as the transport keeps it."""

    def __init__(self) -> None:
        self.step = 0
        self.fns: dict[str, Any] = {}
        #: Older code's heal-history hook (newer code keeps the history itself).
        self.on_committed: Any = None
        self.kept: list[Any] = []
        #: The result's sum of squares, as the transport takes it on its thread.
        self.squares: float | None = None

    @staticmethod
    def agree_in_group(value: int) -> int:
        return value  # a group of one rank decides alone

    def register_state_dict_fn(self, key: str, load: Any, save: Any) -> None:
        self.fns[key] = (load, save)

    def start_quorum(self) -> None:  # older code's quorum
        pass

    def allreduce(self, tensor: Any, **kwargs: Any) -> _Arrived:
        return _Arrived()

    def flush(self) -> None:
        pass

    def should_commit(self) -> bool:
        self.step += 1
        if self.on_committed is not None:
            self.on_committed(self.step, 0, self.kept)
        return True

    def decide(self) -> Any:
        """A committed sync's record, as ``SyncQuorum.decide`` gives it (older code asks
        ``should_commit`` and the questions below one by one)."""
        from torchtitan.experiments.fault_tolerance.sync.quorum import SyncDecision

        self.should_commit()
        return SyncDecision(True, self.step, 1, 0, None, self.squares, self.kept)

    def current_step(self) -> int:
        return self.step

    def delivered(self) -> list[Any]:
        return self.kept

    def site_tokens(self, tokens: int) -> int:
        return tokens  # every group is a site

    def num_participants(self) -> int:
        return 1

    def sync_stats(self) -> tuple[int, None]:
        return 0, None

    def sync_failed(self) -> bool:
        return False

    def sync_squares(self) -> float | None:
        return self.squares

    def errored(self) -> None:
        return None

    def reset_error_feedback(self) -> None:
        pass

    def allow_state_dict_read(self) -> None:
        pass

    def disallow_state_dict_read(self) -> None:
        pass


def _pinned_bytes(device: Any) -> dict[str, int]:
    """Pinned host memory now: torch's caching host allocator's (rounded-up blocks, cached
    after non-blocking copies) and what the outer state page-locked at its exact size
    (``tools.pinned``, absent from older code)."""
    import torch

    if device.type != "cuda":
        return {}
    stats = torch.cuda.host_memory_stats()
    found = {
        "pinned_bytes": int(stats.get("allocated_bytes.current", 0)),
        "pinned_reserved_bytes": int(stats.get("reserved_bytes.current", 0)),
    }
    try:
        from torchtitan.tools import pinned
    except ImportError:
        return found
    return found | {"pinned_exact_bytes": pinned.registered_bytes}


def measure_one(numel: int, repeats: int, device_name: str, threads: int) -> dict[str, Any]:
    """Time ``repeats`` sync points of the code on ``sys.path`` (see the module docstring);
    ``threads``: ``outer_step_threads`` where that code has it (0: its own choice)."""
    import torch
    from torch import nn

    try:
        from torchtitan.experiments.fault_tolerance.heal.history import HealHistory
        from torchtitan.experiments.fault_tolerance.methods.async_diloco import AsyncDiLoCo
        from torchtitan.experiments.fault_tolerance.transport.collective import Delivered
    except ImportError:  # code before the layer packages (a baseline)
        from torchtitan.experiments.fault_tolerance.async_diloco import (  # type: ignore
            AsyncDiLoCo,
        )
        from torchtitan.experiments.fault_tolerance.compression import Delivered  # type: ignore
        from torchtitan.experiments.fault_tolerance.heal_history import (  # type: ignore
            HealHistory,
        )

    torch.set_num_threads(1)  # as torchrun starts a rank
    device = torch.device(device_name)
    sizes = [numel // PARAMS + (i < numel % PARAMS) for i in range(PARAMS)]
    model = nn.Module()
    for i, n in enumerate(sizes):
        model.register_parameter(f"p{i}", nn.Parameter(torch.randn(n, device=device) * 0.02))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = OneGroup()
    options: dict[str, Any] = {}
    if "host_threads" in inspect.signature(AsyncDiLoCo).parameters:
        options["host_threads"] = threads
    if "history" in inspect.signature(AsyncDiLoCo).parameters:
        options["history"] = HealHistory(1)
    loop = AsyncDiLoCo(
        manager,  # type: ignore[arg-type]  # the part of the sync quorum it uses
        [model],
        inner,
        sync_steps=1,
        update="eager",
        outer_lr=0.7,
        outer_momentum=0.9,
        outer_nesterov=True,
        state_device=torch.device("cpu"),
        tokens_per_step=1,
        **options,
    )
    if "history" not in options:  # older code: the heal history's hook on the Manager
        from torchtitan.experiments.fault_tolerance.heal_transport import (  # type: ignore
            HealExchange,
        )

        heal = HealExchange(HealHistory(1), 0, loop, ft=None)  # type: ignore[arg-type,call-arg]
        manager.on_committed = heal.record  # type: ignore[attr-defined]
    # Every quorum is this group alone (older code asked its Manager for it, with no argument).
    quorums = (SimpleNamespace(sync_quorum=lambda: False),)
    if not inspect.signature(loop.sync_point).parameters:
        quorums = ()
    keep = getattr(Delivered, "kept", None)  # the checksum on the transport's thread
    src = torch.ones(numel)  # a memcpy's speed does not depend on the values
    dst = torch.empty(numel)
    memcpy_s, host_s, checksum_s = [], [], []
    for repeat in range(repeats + 2):  # two untimed: no sync in flight, no momentum yet
        with torch.no_grad():  # an inner step's change
            for p in model.parameters():
                p.mul_(0.999)
        for state in loop._states:  # the step, as the inner optimizer's hook counts it
            state.steps += 1
        flight = loop._in_flight
        checksum = 0.0
        if flight is not None:  # what the transport kept of the sync in flight
            average = flight.buffer[:-1].to("cpu", copy=True)
            started = time.perf_counter()
            kept = (keep or Delivered)("float32", average.numel(), 1, 1, average)
            manager.squares = float(torch.dot(average, average))
            checksum = time.perf_counter() - started if keep is not None else 0.0
            manager.kept = [kept]
        started = time.perf_counter()
        dst.copy_(src)
        memcpy = time.perf_counter() - started
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        loop.sync_point(*quorums)
        loop.agreement_digest()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        if repeat >= 2:
            memcpy_s.append(memcpy)
            host_s.append(seconds)
            checksum_s.append(checksum)
    import torchtitan

    return {
        "code": str(Path(torchtitan.__file__).resolve().parents[1]),
        "numel": numel,
        "device": device_name,
        "outer_step_threads": options.get("host_threads"),
        "memcpy_s": [round(s, 4) for s in memcpy_s],
        "host_s": [round(s, 4) for s in host_s],
        "ratio": [round(h / m, 2) for h, m in zip(host_s, memcpy_s, strict=True)],
        "checksum_memcpy": [round(c / m, 2) for c, m in zip(checksum_s, memcpy_s, strict=True)],
        "rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        **_pinned_bytes(device),
    }


# ---- the run: this code and the baseline, in turns -----------------------------------------


def _snapshot(rev: str) -> Path:
    """A clean copy of commit ``rev``'s tree (``git archive``), made once per run."""
    folder = Path(tempfile.mkdtemp(prefix=f"outer_step_{rev}_"))
    archive = subprocess.run(
        ["git", "archive", rev], cwd=REPO, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def _measure_in(
    code: Path, args: argparse.Namespace, numel: int, repeats: int, threads: int
) -> dict[str, Any]:
    # This script, run by its path from the code's folder, with that code first on the path
    # (what else is there stays: installed packages): the code timed is the commit's,
    # whatever this checkout holds.
    path = os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH", "")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, str(Path(__file__).resolve()), "--measure-one",
        f"--numel={numel}", f"--repeats={repeats}", f"--device={args.device}",
        f"--outer-step-threads={threads}",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=code, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"timing the code in {code} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def pooled(key: str) -> list[float]:
        return [x for run in runs for x in run[key]]

    ratios = pooled("ratio")
    summary = {
        "memcpy_equivalents_median": round(statistics.median(ratios), 2),
        "memcpy_equivalents_range": [min(ratios), max(ratios)],
        "host_s_median": round(statistics.median(pooled("host_s")), 3),
        "memcpy_s_median": round(statistics.median(pooled("memcpy_s")), 4),
        "checksum_memcpy_median": round(statistics.median(pooled("checksum_memcpy")), 2),
        "rss_bytes_max": max(run["rss_bytes"] for run in runs),
        "runs": runs,
    }
    for key in ("pinned_bytes", "pinned_exact_bytes"):
        if key in runs[-1]:
            summary[key] = runs[-1][key]
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    numel = 2_000_000 if args.smoke else int(args.numel)
    repeats = 2 if args.smoke else args.repeats
    if args.measure_one:
        print(json.dumps(measure_one(numel, repeats, args.device, args.outer_step_threads)))
        return 0
    from benchmarks import provenance
    from torchtitan.experiments.fault_tolerance.methods.piece_workers import cores_per_rank

    out = args.json or provenance.default_output("outer_step.json", args.smoke)
    # name -> (code, outer_step_threads)
    versions: dict[str, tuple[Path, int]] = {"this": (REPO, 0)}
    if not args.no_one_thread:
        versions["this_1_thread"] = (REPO, 1)
    if args.baseline:
        versions[args.baseline] = (_snapshot(args.baseline), 0)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in versions}
    turns = 1 if args.smoke else args.turns  # in turns: a slow minute hits every version alike
    for _ in range(turns):
        for name, (code, threads) in versions.items():
            runs[name].append(_measure_in(code, args, numel, repeats, threads))
            print(f"{name}: {runs[name][-1]['ratio']} memcpy equivalents", flush=True)
    result: dict[str, Any] = {
        "benchmark": "outer_step",
        "what": "host seconds of one async DiLoCo sync point (outer state on the host) / one "
        "memcpy of the same shard (one thread), timed in the same process",
        "numel": numel,
        "device": args.device,
        "cores": cores_per_rank(),
        "target_memcpy_equivalents": TARGET_MEMCPY,
        "versions": {name: _summary(r) for name, r in runs.items()},
    }
    this = result["versions"]["this"]["memcpy_equivalents_median"]
    result["target_met"] = this <= TARGET_MEMCPY
    provenance.write_result(out, result, provenance.command_line(__file__, argv))
    for name, summary in result["versions"].items():
        print(
            f"{name}: {summary['memcpy_equivalents_median']} memcpy equivalents per sync point "
            f"(range {summary['memcpy_equivalents_range']}), {summary['host_s_median']} s; "
            f"checksum on the transport thread {summary['checksum_memcpy_median']}"
        )
    print(f"target <= {TARGET_MEMCPY} ({result['cores']} cores): "
          f"{'met' if result['target_met'] else 'MISSED'}; {out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
