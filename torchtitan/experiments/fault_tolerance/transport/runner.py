"""Runs the compressed all-reduces of a sync on a background thread, in submission order.

Every rank submits the same collectives in the same order, so one thread issuing them from a
FIFO queue issues them in the same order on every rank; the caller computes meanwhile. Failure
semantics follow torchft's ``Manager.allreduce``: a collective that fails completes its work
normally, with the error in ``work.error`` for its caller to report (the Manager's
``report_error``, so that the sync is not committed); ``wait`` never raises.

A collective can also be *abandoned* (:meth:`AsyncCompressedAllReduce.abandon`): a peer of the
sync is gone, so the collective under way and those queued behind it will never deliver. Their
works complete at once, without result, and later submissions go to a new thread with buffers
of its own. The old thread stays blocked in its collective until that returns (its process
group is torn down at the next quorum, or the collective times out), then touches nothing
shared: no work, no residual. It may still write the tensor it was given,
which belongs to the abandoned sync alone.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from torchtitan.components.ft import given_up
from torchtitan.experiments.fault_tolerance.transport.codecs import (
    check_flat_fp32,
    get_codec,
)
from torchtitan.experiments.fault_tolerance.transport.collective import (
    CompressionStats,
    Delivered,
    IssueGate,
    compressed_all_reduce,
    is_finite,
)
from torchtitan.experiments.fault_tolerance.transport.residuals import (
    FIRST,
    ResidualKey,
    Residuals,
)
from torchtitan.tools.exact_division import divide_
from torchtitan.tools.scratch import Scratch


@dataclass
class Packed:
    """Tensors that travel as one flat fp32 buffer (a bucket), at their offsets in it. The
    background thread makes the buffer right before the bucket's collective and drops it once
    the result is copied back, so that queued buckets do not each hold a copy meanwhile."""

    members: list[tuple[torch.Tensor, int]]
    numel: int
    device: torch.device
    #: On CUDA: recorded on the stream current when each member was handed in (torchft hands
    #: them in on a stream of its own), waited for before packing.
    ready: list[torch.cuda.Event] = field(default_factory=list)

    def pack(self) -> torch.Tensor:
        flat = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        for tensor, offset in self.members:
            flat[offset : offset + tensor.numel()].view_as(tensor).copy_(tensor)
        return flat

    def unpack(self, flat: torch.Tensor) -> None:
        for tensor, offset in self.members:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))


class CompressedWork:
    """A submitted :meth:`AsyncCompressedAllReduce.submit`: wait for it or chain on its future.

    The future completes with the tensor once the all-reduce (and the division) is done, or
    after a failure (in :attr:`error`); it never carries the collective's error. A
    :class:`Packed` submission completes with an empty tensor (its values are back in the
    tensors it packs); an abandoned one completes without result.
    """

    def __init__(self, tensor: torch.Tensor, numel: int | None = None) -> None:
        self.tensor = tensor
        #: fp32 values carried (a packed bucket's, whose ``tensor`` is an empty stand-in).
        self.numel = tensor.numel() if numel is None else numel
        self.stats: CompressionStats | None = None
        #: Why the collective failed (or ended past its timeout), once done; None: it did not.
        self.error: Exception | None = None
        #: With ``check_finite``: ``"sent"`` when this rank's own input held an inf or NaN (it
        #: sent NaNs), ``"received"`` when only the result did; None when all was finite.
        self.non_finite: str | None = None
        #: With ``keep_delivered``: the result as every rank received it (after success).
        self.delivered: Delivered | None = None
        #: Set when the work was abandoned (:meth:`AsyncCompressedAllReduce.abandon`).
        self.abandoned = False
        #: With ``check_finite``, once a finite result arrived: its sum of squares.
        self.squares: float | None = None
        self._future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._done = threading.Event()
        self._lock = threading.Lock()

    def wait(self) -> bool:
        """Block until done, callbacks chained on the future included (torchft's DiLoCo copies
        a bucket back in one; a future's ``wait`` returns before its callbacks have run).
        True, as torchft's works return (a failure is in :attr:`error`)."""
        self._done.wait()
        return True

    def wait_for(self, seconds: float) -> bool:
        """Wait up to ``seconds``; whether the work is done."""
        return self._done.wait(seconds)

    def done(self) -> bool:
        return self._done.is_set()

    def complete(self, error: BaseException | None = None) -> None:
        """Complete the future (running its callbacks), then release ``wait``. Only the first
        call does anything (an abandoned work may be completed from two threads)."""
        with self._lock:
            if self._future.done():
                return
            try:
                if error is None:
                    self._future.set_result(self.tensor)
                else:
                    self._future.set_exception(error)  # type: ignore[arg-type]  # stub says T
            finally:
                self._done.set()

    def abandon(self) -> None:
        """Complete it now, without result (its collective will never deliver)."""
        if not self.done():
            self.abandoned = True
        self.complete()

    def get_future(self) -> torch.futures.Future[torch.Tensor]:
        """Completes with the tensor when done."""
        return self._future


class _Job(NamedTuple):
    pg: dist.ProcessGroup
    tensor: torch.Tensor
    dtype: str
    divide_by: float
    error_feedback: Residuals | None
    key: ResidualKey
    ready: torch.cuda.Event | None
    work: CompressedWork
    timeout: timedelta | None
    check_finite: bool
    packed: Packed | None
    keep_delivered: bool


class _Lane:
    """One thread issuing collectives from its queue, with its own buffers and streams (an
    abandoned lane's collective may still use them)."""

    def __init__(self, run: Callable[[_Lane], None], name: str) -> None:
        self.queue: queue.Queue[_Job | None] = queue.Queue()
        #: The thread's buffers, reused from one collective to the next (see Scratch).
        self.scratch: dict[torch.device, Scratch] = {}
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        #: Held while a finished collective's results are handed over, and to abandon the lane.
        self.lock = threading.Lock()
        #: Closed when the lane is abandoned: no collective of it is issued any more.
        self.gate = IssueGate(self.lock)
        self.current: _Job | None = None
        # A daemon thread, so that a collective hung on a dead peer cannot block process exit.
        self.thread = threading.Thread(target=run, args=(self,), name=name, daemon=True)
        self.thread.start()


class AsyncCompressedAllReduce:
    """Runs :func:`compressed_all_reduce` on one background thread, in submission order. On
    CUDA the thread works on its own stream, after the submitter's stream has produced the
    tensor, and synchronizes before completing the future."""

    def __init__(self, name: str = "compressed-allreduce") -> None:
        self._name = name
        self._closed = False
        self._lock = threading.Lock()
        #: Why this rank's collectives no longer line up with its peers' (a bucket could not be
        #: packed): every later job fails without a collective; the transport stops the trainer.
        self.broken: Exception | None = None
        self._lane = _Lane(self._run, name)

    def submit(
        self,
        pg: dist.ProcessGroup,
        tensor: torch.Tensor | Packed,
        dtype: str,
        *,
        divide_by: float = 1,
        error_feedback: Residuals | None = None,
        key: ResidualKey = FIRST,
        timeout: timedelta | None = None,
        check_finite: bool = False,
        keep_delivered: bool = False,
    ) -> CompressedWork:
        """Queue a SUM all-reduce of ``tensor`` (then divided by ``divide_by``) in place; do
        not touch ``tensor`` (a :class:`Packed`'s tensors) until the returned work is done.

        If the collective fails, the work still completes, with the error in ``work.error``;
        the tensor is then undefined. ``timeout``: the longest each collective may take (default:
        the process group's). ``check_finite``: check the input before it is sent and the
        result after it arrived and say what was found in ``work.non_finite``; an input that
        is not finite is sent as NaNs (and leaves no residual), so that every rank drops the
        result alike. ``keep_delivered``: keep the result as every rank received it in
        ``work.delivered`` (CPU memory).
        """
        get_codec(dtype)  # fail here, in the caller, on a bad name
        packed = tensor if isinstance(tensor, Packed) else None
        if packed is not None:  # an empty stand-in until the thread packs the bucket
            tensor = torch.empty(0, dtype=torch.float32, device=packed.device)
        else:
            assert isinstance(tensor, torch.Tensor)
            check_flat_fp32(tensor)
        ready = torch.cuda.current_stream(tensor.device).record_event() if tensor.is_cuda else None
        work = CompressedWork(tensor, None if packed is None else packed.numel)
        job = _Job(
            pg, tensor, dtype, divide_by, error_feedback, key, ready, work, timeout,
            check_finite, packed, keep_delivered,
        )  # fmt: skip
        with self._lock:
            if self._closed:
                raise RuntimeError("AsyncCompressedAllReduce is shut down")
            self._lane.queue.put(job)
        return work

    def abandon(self) -> int:
        """End the collective under way and every queued one now: their works complete without
        result (marked ``abandoned``) and without an error (the caller reports why).
        Later submissions run on a new thread. Returns how many works were abandoned."""
        with self._lock:
            lane, self._lane = self._lane, _Lane(self._run, self._name)
        # Its collective may stay blocked until its timeout: the process exits past it.
        lane.thread.name = given_up.thread_name(self._name)
        with lane.lock:
            lane.gate.close()
            jobs = [lane.current] if lane.current is not None else []
            while True:
                try:
                    job = lane.queue.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    jobs.append(job)
            lane.queue.put(None)  # the old thread ends once its collective returns
        for job in jobs:
            job.work.abandon()
        return len(jobs)

    def shutdown(self, timeout: float | None = None) -> None:
        """Finish the queued collectives, then stop the thread (waiting up to ``timeout``)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            lane = self._lane
            lane.queue.put(None)
        lane.thread.join(timeout)

    def _run(self, lane: _Lane) -> None:
        while True:
            job = lane.queue.get()
            if job is None:
                return
            with lane.lock:
                taken_too_late = lane.gate.closed  # abandon() did not see it: taken meanwhile
                if not taken_too_late:
                    lane.current = job
            if taken_too_late:
                job.work.abandon()
                return
            self._execute(lane, job)
            with lane.lock:
                lane.current = None

    def _execute(self, lane: _Lane, job: _Job) -> None:
        start = time.monotonic()
        error: Exception | None = None
        try:
            if self.broken is not None:
                # Issuing this collective would pair it with the peers' previous one.
                raise RuntimeError(f"not sent: {self.broken}")
            if job.ready is not None:
                stream = lane.streams.get(job.tensor.device)
                if stream is None:
                    stream = torch.cuda.Stream(job.tensor.device)
                    lane.streams[job.tensor.device] = stream
                # The caller's allocator stream must not reuse the memory while we use it.
                job.tensor.record_stream(stream)
                with torch.cuda.device(job.tensor.device), torch.cuda.stream(stream):
                    stream.wait_event(job.ready)
                    for ready in job.packed.ready if job.packed is not None else ():
                        stream.wait_event(ready)
                    try:
                        self._reduce(lane, job)
                    finally:  # even after a failure: nothing of ours still runs on the tensors
                        stream.synchronize()
            else:
                self._reduce(lane, job)
        except Exception as e:  # torchft semantics: record the error, complete normally
            error = e
        elapsed = time.monotonic() - start
        if job.timeout is not None and elapsed >= job.timeout.total_seconds():
            # Even without an error: e.g. a collective aborted at the timeout is not trusted.
            why = "the collective ended past its timeout" if error is None else error
            error = TimeoutError(f"timed out after {elapsed:.1f}s: {why}")
        with lane.lock:
            if lane.gate.closed:  # the sync ended without this collective: touch nothing shared
                return
            stats = job.work.stats
            if error is None and stats is not None and stats.residual is not None:
                assert job.error_feedback is not None
                job.error_feedback.stage(job.key, stats.residual)
                stats.residual = None
            job.work.error = error
            job.work.complete()

    def _reduce(self, lane: _Lane, job: _Job) -> None:
        packed = job.packed
        if packed is not None:  # the bucket's buffer lives only while its collective runs
            try:
                job = job._replace(tensor=packed.pack())
            except Exception as e:
                self.broken = RuntimeError(
                    f"a bucket of {packed.numel} fp32 values could not be packed before "
                    f"its collective ({type(e).__name__}: {e}); this rank's collectives no "
                    "longer line up with its peers'"
                )
                raise self.broken from e
        device = job.tensor.device
        scratch = lane.scratch.get(device)
        if scratch is None:
            scratch = lane.scratch[device] = Scratch(device)
        feedback = job.error_feedback
        if job.check_finite and not is_finite(job.tensor):
            # It would poison its block's scale and, through error feedback, every later sync:
            # send NaNs, so that every rank's result says so, and keep no residual of it.
            job.work.non_finite = "sent"
            job.tensor.fill_(math.nan)
            feedback = None
        job.work.stats = compressed_all_reduce(
            job.pg,
            job.tensor,
            job.dtype,
            error_feedback=feedback,
            key=job.key,
            scratch=scratch,
            timeout=job.timeout,
            keep_delivered=job.keep_delivered,
            stage=False,  # staged by _execute, unless the sync was abandoned meanwhile
            gate=lane.gate,
        )
        if job.check_finite and job.work.non_finite is None and not is_finite(job.tensor):
            job.work.non_finite = "received"
        if job.divide_by != 1:
            divide_(job.tensor, job.divide_by)
        if job.check_finite and job.work.non_finite is None:
            # For the sync's norm: here while the period computes, not at the sync point.
            flat = job.tensor.detach()
            job.work.squares = float(torch.dot(flat, flat))
        if job.keep_delivered:
            stats = job.work.stats
            if stats.delivered is None:  # float32 (or nothing to send): the result itself
                job.work.delivered = Delivered.kept(
                    "float32", job.tensor.numel(), stats.world_size, 1,
                    job.tensor.detach().to("cpu", copy=True),
                )  # fmt: skip
            else:
                job.work.delivered = Delivered.kept(
                    job.dtype, job.tensor.numel(), stats.world_size, job.divide_by,
                    stats.delivered.to("cpu"),
                )  # fmt: skip
                stats.delivered = None  # the accelerator's copy is not kept for a period
        if packed is not None:
            packed.unpack(job.tensor)
