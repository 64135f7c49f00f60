"""Seconds on the model's device, for DyLU's step times.

The host only queues a GPU's kernels: ``optimizer.step()`` returns when the step is issued, and
the GPU finishes it later, up to a queue's depth of steps behind. The host's clock there says
how fast this group's Python issues work, not how fast its GPU trains, and DyLU would plan
periods from those wrong speeds. :class:`StepClock` reads the time the device's stream has
reached instead.

Each reading makes the host wait for the GPU to catch up (one synchronization, which drains the
queue), so DyLU reads it only where it decides: its speed probe, a correction of the step
count, a period's end and the next one's begin; never after every inner step.
"""

from __future__ import annotations

import time

import torch


class StepClock:
    """``now()``: seconds on ``device``'s timeline.

    On CUDA: an event recorded on the device's current stream, waited for (the host waits
    until the GPU has reached it, no longer), timed from the previous reading's event, the
    first one recorded when the clock is made, at the host's ``time.perf_counter``. On the
    CPU (and other devices) the host's ``time.perf_counter``: a CPU's work is done when its
    call returns. Only differences between readings mean anything."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._seconds = time.perf_counter()
        self._last = self._record() if device.type == "cuda" else None

    def now(self) -> float:
        if self._last is None:
            return time.perf_counter()
        event = self._record()
        event.synchronize()
        # From the last reading, not from the origin: elapsed_time is a float32 of
        # milliseconds, which over a day of training keeps only about 10 ms.
        self._seconds += self._last.elapsed_time(event) / 1000
        self._last = event
        return self._seconds

    def _record(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event
