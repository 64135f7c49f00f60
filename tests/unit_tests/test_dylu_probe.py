"""DyLU's first period: the speed probe plans it (``dylu.PeriodPlan``, ``join.speeds``) from
a quorum that forms while the groups train on (``join.speeds.ProbeInFlight``), and a group
that meets a probe in its own start-up quorum does not use that quorum."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from tests.unit_tests.test_ft_manager import ScriptedManager, make_ft
from tests.unit_tests.test_semi_sync import SummingManager
from torchtitan.components.ft import FaultToleranceError
from torchtitan.experiments.fault_tolerance.events import SPEED_PROBE
from torchtitan.experiments.fault_tolerance.join.exchange import QuorumExchange, StartUp
from torchtitan.experiments.fault_tolerance.join.speeds import ProbeInFlight, SpeedExchange
from torchtitan.experiments.fault_tolerance.methods.dylu import PeriodPlan
from torchtitan.experiments.fault_tolerance.sync.quorum import (
    FRESH,
    RESUMED,
    RUNNING,
    Member,
    RankInGroup,
    SyncQuorum,
)
from torchtitan.experiments.fault_tolerance.transport.shapes import CollectiveShape
from torchtitan.tools.events import Event


def test_the_probe_times_the_steps_after_the_first_and_not_its_own_wait() -> None:
    """Period 8, probe over 1 step: the first step takes 5 s (one-time costs), the second 1 s;
    the probe comes after step 2 and measures 1 s per step. The group then waits 3 s in the
    probe's quorum; the rest is planned from there: its speed at the end of the period is
    that of the planned steps (1 s each), not diluted by the wait or the first step."""
    plan = PeriodPlan(8)
    plan.begin(0.0)
    plan.probe_after(1)
    plan.skip_warm_up(1, lambda: 5.0)
    assert not plan.probe_due(1, lambda: 5.0)
    plan.skip_warm_up(2, lambda: 6.0)  # once per process
    assert plan.probe_due(2, lambda: 6.0) and plan.step_seconds == pytest.approx(1.0)
    assert not plan.probe_due(3, lambda: 7.0)  # once
    plan.plan_rest(2, 6, 6.0, now=9.0)  # after the 3 s wait: 6 more steps in 6 s
    assert plan.steps == 8
    now = 9.0
    for taken in range(3, 9):
        now += 1.0
        if plan.due_correction(taken):
            plan.correct(taken, now, agree=lambda n: n)
    assert plan.steps == 8  # on plan: the corrections keep the count
    plan.end(8, now)
    assert plan.step_seconds == pytest.approx(1.0)


def test_a_correction_after_the_probe_counts_only_the_planned_steps() -> None:
    """Planned after the probe (2 steps done): 6 more in 6 s. They take 2 s each, so at the
    first correction (halfway: after step 5, 6 s gone) the period ends there: 5 steps in all,
    not the count a measurement from the period's start would give."""
    plan = PeriodPlan(8)
    plan.plan_rest(2, 6, 6.0, now=0.0)
    assert plan.due_correction(5)
    plan.correct(5, 6.0, agree=lambda n: n)
    assert plan.steps == 5


@pytest.mark.parametrize(("probe_steps", "expected"), [(0, None), (1, 2), (6, 7), (7, None)])
def test_a_probe_needs_a_step_left_after_it(probe_steps: int, expected: int | None) -> None:
    plan = PeriodPlan(8)
    plan.probe_after(probe_steps)
    assert plan.probe_at == expected


class _Method:
    """What the speed exchange asks of async DiLoCo, around a real ``PeriodPlan``."""

    def __init__(self, period: int, taken: int, step_seconds: float) -> None:
        self.period = period
        self.plan = PeriodPlan(period)
        self.plan.step_seconds = self.plan.probed_seconds = step_seconds
        self.plan.probed_after = taken
        self.taken = taken

    def step_seconds(self) -> float:
        return self.plan.step_seconds

    def local_step(self) -> int:
        return self.taken

    def steps_this_period(self) -> int:
        return self.plan.steps

    def plan_rest_of_period(self, steps: int, seconds: float) -> None:
        self.plan.plan_rest(self.taken, steps, seconds, now=0.0)

    def probe_unused(self) -> None:
        self.plan.time_from(self.taken, now=50.0)


def _exchange(
    method: _Method,
    rank: int,
    others: dict[int, Member],
    groups: int = 2,
    most_in_group: Any = lambda v: v,
) -> SpeedExchange:
    """The speed exchange of one group of a new job of ``groups`` that decided to probe."""
    ft = SimpleNamespace(manager=SummingManager(rank, others))
    exchange = SpeedExchange(
        cast(Any, method),
        1,
        cast(Any, ft),
        cast(Any, SimpleNamespace(step=2)),
        RankInGroup(torch.device("cpu"))
        if most_in_group is None
        else cast(Any, SimpleNamespace(device=torch.device("cpu"), ranks=2, most=most_in_group)),
    )
    if groups:
        exchange.probe_if_new_job([Member(FRESH) for _ in range(groups)])
    return exchange


def test_the_probe_forms_a_quorum_that_is_no_sync() -> None:
    """The probe's quorum, on its own thread, is DyLU's speed probe's, not a sync's: its
    exchange runs in it, outside the sync quorum (a peer healing there is not told it is at
    a sync point), no sync begins, and the plan is taken in the thread that finishes it."""
    manager = ScriptedManager([(2, 5)], step=5)
    ft = make_ft(manager)
    sync = SyncQuorum(ft, 2, 5.0, transport=cast(Any, None))
    began: list[int] = []
    sync.begin_sync = lambda: began.append(1)  # type: ignore[method-assign]
    method = _Method(20, 2, 0.1)
    method.sync = sync  # type: ignore[attr-defined]
    exchange = _exchange(method, 0, {})
    seen: list[tuple[bool, str]] = []
    exchange.on_probe = lambda: seen.append((sync.in_quorum, threading.current_thread().name))
    exchange.after_probe = lambda: seen.append((False, threading.current_thread().name))
    exchange.start_probe().finish()
    ft.shutdown()
    assert seen == [(False, "dylu-speed-probe"), (False, threading.current_thread().name)]
    assert began == [] and manager.calls == ["quorum"] and manager.step == 5


def test_after_the_probe_both_groups_plan_to_reach_the_first_sync_point_together(
    events: list[Event],
) -> None:
    """Period 20, probe after step 2: group 0 takes 0.1 s per step, group 1 twice that. Each
    plans the rest of the period from both speeds: the straggler fewer steps, and both end
    the period within half a straggler's step of each other."""
    speeds = [0.1, 0.2]
    methods = [_Method(20, 2, s) for s in speeds]
    for rank, method in enumerate(methods):
        other = 1 - rank
        them = Member(RUNNING, probe=1, step_us=round(speeds[other] * 1e6))
        exchange = _exchange(method, rank, {other: them})
        exchange.clock = lambda: 0.0
        exchange.on_probe()
        assert method.plan.steps == 20  # planned by the training thread, not in the quorum
        exchange.after_probe()
    rest = [m.plan.steps - 2 for m in methods]
    assert methods[0].plan.steps == 20 and methods[1].plan.steps < methods[0].plan.steps
    ends = [r * s for r, s in zip(rest, speeds, strict=True)]
    assert abs(ends[0] - ends[1]) <= speeds[1] / 2 + 1e-9, (rest, ends)
    probes = [e for e in events if e.name == SPEED_PROBE.name]
    assert [(e["after"], e["planned_at"], e["steps"]) for e in probes] == [
        (2, 2, 20),
        (2, 2, methods[1].plan.steps),
    ]


def test_groups_that_trained_on_while_the_probe_formed_plan_from_when_it_ended(
    events: list[Event],
) -> None:
    """Period 20, probe after step 2, 0.1 and 0.2 s per step; the rest of the period is 9
    straggler steps long (1.8 s) from the end of the exchange. The groups went on training
    while the probe's quorum formed and take its plan at their next step: the fast one 0.3 s
    later at step 5, the straggler 0.2 s later at step 3. Each plans what is left of the 1.8 s
    in its own steps, so both reach the first sync point 1.8 s after the exchange."""
    speeds, applied = [0.1, 0.2], [(5, 0.3), (3, 0.2)]
    methods = [_Method(20, 2, s) for s in speeds]
    for rank, method in enumerate(methods):
        other = 1 - rank
        them = Member(RUNNING, probe=1, step_us=round(speeds[other] * 1e6))
        exchange = _exchange(method, rank, {other: them})
        exchange.clock = iter([0.0, applied[rank][1]]).__next__
        exchange.on_probe()
        method.taken = applied[rank][0]
        exchange.after_probe()
    assert [m.plan.steps for m in methods] == [20, 11]
    ends = [
        t + (m.plan.steps - m.taken) * s
        for m, (_, t), s in zip(methods, applied, speeds, strict=True)
    ]
    assert ends == pytest.approx([1.8, 1.8])
    probes = [e for e in events if e.name == SPEED_PROBE.name]
    assert [(e["after"], e["planned_at"], e["steps"]) for e in probes] == [(2, 5, 20), (2, 3, 11)]


def test_the_probe_s_plan_of_the_rest_counts_the_steps_before_it_in_the_cap(
    events: list[Event],
) -> None:
    """Period 20, probe after step 2: this group takes 0.01 s per step, the straggler 1 s. The
    rest of the period is one straggler step long (1 s), a hundred of this group's steps: it
    plans 38 more, 40 in all (twice the period), the two taken before the probe counted."""
    method = _Method(20, 2, 0.01)
    them = Member(RUNNING, probe=1, step_us=1_000_000)
    exchange = _exchange(method, 0, {1: them}, most_in_group=None)
    exchange.clock = lambda: 0.0
    exchange.on_probe()
    exchange.after_probe()
    assert method.plan.steps == 40
    probes = [e for e in events if e.name == SPEED_PROBE.name]
    assert [(e["planned_at"], e["steps"]) for e in probes] == [(2, 40)]


@pytest.mark.parametrize(("waited", "steps"), [(1.0, 40), (2.0, 30), (3.5, 20)])
def test_at_the_end_of_its_period_a_group_takes_what_is_left_of_the_probe_s_plan(
    events: list[Event], waited: float, steps: int
) -> None:
    """The fast group (0.1 s per step) reached the end of its unplanned period (20 steps)
    before the straggler (3 s per step) reached the probe, and waited there for the probe's
    quorum. The rest of the period is one straggler step long (3 s from the exchange): the
    group takes what is left of it, at most twice the period in all, and nothing when it has
    passed. One rank per group: no agreement asked."""
    method = _Method(20, 2, 0.1)
    them = Member(RUNNING, probe=1, step_us=3_000_000)
    exchange = _exchange(method, 0, {1: them}, most_in_group=None)
    exchange.clock = iter([0.0, waited]).__next__
    exchange.on_probe()
    method.taken = 20
    exchange.after_probe()
    assert method.plan.steps == steps
    probes = [e for e in events if e.name == SPEED_PROBE.name]
    assert [(e["planned_at"], e["steps"]) for e in probes] == ([] if steps == 20 else [(20, steps)])


@pytest.mark.parametrize(
    "case", ["a member is starting", "a member is missing", "another rank found it unusable"]
)
def test_a_probe_that_is_not_the_start_up_groups_leaves_the_period_as_planned(case: str) -> None:
    """A group that restarted meanwhile meets the probe in its start-up quorum, or the
    lighthouse did not wait for the straggler, or another rank of this group saw the exchange
    fail: the period keeps its full length (the quorum is done: True), and its speed is
    measured from the probe on, not from before the probe's wait."""
    method = _Method(20, 2, 0.1)
    peer = Member(RUNNING, probe=1, step_us=200_000)
    if case == "a member is starting":
        exchange = _exchange(method, 0, {1: Member(FRESH, attempts=1)})
    elif case == "a member is missing":
        exchange = _exchange(method, 0, {1: peer}, groups=3)
    else:
        exchange = _exchange(method, 0, {1: peer}, most_in_group=lambda v: [1, *v[1:]])
    assert not method.plan.probe_due(1, lambda: 0.0) and method.plan.probe_due(2, lambda: 1.0)
    exchange.on_probe()
    exchange.after_probe()
    assert method.plan.steps == 20 and method.plan.probe_at is None
    method.plan.end(20, now=68.0)  # 18 steps after the probe's end (50 s): 1 s each
    assert method.plan.step_seconds == pytest.approx(1.0)


def test_a_start_up_record_clears_a_probe_decided_by_an_earlier_quorum() -> None:
    """A start-up quorum that decided a probe and then failed is asked again: the probe is
    decided afresh by the quorum that is used, not kept from the failed one."""
    method = _Method(20, 0, 0.0)
    exchange = _exchange(method, 0, {})
    assert method.plan.probe_at == 2
    exchange.step_us(FRESH)
    assert method.plan.probe_at is None
    exchange.probe_if_new_job([Member(FRESH), Member(FRESH)])
    exchange.step_us(RUNNING)  # a running group's record leaves it
    assert method.plan.probe_at == 2


@pytest.mark.parametrize(
    ("roles", "probes"),
    [([FRESH, FRESH], True), ([FRESH], False), ([FRESH, RESUMED], False),
     ([FRESH, RUNNING], False)],
)  # fmt: skip
def test_only_a_new_job_of_several_groups_probes(roles: list[int], probes: bool) -> None:
    method = _Method(20, 0, 0.0)
    members = [Member(role) for role in roles]
    _exchange(method, 0, {}, groups=0).probe_if_new_job(members)
    assert (method.plan.probe_at is not None) is probes


@pytest.mark.parametrize("healed_there", [False, True])
def test_a_starting_group_that_meets_a_probe_does_not_use_that_quorum(healed_there: bool) -> None:
    """The start-up exchange of a group that (re)started while the others probe: it sees a
    probing member and refuses the quorum (it asks again, and meets them at their first sync
    point). If torchft healed it from a prober in that quorum (mid-period), it forgets that
    peer and announces a step below its own again, so that it is healed once more at the
    sync point, where it takes part in the sync."""
    announced: list[int] = []
    roles: list[int] = []
    manager = SummingManager(1, {0: Member(RUNNING, probe=1)})
    manager.current_step = lambda: 0  # type: ignore[attr-defined]  # after the heal: the peer's
    peer = {"starting": 0, "at_sync": 0, "local_step": 2, "replica_id": 0}
    quorum = SimpleNamespace(
        ft=SimpleNamespace(manager=manager, poll_s=1.0),
        job_config=SimpleNamespace(
            fault_tolerance=SimpleNamespace(group_size=2, quorum_timeout_s=60.0, replica_id=0)
        ),
        _digest_if_due=lambda starting: None,
        _tell_torch_versions=lambda members: None,
        # DyLU's record of this group: made for its role (a start-up's cancels a probe).
        speeds=SimpleNamespace(
            step_us=lambda role: roles.append(role) or 1000,
            planned_steps=lambda members, mine: 0,
        ),
        rank=RankInGroup(torch.device("cpu")),
        set_manager_step=announced.append,
        heal=SimpleNamespace(replay_failed="", take_heal=lambda: None, shape_refused=""),
        sync=SimpleNamespace(
            heartbeat=7, set_members=lambda keys: None, transport=SimpleNamespace(timeout=None)
        ),
        shape=CollectiveShape(1, 1, 100, 300, 0, 5),
    )
    start_up = StartUp(FRESH, peer=dict(peer) if healed_there else None)
    assert QuorumExchange.on_quorum(cast(Any, quorum), start_up) is False
    assert start_up.peer is None
    assert announced == ([-1] if healed_there else [])
    assert roles == [FRESH]


def test_the_probe_forms_beside_training_and_its_plan_is_taken_in_the_training_thread() -> None:
    """``ProbeInFlight`` runs the probe's quorum in a thread of its own (not done while that
    quorum waits for the other groups) and runs the plan (``after``) in the thread that
    calls ``finish``, once."""
    release, ran_in, after_in = threading.Event(), [], []

    def quorum() -> None:
        ran_in.append(threading.current_thread())
        assert release.wait(timeout=30)

    probe = ProbeInFlight(quorum, lambda: after_in.append(threading.current_thread()))
    assert not probe.done()
    release.set()
    probe.finish()
    assert probe.done() and after_in == [threading.current_thread()]
    assert ran_in and ran_in[0] is not threading.current_thread()


def test_a_probe_quorum_that_fails_raises_in_the_training_thread_and_plans_nothing() -> None:
    planned: list[int] = []

    def quorum() -> None:
        raise FaultToleranceError("fault_tolerance.sync_quorum_timeout_s=1 passed")

    probe = ProbeInFlight(quorum, lambda: planned.append(1))
    with pytest.raises(FaultToleranceError, match="sync_quorum_timeout_s"):
        probe.finish()
    assert planned == []


def test_the_ranks_of_a_group_take_one_plan_from_the_probe() -> None:
    """Each rank of a group exchanged with its own peer ranks: this one found the period's
    planned length already over (0 s left), another rank 2 s left in 4 steps. The group
    takes the most of both, so this rank plans 4 more steps in 2 s and corrects them at the
    same steps as the other rank (a rank that did not would miss a collective of the group)."""
    method = _Method(20, 2, 0.5)
    others = {1: Member(RUNNING, probe=1, step_us=1_000_000)}
    exchange = _exchange(method, 0, others, most_in_group=lambda v: [v[0], 4, 2_000_000])
    exchange.clock = iter([0.0, 100.0]).__next__
    exchange.on_probe()
    method.taken = 5
    exchange.after_probe()
    assert method.plan.steps == 9
    assert method.plan.due_correction(7)
