"""``StepClock``: seconds on the model's device, for DyLU's step times."""

from __future__ import annotations

import time

import pytest
import torch

from torchtitan.experiments.fault_tolerance.methods.step_clock import StepClock


def test_on_the_cpu_the_clock_is_the_host_s() -> None:
    clock = StepClock(torch.device("cpu"))
    before = time.perf_counter()
    now = clock.now()
    assert before <= now <= time.perf_counter()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_clock_reads_when_the_gpu_is_done_not_when_the_host_queued() -> None:
    """About 0.5 s of GPU work, queued: the host returns from queueing at once, and the clock
    advances by the time the GPU took (as long as the host then waited in ``now()``)."""
    device = torch.device("cuda")
    cycles = int(0.5 * _cycles_per_second(device))
    clock = StepClock(device)
    before = clock.now()
    start = time.perf_counter()
    torch.cuda._sleep(cycles)
    queued = time.perf_counter() - start
    seconds = clock.now() - before
    waited = time.perf_counter() - start
    assert queued < 0.05 and seconds > 0.25
    assert seconds == pytest.approx(waited, abs=0.03)
    # Nothing queued since: the next reading follows at once.
    assert clock.now() - before == pytest.approx(seconds, abs=0.03)


def _cycles_per_second(device: torch.device) -> float:
    """The GPU's cycles per second in ``torch.cuda._sleep``, timed by the host around fully
    synchronized sleeps (the first one brings the GPU's clocks up)."""
    rate = 0.0
    for _ in range(2):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.cuda._sleep(50_000_000)
        torch.cuda.synchronize(device)
        rate = 50_000_000 / (time.perf_counter() - start)
    return rate
