"""The compressed SUM all-reduce of one flat fp32 tensor over a process group.

It keeps the byte saving for any number ``n`` of ranks: the tensor is cut into ``n`` equal
chunks of whole blocks (the last one encoded as if padded with zeros) and every chunk is
encoded; an all-to-all gives rank ``r`` every rank's chunk ``r``, which it decodes and sums in
fp32 in rank order, then encodes once more; an all-gather hands every rank all ``n`` reduced
chunks to decode into the tensor. A rank sends ``2 * (n - 1)`` encoded chunks, as a ring
all-reduce would. The sparse codec's encodings do not add up: its ranks all-gather their
encodings of the whole tensor and every rank decodes and adds all ``n`` in rank order.

Every rank ends with bit-identical values: each reduced chunk is summed by one rank only, and
every rank (its owner included) decodes the result from the same re-encoded bytes; decoding is
exact (``codecs``). So the outer optimizers of all replica groups step with the same average.

Only ``alltoall_base``, ``allgather`` and ``allreduce`` of a torch.distributed-style process
group (torch's or torchft's) and plain torch ops are used, so the same code serves CPU/gloo and
CUDA/nccl. :func:`compressed_all_reduce` raises whatever the collectives raise, and then leaves
the tensor undefined.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from torchtitan.components.ft.delivery import wait_delivered
from torchtitan.experiments.fault_tolerance.transport.codecs import (
    BLOCK,
    Codec,
    check_flat_fp32,
    get_codec,
)
from torchtitan.experiments.fault_tolerance.transport.residuals import (
    FIRST,
    ResidualKey,
    Residuals,
)
from torchtitan.tools.digest import chunk_hashes
from torchtitan.tools.exact_division import divide_
from torchtitan.tools.scratch import Scratch

_Options = TypeVar("_Options", dist.AllreduceOptions, dist.AllToAllOptions, AllgatherOptions)


@dataclass
class CompressionStats:
    """What one compressed all-reduce cost this rank.

    ``bytes_sent``: the bytes this rank put on the wire (for ``float32`` the nominal
    bandwidth-optimal ``2 * (n - 1) * 4 * ceil(numel / n)``; the backend picks its algorithm).
    The timings are host seconds; on CUDA the stream is synchronized around each phase.
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
    #: With ``stage=False``: the error-feedback residual this all-reduce left, for the caller
    #: to stage (None without error feedback).
    residual: torch.Tensor | None = None


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
    #: The payload's chunk hashes (``tools.digest``) when it was kept (:meth:`kept`): the heal
    #: history's checksum, taken where the result arrived rather than at the sync point.
    hashes: tuple[int, ...] | None = field(default=None, compare=False)

    @classmethod
    def kept(
        cls, dtype: str, numel: int, world_size: int, divide_by: float, payload: torch.Tensor
    ) -> Delivered:
        """A result kept as it arrived, its checksum taken now (``payload`` in CPU memory)."""
        return cls(dtype, numel, world_size, divide_by, payload, tuple(chunk_hashes(payload)))

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
            divide_(out, self.divide_by)
        return out


def _sync(t: torch.Tensor) -> None:
    """Wait for the queued kernels on ``t``'s device, so that host timings measure them."""
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


def _wait(work: dist.Work, pg: dist.ProcessGroup, timeout: timedelta | None) -> None:
    """Wait until the collective's result is in its buffers, at most ``timeout`` (default: the
    group's): ``delivery.wait_delivered`` raises when it failed, also on nccl, where a failure
    never raises in ``wait``, without a device-wide synchronize (the training kernels queued
    meanwhile are not waited for). The runner then fails the sync naming the field."""
    wait_delivered(work, pg, timeout)


class Abandoned(Exception):
    """Raised instead of issuing a collective through a closed :class:`IssueGate`."""


class IssueGate:
    """Held around the issue of each collective of an all-reduce (not its wait): once closed,
    none is issued any more (:class:`Abandoned` is raised instead). Its runner closes it,
    holding ``lock``, when the sync is abandoned: a collective of it could pair with the next
    quorum's."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock
        self.closed = False

    @contextlib.contextmanager
    def issuing(self) -> Iterator[None]:
        with self.lock:
            if self.closed:
                raise Abandoned("the sync was abandoned")
            yield

    def close(self) -> None:
        """No collective is issued from now on (the caller holds :attr:`lock`)."""
        self.closed = True


def _options(options: _Options, timeout: timedelta | None) -> _Options:
    if timeout is not None:
        options.timeout = timeout
    return options


def _all_gather(
    pg: dist.ProcessGroup,
    mine: torch.Tensor,
    timeout: timedelta | None,
    issuing: Callable[[], AbstractContextManager[object]],
) -> list[torch.Tensor]:
    """Every rank's ``mine``, in rank order, in new buffers: a collective that failed on
    another rank's error must not be able to write into the next one's."""
    gathered = [torch.empty_like(mine) for _ in range(pg.size())]
    with issuing():
        work = pg.allgather([gathered], [mine], _options(AllgatherOptions(), timeout))
    _wait(work, pg, timeout)
    _sync(mine)  # this thread's stream only: decoding is timed alone
    return gathered


def chunk_numel(numel: int, world_size: int) -> int:
    """Elements per rank's chunk: ``numel / world_size`` rounded up to whole blocks."""
    return math.ceil(math.ceil(numel / world_size) / BLOCK) * BLOCK


def compressed_all_reduce(
    pg: dist.ProcessGroup,
    tensor: torch.Tensor,
    dtype: str,
    *,
    error_feedback: Residuals | None = None,
    key: ResidualKey = FIRST,
    scratch: Scratch | None = None,
    timeout: timedelta | None = None,
    keep_delivered: bool = False,
    stage: bool = True,
    gate: IssueGate | None = None,
) -> CompressionStats:
    """SUM all-reduce of the 1-D fp32 ``tensor`` in place over ``pg``, ``dtype`` on the wire.

    Every rank must call it with the same ``dtype`` and ``tensor.numel()``, in the same order.
    Blocks until the result is in ``tensor`` (bit-identical on every rank). With
    ``error_feedback``, this rank's residual at ``key`` is added first, and the new one is
    staged once the collectives succeed (``Residuals.stage``: owed only if the sync then
    commits); ``stage=False`` leaves it in ``stats.residual`` for the caller to stage.
    ``scratch`` (of ``tensor``'s device) keeps the buffers for the thread's next call.
    ``timeout``: the longest each collective may take (default: the process group's).
    ``keep_delivered``: keep the bytes the result was decoded from in ``stats.delivered``.
    ``gate``: held around the issue of each collective (not its wait); a closed one stops
    the all-reduce. Raises what the collectives raise; ``tensor`` is then undefined.
    """
    issuing = contextlib.nullcontext if gate is None else gate.issuing
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
            opts = _options(dist.AllreduceOptions(), timeout)
            opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
            with issuing():
                work = pg.allreduce([tensor], opts)
            _wait(work, pg, timeout)
            stats.bytes_sent = 2 * (n - 1) * 4 * math.ceil(numel / n)
        if error_feedback is not None:
            _stage(error_feedback, key, torch.zeros_like(tensor), stats, stage)  # nothing dropped
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
    residual = None if error_feedback is None else error_feedback.buffer(key, tensor)

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
            _stage(error_feedback, key, residual, stats, stage)
        stats.total_s = time.perf_counter() - start
        return stats

    if codec.gathers:
        # Encodings that do not add up (sparse): every rank's encoding of the whole tensor is
        # gathered. The bytes grow with the groups, where the chunked all-reduce's stay near
        # twice one encoding (``sparse``'s docstring says where that stops paying).
        t0 = time.perf_counter()
        mine = scratch.get("send", codec.wire_bytes(numel), torch.uint8)
        codec.encode_into(corrected, mine, numel, residual=residual, scratch=scratch)
        _sync(mine)
        stats.encode_s += time.perf_counter() - t0
        stats.bytes_sent = (n - 1) * mine.numel()
    else:
        mine = _reduce_chunk(
            pg, tensor, corrected, residual, codec, stats, scratch, timeout, issuing
        )
        stats.bytes_sent = 2 * (n - 1) * mine.numel()

    # Every rank decodes the same n encodings, its own included (from the bytes, not from its
    # fp32 sum), so that all ranks hold identical values.
    gathered = _all_gather(pg, mine, timeout, issuing)
    t0 = time.perf_counter()
    _decode_gathered(gathered, codec, numel, tensor, scratch)
    _sync(tensor)
    stats.decode_s += time.perf_counter() - t0
    if keep_delivered:
        stats.delivered = torch.cat(gathered)
    if error_feedback is not None and residual is not None:
        # Only now: had a collective failed, nothing was delivered and the old residual is
        # still owed. Even now only staged: the sync's verdict decides (Residuals.commit).
        _stage(error_feedback, key, residual, stats, stage)
    stats.total_s = time.perf_counter() - start
    return stats


def _reduce_chunk(
    pg: dist.ProcessGroup,
    tensor: torch.Tensor,
    corrected: torch.Tensor,
    residual: torch.Tensor | None,
    codec: Codec,
    stats: CompressionStats,
    scratch: Scratch,
    timeout: timedelta | None,
    issuing: Callable[[], AbstractContextManager[object]],
) -> torch.Tensor:
    """Encode every chunk of ``corrected`` (its tail as zeros), all-to-all so that rank ``r``
    holds every rank's chunk ``r``, and sum those in fp32, in rank order; returns the sum
    re-encoded, this rank's reduced chunk."""
    n, numel = pg.size(), tensor.numel()
    chunk = chunk_numel(numel, n)
    chunk_bytes = codec.wire_bytes(chunk)

    def chunk_of(x: torch.Tensor, i: int) -> torch.Tensor:
        """Chunk ``i`` of a tensor of ``numel`` values: short or empty at the end."""
        return x[min(numel, i * chunk) : min(numel, (i + 1) * chunk)]

    def bytes_of(buf: torch.Tensor, i: int) -> torch.Tensor:
        return buf[i * chunk_bytes : (i + 1) * chunk_bytes]

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
    recv = torch.empty_like(send)  # new, as in _all_gather
    splits = [chunk_bytes] * n
    with issuing():
        work = pg.alltoall_base(
            recv, send, splits, splits, _options(dist.AllToAllOptions(), timeout)
        )
    _wait(work, pg, timeout)
    _sync(recv)  # this thread's stream only: the decode's time below is not the wire's

    # In rank order, so that a rerun gives the same bytes.
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
    return mine


def _stage(
    feedback: Residuals,
    key: ResidualKey,
    residual: torch.Tensor,
    stats: CompressionStats,
    now: bool,
) -> None:
    if now:
        feedback.stage(key, residual)
    else:
        stats.residual = residual


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
    size = codec.wire_bytes(numel if codec.gathers else chunk_numel(numel, world_size))
    if delivered.numel() != world_size * size:
        raise ValueError(
            f"delivered bytes of a {dtype} {'all-gather' if codec.gathers else 'all-reduce'} "
            f"of {numel} values over {world_size} ranks: expected {world_size * size}, got "
            f"{delivered.numel()}"
        )
    parts = [delivered[i * size : (i + 1) * size] for i in range(world_size)]
    _decode_gathered(parts, codec, numel, out, scratch)


def _decode_gathered(
    parts: list[torch.Tensor], codec: Codec, numel: int, out: torch.Tensor, scratch: Scratch | None
) -> None:
    """``out`` from the ``n`` encodings every rank received, the one decode of a result: a
    gathering codec's are decoded and added in rank order; otherwise part ``i`` is chunk ``i``
    of ``out`` (the last chunks of a short tensor are short or empty)."""
    if codec.gathers:
        for i, packed in enumerate(parts):
            codec.decode_into(packed, numel, out, accumulate=i > 0, scratch=scratch)
        return
    chunk = chunk_numel(numel, len(parts))
    for i, packed in enumerate(parts):
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
