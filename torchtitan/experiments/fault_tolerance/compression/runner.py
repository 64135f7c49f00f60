"""Compressed all-reduces on one background thread, in submission order.

Failure semantics follow torchft's ``Manager.allreduce``: a collective that fails calls
``on_error`` (the Manager's ``report_error``, so that the sync is not committed) and completes
its work normally; ``wait`` never raises. Every rank submits the same collectives in the same
order, and one thread issues them in that order.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from torchtitan.experiments.fault_tolerance.compression.codecs import (
    Scratch,
    check_flat_fp32,
    get_codec,
)
from torchtitan.experiments.fault_tolerance.compression.collective import (
    CompressionStats,
    compressed_all_reduce,
    is_finite,
)
from torchtitan.experiments.fault_tolerance.compression.error_feedback import ErrorFeedback


class CompressedWork:
    """A submitted :meth:`AsyncCompressedAllReduce.submit`: wait for it or chain on its future.

    The future completes with the tensor once the all-reduce (and the division) is done, or
    after a failure has been passed to ``on_error``; it never carries the collective's error.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.stats: CompressionStats | None = None
        #: With ``check_finite``: ``"sent"`` when this rank's own input held an inf or NaN
        #: (it then sent NaNs, so that every rank's result shows it), ``"received"`` when only
        #: the result did (another rank's input); None when all was finite.
        self.non_finite: str | None = None
        self._future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._done = threading.Event()

    def wait(self) -> bool:
        """Block until done, callbacks chained on the future included (torchft's DiLoCo copies
        a bucket back into its gradients in one: a future's ``wait`` returns before its
        callbacks have run). True, as torchft's works return (a failure went to
        ``on_error``)."""
        self._done.wait()
        return True

    def complete(self, error: BaseException | None = None) -> None:
        """Complete the future (running its callbacks), then release ``wait``."""
        try:
            if error is None:
                self._future.set_result(self.tensor)
            else:
                self._future.set_exception(error)  # type: ignore[arg-type]  # stub says T
        finally:
            self._done.set()

    def get_future(self) -> torch.futures.Future[torch.Tensor]:
        """Completes with the tensor when done."""
        return self._future


class _Job(NamedTuple):
    pg: dist.ProcessGroup
    tensor: torch.Tensor
    dtype: str
    divide_by: float
    error_feedback: ErrorFeedback | None
    key: str
    on_error: Callable[[Exception], None]
    ready: torch.cuda.Event | None
    work: CompressedWork
    timeout: timedelta | None
    check_finite: bool
    then: Callable[[], None] | None


class AsyncCompressedAllReduce:
    """Runs :func:`compressed_all_reduce` on one background thread, in submission order.

    One thread and a FIFO queue: every rank submits the same collectives in the same order, so
    the thread issues them in the same order on every rank, as collectives require. The caller
    goes on computing meanwhile (Gloo's ``wait`` blocks its thread, and the encode and decode
    kernels run here too). On CUDA the thread works on its own stream, after the submitter's
    stream has produced the tensor, and synchronizes before completing the future.
    """

    def __init__(self, name: str = "compressed-allreduce") -> None:
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        #: The thread's buffers, reused from one collective to the next (see Scratch).
        self._scratch: dict[torch.device, Scratch] = {}
        self._closed = False
        self._lock = threading.Lock()
        # A daemon thread, so that a collective hung on a dead peer cannot block process exit.
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(
        self,
        pg: dist.ProcessGroup,
        tensor: torch.Tensor,
        dtype: str,
        *,
        divide_by: float = 1,
        error_feedback: ErrorFeedback | None = None,
        key: str = "",
        on_error: Callable[[Exception], None],
        timeout: timedelta | None = None,
        check_finite: bool = False,
        then: Callable[[], None] | None = None,
    ) -> CompressedWork:
        """Queue a SUM all-reduce of ``tensor`` (then divided by ``divide_by``) in place.

        Do not touch ``tensor`` until the returned work is done. If the collective fails,
        ``on_error(e)`` is called and the work still completes; the tensor is then undefined.
        ``timeout``: the longest each collective may take (default: the process group's).
        ``check_finite``: check the input before it is sent and the result after it arrived
        (one reduction each) and say what was found in ``work.non_finite``; an input that is
        not finite is sent as NaNs (and leaves no residual), so that every rank's result is
        not finite either and all of them drop it alike. ``then``: run on the background
        thread after a successful all-reduce, before the work completes (e.g. copying a
        bucket's values back into the tensors it packs).
        """
        get_codec(dtype)  # fail here, in the caller, on a bad name
        check_flat_fp32(tensor)
        ready: torch.cuda.Event | None = None
        if tensor.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(tensor.device))
        work = CompressedWork(tensor)
        job = _Job(
            pg,
            tensor,
            dtype,
            divide_by,
            error_feedback,
            key,
            on_error,
            ready,
            work,
            timeout,
            check_finite,
            then,
        )
        with self._lock:
            if self._closed:
                raise RuntimeError("AsyncCompressedAllReduce is shut down")
            self._queue.put(job)
        return work

    def shutdown(self, timeout: float | None = None) -> None:
        """Finish the queued collectives, then stop the thread (waiting up to ``timeout``)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._execute(job)

    def _execute(self, job: _Job) -> None:
        start = time.monotonic()
        try:
            if job.ready is not None:
                stream = self._streams.get(job.tensor.device)
                if stream is None:
                    stream = torch.cuda.Stream(job.tensor.device)
                    self._streams[job.tensor.device] = stream
                # The caller's allocator stream must not reuse the memory while we use it.
                job.tensor.record_stream(stream)
                with torch.cuda.device(job.tensor.device), torch.cuda.stream(stream):
                    stream.wait_event(job.ready)
                    self._reduce(job)
                    stream.synchronize()
            else:
                self._reduce(job)
            late = (
                job.timeout is not None and time.monotonic() - start >= job.timeout.total_seconds()
            )
            if late:  # e.g. a collective aborted at the timeout without raising: not trusted
                raise TimeoutError("the collective ended past its timeout")
        except Exception as e:  # torchft semantics: record the error, complete normally
            elapsed = time.monotonic() - start
            if job.timeout is not None and elapsed >= job.timeout.total_seconds():
                e = TimeoutError(f"timed out after {elapsed:.1f}s: {e}")
            try:
                job.on_error(e)
            except Exception as handler_error:
                # Nobody else would see it: hand it to the waiter rather than hang or drop it.
                job.work.complete(handler_error)
                return
        job.work.complete()

    def _reduce(self, job: _Job) -> None:
        device = job.tensor.device
        scratch = self._scratch.get(device)
        if scratch is None:
            scratch = self._scratch[device] = Scratch(device)
        feedback = job.error_feedback
        if job.check_finite and not is_finite(job.tensor):
            # A value that is not finite would poison its whole block (its scale) and, through
            # error feedback, every later sync: send NaNs instead, so that every rank's result
            # says so, and keep no residual of it.
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
        )
        if job.check_finite and job.work.non_finite is None and not is_finite(job.tensor):
            job.work.non_finite = "received"
        if job.divide_by != 1:
            job.tensor.div_(job.divide_by)
        if job.then is not None:
            job.then()
