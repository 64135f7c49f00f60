"""A heal's transfer in bounded pieces, so that no single operation outlives its timeouts.

torchft's process-group checkpoint transport sends each tensor as one point-to-point operation
and, for device tensors, queues all before waiting for any. c10d's nccl watchdog counts from the
queueing, so the last send of a full heal (160 GB for 8B: 21 min at 1 Gbit/s) would be killed,
and the healthy peer with it. :class:`PiecewiseGroup` stands in for the replicate process group
on both ends: pieces of at most ``piece_bytes``, at most ``in_flight`` queued over all threads
(a new one once the oldest is done), so an operation lasts about ``in_flight * piece_bytes`` at
the link's rate (256 MiB by default: 2.1 s at 1 Gbit/s). Both ends cut alike; each piece has
its own tag.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch

from torchtitan.components.ft.delivery import AllWorks, wait_delivered

#: Largest piece of a tensor in one operation, and how many may be queued at once.
PIECE_BYTES = 64 * 2**20
IN_FLIGHT = 4
#: Piece k's tag is ``tag * MAX_PIECES + k``, within int32 (a huge tensor gets larger pieces).
MAX_PIECES = 1 << 10


def pieces_of(tensor: torch.Tensor, piece_bytes: int) -> list[torch.Tensor]:
    """``tensor``'s bytes (contiguous) as consecutive views of at most ``piece_bytes`` each
    (more when there would be over ``MAX_PIECES``); one empty view for an empty tensor."""
    flat = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else tensor.view(torch.uint8)
    size = max(piece_bytes, -(-flat.numel() // MAX_PIECES))
    return [flat[i : i + size] for i in range(0, flat.numel(), size)] or [flat]


class _Once:
    """A piece's work, waited for at most once: a second ``wait`` on a gloo send or receive
    would wait for another message (and time out). Waiting returns once the piece is there
    and raises when it did not arrive whole (``delivery.wait_delivered``: on nccl a piece cut
    off by a peer's death fails only in its work). Its slot among the pieces in flight is
    freed once, when it was waited for or dropped."""

    def __init__(self, work: Any, pg: Any, free: Callable[[], None]) -> None:
        self.work = work
        self.pg = pg
        self.waited = False
        self._free: Callable[[], None] | None = free

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self.waited:
            self.waited = True
            try:
                wait_delivered(self.work, self.pg, timeout)
            finally:
                self.drop()
        return True

    def drop(self) -> None:
        """Free its slot (once)."""
        free, self._free = self._free, None
        if free is not None:
            free()


class PiecewiseGroup:
    """The replicate process group as a heal's transport sees it (``send``/``recv``), each
    tensor in pieces, ``in_flight`` pieces queued at most, over all threads (a sender answers
    several joiners at once, one per thread: the link carries ``in_flight`` pieces whatever
    their number). ``timeout``: how long the wait for a thread's oldest piece may take (the
    heal's ``timeout_s``); a thread with none queued waits for another's to free a slot."""

    def __init__(
        self,
        pg: Any,
        timeout: timedelta,
        piece_bytes: int = PIECE_BYTES,
        in_flight: int = IN_FLIGHT,
    ) -> None:
        self.pg = pg
        self.timeout = timeout
        self.piece_bytes = piece_bytes
        self.in_flight = in_flight
        self._local = threading.local()
        self._slots = threading.Condition()
        self._in_use = 0
        #: Operations issued so far, and the most that were ever queued at once.
        self.issued = 0
        self.most_queued = 0

    @contextlib.contextmanager
    def heal(self) -> Iterator[None]:
        """Around one end of a heal: an earlier (maybe failed) one is not waited for, and the
        last works, which hold their tensors (on a joiner's GPU, a payload's buffer), are
        dropped at the end."""
        self._drop_queued()
        try:
            yield
        finally:
            self._drop_queued()

    @property
    def _queued(self) -> deque[_Once]:
        """This thread's pieces in flight."""
        if not hasattr(self._local, "queued"):
            self._local.queued = deque()
        queued: deque[_Once] = self._local.queued
        return queued

    def _drop_queued(self) -> None:
        while self._queued:
            self._queued.popleft().drop()

    def _take_slot(self) -> None:
        """A slot for one more piece: this thread's oldest piece waited for while none is
        free, or another thread's freeing one."""
        while True:
            with self._slots:
                if self._in_use < self.in_flight:
                    self._in_use += 1
                    self.issued += 1
                    self.most_queued = max(self.most_queued, self._in_use)
                    return
                if not self._queued:
                    self._slots.wait()
                    continue
            self._queued.popleft().wait(self.timeout)

    def _free_slot(self) -> None:
        with self._slots:
            self._in_use -= 1
            self._slots.notify_all()

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> AllWorks:
        return self._each_piece(self.pg.send, tensors, dst_rank, tag)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> AllWorks:
        return self._each_piece(self.pg.recv, tensors, src_rank, tag)

    def _each_piece(self, issue: Any, tensors: list[torch.Tensor], peer: int, tag: int) -> Any:
        (tensor,) = tensors
        if not tensor.is_contiguous():
            raise ValueError("a heal sends and receives contiguous tensors only")
        works = []
        for k, piece in enumerate(pieces_of(tensor, self.piece_bytes)):
            self._take_slot()
            try:
                issued = issue([piece], peer, tag * MAX_PIECES + k)
            except BaseException:
                self._free_slot()
                raise
            work = _Once(issued, self.pg, self._free_slot)
            self._queued.append(work)
            works.append(work)
        return AllWorks(works)
