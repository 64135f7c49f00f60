"""How the tensors of one sync travel between replica groups, for every method and dtype.

torchft's LocalSGD and DiLoCo hand their Manager one tensor at a time (a parameter, or a
pseudo-gradient), async DiLoCo one flat tensor per fragment plus its token count.
:class:`SyncTransport` carries them, with these invariants:

* **Every tensor is all-reduced, whatever its size.** Tensors smaller than a bucket
  (``bucket_numel`` fp32 values) are packed, in call order, into a flat buffer until the next
  one does not fit; a larger tensor is cut in place into bucket-sized pieces, one transfer
  each. So the timeout below bounds one bucket's transfer, whatever the model. (torchft
  0.2.0's own bucketing sends zeros for every tensor from the first one larger than a bucket.)
* **One bucket's copy at a time.** The background thread makes a packed bucket's buffer right
  before its transfer and drops it once the result is copied back (``runner.Packed``),
  rather than each queued bucket holding a copy until the last transfer ends.
* **The same collectives in the same order on every rank.** Bucket boundaries depend only on
  the sizes and order of the calls; a pending bucket leaves at :meth:`SyncTransport.flush`,
  before an ``exact`` tensor, or when one of its tensors is waited for.
* **Nothing non-finite reaches the global parameters or a residual.** Each transfer's input is
  checked before it is sent and its result after it arrived. A group whose input is not finite
  sends NaNs, so every group's result is not finite and every group fails the sync alike
  (:meth:`SyncTransport.non_finite`); the residuals stay as they were.
* **An error-feedback residual changes only when its sync commits.** The collective stages the
  residual of each transfer at its offset in its fragment (``residuals.ResidualKey``), and
  :meth:`SyncTransport.end_sync` keeps it or drops it with the sync's verdict.
* **A timeout sized for transfers of minutes.** Each collective may take up to
  ``fault_tolerance.sync_collective_timeout_s`` (not the per-step ``process_group_timeout_ms``;
  see ``collective._wait`` for why no wait names it): one that fails or ends past it fails the
  sync with a :class:`CollectiveTimeout` naming the field (:attr:`SyncTransport.timed_out`).
* **A dead or hung peer costs seconds, not the timeout.** While a rank waits for a transfer, it
  asks the lighthouse (``peer_watch.PeerWatch``) whether a group of the sync's quorum is gone;
  if so the sync ends at once with :class:`PeerGone` (:attr:`SyncTransport.peer_gone`), its
  transfers abandoned (``runner``) and, on nccl, the communicator aborted. The old
  process group is dropped at the next quorum. An abandoned transfer may still write into its
  tensor after the sync failed: every tensor handed to :meth:`SyncTransport.allreduce` must
  belong to its sync alone (never the model's own storage).

Failure semantics are torchft's: a failed collective is reported to the Manager
(``report_error``), the sync is not committed, nothing is applied, and ``wait`` never raises.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from torchtitan.components.ft import torchft_adapter as tft
from torchtitan.components.ft.build import end_collectives_in_flight
from torchtitan.components.ft.delivery import AllWorks
from torchtitan.experiments.fault_tolerance.transport.collective import Delivered
from torchtitan.experiments.fault_tolerance.transport.peer_watch import Gone, PeerWatch
from torchtitan.experiments.fault_tolerance.transport.residuals import ResidualKey, Residuals
from torchtitan.experiments.fault_tolerance.transport.runner import (
    AsyncCompressedAllReduce,
    CompressedWork,
    Packed,
)

if TYPE_CHECKING:
    from torchft.manager import Manager

TIMEOUT_FIELD = "fault_tolerance.sync_collective_timeout_s"


def bucket_numel(bucket_mb: float) -> int:
    """fp32 values in a bucket of ``bucket_mb`` MiB (at least one)."""
    return max(1, int(bucket_mb * 2**20) // 4)


class CollectiveTimeout(RuntimeError):
    """A collective of a sync ran past ``fault_tolerance.sync_collective_timeout_s``."""


class PeerGone(RuntimeError):
    """A group of the sync's quorum left while its transfers were in flight: the sync ended
    without waiting for them."""


def _timed_out(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, TimeoutError) or "timed out" in text or "timeout" in text


@dataclass
class _Bucket:
    """Tensors packed into one transfer, in call order."""

    divide_by: float
    device: torch.device
    members: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    numel: int = 0
    #: Once sent: the transfer's work.
    work: CompressedWork | None = None
    #: On CUDA: each member's producer stream when it was handed in.
    ready: list[torch.cuda.Event] = field(default_factory=list)

    def takes(self, tensor: torch.Tensor, divide_by: float, limit: int) -> bool:
        """Whether ``tensor`` joins this bucket rather than starting the next one."""
        return (
            self.numel + tensor.numel() <= max(limit, tensor.numel())
            and self.divide_by == divide_by
            and self.device == tensor.device
        )

    def add(self, tensor: torch.Tensor) -> None:
        self.members.append((tensor, self.numel))
        self.numel += tensor.numel()
        if tensor.is_cuda:  # the bucket may leave from another stream (e.g. at the last flush)
            self.ready.append(torch.cuda.current_stream(tensor.device).record_event())


class Transfer:
    """A tensor's share of one transfer, as torchft's ``Work``: waiting sends its bucket if
    that is still pending, and returns once the result is in the tensor. The transfer's own
    timeout (``sync_collective_timeout_s``) bounds the wait; a ``timeout`` given is not used.
    """

    def __init__(self, transport: SyncTransport, bucket: _Bucket) -> None:
        self._transport = transport
        self._bucket = bucket

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._bucket.work is None:
            self._transport.flush()
        assert self._bucket.work is not None
        self._transport.await_transfer(self._bucket.work)
        return True


class SyncTransport:
    """Carries the tensors of each sync (see the module docstring), one sync at a time:
    :meth:`begin_sync` at its quorum, :meth:`allreduce` for each tensor, :meth:`flush`, the
    works waited for, then :meth:`non_finite` and, with the verdict, :meth:`end_sync`."""

    def __init__(
        self,
        dtype: str,
        *,
        error_feedback: bool,
        bucket_mb: float,
        timeout_s: float,
        keep_delivered: bool = False,
        peers: PeerWatch | None = None,
        residual_decay: float = 1.0,
    ) -> None:
        """``keep_delivered``: keep each transfer's result (CPU memory) for :meth:`delivered`.
        ``peers``: asked during a wait whether a group of the quorum is gone (None: only the
        timeout ends a transfer). ``residual_decay``: ``Residuals``' ``decay``."""
        self.dtype = dtype
        self.keep_delivered = keep_delivered
        #: The error-feedback residuals (None: no error feedback).
        self.residuals = (
            Residuals(residual_decay) if error_feedback and dtype != "float32" else None
        )
        self.bucket_numel = bucket_numel(bucket_mb)
        self.timeout = timedelta(seconds=timeout_s)
        self._runner = AsyncCompressedAllReduce()
        self._manager: Manager | None = None
        self.peers = peers
        self._start(0, (), 0)

    def _start(self, fragment: int, participants: Sequence[int], own: int) -> None:
        self.fragment = fragment
        #: Where the next transfer's values start among the fragment's (``ResidualKey``).
        self._offset = 0
        self._pending: _Bucket | None = None
        #: This sync's transfers of pseudo-gradients or parameters (not the exact ones).
        self.works: list[CompressedWork] = []
        self._all: list[CompressedWork] = []
        #: How many of ``_all``, in order, were looked at for a failure to report.
        self._reported = 0
        #: The error of this sync's first collective that failed or ended past the timeout.
        self.timed_out: CollectiveTimeout | None = None
        #: Why this sync's transfers were abandoned (a group of its quorum is gone), if so.
        self.peer_gone: PeerGone | None = None
        self._participants = tuple(participants)
        self._own = own
        self._sent_at: float | None = None

    def begin_sync(
        self, manager: Manager, fragment: int, participants: Sequence[int] = (), own: int = 0
    ) -> None:
        """A sync of ``fragment`` starts (its quorum is in); what an undecided earlier sync
        staged is void. ``participants``: the heartbeat keys (``peer_watch``) of the quorum's
        groups, watched during waits, this group's ``own`` among them."""
        if self._runner.broken is not None:  # loud, as the failure would have been in flush
            raise RuntimeError(
                f"fault_tolerance: this rank cannot sync any more: {self._runner.broken}; "
                "restart the group (it heals from a peer)"
            )
        self._manager = manager
        self._start(fragment, participants, own)
        if self.residuals is not None:
            self.residuals.discard(loaded=False)

    def allreduce(
        self, manager: Manager, tensor: torch.Tensor, *, average: bool, exact: bool = False
    ) -> AllWorks:
        """All-reduce (SUM, or the mean over the quorum with ``average``) ``tensor`` in place;
        returns its transfers, to ``wait`` for as one. ``exact``: sent as fp32 without error
        feedback (e.g. a token count), after any pending bucket."""
        self._manager = manager
        if manager.errored() is not None:  # torchft: after an error, the rest are no-ops
            return AllWorks([])
        if not manager.is_participating():
            tensor.zero_()  # a healing group sends nothing
        divide_by = manager.num_participants() if average else 1
        if exact:
            self.flush()
            work = self._submit(tensor.view(-1), divide_by, exact=True)
            return self._sent([work], tensor, divide_by)
        if tensor.numel() >= self.bucket_numel and tensor.is_contiguous():
            self.flush()
            flat, step = tensor.view(-1), self.bucket_numel
            pieces = [flat[i : i + step] for i in range(0, flat.numel(), step)]
            works = [self._submit(piece, divide_by) for piece in pieces]
            return self._sent(works, tensor, divide_by)
        bucket = self._pending
        if bucket is None or not bucket.takes(tensor, divide_by, self.bucket_numel):
            self.flush()
            bucket = self._pending = _Bucket(divide_by, tensor.device)
        bucket.add(tensor)
        return AllWorks([Transfer(self, bucket)])

    def _sent(
        self, works: list[CompressedWork], tensor: torch.Tensor, divide_by: float
    ) -> AllWorks:
        """The transfers of ``tensor``, each a bucket of its own already sent, as one work."""
        device = tensor.device
        return AllWorks([Transfer(self, _Bucket(divide_by, device, work=w)) for w in works])

    def flush(self) -> None:
        """Send the pending bucket, if any."""
        bucket, self._pending = self._pending, None
        if bucket is None:
            return
        packed = Packed(bucket.members, bucket.numel, bucket.device, bucket.ready)
        assert self._manager is not None  # set by the allreduce that filled the bucket
        self._report_failures()
        if self._manager.errored() is not None:
            bucket.work = CompressedWork(torch.empty(0, device=bucket.device), bucket.numel)
            bucket.work.complete()
            return
        bucket.work = self._submit(packed, bucket.divide_by)

    def _submit(
        self, flat: torch.Tensor | Packed, divide_by: float, *, exact: bool = False
    ) -> CompressedWork:
        manager = self._manager
        assert manager is not None  # set by allreduce, the only caller (flush too)
        numel = flat.numel if isinstance(flat, Packed) else flat.numel()
        key, feedback = ResidualKey(self.fragment, self._offset), self.residuals
        if exact:
            feedback = None
        else:
            self._offset += numel
        if feedback is not None:
            try:
                feedback.owed(key, numel)
            except ValueError as e:  # a checkpoint's residuals of another size: the sync fails
                manager.report_error(e)
                feedback = None
        if self._sent_at is None:
            self._sent_at = time.monotonic()
        work = self._runner.submit(
            tft.replica_process_group(manager),
            flat,
            "float32" if exact else self.dtype,
            divide_by=divide_by,
            error_feedback=feedback,
            key=key,
            timeout=self.timeout,
            check_finite=True,
            keep_delivered=self.keep_delivered and not exact,
        )
        self._all.append(work)
        if not exact:
            self.works.append(work)
        return work

    def _finished(self, works: list[CompressedWork]) -> Iterator[CompressedWork]:
        """Each of ``works`` once it is done, the pending bucket sent first."""
        self.flush()
        for work in works:
            self.await_transfer(work)
            yield work

    def non_finite(self) -> str | None:
        """Once this sync's works are done: ``"sent"`` when this rank's own input held an inf
        or NaN, ``"received"`` when another group's did, None when every value was finite."""
        found = None
        for work in self._finished(self._all):
            if work.non_finite == "sent":
                return "sent"
            found = found or work.non_finite
        return found

    def end_sync(self, committed: bool) -> None:
        """The sync's verdict: its staged error-feedback residuals are kept or dropped."""
        if self.residuals is not None:
            if committed:
                self.residuals.commit()
            else:
                self.residuals.discard()

    def delivered(self) -> list[Delivered]:
        """After a committed sync (with ``keep_delivered``): its transfers' results as every
        group received them, in order: the fragment's averaged pseudo-gradients, flat."""
        found = []
        for work in self.works:
            self.await_transfer(work)
            assert work.delivered is not None, "a committed transfer kept no result"
            found.append(work.delivered)
        return found

    def wait(self) -> None:
        """Send what is pending and wait for every transfer of this sync (e.g. before a
        checkpoint reads the error-feedback residuals, which the transfers stage)."""
        for _ in self._finished(self._all):
            pass

    def await_transfer(self, work: CompressedWork) -> None:
        """Wait until ``work`` is done; every peer-watch interval meanwhile, ask the lighthouse
        whether a group of this sync's quorum is gone: if so, :meth:`_abandon` the sync. A
        transfer that failed is reported to the Manager (:meth:`_report_failures`)."""
        peers = self.peers
        if peers is None or len(self._participants) < 2:
            work.wait()
        else:
            while not work.wait_for(peers.every_s):
                if self.peer_gone is not None:  # abandoned already: this one never delivers
                    work.abandon()
                    break
                gone = peers.gone(self._participants, self._own)
                if gone is not None:
                    self._abandon(gone)
        self._report_failures()

    def _report_failures(self) -> None:
        """Report each of this sync's finished transfers that failed to the Manager, once (the
        sync is then not committed, and no later transfer of it is sent); one that ran past
        the timeout as a :class:`CollectiveTimeout` naming the field."""
        manager = self._manager
        for work in self._all[self._reported :]:
            if not work.done():
                break
            self._reported += 1
            error = work.error
            if error is None or manager is None:
                continue
            if _timed_out(error):
                sent_as = self.dtype if work in self.works else "float32"
                error = CollectiveTimeout(
                    f"a transfer of fragment {self.fragment}'s sync ({work.numel * 4 / 2**20:.1f} "
                    f"MiB of fp32 values, sent as {sent_as}) did not finish within "
                    f"{TIMEOUT_FIELD}={self.timeout.total_seconds():g}s: raise it if every group "
                    f"is alive ({str(error).splitlines()[0]})"
                )
                if self.timed_out is None:
                    self.timed_out = error
            manager.report_error(error)

    def _abandon(self, gone: Gone) -> None:
        """Fail this sync because ``gone`` left its quorum: report it to the Manager (the sync
        is not committed), complete every transfer without result, and on nccl abort the
        communicator, whose collectives would otherwise stay queued on the device."""
        if self.peer_gone is not None:
            return
        manager = self._manager
        assert manager is not None  # a transfer was submitted, so the sync has a Manager
        since = 0.0 if self._sent_at is None else time.monotonic() - self._sent_at
        self.peer_gone = PeerGone(
            f"{gone.name} stopped heartbeating (the lighthouse dropped it after its heartbeat "
            f"timeout) while fragment {self.fragment}'s transfers were in flight: ended "
            f"{since:.1f}s after they started, without waiting for "
            f"{TIMEOUT_FIELD}={self.timeout.total_seconds():g}s"
        )
        if manager.errored() is None:
            manager.report_error(self.peer_gone)
        # nccl first: an issue to a gone peer may block (a lazy connect) holding the runner's lane.
        end_collectives_in_flight(tft.replica_process_group(manager))
        self._runner.abandon()

    def squares(self) -> float | None:
        """Once this sync's works are done: the sum of squares of its result (not of the
        exact tensors), or None where a transfer has none (it failed, or was not finite)."""
        total = 0.0
        for work in self._finished(self.works):
            if work.squares is None:
                return None
            total += work.squares
        return total

    def stats(self) -> tuple[int, float | None]:
        """This sync's bytes sent by this rank and, compressed, its seconds compressing and
        decompressing (waiting for the transfers). Uncompressed: the payload's bytes and None."""
        sent, seconds = 0, 0.0
        for work in self._finished(self.works):
            if self.dtype == "float32":
                sent += work.numel * 4
            elif work.stats is not None:
                sent += work.stats.bytes_sent
                seconds += work.stats.encode_s + work.stats.decode_s
        return sent, None if self.dtype == "float32" else seconds

    def shutdown(self) -> None:
        self._runner.shutdown()
