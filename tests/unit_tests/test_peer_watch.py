"""Failure detection for a sync in flight: the lighthouse's heartbeats end a sync whose peer is
gone in seconds, while a late but live peer's transfer still completes (real lighthouse, real
gloo groups)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.gloo_groups import LoopbackManager, heartbeat_id, run_groups, sync_manager
from torchtitan.components.ft import given_up
from torchtitan.components.ft.build import fresh_rendezvous_process_group
from torchtitan.components.ft.network import listen_store
from torchtitan.components.ft.timeouts import ReplicaTimeouts
from torchtitan.components.ft.torchft_adapter import lighthouse_heartbeats
from torchtitan.experiments.fault_tolerance import events
from torchtitan.experiments.fault_tolerance.transport.peer_watch import (
    Gone,
    PeerWatch,
    heartbeat_key,
)
from torchtitan.experiments.fault_tolerance.transport.sync_transport import PeerGone
from torchtitan.tools.events import event_of


def _heartbeat_until(client: Any, replica: str, stop: threading.Event) -> None:
    while not stop.is_set():
        client.heartbeat(replica)
        time.sleep(0.05)


def test_the_lighthouse_says_which_groups_it_dropped() -> None:
    """A real lighthouse with a 300 ms heartbeat timeout: a group that keeps heartbeating is
    alive, one that went silent is dropped; the watch names the dropped member of a quorum,
    never this group itself, and concludes nothing from a lighthouse it cannot reach."""
    from torchft.coordination import LighthouseClient, LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, heartbeat_timeout_ms=300)
    stop = threading.Event()
    try:
        address = lighthouse.address()
        client = LighthouseClient(address, connect_timeout=timedelta(seconds=5))
        alive, silent, me = "replica_0:aaaa", "replica_1:bbbb", "replica_2:cccc"
        for replica in (alive, silent, me):
            client.heartbeat(replica)
        beating = threading.Thread(target=_heartbeat_until, args=(client, alive, stop))
        beating.start()
        time.sleep(1.0)
        assert lighthouse_heartbeats(address) == {alive: True, silent: False, me: False}

        watch = PeerWatch(address, every_s=0.0)
        keys = [heartbeat_key(r) for r in (alive, silent, me)]
        assert watch.gone(keys, own=keys[2]) == Gone(silent)
        assert Gone(silent).name == "replica group 1"
        assert watch.gone([keys[0], keys[2]], own=keys[2]) is None  # only itself dropped
        assert PeerWatch("http://127.0.0.1:9", every_s=0.0).gone(keys, own=keys[2]) is None
    finally:
        stop.set()
        lighthouse.shutdown()


def _itself_dropped_after(seconds: float, itself: str, other: str) -> Any:
    """A lighthouse view in which ``itself`` is dropped ``seconds`` from now, ``other`` never."""
    start = time.monotonic()

    def heartbeats(_: str) -> dict[str, bool]:
        return {itself: time.monotonic() - start < seconds, other: True}

    return heartbeats


def _dropped_after(seconds: float, replica: str) -> Any:
    """A lighthouse view in which ``replica`` is dropped ``seconds`` from now."""
    start = time.monotonic()

    def heartbeats(_: str) -> dict[str, bool]:
        return {replica: time.monotonic() - start < seconds, heartbeat_id(0): True}

    return heartbeats


@pytest.mark.parametrize(
    "peer", ["gone", "late_but_alive", "dropped_but_alive", "this_group_dropped_but_alive"]
)
def test_a_peer_the_lighthouse_dropped_ends_the_sync_in_seconds(peer: str, caplog: Any) -> None:
    """Two groups, int8 with error feedback, a collective timeout of 8 s. Group 1 takes part
    in the quorum but does not send its part for 3 s. ``gone``: the lighthouse drops it after
    1 s: group 0's wait ends about then, the sync is not committed, the error names group 1
    and says the timeout did not end it, and no residual of the sync is ever staged, not even
    when the abandoned collective returns at its timeout. ``late_but_alive``: it is alive all
    along: group 0 waits the 3 s and the sync commits with both groups' values.
    ``dropped_but_alive``: dropped after 1 s although alive (a lighthouse that missed its
    heartbeats): group 0 ends its sync as for ``gone``; group 1's part still arrives at 3 s
    and lets group 0's abandoned collective go on, which then issues, stages and reports
    nothing. ``this_group_dropped_but_alive``: the lighthouse group 0 reads has dropped group 0
    itself (it missed its heartbeats, say a long pause): group 0 does not abandon its own sync
    naming itself as the peer that is gone; it waits for group 1's part and commits."""
    caplog.set_level("WARNING")
    keys = [heartbeat_key(heartbeat_id(r)) for r in range(2)]
    released = threading.Event()

    def group(rank: int, pg: Any) -> dict[str, Any]:
        manager = LoopbackManager(pg, rank, 2)
        view = _dropped_after(1e9 if peer == "late_but_alive" else 1.0, heartbeat_id(1))
        if peer == "this_group_dropped_but_alive":  # each group's view: itself dropped
            view = _itself_dropped_after(1.0, heartbeat_id(rank), heartbeat_id(1 - rank))
        watch = PeerWatch("lighthouse", every_s=0.1, heartbeats=view)
        sync = sync_manager(
            manager, "int8", error_feedback=True, bucket_numel=300, timeout_s=8, peers=watch
        )

        try:
            with sync.sync_rounds() as rounds:
                rounds.form()
                sync.set_members(keys)
            if rank == 1:
                time.sleep(3.0)
                if peer == "gone":  # dropped: it never sends; its group lives until the end
                    released.wait(30)
                    return {}
            x = torch.arange(1000, dtype=torch.float32) * (rank + 1)
            started = time.monotonic()
            sync.allreduce(x).wait()
            waited = time.monotonic() - started
            committed = sync.decide().committed
            assert sync.transport.residuals is not None
            return {
                "waited": waited,
                "committed": committed,
                "gone": sync.transport.peer_gone,
                "x": x,
                "residuals": sync.transport.residuals,
                "manager": manager,
            }
        finally:
            if rank == 0:
                released.set()
            sync.transport.shutdown()

    first, _ = run_groups(2, group, timeout_s=60)
    if peer in ("late_but_alive", "this_group_dropped_but_alive"):
        assert first["committed"] is True and first["gone"] is None
        assert first["waited"] >= 2.5
        assert torch.allclose(first["x"], torch.arange(1000.0) * 1.5, rtol=0.02, atol=0.5)
        return
    assert first["committed"] is False
    assert 0.9 <= first["waited"] < 6, first["waited"]
    gone = first["gone"]
    assert isinstance(gone, PeerGone)
    assert "replica group 1 stopped heartbeating" in str(gone)
    assert "without waiting for fault_tolerance.sync_collective_timeout_s=8s" in str(gone)
    lines = [event_of(r) for r in caplog.records]
    assert any(e is not None and e.name == events.PEER_GONE.name for e in lines)
    # The abandoned collective returns at its own timeout (gloo waits for the part group 1
    # never sent): it must neither stage what its encode dropped nor owe anything new.
    _wait_until_none_blocked()
    assert not first["residuals"].has_staged(0)
    # ... nor report an error into whatever sync the Manager holds by then.
    assert first["manager"].errored() is gone
    assert first["residuals"].segments(0) == {}


def _wait_until_none_blocked(timeout_s: float = 30.0) -> None:
    """Until no thread is blocked in a collective given up (a test must not leave one: the
    interpreter's teardown would abort pytest on it)."""
    deadline = time.monotonic() + timeout_s
    while given_up.blocked() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not given_up.blocked()


def test_a_gloo_group_with_a_collective_blocked_is_let_go_at_once() -> None:
    """Rebuilding the replicate group for the next quorum releases the old one: on gloo, with
    a collective still waiting for a peer that stopped, that returns at once (gloo's own
    abort, or its destructor, would wait out the collective's timeout); the collective's group
    is released on a thread of its own, which ends when the collective does."""
    store = listen_store("127.0.0.1")
    address = f"127.0.0.1:{store.port}/test"
    groups: list[Any] = [None, None]

    def configure(rank: int) -> None:
        pg = fresh_rendezvous_process_group("gloo", ReplicaTimeouts.of(5000, 60.0, 300.0))
        pg.configure(address, f"replica_{rank}", rank, 2)
        groups[rank] = pg

    threads = [threading.Thread(target=configure, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    blocked_for: list[float] = []

    def blocked_allreduce() -> None:
        started = time.monotonic()
        try:
            groups[0].allreduce([torch.ones(4)], dist.AllreduceOptions()).wait()
        except RuntimeError:
            pass
        blocked_for.append(time.monotonic() - started)

    collective = threading.Thread(target=blocked_allreduce, daemon=True)
    collective.start()
    time.sleep(0.5)  # group 1 never joins it: group 0's collective waits
    started = time.monotonic()
    groups[0].abort(errored=False)  # what configure does with the last quorum's group
    assert time.monotonic() - started < 1.0
    assert given_up.blocked()  # the release waits for the collective (its 5 s timeout)
    collective.join(30)
    assert blocked_for and blocked_for[0] < 10
    _wait_until_none_blocked()


def test_a_collective_taken_up_as_its_sync_is_abandoned_still_completes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The runner's thread takes a queued collective, and the sync is abandoned before it
    marks it as under way: that collective is not issued, and its work completes as
    abandoned (a waiter would otherwise wait for ever)."""
    import queue

    from torchtitan.experiments.fault_tolerance.transport import (
        runner as runner_module,
    )

    taken = threading.Event()

    class SlowQueue(queue.Queue):  # type: ignore[type-arg]
        def get(self, *args: Any, **kwargs: Any) -> Any:
            job = super().get(*args, **kwargs)
            if job is not None:
                taken.set()
                time.sleep(0.3)  # abandon() runs meanwhile
            return job

    monkeypatch.setattr(runner_module, "queue", SimpleNamespace(Queue=SlowQueue, Empty=queue.Empty))
    runner = runner_module.AsyncCompressedAllReduce()
    issued: list[str] = []
    pg = SimpleNamespace(size=lambda: 2, allreduce=lambda *a: issued.append("allreduce"))
    work = runner.submit(pg, torch.ones(4), "float32")  # type: ignore[arg-type]
    assert taken.wait(5)
    assert runner.abandon() == 0  # neither queued nor under way, as it saw it
    assert work.wait_for(2.0) and work.abandoned
    assert issued == []
    runner.shutdown(timeout=5)


def test_an_all_reduce_abandoned_between_its_collectives_issues_no_more() -> None:
    """A compressed all-reduce is two collectives (an all-to-all, then an all-gather). Its sync
    abandoned while the first is in flight (a peer gone), the second is not issued: it could
    pair with a collective of the next quorum."""
    from torchtitan.experiments.fault_tolerance.transport.collective import (
        Abandoned,
        IssueGate,
        compressed_all_reduce,
    )

    gate = IssueGate(threading.Lock())
    issued: list[str] = []

    class Abandoning:  # the all-to-all's work: the runner abandons the sync while it runs
        def wait(self, *args: Any) -> bool:
            with gate.lock:
                gate.close()
            return True

        def is_completed(self) -> bool:
            return True

    def alltoall_base(out: torch.Tensor, given: torch.Tensor, *args: Any) -> Abandoning:
        issued.append("all-to-all")
        out.copy_(given)
        return Abandoning()

    def allgather(*args: Any) -> None:
        issued.append("all-gather")

    pg = SimpleNamespace(size=lambda: 2, alltoall_base=alltoall_base, allgather=allgather)
    with pytest.raises(Abandoned, match="abandoned"):
        compressed_all_reduce(
            pg,
            torch.ones(8192),
            "int8",
            gate=gate,
            timeout=timedelta(seconds=5),  # type: ignore[arg-type]
        )
    assert issued == ["all-to-all"]


def test_an_abandoned_collective_that_returns_after_the_verdict_stages_nothing() -> None:
    """The sync was abandoned while its last collective (the all-gather, issued before) was in
    flight, then decided (its staged residuals dropped). When that collective returns, even
    whole, its thread touches nothing shared: no residual is staged for the next sync to owe,
    and its work, abandoned, carries no error."""
    from torchtitan.experiments.fault_tolerance.transport.residuals import Residuals
    from torchtitan.experiments.fault_tolerance.transport.runner import AsyncCompressedAllReduce

    issued, release, returned = threading.Event(), threading.Event(), threading.Event()

    class Done:
        def wait(self, *args: Any) -> bool:
            return True

        def is_completed(self) -> bool:
            return True

    class Late(Done):  # the all-gather: whole, but only once released
        def __init__(self, outs: list[torch.Tensor], mine: torch.Tensor) -> None:
            self.outs, self.mine = outs, mine

        def wait(self, *args: Any) -> bool:
            release.wait(10)
            for out in self.outs:
                out.copy_(self.mine)
            returned.set()
            return True

    def alltoall_base(out: torch.Tensor, given: torch.Tensor, *args: Any) -> Done:
        out.copy_(given)
        return Done()

    def allgather(outs: list[list[torch.Tensor]], mine: list[torch.Tensor], *args: Any) -> Late:
        issued.set()
        return Late(outs[0], mine[0])

    pg = SimpleNamespace(size=lambda: 2, alltoall_base=alltoall_base, allgather=allgather)
    runner = AsyncCompressedAllReduce()
    residuals = Residuals()
    work = runner.submit(pg, torch.linspace(-1, 1, 8192), "int8", error_feedback=residuals)  # type: ignore[arg-type]
    assert issued.wait(10)
    assert runner.abandon() == 1 and work.abandoned
    residuals.discard()  # the sync's verdict: not committed
    release.set()
    assert returned.wait(10)
    time.sleep(0.5)  # the old thread hands over (or, rightly, does not)
    assert not residuals.has_staged(0) and work.error is None
    runner.shutdown(timeout=5)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_closed_gate_issues_no_collective(dtype: str) -> None:
    """A lane abandoned after its thread took a job up, before the job's first collective: the
    all-reduce (one collective for float32, two compressed) issues none."""
    from torchtitan.experiments.fault_tolerance.transport.collective import (
        Abandoned,
        IssueGate,
        compressed_all_reduce,
    )

    issued: list[str] = []
    pg = SimpleNamespace(
        size=lambda: 2,
        allreduce=lambda *a: issued.append("all-reduce"),
        alltoall_base=lambda *a: issued.append("all-to-all"),
        allgather=lambda *a: issued.append("all-gather"),
    )
    gate = IssueGate(threading.Lock())
    gate.close()
    with pytest.raises(Abandoned):
        compressed_all_reduce(pg, torch.ones(4096), dtype, gate=gate)  # type: ignore[arg-type]
    assert issued == []
