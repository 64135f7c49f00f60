"""A process group with nccl's semantics, for CPU tests of code written for nccl.

What gloo tests cannot see, and :class:`NcclLikeGroup` shows (over a real gloo group, or
alone for one rank):

* ``wait()`` returns at once: it only orders the caller's stream (recorded, with the stream
  the caller is on: ``streams.current_stream``), and the result lands later, after
  ``land_after_s``; reading it before is reading the old values.
* A failure never raises in ``wait()``: a collective that fails (:meth:`NcclLikeGroup.fail_next`,
  as c10d's watchdog records a peer's closed connection and aborts the communicator) lands half
  its result and is visible only as the work's ``exception()``, or raised by a wait *with a
  timeout*, which blocks until the collective has finished.
* A wait with a timeout on a collective that does not land in time (:meth:`hang_next`: a peer
  gone after the quorum) aborts the communicator, as c10d's does: every pending collective ends
  without its result.
* torchft's abort (:meth:`NcclLikeGroup.abort`, e.g. the peer watch's) ends the pending
  collectives without their result and without an error on their works; the group's ``_pg``
  (torchft's c10d group) is gone, as in torchft's wrapper.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchtitan.components.ft import streams

CPU = torch.device("cpu")


@dataclass
class Issued:
    """One operation as the group saw it."""

    op: str
    #: The stream current when it was issued, and at each ``wait`` on it.
    issued_on: str
    waited_on: list[str] = field(default_factory=list)


class LateWork:
    """An operation's work with nccl's semantics (module docstring)."""

    def __init__(self, group: NcclLikeGroup, issued: Issued) -> None:
        self.group = group
        self.issued = issued
        self._done = threading.Event()
        self._error: Exception | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.issued.waited_on.append(streams.current_stream(CPU))
        if timeout is None:  # the stream waits; the host does not
            return True
        if not self._done.wait(timeout.total_seconds()):
            self.group.abort_communicator()
            raise RuntimeError(f"Watchdog caught collective operation timeout after {timeout}")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def exception(self) -> Exception | None:
        return self._error if self._done.is_set() else None

    def end(self, error: Exception | None) -> None:
        self._error = error
        self._done.set()


class NcclLikeGroup:
    """``inner`` (a gloo process group; None: one rank, nothing to talk to) with nccl's
    semantics. ``land_after_s``: how long after the collective a result lands."""

    def __init__(
        self, inner: dist.ProcessGroup | None = None, *, land_after_s: float = 0.3
    ) -> None:
        self.inner = inner
        self.land_after_s = land_after_s
        self.issued: list[Issued] = []
        self._fail_in: int | None = None
        self._hang_next = False
        self._pending: list[tuple[LateWork, Callable[[bool], None]]] = []
        self._lock = threading.Lock()
        #: torchft's c10d group under its wrapper: gone after torchft's abort.
        self._pg: object | None = object()

    # ---- what a test plants ------------------------------------------------------------------

    def fail_next(self, after: int = 0) -> None:
        """The next collective but ``after`` fails after half its result landed (an
        asynchronous error; the peers' side of it completes)."""
        self._fail_in = after

    def hang_next(self) -> None:
        """The next collective never lands (a peer gone after the quorum), until an abort."""
        self._hang_next = True

    # ---- torchft's reconfigurable group, as our code uses it ---------------------------------

    def size(self) -> int:
        return 1 if self.inner is None else self.inner.size()

    def rank(self) -> int:
        return 0 if self.inner is None else self.inner.rank()

    def abort(self, errored: bool = True) -> None:
        """torchft's abort: its c10d group dropped, the kernels in flight ended, unwritten."""
        self._pg = None
        self._end_pending(None)

    def abort_communicator(self) -> None:
        """c10d's abort of the communicator (a wait past its timeout): what is in flight ends
        unwritten, with the error on its work."""
        self._end_pending(RuntimeError("NCCL communicator was aborted"))

    def _end_pending(self, error: Exception | None) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for work, _ in pending:
            work.end(error)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> LateWork:
        private = [t.clone() for t in tensors]
        inner = None if self.inner is None else self.inner.allreduce(private, opts)
        return self._issue("allreduce", inner, list(zip(private, tensors, strict=True)), opts)

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any
    ) -> LateWork:
        private = [[t.clone() for t in out] for out in outputs]
        if self.inner is None:
            private[0][0].copy_(inputs[0])
            inner = None
        else:
            inner = self.inner.allgather(private, inputs, opts)
        pairs = [(p, t) for out_p, out in zip(private, outputs, strict=True)
                 for p, t in zip(out_p, out, strict=True)]  # fmt: skip
        return self._issue("allgather", inner, pairs, opts)

    def alltoall_base(
        self, output: torch.Tensor, input: torch.Tensor, out_splits: list[int],
        in_splits: list[int], opts: Any,
    ) -> LateWork:  # fmt: skip
        private = output.clone()
        if self.inner is None:
            private.copy_(input)
            inner = None
        else:
            inner = self.inner.alltoall_base(private, input, out_splits, in_splits, opts)
        return self._issue("alltoall", inner, [(private, output)], opts)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> LateWork:
        assert self.inner is not None, "point-to-point needs a peer"
        return self._issue("send", self.inner.send(tensors, dst, tag), [], None)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> LateWork:
        assert self.inner is not None, "point-to-point needs a peer"
        private = [t.clone() for t in tensors]
        inner = self.inner.recv(private, src, tag)
        return self._issue("recv", inner, list(zip(private, tensors, strict=True)), None)

    def _issue(
        self, op: str, inner: Any, results: list[tuple[torch.Tensor, torch.Tensor]], opts: Any
    ) -> LateWork:
        issued = Issued(op, streams.current_stream(CPU))
        self.issued.append(issued)
        work = LateWork(self, issued)
        fail = self._fail_in == 0
        self._fail_in = None if self._fail_in in (None, 0) else self._fail_in - 1
        hang, self._hang_next = self._hang_next, False

        def land(whole: bool) -> None:
            for source, target in results:
                n = source.numel() if whole else source.numel() // 2
                target.view(-1)[:n].copy_(source.view(-1)[:n])

        def deliver() -> None:
            error: Exception | None = None
            try:
                if inner is not None:
                    inner.wait()
            except Exception as e:
                error = e
            time.sleep(self.land_after_s)
            with self._lock:
                if (work, land) not in self._pending:
                    return  # aborted meanwhile: nothing lands
                self._pending.remove((work, land))
            if hang:
                return
            if fail and error is None:
                error = RuntimeError("NCCL communicator was aborted: remote process exited")
            land(error is None)
            work.end(error)

        with self._lock:
            self._pending.append((work, land))
        if hang:  # stays pending until an abort
            threading.Thread(target=lambda: inner.wait() if inner is not None else None,
                             daemon=True).start()  # fmt: skip
        else:
            threading.Thread(target=deliver, daemon=True).start()
        return work
