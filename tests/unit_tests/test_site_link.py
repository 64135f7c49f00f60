"""``sync.site_link``: who leads a site, and the leader's sync result shared with its site's other
groups over a real gloo process group (one thread per group, ``gloo_groups``)."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from tests.unit_tests.gloo_groups import (
    LoopbackManager,
    OneGroupFT,
    heartbeat_id,
    run_groups,
)
from torchtitan.components.ft import torchft_adapter as tft
from torchtitan.experiments.fault_tolerance import events
from torchtitan.experiments.fault_tolerance.sync.quorum import SyncQuorum
from torchtitan.experiments.fault_tolerance.sync.site_link import SiteHeader, SiteLink
from torchtitan.experiments.fault_tolerance.transport.sync_transport import SyncTransport
from torchtitan.tools.events import event_of


class JobFT:
    """The job's FTManager of a group that does not lead: no Manager, its step held."""

    started = False
    group_size = 2

    def __init__(self, step: int = 0) -> None:
        self.step = {"step": step, "batches_committed": 0}

    def state_dict(self) -> dict[str, int]:
        return dict(self.step)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = dict(state)


class SiteManager(LoopbackManager):
    """A site's torchft Manager: the loopback one, with what a heal's step needs and the
    members of its last quorum."""

    def __init__(self, pg: Any, rank: int, size: int, members: list[int]) -> None:
        super().__init__(pg, rank, size)
        self._client = SimpleNamespace()
        tft.record_quorum_members(self)  # type: ignore[arg-type]
        self._client.replica_ids = [f"replica_{m}:x" for m in members]

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._step = state["step"]

    def batches_committed(self) -> int:
        return 0


def link(pg: Any, rank: int, size: int, job: JobFT | None = None, step: int = 5) -> SiteLink:
    """Group ``rank`` of a site of ``size`` groups, whose leader is group 0's process."""
    manager = SiteManager(pg, rank, size, list(range(size)))
    manager._step = step
    site_ft: Any = OneGroupFT(manager)
    site = SiteLink(site_ft, job or JobFT(), rank, size, 0, torch.device("cpu"), 30.0)  # type: ignore[arg-type]
    site.leader = heartbeat_id(0)
    return site


def payload() -> list[torch.Tensor]:
    """Values a sum with zeros would change: -0.0, a subnormal, large ones, NaN, infinities."""
    first = torch.tensor([-0.0, 1e-45, -3.5e38, 1.0, float("nan"), float("-inf")])
    return [first, torch.randn(1000, generator=torch.Generator().manual_seed(0))]


def bits(tensors: list[torch.Tensor]) -> list[list[int]]:
    return [t.view(torch.int32).tolist() for t in tensors]


def test_followers_take_the_leaders_result_and_decision_bit_for_bit() -> None:
    header = SiteHeader(True, 7, 2, 4096, 12.5, 2)

    def group(rank: int, pg: dist.ProcessGroup) -> Any:
        site = link(pg, rank, 3)
        assert site.leads() == (rank == 0)
        if rank == 0:
            site.send(header, payload())
            return None, payload(), site
        mine = [torch.full_like(t, 3.0) for t in payload()]
        return site.receive(mine), mine, site

    results = run_groups(3, group)
    for (found, holds), tensors, site in results[1:]:
        assert found == header and holds
        assert bits(tensors) == bits(payload())
        assert site.job_groups == 2


def test_an_uncommitted_sync_sends_no_result_and_the_leaders_heal_is_told_at_its_quorum() -> None:
    """An uncommitted sync's header comes alone (the followers' tensors stay as they are);
    after its sync's quorum the leader says whether it healed from another site there."""

    def group(rank: int, pg: dist.ProcessGroup) -> Any:
        site = link(pg, rank, 2)
        if rank == 0:
            site.send(SiteHeader(False, 8, 2, 0, None, 2), payload())
            site.share_quorum(True)
            site.share_quorum(False)
            return None
        mine = [torch.zeros_like(t) for t in payload()]
        return (*site.receive(mine), bits(mine)), [site.hear_quorum(), site.hear_quorum()]

    _, ((skipped, kept, untouched), heard) = run_groups(2, group)
    assert skipped is not None and not skipped.committed and skipped.squares is None and kept
    assert untouched == bits([torch.zeros_like(t) for t in payload()])
    assert heard == [True, False]


def test_a_follower_whose_sync_is_not_the_leaders_keeps_the_collectives_paired() -> None:
    """One follower holds tensors of other sizes (it healed while a sync was in flight): it
    takes part in every collective and does not hold the result; the other follower gets it
    as usual."""
    header = SiteHeader(True, 3, 2, 64, 1.0, 2)

    def group(rank: int, pg: dist.ProcessGroup) -> Any:
        site = link(pg, rank, 3)
        if rank == 0:
            site.send(header, payload())
            return None
        mine = [torch.zeros_like(t) for t in payload()]
        if rank == 2:
            mine = [torch.zeros(6)]
        return site.receive(mine), bits(mine)

    _, good, odd = run_groups(3, group)
    assert good == ((header, True), bits(payload()))
    assert odd[0] == (header, False)


def test_groups_that_hold_the_sites_state_move_their_step_up_and_the_others_heal() -> None:
    manager = SiteManager(None, 1, 2, [0, 1])
    manager._step = 9
    site = SiteLink(SimpleNamespace(manager=manager), JobFT(), 1, 2, 0, torch.device("cpu"), 30.0)  # type: ignore[arg-type]
    site.settle(True)
    assert manager.current_step() == 10
    site.settle(False)
    assert manager.current_step() == 10  # behind the groups that settled True: it heals


def test_the_leader_stays_while_it_is_in_the_site_and_the_lowest_member_follows_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    manager = SiteManager(None, 1, 3, [0, 1, 2])
    site_ft: Any = SimpleNamespace(manager=manager, started=True)
    site = SiteLink(site_ft, JobFT(), 1, 3, 0, torch.device("cpu"), 30.0)  # type: ignore[arg-type]
    assert site.leads() is False and site.leader == ""
    assert site.elect() is True and site.leader == "replica_0:x"  # the first: no event
    assert site.elect() is False and not site.leads()
    manager._client.replica_ids = ["replica_2:a", heartbeat_id(1)]  # group 0 is gone
    log = logging.getLogger("torchtitan")
    log.addHandler(caplog.handler)
    try:
        assert site.elect() is True
    finally:
        log.removeHandler(caplog.handler)
    assert site.leader == heartbeat_id(1) and site.leads()
    seen = {
        (e["leader"], e["previous"], e["groups"])
        for e in map(event_of, caplog.records)
        if e is not None and e.name == events.SITE_LEADER.name
    }
    assert seen == {(1, 0, 2)}
    assert site.elect() is False  # electing again changes nothing
    manager._client.replica_ids = ["replica_0:c", heartbeat_id(1), "replica_2:a"]  # 0 is back
    assert site.elect() is False and site.leads()  # sticky
    # A restarted group 1 (a new id) is not its predecessor: it does not lead unless elected.
    manager._client.replica_ids = ["replica_0:c", "replica_1:new", "replica_2:a"]
    assert site.elect() is True and site.leader == "replica_0:c"


def test_a_healed_group_takes_the_leader_and_the_jobs_step_from_its_peer() -> None:
    job = JobFT(step=2)
    sender = SiteLink(
        SimpleNamespace(),
        JobFT(step=9),
        1,
        3,
        0,
        torch.device("cpu"),
        30.0,  # type: ignore[arg-type]
    )
    sender.leader, sender.job_groups = "replica_1:b", 3
    receiver = SiteLink(SimpleNamespace(), job, 0, 3, 0, torch.device("cpu"), 30.0)  # type: ignore[arg-type]
    receiver.load_state_dict(sender.state_dict())
    assert (receiver.leader, receiver.job_groups, job.step["step"]) == ("replica_1:b", 3, 9)


def test_a_follower_sends_nothing_and_knows_the_job_through_its_leader() -> None:
    """A group that does not lead starts no transfer (its tensors are where the leader's result
    goes), its sync is never known to have arrived before the decision, and it answers the
    job's step, sync quorum size and a site's tokens from what its leader told it."""

    def group(rank: int, pg: dist.ProcessGroup) -> Any:
        site = link(pg, rank, 2, job=JobFT(step=4))
        if rank == 1:
            transport = SyncTransport("float32", error_feedback=False, bucket_mb=1.0, timeout_s=30)
            job: Any = site.job_ft
            sync = SyncQuorum(job, 1, 60.0, transport=transport, site=site)
            grad = torch.full((10,), 2.0)
            works = sync.allreduce(grad)
            assert works.works == [] and sync.sync_failed()
            assert (sync.current_step(), sync.num_participants()) == (4, 0)
            assert sync.site_tokens(100) == 200  # 2 groups in the site's last step
            decision = sync.decide()
            site_step = site.site_ft.manager.current_step()
            return decision, grad, sync.current_step(), sync.num_participants(), site_step
        site.send(SiteHeader(True, 5, 2, 40, 10.0, 1), [torch.full((10,), 7.0)])
        return None

    _, (decision, grad, step, groups, site_step) = run_groups(2, group)
    assert (decision.committed, decision.number, decision.groups) == (True, 5, 2)
    assert (decision.bytes_sent, decision.squares) == (0, 10.0)
    assert grad.tolist() == [7.0] * 10
    assert (step, groups) == (5, 2)
    assert site_step == 6  # it holds the site's state: its site step moves up with the leader's


@pytest.mark.parametrize("squares", [None, 0.0, 3.25])
def test_a_header_travels_as_float64_values(squares: float | None) -> None:
    header = SiteHeader(True, 2**40 + 1, 17, 2**45, squares, 9, 3)
    assert SiteHeader.of(header.as_tensor(torch.device("cpu"))) == header
    found = header.as_tensor(torch.device("cpu"))
    assert found.dtype == torch.float64 and math.isnan(found[4]) == (squares is None)


class Loop:
    """What ``SiteHealState`` asks of a method: async DiLoCo with fragment ``in_flight``'s sync
    in flight (or arrived)."""

    def __init__(self, in_flight: int = -1, arrived: int = -1) -> None:
        self.fragments = [0, 1]
        self.step = 3
        self._in_flight, self._arrived = in_flight, arrived
        self.awaited: list[int] = []
        self.loaded: dict[str, Any] = {}

    def local_step(self) -> int:
        return self.step

    def set_local_step(self, step: int) -> None:
        self.step = step

    def in_flight(self, index: int) -> bool:
        return index == self._in_flight

    def has_arrived(self, index: int) -> bool:
        return index == self._arrived

    def extra_state(self, wait: bool = True) -> dict[str, Any]:
        assert not wait, "a heal within a site must not wait for the slow link"
        return {"sync_points": 4}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.loaded["extra"] = state

    def fragment_state(self, index: int) -> dict[str, Any]:
        return {"copy": torch.full((2,), float(index))}

    def load_fragment_state(self, index: int, state: dict[str, Any]) -> None:
        self.loaded[f"fragment_{index}"] = state

    def await_share(self, index: int) -> None:
        self.awaited.append(index)

    def fragment_parameters(self, index: int) -> dict[str, torch.Tensor]:
        return {"w": torch.zeros(3 + index)}


@pytest.mark.parametrize(
    ("in_flight", "arrived", "awaited"), [(0, -1, [0]), (1, -1, [1]), (-1, 0, [0]), (-1, -1, [])]
)
def test_a_group_healing_from_its_site_takes_its_position_and_awaits_the_sync_in_flight(
    in_flight: int, arrived: int, awaited: list[int]
) -> None:
    from torchtitan.experiments.fault_tolerance.method_state import SiteHealState
    from torchtitan.experiments.fault_tolerance.sync.lineage import Lineage

    none: Any = SimpleNamespace(residuals=None)
    sender = SiteHealState(Loop(in_flight), Lineage(last_shared_sync=6), none)  # type: ignore[arg-type]
    healed_loop = Loop(arrived=arrived)
    healed_loop.step = 0
    lineage = Lineage()
    SiteHealState(healed_loop, lineage, none).load_state_dict(sender.state_dict())  # type: ignore[arg-type]
    assert healed_loop.step == 3 and lineage.last_shared_sync == 6
    assert healed_loop.loaded["extra"] == {"sync_points": 4}
    assert healed_loop.loaded["fragment_1"]["copy"].tolist() == [1.0, 1.0]
    assert healed_loop.awaited == awaited


def test_a_group_healing_from_its_site_owes_what_its_peer_owes() -> None:
    """Error feedback: the healed group's residuals are its peer's (which owes what the site's
    leader owes), in place of its own."""
    from torchtitan.experiments.fault_tolerance.method_state import SiteHealState
    from torchtitan.experiments.fault_tolerance.sync.lineage import Lineage

    def transport() -> Any:
        return SyncTransport("int8", error_feedback=True, bucket_mb=1.0, timeout_s=30)

    sending, healing = transport(), transport()
    sending.residuals.load(1, torch.arange(4.0))
    healing.residuals.load(0, torch.ones(3))  # its own, void after the heal
    sender = SiteHealState(Loop(), Lineage(), sending)  # type: ignore[arg-type]
    SiteHealState(Loop(), Lineage(), healing).load_state_dict(sender.state_dict())  # type: ignore[arg-type]
    assert healing.residuals.flat(0, 3).tolist() == [0.0] * 3
    assert healing.residuals.flat(1, 4).tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_follower_owes_what_its_leader_owes_and_keeps_the_result_for_a_replay() -> None:
    """Error feedback: after a committed sync the leader sends what its compression owes
    (behind the result), which the follower owes from then on; with a heal history the
    follower keeps the result as it arrived (fp32), the token count apart."""

    def group(rank: int, pg: dist.ProcessGroup) -> Any:
        site = link(pg, rank, 2, job=JobFT(step=4))
        result, tokens, owed = torch.linspace(-1, 1, 10), torch.tensor([40.0]), torch.arange(10.0)
        if rank == 0:
            site.send(SiteHeader(True, 5, 2, 40, 1.0, 3, 0), [result, tokens, owed])
            return None
        transport = SyncTransport(
            "int8", error_feedback=True, bucket_mb=1.0, timeout_s=30, keep_delivered=True
        )
        job: Any = site.job_ft
        sync = SyncQuorum(job, 1, 60.0, transport=transport, site=site)
        mine = [torch.zeros(10), torch.zeros(1)]
        sync.allreduce(mine[0], ReduceOp.SUM)
        sync.allreduce(mine[1], ReduceOp.SUM, exact=True)
        decision = sync.decide()
        return decision, mine, transport.residuals.flat(0, 10), result

    _, (decision, mine, owed, result) = run_groups(2, group)
    assert decision.committed and torch.equal(mine[0], result) and mine[1].item() == 40.0
    assert owed.tolist() == list(range(10))
    assert [d.numel for d in decision.delivered] == [10]
    assert torch.equal(decision.delivered[0].values(), result)


def test_a_follower_that_misses_the_result_drops_the_sync_and_stays_behind() -> None:
    """The leader's result does not fit this follower's sync (it healed while another was in
    flight): its decision is not committed, its job step stays, and its site step stays
    behind the leader's, so it heals from its site at the next step."""

    def group(rank: int, pg: dist.ProcessGroup) -> Any:
        site = link(pg, rank, 2, job=JobFT(step=4))
        if rank == 0:
            site.send(SiteHeader(True, 5, 2, 40, 1.0, 1), [torch.full((10,), 7.0)])
            site.settle(True)
            return site.site_ft.manager.current_step()
        transport = SyncTransport("float32", error_feedback=False, bucket_mb=1.0, timeout_s=30)
        job: Any = site.job_ft
        sync = SyncQuorum(job, 1, 60.0, transport=transport, site=site)
        sync.allreduce(torch.zeros(6))
        decision = sync.decide()
        return decision, sync.current_step(), site.site_ft.manager.current_step()

    leader_step, (decision, job_step, site_step) = run_groups(2, group)
    assert not decision.committed and decision.delivered == []
    assert job_step == 4
    assert (leader_step, site_step) == (6, 5)
