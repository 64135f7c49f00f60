"""A pass over a fragment's tensors in pieces (``outer_passes``): on the host, pieces of
:data:`PASS_PIECE_VALUES` values shared out over the cores this rank may use, each piece's
operations run while it is in a core's cache, into scratch buffers of a piece's size, each
thread taking every n-th piece with each op on one core; on an accelerator, pieces of
:data:`DEVICE_PIECE_VALUES` values queued by the caller's thread.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch

from torchtitan.tools.digest import PieceHashes
from torchtitan.tools.scratch import Scratch

#: Values per piece: 1 MiB of fp32 per array, so that a piece's arrays and scratch stay in a
#: core's cache; a divisor of the digest's chunk (2^20).
PASS_PIECE_VALUES = 1 << 18
#: Values per piece on an accelerator: 16 MiB of fp32 per array, few enough launches and a
#: bounded scratch.
DEVICE_PIECE_VALUES = 1 << 22
HOST = torch.device("cpu")


def piece_values(device: torch.device) -> int:
    """The values of a piece of a pass over tensors on ``device``."""
    return PASS_PIECE_VALUES if device.type == "cpu" else DEVICE_PIECE_VALUES


def cores_per_rank() -> int:
    """The host cores this rank may run on (its affinity), shared with the other ranks of its
    host (``LOCAL_WORLD_SIZE``), at least one."""
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    available = available or os.cpu_count() or 1
    return max(1, available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


class Piece(NamedTuple):
    """A piece's values (fewer at a parameter's end) of one parameter from element ``a``: its
    global copy and what the pass also needs there (None: not in this pass): the local start,
    the model's values, the pass's output, the gradient of the outer step, and the outer
    optimizer's momentum and (Delayed Nesterov) sum of the window's gradients."""

    name: str
    a: int
    glob: torch.Tensor
    start: torch.Tensor | None
    local: torch.Tensor | None
    out: torch.Tensor | None
    source: torch.Tensor | None
    momentum: torch.Tensor | None
    grad_sum: torch.Tensor | None


def cut(
    numel: dict[str, int],
    columns: Sequence[Mapping[str, torch.Tensor | None] | None],
    values: int = PASS_PIECE_VALUES,
) -> list[Piece]:
    """Each non-empty parameter's pieces of ``values`` values, from its tensor in each column
    (the fields of :class:`Piece` after ``a``; None: not in this pass). One ``split`` per
    tensor: slicing each piece in Python costs more than a small piece's ops."""
    pieces = []
    for name, n in numel.items():
        if n == 0:  # e.g. a rank's empty FSDP shard of a small parameter
            continue
        tensors = [None if c is None else c[name] for c in columns]
        split = [
            (None,) * -(-n // values) if t is None else t.view(-1).split(values) for t in tensors
        ]
        parts = enumerate(zip(*split, strict=True))
        pieces += [Piece(name, k * values, *row) for k, row in parts]
    return pieces


class PieceBuffers(NamedTuple):
    """A piece's temporaries: views of its worker's :class:`~torchtitan.tools.scratch.Scratch`,
    reused by every piece."""

    grad: torch.Tensor
    t1: torch.Tensor
    #: The outer step's temporary.
    step: torch.Tensor


class Worker:
    """One thread's scratch buffers on ``device`` and the chunk hashes of the pieces it took."""

    def __init__(self, device: torch.device) -> None:
        self._buffers = Scratch(device)
        self.hashes: dict[str, PieceHashes] = {}
        if device.type == "cpu":
            self.scratch(PASS_PIECE_VALUES)  # allocated once, at a piece's size

    def scratch(self, numel: int, dtype: torch.dtype = torch.float32) -> PieceBuffers:
        """Temporaries for a piece of ``numel`` values of ``dtype`` (the state's: a temporary
        of another dtype would round otherwise than the whole-tensor operation), kept per
        dtype."""
        get = self._buffers.get
        return PieceBuffers(
            grad=get(f"grad {dtype}", numel, dtype),
            t1=get(f"t1 {dtype}", numel, dtype),
            step=get(f"step {dtype}", numel, dtype),
        )


def run_pieces(
    pieces: list[Piece],
    body: Callable[[Piece, Worker], None],
    threads: int = 0,
    hashed: dict[str, int] | None = None,
    device: torch.device = HOST,
) -> dict[str, list[int]]:
    """``body(piece, worker)`` for every piece of tensors on ``device``. On the host, on
    ``threads`` threads (0: :func:`cores_per_rank`) with torch's intra-op threads set to one
    meanwhile (splitting a piece's ops would pay a fork and join per op); on an accelerator,
    queued by the caller's thread. With ``hashed`` (each parameter's numel), the chunk hashes
    the bodies took, by parameter."""
    if device.type != "cpu":
        return _workers(1, device).run(pieces, body, hashed)
    before = torch.get_num_threads()
    if before != 1:
        torch.set_num_threads(1)
    try:
        return _workers(threads or cores_per_rank()).run(pieces, body, hashed)
    finally:
        if before != 1:
            torch.set_num_threads(before)


@functools.cache
def _workers(count: int, device: torch.device = HOST) -> _Workers:
    """The process's workers on ``device``, shared by its passes."""
    return _Workers(count, device)


class _Workers:
    """The caller's thread and ``count - 1`` more, each taking every ``count``-th piece (torch's
    ops release the GIL)."""

    def __init__(self, count: int, device: torch.device) -> None:
        self.device = device
        self.workers = [Worker(device) for _ in range(count)]
        self._lock = threading.Lock()  # one pass at a time (tests run several groups)
        self._pool = (
            ThreadPoolExecutor(count - 1, thread_name_prefix="sync-point-pass")
            if count > 1
            else None
        )

    def run(
        self,
        pieces: list[Piece],
        body: Callable[[Piece, Worker], None],
        hashed: dict[str, int] | None,
    ) -> dict[str, list[int]]:
        """:func:`run_pieces`; a chunk's hash is its sums from every worker, modulo 2^64."""
        with self._lock:
            for worker in self.workers:
                worker.hashes = {
                    name: PieceHashes(n, 4, self.device) for name, n in (hashed or {}).items()
                }
            count = len(self.workers)

            def share(k: int) -> None:
                for piece in pieces[k::count]:
                    body(piece, self.workers[k])

            futures = [] if self._pool is None else [
                self._pool.submit(share, k) for k in range(1, count)
            ]  # fmt: skip
            try:
                share(0)
            finally:
                for future in futures:
                    future.result()  # raises what the worker raised
            return {
                name: [
                    sum(chunk) % (1 << 64)
                    for chunk in zip(*(w.hashes[name].hashes for w in self.workers), strict=True)
                ]
                for name in hashed or {}
            }
