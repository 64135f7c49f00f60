"""How the tensors of one sync travel between replica groups, for every method and dtype.

torchft's LocalSGD and DiLoCo hand their Manager one tensor at a time (a parameter, or a
pseudo-gradient), async DiLoCo one flat tensor per fragment plus its token count.
:class:`SyncTransport` carries them, with these invariants:

* **Every tensor is all-reduced, whatever its size.** Tensors smaller than a bucket
  (``bucket_numel`` fp32 values) are packed, in call order, into a new flat buffer until the
  next one does not fit; a tensor of a bucket's size or more is cut into bucket-sized pieces,
  each a transfer of its own, in place (no copy). So no transfer exceeds a bucket, and the
  timeout below bounds a bucket's transfer, whatever the model. (torchft 0.2.0's own bucketing
  stops packing at the first tensor larger than a bucket and sends zeros for it and every
  tensor after it: each group then applies its own pseudo-gradient there.)
* **One bucket's copy at a time.** A packed bucket's flat buffer is made by the background
  thread right before its transfer and dropped once its result is copied back
  (:class:`~torchtitan.experiments.fault_tolerance.compression.Packed`): a sync queues all its
  buckets at once, and copies made at queueing time would add the whole fragment's size again
  (the pseudo-gradients themselves are already a copy) until the last transfer ended.
* **The same collectives in the same order on every rank.** Bucket boundaries depend only on
  the sizes and the order of the calls, which are alike in every group; a pending bucket
  leaves at :meth:`SyncTransport.flush` (the caller flushes after handing in a sync's
  tensors), before an ``exact`` tensor, or when one of its tensors is waited for.
* **Nothing non-finite reaches the global parameters or a residual.** Each transfer's input is
  checked before it is sent and its result after it arrived (one reduction each). A group
  whose input is not finite sends NaNs, so that every group's result is not finite either,
  and every group fails the sync alike (:meth:`SyncTransport.non_finite`); the residuals stay
  as they were.
* **An error-feedback residual changes only when its sync commits.** The collective stages
  the residual of transfer ``n`` of fragment ``f`` (:meth:`FragmentResiduals.key`), and
  :meth:`SyncTransport.end_sync` keeps it or drops it with the sync's verdict. The keys of a
  fragment cover its parameters once, so a checkpoint holds a fragment's residuals as one flat
  tensor of fixed size, whatever the buckets (:class:`FragmentResiduals`).
* **A timeout sized for transfers of minutes.** Each collective may take up to
  ``fault_tolerance.sync_collective_timeout_s`` (the per-step ``process_group_timeout_ms`` does
  not apply; gloo takes it in the collective's options, torchft's nccl wrapper as its own
  timeout, so that no wait needs to name it: named, torchft's wrapper synchronizes the whole
  device, see ``collective._wait``): one that fails or ends past it fails the sync with a
  :class:`CollectiveTimeout` whose message names the field (:attr:`SyncTransport.timed_out`).
* **A dead or hung peer costs seconds, not the timeout.** While a rank waits for a transfer,
  it asks the lighthouse (``peer_watch.PeerWatch``) whether a group of the sync's quorum is
  gone; if so the sync ends at once with :class:`PeerGone` (:attr:`SyncTransport.peer_gone`),
  its transfers abandoned (``compression.runner``), and on nccl the communicator aborted so
  that nothing stays queued on the device. The old process group is dropped at the next
  quorum, whose id the failed commit changes. A transfer ended so may still write into the
  tensor it carried after the sync failed: every tensor handed to :meth:`SyncTransport.allreduce`
  must belong to its sync alone (LocalSGD, DiLoCo and async DiLoCo hand in fresh ones, never
  the model's own storage).

Failure semantics are torchft's: a failed collective is reported to the Manager
(``report_error``), the sync is not committed, nothing is applied, and ``wait`` never raises.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from torchtitan.components.ft import torchft_adapter as tft
from torchtitan.components.ft.build import end_collectives_in_flight
from torchtitan.experiments.fault_tolerance.compression import (
    AsyncCompressedAllReduce,
    CompressedWork,
    Delivered,
    ErrorFeedback,
    Packed,
)
from torchtitan.experiments.fault_tolerance.peer_watch import Gone, PeerWatch

if TYPE_CHECKING:
    from torchft.manager import Manager

#: The default bucket: fp32 values of one compressed transfer (``fault_tolerance.sync_bucket_mb``).
DEFAULT_BUCKET_MB = 32.0

TIMEOUT_FIELD = "fault_tolerance.sync_collective_timeout_s"


def bucket_numel(bucket_mb: float) -> int:
    """fp32 values in a bucket of ``bucket_mb`` MiB (at least one)."""
    return max(1, int(bucket_mb * 2**20) // 4)


class CollectiveTimeout(RuntimeError):
    """A collective of a sync ran past ``fault_tolerance.sync_collective_timeout_s``."""


class PeerGone(RuntimeError):
    """The lighthouse dropped a group of the sync's quorum while its transfers were in flight:
    the sync ended without waiting for them."""


def _timed_out(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, TimeoutError) or "timed out" in text or "timeout" in text


class FragmentResiduals:
    """This rank's error-feedback residuals by fragment, and their checkpoint.

    The residual of transfer ``n`` of fragment ``f``'s sync lives under ``key(f, n)`` in a
    per-key :class:`ErrorFeedback` store (:attr:`feedback`). Together a fragment's transfers
    cover its parameters once, in order, so its residuals go into a checkpoint as one flat fp32
    tensor of the fragment's size (:meth:`flat`), whatever the bucket sizes, and a restarted rank
    hands the loaded tensor (:meth:`load`) back in slices as the sync's transfers ask for their
    keys. What an undecided sync staged is checkpointed apart (``staged``) and owed only if that
    sync then commits (:meth:`commit`).
    """

    def __init__(self, decay: float = 1.0) -> None:
        #: Loaded flat residuals not handed out yet: fragment -> (flat, offset taken so far).
        self._loaded: dict[int, tuple[torch.Tensor, int]] = {}
        #: Residuals of an undecided sync, by fragment, as a checkpoint saved them.
        self._staged_loaded: dict[int, torch.Tensor] = {}
        self.feedback = ErrorFeedback(take_loaded=self._take_loaded, decay=decay)

    @staticmethod
    def key(fragment: int, index: int) -> str:
        return f"fragment_{fragment}/{index}"

    @staticmethod
    def fragment_of(key: str) -> int | None:
        """The fragment of a :meth:`key` (None for another key)."""
        head, _, tail = key.partition("/")
        if not head.startswith("fragment_") or not tail.isdigit():
            return None
        return int(head.removeprefix("fragment_"))

    def _take_loaded(self, key: str, numel: int) -> torch.Tensor | None:
        """The next ``numel`` values of the loaded flat residual of ``key``'s fragment."""
        fragment = self.fragment_of(key)
        if fragment is None or fragment not in self._loaded:
            return None
        flat, offset = self._loaded[fragment]
        if offset + numel > flat.numel():
            raise ValueError(
                f"error feedback {key!r}: the checkpointed residual of fragment {fragment} has "
                f"{flat.numel()} values, {offset} taken; this tensor needs {numel} more"
            )
        if offset + numel == flat.numel():
            del self._loaded[fragment]
        else:
            self._loaded[fragment] = (flat, offset + numel)
        return flat[offset : offset + numel]

    def _keys(self, fragment: int, residuals: dict[str, torch.Tensor]) -> list[str]:
        found = [
            (int(k.rsplit("/", 1)[1]), k) for k in residuals if self.fragment_of(k) == fragment
        ]
        return [key for _, key in sorted(found)]

    def flat(self, fragment: int, numel: int, staged: bool = False) -> torch.Tensor:
        """This rank's residuals of ``fragment`` as one flat fp32 CPU tensor of ``numel``
        values (the fragment's local parameters), in key order; zeros where it owes nothing
        (before its first compressed sync, or right after a heal). ``staged``: the residuals
        the undecided sync of ``fragment`` leaves if it commits (:meth:`has_staged`)."""
        out = torch.zeros(numel, dtype=torch.float32)
        if staged and fragment in self._staged_loaded:
            out.copy_(self._staged_loaded[fragment])
            return out
        if not staged and fragment in self._loaded:
            loaded, offset = self._loaded[fragment]
            out[offset:] = loaded[offset:].cpu()
        residuals = self.feedback.owed(staged)
        offset = 0
        for key in self._keys(fragment, residuals):
            residual = residuals[key].reshape(-1)
            if offset + residual.numel() > numel:
                raise ValueError(
                    f"error feedback: fragment {fragment}'s residuals hold more than its "
                    f"{numel} parameter values (key {key!r})"
                )
            out[offset : offset + residual.numel()] = residual.cpu()
            offset += residual.numel()
        return out

    def load(self, fragment: int, flat: torch.Tensor, staged: bool = False) -> None:
        """Owe ``flat`` (from :meth:`flat`) again: the fragment's next sync takes it in slices,
        one per transfer, in key order. ``staged``: what the undecided sync of ``fragment``
        leaves if it commits (owed from :meth:`commit` on)."""
        flat = flat.detach().reshape(-1).clone()
        if staged:
            self._staged_loaded[fragment] = flat
            return
        for key in self._keys(fragment, self.feedback.owed()):
            self.feedback.forget(key)
        self._loaded[fragment] = (flat, 0)

    def has_staged(self, fragment: int) -> bool:
        """Whether the undecided sync of ``fragment`` left residuals."""
        staged = self.feedback.owed(staged=True)
        return fragment in self._staged_loaded or bool(self._keys(fragment, staged))

    def commit(self) -> None:
        """The sync committed: what it staged (or a checkpoint loaded as staged) is owed."""
        self.feedback.commit()
        for fragment, flat in self._staged_loaded.items():
            self.load(fragment, flat)
        self._staged_loaded.clear()

    def discard(self, loaded: bool = True) -> None:
        """The sync did not commit (or was never decided): what was owed before stays owed.
        ``loaded``: also drop what a checkpoint loaded as staged (False: keep it for the
        verdict of the sync it belongs to)."""
        self.feedback.discard()
        if loaded:
            self._staged_loaded.clear()

    def reset(self) -> None:
        """Owe nothing (after a heal: the residuals belong to state this group no longer has),
        loaded residuals included."""
        self.feedback.reset()
        self._loaded.clear()
        self._staged_loaded.clear()


class _Done:
    """The work of a call that sent nothing (the Manager had already failed this sync)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def wait(self) -> bool:
        return True


class _Pieces:
    """The works of a tensor sent in bucket-sized pieces (or in one, e.g. an exact one)."""

    def __init__(
        self, transport: SyncTransport, tensor: torch.Tensor, works: list[CompressedWork]
    ) -> None:
        self._transport = transport
        self.tensor = tensor
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            self._transport.await_transfer(work)
        return True


@dataclass
class _Bucket:
    """Tensors packed into one transfer, in call order."""

    divide_by: float
    device: torch.device
    members: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    numel: int = 0
    #: Once sent: the transfer's work.
    work: CompressedWork | None = None
    #: On CUDA: where each member's producer stream was when it was handed in.
    ready: list[torch.cuda.Event] = field(default_factory=list)

    def add(self, tensor: torch.Tensor) -> None:
        self.members.append((tensor, self.numel))
        self.numel += tensor.numel()
        if tensor.is_cuda:  # the bucket may leave from another stream (e.g. the last flush)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(tensor.device))
            self.ready.append(event)


class BucketedWork:
    """The work of one tensor packed into a bucket: waiting sends the bucket if it is still
    pending, and returns once the tensor holds its result (torchft's ``Work.wait``)."""

    def __init__(self, transport: SyncTransport, bucket: _Bucket, tensor: torch.Tensor) -> None:
        self._transport = transport
        self._bucket = bucket
        self.tensor = tensor

    def wait(self) -> bool:
        if self._bucket.work is None:
            self._transport.flush()
        assert self._bucket.work is not None
        self._transport.await_transfer(self._bucket.work)
        return True


#: What :meth:`SyncTransport.allreduce` returns: each waits until its tensor holds the result.
TransferWork = _Done | _Pieces | BucketedWork


class SyncTransport:
    """Carries the tensors of each sync (see the module docstring).

    One sync at a time: :meth:`begin_sync` at its quorum, :meth:`allreduce` for each tensor,
    :meth:`flush`, the works waited for, then :meth:`non_finite` and, with the verdict,
    :meth:`end_sync`.
    """

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
        """``keep_delivered``: keep each transfer's result as every group received it (CPU
        memory), for :meth:`delivered` (the heal history). ``peers``: asked while a transfer
        is waited for whether a group of the sync's quorum is gone (None: only the timeout
        ends a transfer). ``residual_decay``: what of an error-feedback residual is still
        owed a sync later (``ErrorFeedback``)."""
        self.dtype = dtype
        self.keep_delivered = keep_delivered
        #: The error-feedback residuals (None: no error feedback).
        self.residuals = (
            FragmentResiduals(residual_decay) if error_feedback and dtype != "float32" else None
        )
        self.bucket_numel = bucket_numel(bucket_mb)
        self.timeout = timedelta(seconds=timeout_s)
        self._runner = AsyncCompressedAllReduce()
        self._manager: Manager | None = None
        self.fragment = 0
        self._transfers = 0
        self._pending: _Bucket | None = None
        #: This sync's transfers of pseudo-gradients or parameters (not the exact ones).
        self.works: list[CompressedWork] = []
        self._all: list[CompressedWork] = []
        #: The error of this sync's first collective that failed or ended past the timeout.
        self.timed_out: CollectiveTimeout | None = None
        self.peers = peers
        #: Why this sync's transfers were abandoned (a group of its quorum is gone), if so.
        self.peer_gone: PeerGone | None = None
        self._participants: tuple[int, ...] = ()
        self._own = 0
        self._sent_at: float | None = None

    # ---- one sync ------------------------------------------------------------------------------

    def begin_sync(
        self, manager: Manager, fragment: int, participants: Sequence[int] = (), own: int = 0
    ) -> None:
        """A sync of ``fragment`` starts (its quorum is in): transfers are numbered from 0. What
        an earlier sync staged and nobody decided (it was dropped, e.g. at the end of
        training) is void; residuals a checkpoint loaded as staged stay for the next verdict.
        ``participants``: the heartbeat keys of the quorum's groups (``peer_watch``), this
        group's ``own`` among them, watched while the sync's transfers are waited for."""
        if self._runner.broken is not None:  # loud, as the failure would have been in flush
            raise RuntimeError(
                f"fault_tolerance: this rank cannot sync any more: {self._runner.broken}; "
                "restart the group (it heals from a peer)"
            )
        self._manager = manager
        self.fragment = fragment
        self._transfers = 0
        self._pending = None
        self.works = []
        self._all = []
        self.timed_out = None
        self.peer_gone = None
        self._participants = tuple(participants)
        self._own = own
        self._sent_at = None
        if self.residuals is not None:
            self.residuals.discard(loaded=False)

    def allreduce(
        self, manager: Manager, tensor: torch.Tensor, *, average: bool, exact: bool = False
    ) -> TransferWork:
        """All-reduce (SUM, or the mean over the quorum with ``average``) ``tensor`` in place.

        ``exact``: sent as fp32, without error feedback (e.g. a token count), after any
        pending bucket. Returns a work to ``wait`` for.
        """
        self._manager = manager
        if manager.errored() is not None:  # torchft: after an error, the rest are no-ops
            return _Done(tensor)
        if not manager.is_participating():
            tensor.zero_()  # a healing group sends nothing
        divide_by = manager.num_participants() if average else 1
        if exact:
            self.flush()
            return _Pieces(self, tensor, [self._submit(tensor.view(-1), divide_by, exact=True)])
        if tensor.numel() >= self.bucket_numel and tensor.is_contiguous():
            self.flush()
            flat, step = tensor.view(-1), self.bucket_numel
            pieces = [flat[i : i + step] for i in range(0, flat.numel(), step)]
            return _Pieces(self, tensor, [self._submit(piece, divide_by) for piece in pieces])
        bucket = self._pending
        if (
            bucket is None
            or bucket.numel + tensor.numel() > max(self.bucket_numel, tensor.numel())
            or bucket.divide_by != divide_by
            or bucket.device != tensor.device
        ):
            self.flush()
            bucket = self._pending = _Bucket(divide_by, tensor.device)
        bucket.add(tensor)
        return BucketedWork(self, bucket, tensor)

    def flush(self) -> None:
        """Send the pending bucket, if any."""
        bucket, self._pending = self._pending, None
        if bucket is None:
            return
        packed = Packed(bucket.members, bucket.numel, bucket.device, bucket.ready)
        assert self._manager is not None  # set by the allreduce that filled the bucket
        if self._manager.errored() is not None:
            bucket.work = CompressedWork(torch.empty(0, device=bucket.device), bucket.numel)
            bucket.work.complete()
            return
        bucket.work = self._submit(packed, bucket.divide_by)

    def _submit(
        self, flat: torch.Tensor | Packed, divide_by: float, *, exact: bool = False
    ) -> CompressedWork:
        manager = self._manager
        assert manager is not None  # set by allreduce, the only caller (through flush too)
        key = ""
        if not exact:
            key = FragmentResiduals.key(self.fragment, self._transfers)
            self._transfers += 1
        numel = flat.numel if isinstance(flat, Packed) else flat.numel()
        if self._sent_at is None:
            self._sent_at = time.monotonic()

        def on_error(error: Exception) -> None:
            if _timed_out(error):
                error = CollectiveTimeout(
                    f"a transfer of fragment {self.fragment}'s sync ({numel * 4 / 2**20:.1f} MiB "
                    f"of fp32 values, sent as {'float32' if exact else self.dtype}) did not "
                    f"finish within {TIMEOUT_FIELD}={self.timeout.total_seconds():g}s: raise it "
                    f"if every group is alive ({str(error).splitlines()[0]})"
                )
                if self.timed_out is None:
                    self.timed_out = error
            manager.report_error(error)

        work = self._runner.submit(
            tft.replica_process_group(manager),
            flat,
            "float32" if exact else self.dtype,
            divide_by=divide_by,
            error_feedback=None if exact or self.residuals is None else self.residuals.feedback,
            key=key,
            on_error=on_error,
            timeout=self.timeout,
            check_finite=True,
            keep_delivered=self.keep_delivered and not exact,
        )
        self._all.append(work)
        if not exact:
            self.works.append(work)
        return work

    def non_finite(self) -> str | None:
        """After this sync's works are done: ``"sent"`` when this rank's own input held an inf
        or NaN, ``"received"`` when another group's did (the result was not finite), None when
        every value was finite."""
        self.flush()
        found = None
        for work in self._all:
            self.await_transfer(work)
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
        group received them, in order. Together they are the fragment's averaged
        pseudo-gradients, flat, in the order the method handed them in."""
        found = []
        for work in self.works:
            self.await_transfer(work)
            assert work.delivered is not None, "a committed transfer kept no result"
            found.append(work.delivered)
        return found

    def wait(self) -> None:
        """Send what is pending and wait for every transfer of this sync (e.g. before a
        checkpoint reads the error-feedback residuals, which the transfers stage)."""
        self.flush()
        for work in self._all:
            self.await_transfer(work)

    def await_transfer(self, work: CompressedWork) -> None:
        """Wait until ``work`` is done. While it takes longer than the peer watch's interval,
        ask the lighthouse whether a group of this sync's quorum is gone: if one is, the
        sync's transfers are abandoned (:meth:`_abandon`) and the wait ends at once."""
        peers = self.peers
        if peers is None or len(self._participants) < 2:
            work.wait()
            return
        while not work.wait_for(peers.every_s):
            if self.peer_gone is not None:  # abandoned already: this one never delivers
                work.abandon()
                return
            gone = peers.gone(self._participants, self._own)
            if gone is not None:
                self._abandon(gone)

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
        # nccl first: issuing a collective on a communicator whose peer is gone may block (a
        # lazy connection), and the runner's thread holds its lane while it issues.
        end_collectives_in_flight(tft.replica_process_group(manager))
        self._runner.abandon()

    def squares(self) -> float | None:
        """After this sync's works are done: the sum of squares of its result (the
        pseudo-gradients, not the exact tensors), or None where one transfer has none (it
        failed, or was not finite)."""
        self.flush()
        total = 0.0
        for work in self.works:
            self.await_transfer(work)
            if work.squares is None:
                return None
            total += work.squares
        return total

    def stats(self) -> tuple[int, float | None]:
        """This sync's bytes sent by this rank and, compressed, its seconds compressing and
        decompressing (waiting for the transfers). Uncompressed: the payload's bytes and None."""
        self.flush()
        sent, seconds = 0, 0.0
        for work in self.works:
            self.await_transfer(work)
            if self.dtype == "float32":
                sent += work.numel * 4
            elif work.stats is not None:
                sent += work.stats.bytes_sent
                seconds += work.stats.encode_s + work.stats.decode_s
        return sent, None if self.dtype == "float32" else seconds

    def shutdown(self) -> None:
        self._runner.shutdown()
