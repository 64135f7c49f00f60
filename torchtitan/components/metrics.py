"""The per-step log line, TensorBoard scalars and a JSONL record of every logged value.

``step: N  loss: X  grad_norm: X  memory: X GiB  tps: X  tflops: X  mfu: X%``: ``tps`` is
tokens per second on this rank, ``tflops`` the model FLOPs per second it achieved, ``mfu`` that
divided by the device's peak. On CPU, memory is the process's peak resident set and the peak is
measured at start-up (``measure_matmul_peak_flops``) unless ``metrics.cpu_peak_flops`` is set.
The line is the event ``train.step`` (``TRAIN_STEP``; every rank's event file, unrounded).

Every value that goes to TensorBoard also goes, unrounded, to ``<dump_folder>/metrics.jsonl``
(``metrics_replica_<R>.jsonl`` per fault-tolerant replica group), written by the job's rank 0:
one JSON object per line, ``{"step": N, "train/loss": ..., ...}``, flushed as it is written.
Training steps and validation write separate lines for the same step. When a run resumes from
the checkpoint of step K, lines of steps after K (left by the run that died) are dropped first,
so the file always reads as one history, whatever restarts it went through.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import IO, Any

import torch

from torchtitan.config.job_config import JobConfig
from torchtitan.tools.events import EventKind
from torchtitan.tools.logging import logger

# Dense bf16 peak FLOP/s of common accelerators (vendor datasheets, without sparsity).
_GPU_PEAK_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
}


def _step_line(values: dict[str, Any], color: bool) -> str:
    step, loss = values["step"], values["loss"]
    if color:
        head = f"\033[31mstep: {step:>5}\033[0m  \033[32mloss: {loss:8.4f}\033[0m"
    else:
        head = f"step: {step:>5}  loss: {loss:8.4f}"
    mfu = "n/a" if values["mfu_pct"] is None else f"{values['mfu_pct']:.1f}%"
    groups = f"  groups: {values['groups']}" if values["groups"] else ""
    return (
        f"{head}  grad_norm: {values['grad_norm']:7.4f}  memory: {values['memory_gib']:5.2f} GiB  "
        f"tps: {values['tps']:,.0f}  tflops: {values['tflops']:.3f}  mfu: {mfu}{groups}"
    )


def use_color(disabled: bool) -> bool:
    """Colour the step line only for a terminal: not when ``metrics.disable_color_printing``
    is set, ``NO_COLOR`` is (https://no-color.org), or the log (stderr) is a pipe or a file."""
    if disabled or os.environ.get("NO_COLOR"):
        return False
    return sys.stderr.isatty()


#: The step line. ``groups``: replica groups in the last quorum (None without fault tolerance
#: and before a semi-sync run's first sync); ``mfu_pct`` None when the peak is unknown.
TRAIN_STEP = EventKind("train.step", _step_line)


def cpu_threads() -> int:
    """Threads torch's CPU kernels use here, at most the CPUs this process may run on."""
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        available = os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), available))


def measure_matmul_peak_flops(
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    sizes: tuple[int, ...] | None = None,
    seconds: float = 0.1,
) -> float:
    """A practical peak FLOP/s of ``torch.mm`` in ``dtype`` on ``device``.

    The best of many square matmuls (each size in ``sizes`` in turn, for ``seconds`` in all and
    at least 3 rounds). Every rank pays ``seconds`` of CPU at start-up; on the 2-core machines
    here 0.1 s gave 190-192 GFLOP/s idle against 191-193 with 0.5 s, and 1-3 % less than 0.5 s
    with both cores busy. On CPU the matmuls run on one thread and the result is multiplied by
    :func:`cpu_threads`: a matmul short enough to run inside one scheduler slice of one core
    is rarely slowed by other processes, whereas a multi-threaded one is as slow as its most
    disturbed thread, so on a busy machine this gives a peak close to the idle machine's and
    keeps mfu from passing 100 % because the machine was busy at start-up.

    Limits: the figure assumes that all threads run as fast as one (it is a little high when
    turbo clocks fall with more busy cores, so mfu reads a little low), and a machine that is
    busy for the whole window still gives a low peak (mfu then reads high). Where that matters,
    measure once on an idle machine (``benchmarks/throughput.py`` prints it) and set
    ``metrics.cpu_peak_flops``.
    """
    on_cpu = device.type == "cpu"
    if sizes is None:
        sizes = (256, 512) if on_cpu else (4096, 8192)
    threads = torch.get_num_threads()
    if on_cpu:
        torch.set_num_threads(1)
    try:
        pairs = [
            (
                torch.randn(n, n, device=device, dtype=dtype),
                torch.randn(n, n, device=device, dtype=dtype),
            )
            for n in sizes
        ]
        for a, b in pairs:
            torch.mm(a, b)  # warm-up: allocation, kernel selection
        best = [math.inf] * len(sizes)
        start, rounds = time.perf_counter(), 0
        # Round-robin over the sizes, so that a busy spell hits all of them alike.
        while rounds < 3 or time.perf_counter() - start < seconds:
            for i, (a, b) in enumerate(pairs):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                torch.mm(a, b)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                best[i] = min(best[i], time.perf_counter() - t0)
            rounds += 1
    finally:
        if on_cpu:
            torch.set_num_threads(threads)
    flops = max(2 * n**3 / t for n, t in zip(sizes, best, strict=True))
    return flops * cpu_threads() if on_cpu else flops


def metrics_file(job_config: JobConfig) -> Path:
    """Where the job's rank 0 writes its JSONL metrics (one file per replica group)."""
    ft = job_config.fault_tolerance
    name = f"metrics_replica_{ft.replica_id}.jsonl" if ft.enable else "metrics.jsonl"
    return Path(job_config.job.dump_folder) / name


def read_metrics(path: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """A metrics JSONL file as ``{step: {name: value}}``, the lines of a step merged."""
    steps: dict[int, dict[str, Any]] = {}
    for record in _records(Path(path)):
        steps.setdefault(int(record.pop("step")), {}).update(record)
    return steps


def _records(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break  # the torn last line of a process killed while writing it
            raise
    return records


def peak_flops(device: torch.device, job_config: JobConfig) -> float | None:
    """Peak FLOP/s used for mfu, or None when unknown (mfu is then printed as n/a)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in _GPU_PEAK_BF16.items():
            if key in name:
                return value
        return None
    configured = job_config.metrics.cpu_peak_flops
    if configured < 0:
        return None
    if configured > 0:
        return configured
    measured = measure_matmul_peak_flops(device)
    logger.info(
        f"CPU peak for mfu: {measured / 1e9:.1f} GFLOP/s (float32 matmul, measured on one "
        f"thread, times {cpu_threads()} threads); set metrics.cpu_peak_flops to fix it"
    )
    return measured


def peak_memory_gib(device: torch.device) -> float:
    """Peak accelerator memory reserved, or the process's peak resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class MetricsProcessor:
    """Accumulates tokens and time between log steps; prints the step line; writes TensorBoard
    (into ``tb_folder``) and JSONL records (into ``jsonl_path``); None turns either off, as on
    every rank but the job's first."""

    def __init__(
        self,
        job_config: JobConfig,
        device: torch.device,
        flops_per_token: float,
        tb_folder: Path | None,
        jsonl_path: Path | None = None,
    ) -> None:
        self.device = device
        self.flops_per_token = flops_per_token
        self.peak = peak_flops(device, job_config)
        self.color = use_color(job_config.metrics.disable_color_printing)
        self.writer = None
        if tb_folder is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(tb_folder))
        self.jsonl_path = jsonl_path
        self.jsonl: IO[str] | None = None
        self.tokens = 0
        self.last_time = time.perf_counter()

    def start(self, step: int) -> None:
        """Training (re)starts after ``step`` (0: from scratch): open the JSONL file, dropping
        the records of later steps a previous run left, and restart the tps clock."""
        if self.jsonl_path is not None:
            kept: list[dict[str, Any]] = []
            if step > 0 and self.jsonl_path.is_file():
                kept = [r for r in _records(self.jsonl_path) if r.get("step", 0) <= step]
            self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
            if self.jsonl is not None:
                self.jsonl.close()
            self.jsonl = self.jsonl_path.open("w", encoding="utf-8")
            for record in kept:
                self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        self.tokens = 0
        self.last_time = time.perf_counter()

    def count(self, tokens: int) -> None:
        """Add the tokens of one step (counted toward tps until the next log line)."""
        self.tokens += tokens

    def log_step(self, step: int, loss: float, grad_norm: float, groups: int | None = None) -> dict:
        """Print the step line (with ``groups`` in the last quorum, if given) and write its
        scalars; returns them."""
        now = time.perf_counter()
        elapsed = max(now - self.last_time, 1e-9)
        tps = self.tokens / elapsed
        flops = tps * self.flops_per_token
        memory = peak_memory_gib(self.device)
        values = {
            "loss": loss,
            "grad_norm": grad_norm,
            "memory_gib": memory,
            "tps": tps,
            "tflops": flops / 1e12,
        }
        if self.peak:
            values["mfu_pct"] = 100 * flops / self.peak
        fields: dict[str, Any] = {
            **values,
            "mfu_pct": values.get("mfu_pct"),
            "groups": groups or None,
        }
        TRAIN_STEP.emit(step=step, color=self.color, **fields)
        self.write_scalars(step, {f"train/{k}": v for k, v in values.items()})
        self.tokens = 0
        self.last_time = now
        return values

    def exclude_time(self, seconds: float) -> None:
        """Leave ``seconds`` (validation, checkpointing) out of the next tps figure."""
        self.last_time += seconds

    def write_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """Write scalars to TensorBoard and as one JSONL line (each only where it is on)."""
        if self.jsonl is None and self.jsonl_path is not None:
            self.start(0)  # a caller that never called start(): a fresh file
        if self.jsonl is not None:
            # Floats as Python writes them: the shortest text that reads back bit-identical.
            self.jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
            self.jsonl.flush()
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
