"""Seconds on the model's device, for DyLU's step times.

The host only queues a GPU's kernels, up to a queue's depth of steps ahead, so its clock
measures how fast Python issues work, not how fast the GPU trains. :class:`StepClock` reads the
time the device's stream has reached instead. Each reading synchronizes (drains the queue), so
DyLU reads it only where it decides (probe, correction, period end and begin), never after
every inner step.
"""

from __future__ import annotations

import time

import torch


class StepClock:
    """``now()``: seconds on ``device``'s timeline; only differences between readings mean
    anything.

    On CUDA: an event recorded on the current stream and synchronized (the host waits until
    the GPU reaches it), timed from the previous reading's event (the first recorded at
    construction). Elsewhere the host's ``time.perf_counter``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._seconds = time.perf_counter()
        self._last = self._record() if device.type == "cuda" else None

    def now(self) -> float:
        if self._last is None:
            return time.perf_counter()
        event = self._record()
        event.synchronize()
        # From the last reading: elapsed_time is float32 ms, ~10 ms resolution after a day.
        self._seconds += self._last.elapsed_time(event) / 1000
        self._last = event
        return self._seconds

    def _record(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event
