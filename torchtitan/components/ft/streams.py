"""Which stream a thread's kernels and collective waits are queued on.

On nccl a collective's ``wait()`` makes the calling thread's current stream wait for it, and
every kernel queued on that stream afterwards waits too. Every thread starts on the device's
default stream, which is the training stream: work that runs beside training on a thread of
its own (DyLU's speed probe) must take a stream of its own, or the next training step waits
for the other groups. :func:`side_stream` gives it one; :func:`current_stream` says which one
a thread is on, also on a CPU (there by name only: nothing is queued), so tests can tell.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator

import torch

#: The name of the stream a thread starts on (the device's default: training's).
DEFAULT = "default"

_names = itertools.count(1)
_on_host = threading.local()


@contextlib.contextmanager
def side_stream(device: torch.device) -> Iterator[None]:
    """This thread's kernels and collective waits on a new stream of ``device`` while the
    block runs, so that training's stream never waits for them."""
    if device.type == "cuda":
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # after what is queued so far
        with torch.cuda.device(device), torch.cuda.stream(stream):
            yield
        return
    before = getattr(_on_host, "name", DEFAULT)
    _on_host.name = f"side-{next(_names)}"
    try:
        yield
    finally:
        _on_host.name = before


def current_stream(device: torch.device) -> str:
    """This thread's current stream of ``device``: :data:`DEFAULT` or another name."""
    if device.type == "cuda":
        stream = torch.cuda.current_stream(device)
        default = torch.cuda.default_stream(device)
        return DEFAULT if stream == default else f"cuda-stream-{stream.stream_id}"
    return str(getattr(_on_host, "name", DEFAULT))
