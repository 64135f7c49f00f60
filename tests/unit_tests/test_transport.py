"""The sync transport between replica groups (real gloo process groups, one thread per group):
buckets, exact tensors, a healing group's zeros, non-finite values, error-feedback residuals
that follow the sync's verdict, and the collective timeout."""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch.distributed import ReduceOp

from tests.unit_tests.gloo_groups import LoopbackManager, open_quorum, run_groups, sync_manager
from tests.unit_tests.test_compression import _varied, encode_staged
from torchtitan.components.ft import FaultToleranceError, torchft_adapter
from torchtitan.experiments.fault_tolerance import events
from torchtitan.experiments.fault_tolerance.job_config import PSEUDO_GRAD_DTYPES
from torchtitan.experiments.fault_tolerance.transport.codecs import get_codec
from torchtitan.experiments.fault_tolerance.transport.residuals import ResidualKey, Residuals
from torchtitan.experiments.fault_tolerance.transport.sync_transport import (
    CollectiveTimeout,
    SyncTransport,
    bucket_numel,
)
from torchtitan.tools.events import event_of


def _sizes() -> list[int]:
    # 700 (in pieces of 300, 300, 100), 100 + 150 (a bucket), 120 (does not fit after 250: the
    # next bucket), 1 (with it).
    return [700, 100, 150, 120, 1]


def _tensors(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(n, generator=g) * (rank + 1) for n in _sizes()]


def test_the_bucket_holds_whole_fp32_values() -> None:
    assert bucket_numel(32) == 32 * 2**20 // 4
    assert bucket_numel(1e-9) == 1


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_every_tensor_is_averaged_in_buckets_of_its_own_and_the_transfers_are_counted(dtype):
    def group(rank: int, pg: Any) -> tuple[list[torch.Tensor], int, list[int]]:
        sync = sync_manager(LoopbackManager(pg, rank, 2), dtype, bucket_numel=300)
        try:
            sync.begin_sync()
            tensors = _tensors(rank)
            works = [sync.allreduce(t) for t in tensors]
            for work in works:
                work.wait()
            transfers = [w.numel for w in sync.transport.works]
            # A packed bucket's work holds no copy of its tensors (pieces are the tensor's own
            # storage): the buffer lived only while its transfer ran.
            held = [w.tensor.numel() for w in sync.transport.works]
            assert held == [300, 300, 100, 0, 0], held
            return tensors, len(sync.transport.works), transfers
        finally:
            sync.transport.shutdown()

    (got0, count, transfers), (got1, _, _) = run_groups(2, group)
    assert count == 5 and transfers == [300, 300, 100, 250, 121]
    for index, (a, b) in enumerate(zip(got0, got1, strict=True)):
        assert torch.equal(a, b), index
        mean = (_tensors(0)[index] + _tensors(1)[index]) / 2
        tolerance = 0 if dtype == "float32" else 4 * mean.abs().max() / 127
        assert (a - mean).abs().max() <= tolerance + 1e-6, index


def test_an_exact_tensor_travels_as_it_is_and_a_healing_group_sends_zeros() -> None:
    """A token count next to a tiny value: int8 would round 0.001 to 0 in a block whose
    absmax is 12345.678; sent exact it arrives bit for bit. A group that is not participating
    (it heals in this quorum) adds zeros."""

    def group(rank: int, pg: Any) -> tuple[torch.Tensor, torch.Tensor]:
        manager = LoopbackManager(pg, rank, 2)
        if rank == 1:
            manager.is_participating = lambda: False  # type: ignore[method-assign]
        sync = sync_manager(manager, "int8", bucket_numel=300)
        try:
            sync.begin_sync()
            exact = torch.tensor([12345.678, 0.001])
            pseudo = torch.full((200,), 2.0)
            works = [
                sync.allreduce(pseudo, reduce_op=ReduceOp.SUM),
                sync.allreduce(exact, reduce_op=ReduceOp.SUM, exact=True),
            ]
            for work in works:
                work.wait()
            return exact, pseudo
        finally:
            sync.transport.shutdown()

    (exact0, pseudo0), (exact1, pseudo1) = run_groups(2, group)
    assert torch.equal(exact0, torch.tensor([12345.678, 0.001]))  # group 1 sent zeros
    assert torch.equal(exact0, exact1) and torch.equal(pseudo0, pseudo1)
    assert torch.equal(pseudo0, torch.full((200,), 2.0))  # only group 0's contribution


def _sync_once(
    sync: Any, manager: LoopbackManager, tensor: torch.Tensor, fail: bool = False
) -> bool:
    open_quorum(sync)
    sync.allreduce(tensor).wait()
    if fail:
        manager.report_error(RuntimeError("another rank of this group failed"))
    return sync.decide().committed


def test_a_residual_changes_only_when_its_sync_commits() -> None:
    """Three int8 syncs with error feedback, each of three transfers. In the second, group 0's
    commit fails after all its transfers succeeded (another rank of the group failed): its
    residuals stay what the first sync left; the third sync, committed, replaces them."""

    def group(rank: int, pg: Any) -> list[torch.Tensor | None]:
        manager = LoopbackManager(pg, rank, 2)
        sync = sync_manager(manager, "int8", error_feedback=True, bucket_numel=300)
        residuals = sync.transport.residuals
        assert residuals is not None
        seen: list[torch.Tensor | None] = []
        try:
            for number, seed in enumerate((1, 2, 3)):
                x = torch.randn(750, generator=torch.Generator().manual_seed(seed + 10 * rank))
                committed = _sync_once(sync, manager, x, fail=rank == 0 and number == 1)
                assert committed == (rank != 0 or number != 1)
                seen.append(residuals.flat(0, 750))
                assert list(residuals.segments(0)) == [0, 300, 600]  # transfers of 300, 300, 150
        finally:
            sync.transport.shutdown()
        return seen

    mine, theirs = run_groups(2, group)
    assert all(r is not None for r in mine + theirs)
    assert torch.equal(mine[1], mine[0])  # not committed: unchanged
    assert not torch.equal(mine[2], mine[1])
    assert not torch.equal(theirs[1], theirs[0])  # the other group committed


def test_a_decision_numbers_its_sync_and_keeps_what_only_a_committed_one_delivered() -> None:
    """Three fp32 syncs of 750 values (transfers of 300, 300 and 150) whose results are kept
    for a heal history; group 0 fails the second after its transfers arrived (another rank
    of the group failed). Each decision numbers its sync by the step a commit makes (a failed
    one by the number it is retried under), counts the quorum's groups, this rank's bytes and
    the sum of squares of the result, and keeps what a committed sync delivered, as received;
    a failed one keeps nothing."""

    def group(rank: int, pg: Any) -> list[Any]:
        manager = LoopbackManager(pg, rank, 2)
        sync = sync_manager(manager, "float32", bucket_numel=300, keep_delivered=True)
        decisions = []
        try:
            for number in range(3):
                open_quorum(sync)
                sync.allreduce(torch.full((750,), float(rank + 1 + number))).wait()
                if rank == 0 and number == 1:
                    manager.report_error(RuntimeError("another rank of this group failed"))
                decisions.append(sync.decide())
        finally:
            sync.transport.shutdown()
        return decisions

    mine, theirs = run_groups(2, group)
    assert [(d.committed, d.number) for d in mine] == [(True, 1), (False, 2), (True, 2)]
    assert [(d.committed, d.number) for d in theirs] == [(True, 1), (True, 2), (True, 3)]
    assert mine[1].delivered == []
    for number, decision in enumerate(theirs):
        average = 1.5 + number  # the mean of group 0's 1 + n and group 1's 2 + n
        assert (decision.groups, decision.bytes_sent) == (2, 750 * 4)
        assert decision.compression_s is None
        assert decision.squares == pytest.approx(750 * average**2)
        assert [d.numel for d in decision.delivered] == [300, 300, 150]
        received = torch.cat([d.payload.reshape(-1) for d in decision.delivered])
        assert torch.equal(received, torch.full((750,), average))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", PSEUDO_GRAD_DTYPES)
def test_a_non_finite_pseudo_gradient_fails_the_sync_on_every_group(
    caplog, dtype: str, value: float
) -> None:
    """Group 1 sends a NaN, +inf or -inf in its second sync, in every dtype (compressed ones
    with error feedback): both groups drop that sync, both residuals stay as the first sync
    left them, group 1 is named as the source, and the next sync commits with finite values."""
    compressed = dtype != "float32"

    def group(rank: int, pg: Any) -> dict[str, Any]:
        manager = LoopbackManager(pg, rank, 2)
        sync = sync_manager(manager, dtype, error_feedback=compressed, bucket_numel=300)
        residuals = sync.transport.residuals
        assert (residuals is not None) == compressed
        out: dict[str, Any] = {"committed": [], "residuals": [], "results": []}
        try:
            for number in range(3):
                x = torch.randn(280, generator=torch.Generator().manual_seed(number + 10 * rank))
                if rank == 1 and number == 1:
                    x[137] = value
                out["committed"].append(_sync_once(sync, manager, x))
                if residuals is not None:
                    out["residuals"].append(residuals.flat(0, 280))
                out["results"].append(x)
        finally:
            sync.transport.shutdown()
        return out

    with caplog.at_level(logging.INFO, logger="torchtitan"):
        first, second = run_groups(2, group)
    for out in (first, second):
        assert out["committed"] == [True, False, True]
        if compressed:
            assert torch.equal(out["residuals"][1], out["residuals"][0])
            assert all(torch.isfinite(r).all() for r in out["residuals"])
        assert torch.isfinite(out["results"][2]).all()
    seen = [event_of(r) for r in caplog.records]
    found = [e.fields for e in seen if e is not None and e.name == events.NON_FINITE.name]
    assert sorted((f["origin"], f["group"]) for f in found) == [
        ("another group", None),
        ("this group", 1),
    ]


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_non_finite_value_in_an_early_transfer_fails_the_sync_whatever_follows(
    caplog, dtype: str
) -> None:
    """A sync of three transfers (700 values in buckets of 300): group 1's NaN is in the first,
    the two after it are finite on both groups. Both groups drop the sync (the first transfer
    decides, not the last), nothing is committed, group 1 is named as the source."""

    def group(rank: int, pg: Any) -> tuple[bool, int]:
        manager = LoopbackManager(pg, rank, 2)
        sync = sync_manager(manager, dtype, bucket_numel=300)
        try:
            x = torch.randn(700, generator=torch.Generator().manual_seed(rank))
            if rank == 1:
                x[17] = float("nan")
            committed = _sync_once(sync, manager, x)
            return committed, len(sync.transport.works)
        finally:
            sync.transport.shutdown()

    with caplog.at_level(logging.INFO, logger="torchtitan"):
        first, second = run_groups(2, group)
    assert first == second == (False, 3)
    seen = [event_of(r) for r in caplog.records]
    found = [e.fields for e in seen if e is not None and e.name == events.NON_FINITE.name]
    assert sorted((f["origin"], f["group"]) for f in found) == [
        ("another group", None),
        ("this group", 1),
    ]


@pytest.mark.parametrize("group_gone", [False, True])
def test_a_collective_past_the_timeout_fails_the_sync_naming_the_field(group_gone: bool) -> None:
    """Group 1 joins each collective 2 s late while the timeout is 0.5 s: group 0's sync fails
    with an error naming fault_tolerance.sync_collective_timeout_s. The second time in a row,
    with both groups still in the quorum, the run stops (the timeout is too small for the
    link); if the quorum has lost a group by then (a peer died or hung and was dropped), it
    goes on."""

    def group(rank: int, pg: Any) -> list[Any]:
        manager = LoopbackManager(pg, rank, 2)
        sync = sync_manager(manager, "int8", bucket_numel=300, timeout_s=0.5)
        outcomes: list[Any] = []
        try:
            for attempt in range(2):
                if rank == 1:
                    time.sleep(2.0)
                if group_gone and attempt == 1:
                    manager.size = 1  # the lighthouse no longer counts the late group
                try:
                    outcomes.append(_sync_once(sync, manager, torch.ones(100)))
                except FaultToleranceError as e:
                    outcomes.append(str(e))
                outcomes.append(manager.errored())
        finally:
            sync.transport.shutdown()
        return outcomes

    started = time.monotonic()
    waiting, _ = run_groups(2, group, timeout_s=60)
    assert time.monotonic() - started < 30
    committed, error, second, _ = waiting
    assert committed is False and isinstance(error, CollectiveTimeout)
    assert "fault_tolerance.sync_collective_timeout_s=0.5s" in str(error)
    if group_gone:
        assert second is False  # not committed, and no stop
    else:
        assert "2 syncs in a row timed out with all 2 groups still in the quorum" in second


def test_after_an_error_the_rest_of_a_sync_sends_nothing() -> None:
    """torchft's rule: once the Manager recorded an error in a sync, further all-reduces are
    no-ops that return at once (the sync fails anyway), leaving the tensor as it was."""

    def group(rank: int, pg: Any) -> tuple[bool, int, bool]:
        manager = LoopbackManager(pg, rank, 2)
        sync = sync_manager(manager, "int8", bucket_numel=300)
        try:
            open_quorum(sync)
            manager.report_error(RuntimeError("a peer died"))
            x = torch.arange(500, dtype=torch.float32)
            started = time.monotonic()
            sync.allreduce(x).wait()
            sync.allreduce(x[:10]).wait()
            quick = time.monotonic() - started < 5
            return (
                torch.equal(x, torch.arange(500, dtype=torch.float32)),
                len(sync.transport.works),
                quick,
            )
        finally:
            sync.transport.shutdown()

    assert run_groups(2, group) == [(True, 0, True)] * 2


def test_a_transfer_that_failed_unwaited_stops_the_next_bucket() -> None:
    """Group 1 never joins: group 0's first transfer fails at the 0.5 s timeout while nobody
    waits for it. The next bucket is not sent (its collective would only time out too), and
    the failure is the Manager's (the sync is not committed), named as a timeout."""

    def group(rank: int, pg: Any) -> tuple[int, str]:
        manager = LoopbackManager(pg, rank, 2)
        sync = sync_manager(manager, "int8", bucket_numel=300, timeout_s=0.5)
        try:
            if rank == 1:
                time.sleep(3.0)  # absent from the collective, then gone
                return 0, ""
            open_quorum(sync)
            sync.allreduce(torch.ones(100))
            sync.transport.flush()
            time.sleep(2.0)  # the transfer failed meanwhile, unwaited
            sync.allreduce(torch.ones(100))
            sync.transport.flush()
            return len(sync.transport.works), type(manager.errored()).__name__
        finally:
            sync.transport.shutdown()

    first, _ = run_groups(2, group, timeout_s=60)
    assert first == (1, "CollectiveTimeout")


def test_a_fragments_residuals_checkpoint_as_one_flat_tensor_and_continue_exactly() -> None:
    """A fragment synced in two buckets (300 + 200 values): its residuals go into a checkpoint
    as one flat tensor of the fragment's 500 values; fresh residuals loaded from it encode
    the next syncs bit for bit as the ones that never stopped, reading the loaded tensor at
    each transfer's offset."""
    codec = get_codec("int4")
    first, second = ResidualKey(0, 0), ResidualKey(0, 300)

    def sync(residuals: Residuals, seed: int) -> list[torch.Tensor]:
        sent = [
            encode_staged(residuals, first, _varied(300, seed), codec),
            encode_staged(residuals, second, _varied(200, seed + 100), codec),
        ]
        residuals.commit()
        return sent

    running = Residuals()
    assert torch.equal(running.flat(0, 500), torch.zeros(500))  # owes nothing yet
    sync(running, seed=1)
    encode_staged(running, ResidualKey(1, 0), _varied(50, 9), codec)  # another fragment
    running.commit()
    flat = running.flat(0, 500)
    assert torch.equal(flat[:300], running.segments(0)[0])
    assert torch.equal(flat[300:], running.segments(0)[300])

    restarted = Residuals()
    restarted.load(0, flat)
    assert torch.equal(restarted.flat(0, 500), flat)  # checkpointed again as is
    for seed in (2, 3):
        expected, got = sync(running, seed), sync(restarted, seed)
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), seed
    assert restarted.segments(1) == {}
    with pytest.raises(ValueError, match="more than its 400"):
        running.flat(0, 400)
    # A loaded residual read by a sync that then fails is still owed, all of it.
    failed = Residuals()
    failed.load(0, flat)
    x = _varied(300, seed=5)
    encode_staged(failed, first, x, codec)
    failed.discard()
    assert torch.equal(failed.flat(0, 500), flat)
    assert torch.equal(failed.correct_(first, x.clone()), x + flat[:300])
    assert torch.equal(failed.correct_(second, x[:200].clone()), x[:200] + flat[300:])
    short = Residuals()
    short.load(0, flat[:250])
    with pytest.raises(ValueError, match="of 250 values, none covering the 300 values at offset 0"):
        sync(short, seed=4)
    short.reset()
    assert short.flat(0, 500).count_nonzero() == 0  # a heal drops the loaded too


def test_residuals_a_checkpoint_staged_wait_for_the_verdict_of_their_sync() -> None:
    """A checkpoint saved while a sync was undecided (async DiLoCo) holds what it staged
    apart. After a restart they survive the next quorum's start (``discard(loaded=False)``)
    and are owed only if that sync commits; a newer sync of the fragment that stages voids
    them."""
    owed, staged = torch.full((500,), 1.0), torch.full((500,), 2.0)

    def restarted() -> Residuals:
        residuals = Residuals()
        residuals.load(0, owed)
        residuals.load(0, staged, staged=True)
        residuals.discard(loaded=False)  # the next sync's quorum begins
        assert residuals.has_staged(0) and not residuals.has_staged(1)
        assert torch.equal(residuals.flat(0, 500, staged=True), staged)
        return residuals

    committed = restarted()
    committed.commit()
    assert torch.equal(committed.flat(0, 500), staged) and not committed.has_staged(0)
    failed = restarted()
    failed.discard()
    assert torch.equal(failed.flat(0, 500), owed) and not failed.has_staged(0)
    newer = restarted()
    x = _varied(200, seed=7)
    encode_staged(newer, ResidualKey(0, 300), x, get_codec("int8"))
    assert list(newer.segments(0, staged=True)) == [300]
    newer.commit()
    assert newer.flat(0, 500)[:300].count_nonzero() == 0


def test_a_fragment_sent_in_three_transfers_gets_each_residual_back_at_its_offset() -> None:
    """int4 with error feedback: a fragment of 700 values travels in three transfers (300, 300
    and 100: buckets of 300). After its first sync both groups restart from a checkpoint of
    their residuals (one flat tensor of the fragment's size, as the checkpoint holds it): the
    next two syncs deliver bit for bit what groups that never stopped deliver, and leave the
    same residual under each transfer's key."""
    numel = 700

    def group(rank: int, pg: Any, restart: bool) -> tuple[list[torch.Tensor], list[Any]]:
        manager = LoopbackManager(pg, rank, 2)
        sync = sync_manager(manager, "int4", error_feedback=True, bucket_numel=300)
        results: list[torch.Tensor] = []
        try:
            for number in range(3):
                if restart and number == 1:
                    assert sync.transport.residuals is not None
                    saved = sync.transport.residuals.flat(0, numel)  # the checkpoint's tensor
                    sync.transport.shutdown()
                    manager = LoopbackManager(pg, rank, 2)
                    sync = sync_manager(manager, "int4", error_feedback=True, bucket_numel=300)
                    assert sync.transport.residuals is not None
                    sync.transport.residuals.load(0, saved)
                x = _varied(numel, seed=number + 10 * rank)
                assert _sync_once(sync, manager, x)
                assert [w.numel for w in sync.transport.works] == [300, 300, 100]
                results.append(x)
            assert sync.transport.residuals is not None
            owed = sync.transport.residuals.segments(0)
            return results, [owed.get(offset) for offset in (0, 300, 600)]
        finally:
            sync.transport.shutdown()

    never_stopped = run_groups(2, lambda rank, pg: group(rank, pg, restart=False))
    restarted = run_groups(2, lambda rank, pg: group(rank, pg, restart=True))
    for (expected, expected_owed), (got, got_owed) in zip(never_stopped, restarted, strict=True):
        for number in (1, 2):
            assert torch.equal(got[number], expected[number]), f"sync {number}"
        for n, (a, b) in enumerate(zip(got_owed, expected_owed, strict=True)):
            assert a is not None and b is not None and torch.equal(a, b), f"transfer {n}"


def test_a_rank_whose_collectives_no_longer_line_up_stops_at_its_next_sync() -> None:
    def group(rank: int, pg: Any) -> str:
        sync = sync_manager(LoopbackManager(pg, rank, 1), "float32", bucket_numel=300)
        try:
            sync.transport._runner.broken = RuntimeError("a bucket could not be packed")
            with pytest.raises(RuntimeError, match="cannot sync any more") as raised:
                sync.begin_sync()
            return str(raised.value)
        finally:
            sync.transport.shutdown()

    (message,) = run_groups(1, group)
    assert "a bucket could not be packed" in message and "restart the group" in message


class _NcclLikeGroup:
    """A real gloo group whose collectives come back wrapped as torchft's nccl group wraps them
    (``_WorkAcceleratorTimeout``, with the collective timeout ``build.py`` gives it): the wait
    path of a sync on GPUs, run on the CPU."""

    def __init__(self, pg: Any, timeout: timedelta) -> None:
        self._pg = pg
        self._timeout = timeout
        self.aborted = 0

    def size(self) -> int:
        return self._pg.size()

    def abort(self) -> None:
        self.aborted += 1

    def _wrap(self, work: Any) -> Any:
        return torchft_adapter.accelerator_timeout_work(self, work, self._timeout)

    def allreduce(self, *args: Any) -> Any:
        return self._wrap(self._pg.allreduce(*args))

    def alltoall_base(self, *args: Any) -> Any:
        return self._wrap(self._pg.alltoall_base(*args))

    def allgather(self, *args: Any) -> Any:
        return self._wrap(self._pg.allgather(*args))


@pytest.mark.parametrize("late_s", [0.0, 2.0])
def test_a_sync_waits_without_synchronizing_the_device_and_still_times_out(
    monkeypatch: pytest.MonkeyPatch, late_s: float
) -> None:
    """torchft's nccl wrapper synchronizes the whole device (every stream, the training
    kernels queued behind the sync included) when a wait names a timeout, and its wait arms an
    abort timer that outlives a wait that raises (it would abort the next quorum's group). A
    sync's waits go around it, to the c10d work's own wait with the collective timeout: no
    ``torch.accelerator.synchronize`` nor ``torch.cuda.synchronize`` during a sync of every
    dtype, no torchft timer, and a peer 2 s late with a 0.5 s timeout still fails the sync
    naming ``fault_tolerance.sync_collective_timeout_s``."""
    import torchft.process_group as tft_pg

    synchronized: list[str] = []
    stream_timers: list[float] = []
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: synchronized.append("acc"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: synchronized.append("cuda"))
    # On a GPU: an event recorded on the waiting stream, checked at the timeout (the CPU has
    # no events).
    monkeypatch.setattr(
        tft_pg,
        "stream_timeout",
        lambda callback, timeout: stream_timers.append(timeout.total_seconds()),
    )
    timeout_s = 0.5 if late_s else 30.0

    def group(rank: int, pg: Any) -> list[Any]:
        wrapped = _NcclLikeGroup(pg, timedelta(seconds=timeout_s))
        manager = LoopbackManager(wrapped, rank, 2)  # type: ignore[arg-type]
        outcomes: list[Any] = []
        for dtype in ("float32", "int8") if not late_s else ("int8",):
            sync = sync_manager(manager, dtype, bucket_numel=300, timeout_s=timeout_s)
            try:
                if rank == 1:
                    time.sleep(late_s)
                tensors = _tensors(rank)
                open_quorum(sync)
                for work in [sync.allreduce(t) for t in tensors]:
                    work.wait()
                outcomes += [sync.decide().committed, manager.errored()]
            finally:
                sync.transport.shutdown()
        return [*outcomes, wrapped.aborted]

    started = time.monotonic()
    results, _ = run_groups(2, group, timeout_s=60)
    assert time.monotonic() - started < 30
    assert synchronized == [], synchronized
    assert stream_timers == [], stream_timers
    if late_s:
        # Group 0's first wait ran into the timeout (on nccl, c10d's wait then aborts the
        # communicator; over gloo here it raises).
        committed, error, aborted = results
        assert committed is False and isinstance(error, CollectiveTimeout)
        assert "fault_tolerance.sync_collective_timeout_s=0.5s" in str(error)
        assert aborted == 0
    else:
        assert results == [True, None, True, None, 0]


def test_a_checkpoints_residual_of_another_size_fails_the_sync_not_the_training() -> None:
    """Residuals loaded from a checkpoint that does not cover the fragment (written with other
    shards), on group 0 only: its transfers fail its sync, as a failed collective does, and
    say why; they still take part in the collectives, so group 1's arrive whole (its verdict
    here is its own), well before the collective timeout; the training thread goes on."""

    def group(rank: int, pg: Any) -> tuple[bool, str, float]:
        manager = LoopbackManager(pg, rank, 2)
        sync = sync_manager(manager, "int4", error_feedback=True, bucket_numel=300, timeout_s=20)
        try:
            assert sync.transport.residuals is not None
            if rank == 0:
                sync.transport.residuals.load(0, torch.zeros(250))  # the fragment has 700
            start = time.monotonic()
            committed = _sync_once(sync, manager, _varied(700, seed=rank))
            return committed, str(manager.errored()), time.monotonic() - start
        finally:
            sync.transport.shutdown()

    (committed, error, _), (other, other_error, seconds) = run_groups(2, group)
    assert not committed
    assert "fragment 0 owes residuals of 250 values, none covering the" in error
    assert other and other_error == "None" and seconds < 15


def test_an_exact_transfer_takes_no_place_among_the_fragments_values() -> None:
    """A token count sent exact before a fragment's pseudo-gradient (fp32, no error feedback)
    leaves the fragment's transfers at their offsets: the residuals sit at 0, 300 and 600,
    and the checkpoint's flat tensor holds the fragment's 700 values."""

    def group(rank: int, pg: Any) -> list[int]:
        manager = LoopbackManager(pg, rank, 2)
        sync = sync_manager(manager, "int8", error_feedback=True, bucket_numel=300)
        try:
            open_quorum(sync)
            tokens = torch.ones(1)
            sync.allreduce(tokens, ReduceOp.SUM, exact=True).wait()
            sync.allreduce(_varied(700, seed=rank)).wait()
            assert sync.decide().committed and tokens.item() == 2
            assert sync.transport.residuals is not None
            assert sync.transport.residuals.flat(0, 700).count_nonzero() > 0
            return list(sync.transport.residuals.segments(0))
        finally:
            sync.transport.shutdown()

    for offsets in run_groups(2, group):
        assert offsets == [0, 300, 600]


@pytest.mark.parametrize("committed", [True, False])
def test_the_verdict_of_a_restored_undecided_sync_decides_its_staged_residuals(
    committed: bool,
) -> None:
    """Restarted from a checkpoint saved while async DiLoCo's sync was undecided: the
    transport's verdict on that sync keeps what it staged, or drops it for good."""
    transport = SyncTransport("int8", error_feedback=True, bucket_mb=1.0, timeout_s=5)
    try:
        residuals = transport.residuals
        assert residuals is not None
        owed, staged = torch.full((500,), 1.0), torch.full((500,), 2.0)
        residuals.load(0, owed)
        residuals.load(0, staged, staged=True)
        transport.end_sync(committed)
        assert not residuals.has_staged(0)
        assert torch.equal(residuals.flat(0, 500), staged if committed else owed)
        residuals.commit()  # a later sync that staged nothing of fragment 0 commits
        assert torch.equal(residuals.flat(0, 500), staged if committed else owed)
    finally:
        transport.shutdown()
