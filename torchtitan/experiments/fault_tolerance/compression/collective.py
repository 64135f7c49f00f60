"""The compressed SUM all-reduce of one flat fp32 tensor over a process group.

It keeps the byte saving for any number ``n`` of ranks: the tensor is cut into ``n`` equal chunks
(each a whole number of blocks, so blocks never straddle chunks; the last one is encoded as if
padded with zeros) and every chunk is encoded; an all-to-all gives rank ``r`` every rank's chunk
``r``, which it decodes and sums in fp32 in rank order; it encodes that reduced chunk once more
and an all-gather hands every rank all ``n`` reduced chunks, which each rank decodes into the
tensor. A rank sends ``2 * (n - 1)`` encoded chunks in all, as a ring all-reduce would.

Every rank ends with bit-identical values: each reduced chunk is summed by one rank only, and
every rank (its owner included) takes the result from the same re-encoded bytes, never from the
owner's private fp32 sum; decoding is exact (``codecs``). So the outer optimizers of all replica
groups step with the same average and their global parameters stay equal.

Only ``alltoall_base``, ``allgather`` and ``allreduce`` of a torch.distributed-style process
group (torch's Gloo/NCCL groups or torchft's reconfigurable wrappers) and plain torch ops are
used, so the same code serves CPU/gloo and CUDA/nccl (tested on CPU/gloo; the CUDA path has
not run on a GPU yet). :func:`compressed_all_reduce` raises whatever the collectives raise,
and then leaves the tensor undefined.

:class:`AsyncCompressedAllReduce` runs these all-reduces on one background thread, in
submission order (every rank submits the same collectives in the same order). Its failure
semantics follow torchft's ``Manager.allreduce``: a collective that fails calls ``on_error``
(the Manager's ``report_error``, so that the sync is not committed) and completes its work
normally; ``wait`` never raises.
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
from torch.distributed.distributed_c10d import AllgatherOptions

from torchtitan.experiments.fault_tolerance.compression.codecs import (
    BLOCK,
    Codec,
    Scratch,
    check_flat_fp32,
    get_codec,
)
from torchtitan.experiments.fault_tolerance.compression.error_feedback import ErrorFeedback


@dataclass
class CompressionStats:
    """What one compressed all-reduce cost this rank.

    ``bytes_sent`` counts the bytes this rank put on the wire: for the compressed dtypes its
    ``n - 1`` outgoing chunks of the all-to-all plus its re-encoded chunk to each of the
    ``n - 1`` peers in the all-gather; for ``float32`` the nominal bandwidth-optimal volume
    ``2 * (n - 1) * 4 * ceil(numel / n)`` (the backend chooses its own algorithm). The timings
    are host seconds; on CUDA the stream is synchronized around each phase so that they hold.
    """

    dtype: str
    numel: int
    world_size: int
    bytes_sent: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0
    #: With ``keep_delivered``: the bytes every rank decoded its result from (the ``n``
    #: re-encoded reduced chunks, one after the other; with one rank its own encoding), for
    #: :func:`decode_delivered`. None for ``float32`` and by default.
    delivered: torch.Tensor | None = None


@dataclass(frozen=True)
class Delivered:
    """One all-reduce's result as every rank received it, kept (in CPU memory) so that it can
    be taken again, bit for bit, later and elsewhere (:meth:`values`)."""

    dtype: str
    numel: int
    world_size: int
    divide_by: float
    #: The bytes the result was decoded from (compressed dtypes: ``CompressionStats.delivered``)
    #: or, for ``float32``, the result itself (already divided).
    payload: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.payload.numel() * self.payload.element_size()

    def values(self, device: torch.device | None = None) -> torch.Tensor:
        """The result as the all-reduce left it in its tensor (divided by ``divide_by``)."""
        payload = self.payload if device is None else self.payload.to(device)
        if self.dtype == "float32":
            return payload.clone()
        out = torch.empty(self.numel, dtype=torch.float32, device=payload.device)
        decode_delivered(payload, self.dtype, self.numel, self.world_size, out)
        if self.divide_by != 1:
            out.div_(self.divide_by)
        return out


def _sync(t: torch.Tensor) -> None:
    """Wait for the queued kernels on ``t``'s device, so that host timings measure them."""
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


def _wait(work: dist.Work, timeout: timedelta | None) -> None:
    """Wait for a collective. The timeout goes to the options (gloo honours those) and to the
    wait: torchft's nccl wrapper clears the options' timeout and honours only the wait's."""
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)


def chunk_numel(numel: int, world_size: int) -> int:
    """Elements per rank's chunk: ``numel / world_size`` rounded up to whole blocks."""
    return math.ceil(math.ceil(numel / world_size) / BLOCK) * BLOCK


def compressed_all_reduce(
    pg: dist.ProcessGroup,
    tensor: torch.Tensor,
    dtype: str,
    *,
    error_feedback: ErrorFeedback | None = None,
    key: str = "",
    scratch: Scratch | None = None,
    timeout: timedelta | None = None,
    keep_delivered: bool = False,
) -> CompressionStats:
    """SUM all-reduce of the 1-D fp32 ``tensor`` in place over ``pg``, ``dtype`` on the wire.

    Every rank must call it with the same ``dtype`` and ``tensor.numel()``, in the same order.
    Blocks until the result is in ``tensor`` (bit-identical on every rank). With
    ``error_feedback``, this rank's residual under ``key`` is added first, and the new one is
    staged once the collectives succeed (``ErrorFeedback.stage``: owed only if the sync then
    commits). ``scratch`` (of ``tensor``'s device) keeps the buffers for the next call of the
    same thread. ``timeout``: the longest each collective may take (default: the process
    group's). ``keep_delivered``: keep a copy of the bytes the result was decoded from in
    ``stats.delivered`` (compressed dtypes). Raises what the collectives raise; ``tensor`` is
    then undefined.
    """
    codec = get_codec(dtype)
    check_flat_fp32(tensor)
    # No ``pg.rank()``: the collectives place each rank's part by rank themselves, and torchft's
    # reconfigurable wrappers answer rank() with 0 whatever the real rank is.
    n, numel = pg.size(), tensor.numel()
    stats = CompressionStats(dtype=dtype, numel=numel, world_size=n)
    start = time.perf_counter()

    if dtype == "float32":
        if error_feedback is not None:
            # fp32 drops nothing, but a residual from another dtype is still owed.
            error_feedback.correct_(key, tensor)
        if n > 1:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
            if timeout is not None:
                opts.timeout = timeout
            _wait(pg.allreduce([tensor], opts), timeout)
            stats.bytes_sent = 2 * (n - 1) * 4 * math.ceil(numel / n)
        if error_feedback is not None:
            error_feedback.stage(key, torch.zeros_like(tensor))  # nothing dropped
        _sync(tensor)
        stats.total_s = time.perf_counter() - start
        return stats

    if numel == 0:
        return stats
    if scratch is None or scratch.device != tensor.device:
        scratch = Scratch(tensor.device)
    # Corrected in place: the tensor is undefined after a failure anyway, and the residual
    # it owed stays in ``error_feedback`` until the collectives have succeeded.
    corrected = tensor if error_feedback is None else error_feedback.correct_(key, tensor)
    # What this rank's own encoding drops, filled in by the encode itself.
    residual = None if error_feedback is None else error_feedback.residual_buffer(key, tensor)

    if n == 1:
        # Nobody to talk to: the result is what the encoding keeps of the tensor.
        t0 = time.perf_counter()
        packed = scratch.get("send", codec.wire_bytes(numel), torch.uint8)
        codec.encode_into(corrected, packed, numel, residual=residual, scratch=scratch)
        _sync(tensor)
        t1 = time.perf_counter()
        decode_delivered(packed, dtype, numel, 1, tensor, scratch=scratch)
        _sync(tensor)
        stats.encode_s, stats.decode_s = t1 - t0, time.perf_counter() - t1
        if keep_delivered:
            stats.delivered = packed.clone()
        if error_feedback is not None and residual is not None:
            error_feedback.stage(key, residual)
        stats.total_s = time.perf_counter() - start
        return stats

    chunk = chunk_numel(numel, n)
    chunk_bytes = codec.wire_bytes(chunk)

    def chunk_of(x: torch.Tensor, i: int) -> torch.Tensor:
        """Chunk ``i`` of a tensor of ``numel`` values: short or empty at the end."""
        return x[min(numel, i * chunk) : min(numel, (i + 1) * chunk)]

    def bytes_of(buf: torch.Tensor, i: int) -> torch.Tensor:
        return buf[i * chunk_bytes : (i + 1) * chunk_bytes]

    # Phase 1: encode every chunk (the tensor's tail as zeros); all-to-all so that rank r holds
    # every rank's chunk r.
    t0 = time.perf_counter()
    send = scratch.get("send", n * chunk_bytes, torch.uint8)
    for i in range(n):
        codec.encode_into(
            chunk_of(corrected, i),
            bytes_of(send, i),
            chunk,
            residual=None if residual is None else chunk_of(residual, i),
            scratch=scratch,
        )
    _sync(send)
    stats.encode_s += time.perf_counter() - t0
    # The buffers the collectives write are new every time: a collective that failed on another
    # rank's error must not be able to write into the next one's.
    recv = torch.empty_like(send)
    splits = [chunk_bytes] * n
    alltoall_opts = dist.AllToAllOptions()
    if timeout is not None:
        alltoall_opts.timeout = timeout
    _wait(pg.alltoall_base(recv, send, splits, splits, alltoall_opts), timeout)

    # Reduce this rank's chunk in fp32, in rank order, so that a rerun gives the same bytes.
    t0 = time.perf_counter()
    # The tensor's values are all encoded by now: its head can hold the sum (it is decoded over
    # only after the sum has been encoded).
    reduced = tensor[:chunk] if chunk <= numel else scratch.get("reduced", chunk, torch.float32)
    for i in range(n):
        codec.decode_into(bytes_of(recv, i), chunk, reduced, accumulate=i > 0, scratch=scratch)
    _sync(reduced)
    t1 = time.perf_counter()
    stats.decode_s += t1 - t0
    mine = scratch.get("mine", chunk_bytes, torch.uint8)
    codec.encode_into(reduced, mine, chunk, scratch=scratch)
    _sync(mine)
    stats.encode_s += time.perf_counter() - t1

    # Phase 2: all-gather the re-encoded chunks; every rank decodes the same n chunks, its own
    # included (from the bytes, not from ``reduced``), so that all ranks hold identical values.
    gathered = [torch.empty_like(mine) for _ in range(n)]
    allgather_opts = AllgatherOptions()
    if timeout is not None:
        allgather_opts.timeout = timeout
    _wait(pg.allgather([gathered], [mine], allgather_opts), timeout)
    t0 = time.perf_counter()
    _decode_reduced_chunks(gathered, codec, numel, tensor, scratch)
    _sync(tensor)
    stats.decode_s += time.perf_counter() - t0
    if keep_delivered:
        stats.delivered = torch.cat(gathered)

    if error_feedback is not None and residual is not None:
        # Only now: had a collective failed, nothing was delivered and the old residual is
        # still owed. Even now only staged: the sync's verdict decides (ErrorFeedback.commit).
        error_feedback.stage(key, residual)
    stats.bytes_sent = 2 * (n - 1) * chunk_bytes
    stats.total_s = time.perf_counter() - start
    return stats


def decode_delivered(
    delivered: torch.Tensor,
    dtype: str,
    numel: int,
    world_size: int,
    out: torch.Tensor,
    *,
    scratch: Scratch | None = None,
) -> None:
    """Decode into ``out`` (1-D fp32, ``numel`` values) the bytes a compressed all-reduce over
    ``world_size`` ranks delivered (``CompressionStats.delivered``): the values every rank got
    as the SUM, bit for bit, whoever decodes them and whenever (a replaying joiner too)."""
    codec = get_codec(dtype)
    if world_size == 1:
        codec.decode_into(delivered, numel, out, scratch=scratch)
        return
    chunk = chunk_numel(numel, world_size)
    chunk_bytes = codec.wire_bytes(chunk)
    if delivered.numel() != world_size * chunk_bytes:
        raise ValueError(
            f"delivered bytes of a {dtype} all-reduce of {numel} values over {world_size} ranks: "
            f"expected {world_size * chunk_bytes}, got {delivered.numel()}"
        )
    chunks = [delivered[i * chunk_bytes : (i + 1) * chunk_bytes] for i in range(world_size)]
    _decode_reduced_chunks(chunks, codec, numel, out, scratch)


def _decode_reduced_chunks(
    chunks: list[torch.Tensor],
    codec: Codec,
    numel: int,
    out: torch.Tensor,
    scratch: Scratch | None,
) -> None:
    """Chunk ``i`` of ``out`` from the ``i``-th re-encoded reduced chunk (the last chunks of a
    short tensor are short or empty): the one decode of an all-reduce's result."""
    chunk = chunk_numel(numel, len(chunks))
    for i, packed in enumerate(chunks):
        codec.decode_into(
            packed, chunk, out[min(numel, i * chunk) : min(numel, (i + 1) * chunk)],
            scratch=scratch,
        )  # fmt: skip


def is_finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite: one reduction (the largest magnitude, which is
    inf or NaN as soon as one value is)."""
    if t.numel() == 0:
        return True
    return bool(torch.isfinite(torch.linalg.vector_norm(t, ord=math.inf)))


@dataclass
class Packed:
    """Tensors that travel as one flat fp32 buffer (a bucket), at their offsets in it. The
    background thread makes the buffer right before the bucket's collective and drops it once
    the result is copied back into the tensors, so that the buckets of a sync, all queued at
    once, do not each hold a copy of their tensors while they wait their turn."""

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
    after a failure has been passed to ``on_error``; it never carries the collective's error.
    A :class:`Packed` submission completes with an empty tensor: its values are back in the
    tensors it packs, and its buffer is gone.
    """

    def __init__(self, tensor: torch.Tensor, numel: int | None = None) -> None:
        self.tensor = tensor
        #: fp32 values carried (a packed bucket's, whose ``tensor`` is an empty stand-in).
        self.numel = tensor.numel() if numel is None else numel
        self.stats: CompressionStats | None = None
        #: With ``check_finite``: ``"sent"`` when this rank's own input held an inf or NaN
        #: (it then sent NaNs, so that every rank's result shows it), ``"received"`` when only
        #: the result did (another rank's input); None when all was finite.
        self.non_finite: str | None = None
        #: With ``keep_delivered``: the result as every rank received it (after success).
        self.delivered: Delivered | None = None
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
    packed: Packed | None
    keep_delivered: bool


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
        #: Why this rank's collectives no longer line up with its peers' (a bucket that could
        #: not be packed, so its collective was never issued): every later job is then
        #: failed without a collective, and the transport stops the trainer at the next sync.
        self.broken: Exception | None = None
        # A daemon thread, so that a collective hung on a dead peer cannot block process exit.
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(
        self,
        pg: dist.ProcessGroup,
        tensor: torch.Tensor | Packed,
        dtype: str,
        *,
        divide_by: float = 1,
        error_feedback: ErrorFeedback | None = None,
        key: str = "",
        on_error: Callable[[Exception], None],
        timeout: timedelta | None = None,
        check_finite: bool = False,
        keep_delivered: bool = False,
    ) -> CompressedWork:
        """Queue a SUM all-reduce of ``tensor`` (then divided by ``divide_by``) in place.

        Do not touch ``tensor`` until the returned work is done. If the collective fails,
        ``on_error(e)`` is called and the work still completes; the tensor is then undefined.
        ``timeout``: the longest each collective may take (default: the process group's).
        ``check_finite``: check the input before it is sent and the result after it arrived
        (one reduction each) and say what was found in ``work.non_finite``; an input that is
        not finite is sent as NaNs (and leaves no residual), so that every rank's result is
        not finite either and all of them drop it alike. A :class:`Packed` ``tensor``: its
        tensors are packed into a flat buffer on the background thread right before the
        collective (on CUDA, after the submitter's stream has produced them) and the result
        copied back into them before the work completes; do not touch them until then.
        ``keep_delivered``: keep the result as every rank received it in ``work.delivered``
        (CPU memory).
        """
        get_codec(dtype)  # fail here, in the caller, on a bad name
        packed = tensor if isinstance(tensor, Packed) else None
        if packed is not None:  # an empty stand-in until the thread packs the bucket
            tensor = torch.empty(0, dtype=torch.float32, device=packed.device)
        else:
            assert isinstance(tensor, torch.Tensor)
            check_flat_fp32(tensor)
        ready: torch.cuda.Event | None = None
        if tensor.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(tensor.device))
        work = CompressedWork(tensor, None if packed is None else packed.numel)
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
            packed,
            keep_delivered,
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
            if self.broken is not None:
                # Issuing this collective would pair it with the peers' previous one.
                raise RuntimeError(f"not sent: {self.broken}")
            if job.ready is not None:
                stream = self._streams.get(job.tensor.device)
                if stream is None:
                    stream = torch.cuda.Stream(job.tensor.device)
                    self._streams[job.tensor.device] = stream
                # The caller's allocator stream must not reuse the memory while we use it.
                job.tensor.record_stream(stream)
                with torch.cuda.device(job.tensor.device), torch.cuda.stream(stream):
                    stream.wait_event(job.ready)
                    for ready in job.packed.ready if job.packed is not None else ():
                        stream.wait_event(ready)
                    try:
                        self._reduce(job)
                    finally:  # even after a failure: nothing of ours still runs on the tensors
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
            keep_delivered=job.keep_delivered,
        )
        if job.check_finite and job.work.non_finite is None and not is_finite(job.tensor):
            job.work.non_finite = "received"
        if job.divide_by != 1:
            job.tensor.div_(job.divide_by)
        if job.keep_delivered:
            stats = job.work.stats
            if stats.delivered is None:  # float32 (or nothing to send): the result itself
                job.work.delivered = Delivered(
                    "float32", job.tensor.numel(), stats.world_size, 1,
                    job.tensor.detach().to("cpu", copy=True),
                )  # fmt: skip
            else:
                job.work.delivered = Delivered(
                    job.dtype, job.tensor.numel(), stats.world_size, job.divide_by,
                    stats.delivered.to("cpu"),
                )  # fmt: skip
                stats.delivered = None  # the accelerator's copy is not kept for a period
        if packed is not None:
            packed.unpack(job.tensor)
