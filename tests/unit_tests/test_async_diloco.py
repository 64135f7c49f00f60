"""Async DiLoCo's outer loop, two or three groups in one process: the groups' Managers share an
in-memory SUM all-reduce, so the tests see the exact numbers each group applies. The real
Manager, lighthouse and process groups are in tests/integration_tests/test_async_diloco.py."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from torch import nn
from torch.distributed import ReduceOp

from torchtitan.experiments.fault_tolerance.method_state import SemiSyncState
from torchtitan.experiments.fault_tolerance.methods.async_diloco import AsyncDiLoCo, AsyncOuterState
from torchtitan.experiments.fault_tolerance.methods.dylu import (
    dylu_inner_steps,
    dylu_next_correction,
    dylu_period_seconds,
    dylu_steps_to_deadline,
)
from torchtitan.experiments.fault_tolerance.methods.outer_optimizer import OuterSGD, outer_optimizer
from torchtitan.experiments.fault_tolerance.sync.lineage import Lineage
from torchtitan.experiments.fault_tolerance.sync.quorum import SyncDecision

#: The trainer's sync quorum as the checkpoint sees it when nothing is compressed.
NO_COMPRESSION = SimpleNamespace(residuals=None, wait=lambda: None)


def parts(trainer: Any) -> tuple[Any, Any, Any]:
    """What SemiSyncState is built with, from ``as_trainer``'s view of a trainer."""
    return trainer.algorithm, trainer.sync, trainer.lineage


def as_trainer(group: Group) -> Any:
    """What SemiSyncState sees of the trainer."""
    return SimpleNamespace(algorithm=group.loop, sync=NO_COMPRESSION, lineage=Lineage())


class Work:
    def __init__(self, cluster: Cluster, round_: int, manager: FakeManager) -> None:
        self.cluster, self.round, self.manager = cluster, round_, manager

    def wait(self) -> None:
        """As torchft's managed work: a failed collective is recorded by the Manager (its
        ``errored()``), not raised, and the buffer keeps what it held."""
        if self.round in self.cluster.failing:
            self.manager.error = RuntimeError(f"all-reduce round {self.round} failed")
            return
        self.cluster.reduce(self.round)


class Cluster:
    """An all-reduce among the groups' Managers: round ``r`` is every group's ``r``-th call.
    ``failing`` holds rounds whose collective fails on every group."""

    def __init__(self) -> None:
        self.rounds: dict[int, list[torch.Tensor]] = {}
        self.done: set[int] = set()
        self.failing: set[int] = set()
        self.members: list[FakeManager] = []

    def reduce(self, round_: int) -> None:
        if round_ in self.done:
            return
        buffers = self.rounds[round_]
        total = torch.stack(buffers).sum(0)
        for b in buffers:
            b.copy_(total)
        self.done.add(round_)


def test_a_site_weighs_its_pseudo_gradient_by_the_tokens_of_all_its_groups() -> None:
    """Sites of groups: the groups of a site trained the same steps, each on its own batches;
    the site's sync counts them all (3 groups x 4 steps x 8 tokens)."""
    group = Group(Cluster(), 1, tokens_per_step=8)
    group.manager.site_groups = 3
    with training([group]):
        for _ in range(4):
            group.step()
    flight = group.loop._in_flight
    assert flight is not None and flight.tokens == 96 and float(flight.buffer[-1]) == 96.0


class FakeManager:
    """What AsyncDiLoCo asks of the sync quorum, for one group in a quorum of every group of
    its cluster: ``num_participants`` is the size of the last quorum (every group of the
    cluster when it formed; the start-up quorum's before the first sync), an error recorded by
    a failed collective makes ``errored``, ``sync_failed`` and ``should_commit`` say so until
    the next quorum, as the trainer's ``SyncQuorum`` over torchft's Manager does."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        cluster.members.append(self)
        self.calls = 0
        self.step = 0
        #: False: this group's commit says no (a peer failed), without an error of its own.
        self.commit = True
        self.error: Exception | None = None
        self.fns: dict[str, tuple[Any, Any]] = {}
        self.heal_from: FakeManager | None = None
        #: Times the error-feedback residuals were forgotten (after a heal).
        self.feedback_resets = 0
        self._quorum_size: int | None = None

    @staticmethod
    def agree_in_group(value: int) -> int:
        return value  # one rank per group

    def register_state_dict_fn(self, key: str, load: Any, save: Any) -> None:
        self.fns[key] = (load, save)

    def start_quorum(self, accept: Any) -> bool:
        """The quorum of every group of the cluster; returns whether this group healed in it
        (from :attr:`heal_from`)."""
        self.error = None
        self._quorum_size = len(self.cluster.members)
        if self.heal_from is None:
            return False
        for key, (load, _) in self.fns.items():  # a copy, as the transport delivers
            load(copy.deepcopy(self.heal_from.fns[key][1]()))
        self.step = self.heal_from.step
        self.heal_from = None
        return True

    def allreduce(
        self,
        buffer: torch.Tensor,
        reduce_op: Any = None,
        *,
        exact: bool = False,
    ) -> Work:
        assert reduce_op == ReduceOp.SUM, reduce_op
        self.cluster.rounds.setdefault(self.calls, []).append(buffer)
        self.calls += 1
        return Work(self.cluster, self.calls - 1, self)

    def sync_failed(self) -> bool:
        return self.error is not None

    def reset_error_feedback(self) -> None:
        self.feedback_resets += 1

    def decide(self) -> SyncDecision:
        """The verdict; no bytes counted, and no squares (as a transport that took none: the
        sync point takes them)."""
        groups = self.num_participants()
        committed = self.commit and self.error is None
        self.step += committed
        return SyncDecision(committed, self.step + (not committed), groups, 0, None, None, [])

    def current_step(self) -> int:
        return self.step

    #: The groups of this group's site (sites of groups: the site's tokens are all of theirs).
    site_groups = 1

    def site_tokens(self, tokens: int) -> int:
        return tokens * self.site_groups

    def num_participants(self) -> int:
        if self._quorum_size is None:  # the start-up quorum, of every group
            self._quorum_size = len(self.cluster.members)
        return self._quorum_size

    def errored(self) -> Exception | None:
        return self.error

    def allow_state_dict_read(self) -> None:
        pass

    def disallow_state_dict_read(self) -> None:
        pass


class FakeQuorums:
    """``outer_loop.Quorums`` over a :class:`FakeManager`: its quorum, and its probes."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager

    def sync_quorum(self) -> bool:
        return self.manager.start_quorum(None)

    def start_probe(self) -> Any:
        return self.manager.start_probe(None, None)


class Group:
    def __init__(self, cluster: Cluster, seed: int, fragments: int = 1, **kwargs: Any) -> None:
        torch.manual_seed(0)  # every group starts from the same model
        self.model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.manager = FakeManager(cluster)
        parts = [self.model] if fragments == 1 else list(self.model)
        options = dict(
            sync_steps=4,
            update="eager",
            outer_lr=0.7,
            outer_momentum=0.9,
            outer_nesterov=True,
            state_device=torch.device("cpu"),
            tokens_per_step=10,
        )
        options.update(kwargs)
        # The options dict mixes value types, which mypy cannot match to the keywords.
        self.loop = AsyncDiLoCo(self.manager, parts, self.optimizer, **options)  # type: ignore[arg-type]
        self.data = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        x = torch.randn(8, 4, generator=self.data)
        loss = self.model(x).pow(2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()

    def globals_(self) -> list[torch.Tensor]:
        return [
            t.clone()
            for i in range(len(self.loop.fragments))
            for t in self.loop.global_parameters(i).values()
        ]


@contextlib.contextmanager
def training(groups: list[Group]) -> Iterator[None]:
    """Every group's outer-loop hooks installed, with gradients on."""
    with torch.enable_grad(), contextlib.ExitStack() as stack:
        for g in groups:
            stack.enter_context(g.loop.hooks(FakeQuorums(g.manager)))
        yield


def run(groups: list[Group], steps: int) -> list[list[list[torch.Tensor]]]:
    """Lock-step inner steps; the global copies of each group after every sync point."""
    seen: list[list[list[torch.Tensor]]] = [[] for _ in groups]
    with training(groups):
        for _ in range(steps):
            for i, g in enumerate(groups):
                g.step()
                if g.loop.local_step() == 0:
                    seen[i].append(g.globals_())
    return seen


@pytest.mark.parametrize("update", ["eager", "eager_share", "delayed"])
@pytest.mark.parametrize("fragments", [1, 2])
def test_groups_hold_identical_global_parameters_after_every_sync(update, fragments):
    cluster = Cluster()
    groups = [Group(cluster, seed, fragments, update=update) for seed in (1, 2, 3)]
    seen = run(groups, 24)
    assert len(seen[0]) == 24 // (4 // fragments)
    for a, b, c in zip(*seen, strict=True):
        assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(a, b, c, strict=True))
    first, last = seen[0][0], seen[0][-1]
    assert not all(torch.equal(x, y) for x, y in zip(first, last, strict=True))  # they did train
    for g in groups:
        g.loop.finish(FakeQuorums(g.manager))
    final = [torch.cat([p.detach().flatten() for p in g.model.parameters()]) for g in groups]
    assert torch.equal(final[0], final[1]) and torch.equal(final[0], final[2])


def models_at_sync_points(group: Group) -> list[list[torch.Tensor]]:
    """The group's model parameters as each sync point finds them (after the inner step)."""
    seen: list[list[torch.Tensor]] = []
    sync_point = group.loop.sync_point

    def recording(quorums: Any) -> None:
        seen.append([p.detach().clone() for p in group.model.parameters()])
        sync_point(quorums)

    group.loop.sync_point = recording  # type: ignore[method-assign]  # a spy on the method
    return seen


def test_delayed_parameter_averaging_is_local_sgd_one_period_late():
    """outer_lr 1, no momentum: the global copy becomes the average of the groups' models at
    the end of the period, applied at the next sync point; meanwhile each group restarted
    from the old global copy."""
    cluster = Cluster()
    groups = [
        Group(cluster, seed, update="delayed", outer_lr=1.0, outer_momentum=0.0) for seed in (1, 2)
    ]
    start = [p.detach().clone() for p in groups[0].model.parameters()]
    ends = [models_at_sync_points(g) for g in groups]
    run(groups, 4)
    for g in groups:
        assert all(torch.equal(p, s) for p, s in zip(g.model.parameters(), start, strict=True))
        assert g.loop.in_flight(0)
    assert all(g.loop.finish(FakeQuorums(g.manager)).synced for g in groups)
    for g in groups:
        for p, a, b in zip(g.model.parameters(), ends[0][0], ends[1][0], strict=True):
            torch.testing.assert_close(p.detach(), (a + b) / 2, rtol=0, atol=1e-6)


def test_pseudo_gradients_are_weighted_by_tokens():
    """A group that trained on 3x the tokens counts 3x in the average."""
    cluster = Cluster()
    plain = dict(update="delayed", outer_lr=1.0, outer_momentum=0.0)
    groups = [
        Group(cluster, 1, tokens_per_step=30, **plain),
        Group(cluster, 2, tokens_per_step=10, **plain),
    ]
    ends = [models_at_sync_points(g) for g in groups]
    run(groups, 4)
    for g in groups:
        g.loop.finish(FakeQuorums(g.manager))
        for p, a, b in zip(g.model.parameters(), ends[0][0], ends[1][0], strict=True):
            torch.testing.assert_close(p.detach(), 0.75 * a + 0.25 * b, rtol=0, atol=1e-6)


def test_eager_starts_where_the_outer_optimizer_would_go_on_its_own_pseudo_gradient():
    group = Group(Cluster(), 1, update="eager")
    before = [p.detach().clone() for p in group.model.parameters()]
    ends = models_at_sync_points(group)
    run([group], 4)
    reference = [b.clone().requires_grad_() for b in before]
    outer = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=True)
    for r, b, e in zip(reference, before, ends[0], strict=True):
        r.grad = b - e  # this group's pseudo-gradient
    outer.step()
    for p, r in zip(group.model.parameters(), reference, strict=True):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=1e-6)
    # The global copy itself has not moved: the average is not there yet.
    for g, b in zip(group.loop.global_parameters(0).values(), before, strict=True):
        assert torch.equal(g, b)


@pytest.mark.parametrize("count", [2, 3])
def test_eager_share_applies_its_share_now_and_the_others_when_the_average_arrives(count):
    """outer SGD lr 0.7 without momentum, 2 and 3 groups: after sync point 1 each group's model
    is the global copy moved by 0.7 x its own pseudo-gradient / count (the number of groups in
    the quorum); after sync point 2 (the average of period 1 arrived, the next period's share
    applied) the global copy has taken the average, and every pseudo-gradient counted once,
    with weight 1 / count (arXiv 2502.12996's eager update)."""
    cluster = Cluster()
    plain = dict(update="eager_share", outer_lr=0.7, outer_momentum=0.0)
    groups = [Group(cluster, seed, **plain) for seed in range(1, count + 1)]
    before = [p.detach().clone() for p in groups[0].model.parameters()]
    ends = [models_at_sync_points(g) for g in groups]
    run(groups, 4)
    for g, own in zip(groups, ends, strict=True):
        for p, b, e in zip(g.model.parameters(), before, own[0], strict=True):
            torch.testing.assert_close(p.detach(), b - 0.7 * (b - e) / count, rtol=0, atol=1e-6)
    run(groups, 4)
    for g in groups:
        for k, (t, b) in enumerate(zip(g.loop.global_parameters(0).values(), before, strict=True)):
            mean = sum(b - list(own[0])[k] for own in ends) / count
            torch.testing.assert_close(t, b - 0.7 * mean, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("momentum", "nesterov"), [(0.0, False), (0.9, False), (0.9, True)])
def test_eager_starts_exactly_where_the_outer_step_goes_on_the_own_pseudo_gradient(
    momentum: float, nesterov: bool
) -> None:
    """Bit for bit, at every sync point (the first without momentum yet, then with its
    history): the model starts its period where the outer optimizer's own step would take the
    global copy if every group had sent this group's pseudo-gradient."""
    # 8 tokens per step: the pseudo-gradient is sent times 32, a power of two (exact).
    group = Group(Cluster(), 1, outer_momentum=momentum, outer_nesterov=nesterov, tokens_per_step=8)
    state = group.loop._states[0]
    with training([group]):
        for step in range(12):
            group.step()
            if group.loop.local_step() != 0:
                continue
            flight = group.loop._in_flight
            assert flight is not None and flight.tokens == 32
            copies = [g.clone().requires_grad_() for g in state.global_copy.values()]
            outer = OuterSGD(copies, lr=0.7, momentum=momentum, nesterov=nesterov)
            offset = 0
            for copy, glob in zip(copies, state.global_copy.values(), strict=True):
                copy.grad = flight.buffer[offset : offset + copy.numel()].view_as(copy) / 32
                offset += copy.numel()
                buf = state.outer.state.get(glob, {}).get("momentum_buffer")
                if buf is not None:
                    outer.state[copy]["momentum_buffer"] = buf.clone()
            outer.step()
            for p, expected in zip(group.model.parameters(), copies, strict=True):
                assert torch.equal(p.detach(), expected.detach()), f"sync point after {step}"


def test_an_uncommitted_sync_is_dropped_alike_and_the_local_copy_follows():
    cluster = Cluster()
    groups = [Group(cluster, seed) for seed in (1, 2)]
    run(groups, 4)  # sync point 1: sync 1 started
    before = [g.globals_() for g in groups]
    for g in groups:
        g.manager.commit = False
    run(groups, 4)  # sync point 2: sync 1 not committed, sync 2 started
    for g, b in zip(groups, before, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(g.globals_(), b, strict=True))
        outcome = g.loop.last_outcome()
        assert outcome is not None and outcome.committed is False
        g.manager.commit = True
    seen = run(groups, 8)
    assert all(torch.equal(x, y) for x, y in zip(seen[0][-1], seen[1][-1], strict=True))


def test_a_failed_all_reduce_in_flight_is_dropped_by_every_group_and_never_saved_as_arrived():
    """Sync 1's collective fails on every group (torchft records the error, it does not raise
    it). A checkpoint taken mid-period after that keeps nothing as arrived and says the sync is
    still in flight; at the next sync point no group commits it or applies it, the local copy
    follows the unchanged global copy, and the next sync is committed again with the error
    cleared by its quorum."""
    cluster = Cluster()
    groups = [Group(cluster, seed) for seed in (1, 2, 3)]
    run(groups, 4)  # sync point 1: sync 1 started (rounds 0 and 1 of the cluster)
    cluster.failing |= {0, 1}
    before = [g.globals_() for g in groups]
    run(groups, 1)
    for g in groups:
        state = g.loop.extra_state()
        assert g.manager.errored() is not None and g.manager.sync_failed()
        assert state["arrived"]["fragment"] == -1 and state["arrived"]["tokens"] == 0.0
        assert g.loop.in_flight(0)
    run(groups, 3)  # sync point 2: sync 1 dropped, sync 2 started
    for g, b in zip(groups, before, strict=True):
        outcome = g.loop.last_outcome()
        assert outcome is not None and outcome.committed is False and outcome.groups == 3
        assert all(torch.equal(x, y) for x, y in zip(g.globals_(), b, strict=True))
        assert g.manager.errored() is None  # the quorum of sync 2 cleared it
    run(groups, 4)  # sync point 3: sync 2 committed by all
    seen = [g.globals_() for g in groups]
    for g in groups:
        outcome = g.loop.last_outcome()
        assert outcome is not None and outcome.committed and g.manager.step == 1
    assert not all(torch.equal(x, y) for x, y in zip(seen[0], before[0], strict=True))
    for other in seen[1:]:
        assert all(torch.equal(x, y) for x, y in zip(seen[0], other, strict=True))


def test_a_committed_syncs_buffer_carries_the_next_sync_and_a_failed_ones_never_does():
    """A shard-sized buffer is not allocated at every sync point: a committed sync's buffer
    carries the next pseudo-gradient. A failed sync's is never taken again: a transfer
    abandoned with it may still write into it."""
    cluster = Cluster()
    groups = [Group(cluster, seed) for seed in (1, 2)]

    def buffer_of(group: Group) -> int:
        flight = group.loop._in_flight
        assert flight is not None
        return flight.buffer.data_ptr()

    run(groups, 4)  # sync 1 started
    first = [buffer_of(g) for g in groups]
    run(groups, 4)  # sync 1 committed, sync 2 started in its buffer
    assert [buffer_of(g) for g in groups] == first
    cluster.failing |= {2, 3}  # sync 2's collective fails
    run(groups, 4)  # sync 2 dropped, sync 3 started in a new buffer
    assert all(buffer_of(g) != f for g, f in zip(groups, first, strict=True))
    for g in groups:
        outcome = g.loop.last_outcome()
        assert outcome is not None and not outcome.committed


def test_an_average_the_passes_step_with_is_reported_by_its_sum_of_squares():
    """The sync point's passes step the outer state without ``optimizer.step()``, whose
    pre-hook measures the average for the sync's report: the outcome carries it instead."""
    cluster = Cluster()
    groups = [Group(cluster, seed) for seed in (1, 2)]
    run(groups, 4)  # sync 1 started
    flight = groups[0].loop._in_flight
    assert flight is not None
    seen: list[float] = []
    decide = flight.decide

    def deciding(manager: Any) -> Any:
        decided = decide(manager)  # the average, before the pass overwrites the sums
        seen.append(float((flight.buffer[:-1].double() / float(flight.buffer[-1])).square().sum()))
        return decided

    flight.decide = deciding  # type: ignore[method-assign]
    run(groups, 4)  # sync 1 committed: its average is the summed buffer / its tokens
    outcome = groups[0].loop.last_outcome()
    assert outcome is not None and outcome.committed and outcome.pseudo_grad_squares is not None
    assert len(seen) == 1 and float(outcome.pseudo_grad_squares) == pytest.approx(seen[0], rel=1e-5)
    # Taken once: the next report of no outer step has none.
    assert groups[0].loop.take_stepped_squares() is None


def test_a_group_that_heals_sends_weight_zero_and_takes_the_global_copy():
    cluster = Cluster()
    groups = [Group(cluster, seed) for seed in (1, 2)]
    run(groups, 8)
    groups[1].manager.heal_from = groups[0].manager
    with torch.no_grad():
        for p in groups[1].loop.global_parameters(0).values():
            p.add_(1.0)  # state the heal must replace
    run(groups, 4)
    flight = groups[1].loop._in_flight
    assert flight is not None
    flight.work.wait()
    assert float(flight.buffer[-1]) == 40.0  # group 0's 4 steps x 10 tokens; its own: 0
    healed = groups[1]
    assert all(
        torch.equal(x, y) for x, y in zip(groups[0].globals_(), healed.globals_(), strict=True)
    )
    assert healed.loop.sync_points == groups[0].loop.sync_points == 3
    # What its compression still owed belonged to the state it no longer has.
    assert (healed.manager.feedback_resets, groups[0].manager.feedback_resets) == (1, 0)
    global_copy = healed.loop.global_parameters(0).values()
    for p, g in zip(healed.model.parameters(), global_copy, strict=True):
        assert torch.equal(p.detach(), g)
    # Later syncs, with the outer momentum taken from the peer: the same global copies still.
    before = groups[0].globals_()
    run(groups, 8)
    assert not all(torch.equal(x, y) for x, y in zip(before, groups[0].globals_(), strict=True))
    assert all(
        torch.equal(x, y) for x, y in zip(groups[0].globals_(), healed.globals_(), strict=True)
    )


def _save(group: Group, folder: Any) -> dict[str, Any]:
    """A checkpoint of ``group``: the semi-sync state through DCP, the rest in memory."""
    import torch.distributed.checkpoint as dcp

    dcp.save(
        {"semi_sync": SemiSyncState(*parts(as_trainer(group)))},
        checkpoint_id=folder,
    )
    return {
        "model": {k: v.clone() for k, v in group.model.state_dict().items()},
        "step": group.manager.step,
        "data": group.data.get_state(),
    }


def _load(group: Group, folder: Any, rest: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp

    state = SemiSyncState(*parts(as_trainer(group)))
    dcp.load({"semi_sync": state}, checkpoint_id=folder)
    group.model.load_state_dict(rest["model"])
    group.manager.step = rest["step"]
    group.data.set_state(rest["data"])
    assert state.loaded


@pytest.mark.parametrize(
    "fragments, momentum_every, before", [(1, 1, 7), (2, 1, 7), (1, 3, 15), (2, 2, 13)]
)
def test_a_restart_from_checkpoints_taken_mid_period_continues_bit_for_bit(
    tmp_path, fragments, momentum_every, before
):
    """Checkpoints of both groups taken while a sync is in flight (sync_steps 4) hold its
    summed result, the local-period starts, the token counts and (Delayed Nesterov) the outer
    optimizer's place in its window and the pseudo-gradients summed in it: groups restarted
    from them in fresh processes apply that sync at their next sync point and hold, at every
    later sync, the global parameters of the uninterrupted run."""
    cluster = Cluster()
    options = dict(outer_momentum_every=momentum_every)
    groups = [Group(cluster, seed, fragments, **options) for seed in (1, 2)]
    run(groups, before)
    assert all(g.loop._in_flight is not None for g in groups)
    if momentum_every > 1:  # mid-window: the checkpoint must carry the partial sum
        outer = groups[0].loop.outer_optimizer(0)
        assert outer.param_groups[0]["step"] % momentum_every != 0
    saved = [_save(g, tmp_path / f"group{i}") for i, g in enumerate(groups)]
    uninterrupted = run(groups, 12)

    fresh_cluster = Cluster()
    fresh = [Group(fresh_cluster, seed, fragments, **options) for seed in (1, 2)]
    period = 4 // fragments
    for i, g in enumerate(fresh):
        _load(g, tmp_path / f"group{i}", saved[i])
        g.loop.set_local_step(before % period)
    assert [g.loop.sync_points for g in fresh] == [before // period] * 2
    resumed = run(fresh, 12)
    assert len(resumed[0]) == len(uninterrupted[0]) > 0
    for before_, after in zip(uninterrupted[0], resumed[0], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(before_, after, strict=True))


def test_a_sync_loaded_as_arrived_goes_into_the_heal_history_as_its_fp32_sums(tmp_path):
    """A sync a checkpoint held as arrived reached no transfer of the restarted process: when it
    commits at the next sync point, the heal history keeps its summed values in fp32 (what a
    replay decodes), divided by its tokens (the outer step's divisor), before its outer step
    (the basis digest)."""
    from torchtitan.experiments.fault_tolerance.heal.history import HealHistory
    from torchtitan.tools.digest import device_digest

    cluster = Cluster()
    groups = [Group(cluster, seed) for seed in (1, 2)]
    run(groups, 6)  # sync 1 started at step 4, in flight
    saved = [_save(g, tmp_path / f"group{i}") for i, g in enumerate(groups)]
    flight = groups[0].loop._in_flight
    assert flight is not None and flight.arrived
    sums, tokens = flight.buffer[:-1].clone(), float(flight.buffer[-1])
    fresh_cluster = Cluster()
    history = HealHistory(3)
    fresh = [Group(fresh_cluster, 1, history=history), Group(fresh_cluster, 2)]
    for i, g in enumerate(fresh):
        _load(g, tmp_path / f"group{i}", saved[i])
        g.loop.set_local_step(2)
    basis = device_digest(fresh[0].loop.global_parameters(0).values())
    # This process's transport carried none of it: a real one's record then sums no squares.
    decide = fresh[0].manager.decide
    fresh[0].manager.decide = lambda: dataclasses.replace(decide(), squares=0.0)  # type: ignore[method-assign]
    run(fresh, 2)  # the next sync point decides sync 1
    (entry,) = history.after(0)
    assert (entry.sync, entry.fragment, entry.scale) == (1, 0, tokens) and tokens == 80
    (kept,) = entry.transfers
    assert kept.dtype == "float32" and torch.equal(kept.payload, sums)
    assert entry.basis_digest == basis
    # Its report: the payload the process that saved it sent (the sums and the token count),
    # and the sum of squares of the average it applied, from the loaded sums.
    outcome = fresh[0].loop.last_outcome()
    assert outcome is not None and outcome.committed and outcome.compression_s is None
    assert outcome.bytes_sent == (sums.numel() + 1) * 4
    assert outcome.pseudo_grad_squares is not None
    expected = float(torch.dot(sums, sums)) / tokens**2
    assert float(outcome.pseudo_grad_squares) == pytest.approx(expected, rel=1e-6)


def test_delayed_nesterov_groups_agree_and_eager_starts_where_its_next_step_goes():
    """outer_momentum_every=2: the groups' global copies stay identical, and the eager start
    of a period is the global copy moved by the step Delayed Nesterov would take on this
    group's own pseudo-gradient."""
    cluster = Cluster()
    groups = [Group(cluster, seed, outer_momentum_every=2) for seed in (1, 2)]
    seen = run(groups, 20)
    for a, b in zip(*seen, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    from torchtitan.experiments.fault_tolerance.methods.outer_optimizer import DelayedNesterov

    assert isinstance(groups[0].loop.outer_optimizer(0), DelayedNesterov)
    alone = Group(Cluster(), 1, outer_momentum_every=2)
    before = [p.detach().clone() for p in alone.model.parameters()]
    ends = models_at_sync_points(alone)
    run([alone], 4)
    outer = alone.loop.outer_optimizer(0)
    for p, g, b, e in zip(
        alone.model.parameters(),
        alone.loop.global_parameters(0).values(),
        before,
        ends[0],
        strict=True,
    ):
        expected = g.sub(outer.direction(g, b - e), alpha=0.7)  # type: ignore[attr-defined]
        assert torch.equal(p.detach(), expected)


def test_dylu_plans_periods_that_end_together():
    # Group 1 at 1.9x group 0's step time (0.85 s vs 1.615 s), period 20: group 1 takes 11
    # steps (17.8 s), the closest to group 0's 20 x 0.85 = 17 s; group 0 fills that time.
    assert dylu_inner_steps(20, [0.85, 1.615], 1.615) == 11
    assert dylu_inner_steps(20, [0.85, 1.615], 0.85) == 21
    assert dylu_inner_steps(20, [0.1, 0.2], 0.2) == 10  # exactly twice as slow
    assert dylu_inner_steps(20, [0.1, 0.2], 0.1) == 20
    assert dylu_inner_steps(20, [0.1, 0.1], 0.1) == 20  # equal speeds: nothing changes
    assert dylu_inner_steps(20, [0.001, 1.0], 1.0) == 1  # never fewer than one step
    assert dylu_inner_steps(20, [0.001, 1.0], 0.001) == 40  # nor more than 2 x period
    assert dylu_inner_steps(20, [0.0, 0.3], 0.3) == 20  # the other group is not measured yet
    assert dylu_inner_steps(20, [0.1, 0.0], 0.0) == 20  # this one is not
    assert dylu_inner_steps(20, [], 0.0) == 20
    # Three groups: every group's planned time is within half of its own step of the others'.
    speeds = [0.31, 0.5, 0.77]
    ends = [dylu_inner_steps(20, speeds, s) * s for s in speeds]
    assert max(ends) - min(ends) <= max(speeds) / 2 + min(speeds) / 2


def test_dylu_period_length_and_the_halfway_correction():
    # The slowest group's whole steps closest to the fastest group's 20 steps, in its time.
    assert dylu_period_seconds(20, [0.85, 1.615]) == pytest.approx(11 * 1.615)
    assert dylu_period_seconds(20, [0.0, 0.3]) == pytest.approx(20 * 0.3)
    assert dylu_period_seconds(20, []) == 0.0
    # 5 of the planned steps done; the period is planned to last 10 s.
    assert dylu_steps_to_deadline(5, 5.0, 10.0, 20) == 10  # on plan
    assert dylu_steps_to_deadline(5, 6.25, 10.0, 20) == 8  # slower this period: 3 more
    assert dylu_steps_to_deadline(5, 4.0, 10.0, 20) == 13  # faster: 7.5 more, rounds to 8
    assert dylu_steps_to_deadline(5, 11.0, 10.0, 20) == 5  # already late: sync now
    assert dylu_steps_to_deadline(5, 0.5, 10.0, 20) == 40  # never more than 2 x period
    assert dylu_steps_to_deadline(0, 0.0, 10.0, 20) == 1


class FakeClock:
    """The device's clock (and ``time.perf_counter`` of a module under test), moved by hand."""

    def __init__(self) -> None:
        self.now = 100.0
        self.reads = 0

    def perf_counter(self) -> float:
        self.reads += 1
        return self.now


def test_a_period_slower_than_planned_is_shortened_halfway():
    """Planned: 8 inner steps in 8 s. The group takes 2 s per step in this period, so after
    4 steps (8 s) it has reached the planned length and syncs there; the group's ranks agree
    on the count (here: the agreement raises it to 6). The next period, planned afresh, is not
    corrected when no length is given."""
    clock = FakeClock()
    group = Group(Cluster(), 1, clock=clock.perf_counter)
    group.loop.period = group.loop.plan.period = 8
    asked: list[int] = []
    group.loop.agree_in_group = lambda n: asked.append(n) or 6
    group.loop.plan.plan(8, seconds=8.0)
    with training([group]):
        steps = 0
        while True:
            clock.now += 2.0
            group.step()
            steps += 1
            if group.loop.local_step() == 0:
                break
        # After step 4 it asks for 4 (on time), after step 5 for 5 (late): both raised to 6.
        assert (asked, steps) == ([4, 5], 6)
        group.loop.plan.plan(3)
        for _ in range(3):
            clock.now += 5.0
            group.step()
        assert group.loop.local_step() == 0 and asked == [4, 5]
        assert group.loop.step_seconds() == pytest.approx(5.0)


def test_a_period_much_faster_than_planned_takes_twice_the_period_in_all_at_most():
    """Planned: 8 inner steps in 8 s. The process's first step takes 1 s (one-time costs, so
    the period is timed from after it), every later one 0.01 s: at each correction the time
    left would fit hundreds of steps. The period ends after 16 steps in all (twice the
    period), the first one counted, not after 16 timed ones."""
    clock = FakeClock()
    group = Group(Cluster(), 1, clock=clock.perf_counter)
    group.loop.period = group.loop.plan.period = 8
    asked: list[int] = []
    group.loop.agree_in_group = lambda n: asked.append(n) or n
    group.loop.plan.plan(8, seconds=8.0)
    with training([group]):
        for steps in range(1, 4 * 8):
            clock.now += 1.0 if steps == 1 else 0.01
            group.step()
            if group.loop.local_step() == 0:
                break
    # Corrected after steps 4, 10, 13, 14 and 15: each time to 16.
    assert (asked, steps) == ([16] * 5, 16)


def test_a_period_that_slows_down_late_is_corrected_again():
    """Planned: 16 inner steps in 16 s. The first 8 take 1 s each (on plan at the halfway
    correction), then each takes 2 s: the correction after step 12 (16 s gone) ends the period
    there, where the plan from halfway would have run 8 s late."""
    corrections = [dylu_next_correction(t, 20) for t in (0, 10, 15, 17, 18, 19)]
    assert corrections == [10, 15, 17, 18, 19, None]
    assert dylu_next_correction(0, 1) is None
    clock = FakeClock()
    group = Group(Cluster(), 1, clock=clock.perf_counter)
    group.loop.period = group.loop.plan.period = 16
    asked: list[int] = []
    group.loop.agree_in_group = lambda n: asked.append(n) or n
    group.loop.plan.plan(16, seconds=16.0)
    with training([group]):
        steps = 0
        while True:
            clock.now += 1.0 if steps < 8 else 2.0
            group.step()
            steps += 1
            if group.loop.local_step() == 0:
                break
    assert (asked, steps) == ([16, 12], 12)


def test_dylu_times_inner_steps_on_the_device_not_on_the_host() -> None:
    """On a GPU the host only queues an inner step and returns at once; the device takes 1 s
    for it. The group's measured speed, which DyLU plans from, is the device's 1 s per step,
    not the host's microseconds."""
    clock = FakeClock()
    group = Group(Cluster(), 1, clock=clock.perf_counter)
    with training([group]):
        for _ in range(8):
            clock.now += 1.0
            group.step()
    assert group.loop.sync_points == 2
    assert group.loop.step_seconds() == pytest.approx(1.0)


@pytest.mark.parametrize("start", [0, 1])
def test_a_process_s_first_inner_step_is_not_in_its_measured_speed(start: int) -> None:
    """A (re)started process compiles in its first inner step (30 s), at the period's start or
    mid-period (joined at the peers' inner step 1); its later steps take 1 s. Its speed is
    measured from after that step: 1 s per step, not a slow group that DyLU would give too
    few steps next period."""
    clock = FakeClock()
    group = Group(Cluster(), 1, clock=clock.perf_counter)
    group.loop.set_local_step(start)
    with training([group]):
        for seconds in [30.0] + [1.0] * (3 - start):
            clock.now += seconds
            group.step()
    assert group.loop.sync_points == 1
    assert group.loop.step_seconds() == pytest.approx(1.0)


def test_the_warm_up_step_counts_against_the_period_s_length_but_not_in_its_speed() -> None:
    """Planned: 8 inner steps in 8 s. The process's first step takes 3 s (compiling), the
    others 1 s. The correction after step 4 (6 s gone) sees 1 s per step and the 2 s left
    of the period's length (the other groups keep to it): 6 steps, ending at 8 s."""
    clock = FakeClock()
    group = Group(Cluster(), 1, clock=clock.perf_counter)
    group.loop.period = group.loop.plan.period = 8
    asked: list[int] = []

    def agree(n: int) -> int:
        asked.append(n)
        return n

    group.loop.agree_in_group = agree
    group.loop.plan.plan(8, seconds=8.0)
    with training([group]):
        steps = 0
        while True:
            clock.now += 3.0 if steps == 0 else 1.0
            group.step()
            steps += 1
            if group.loop.local_step() == 0:
                break
    assert (asked, steps) == ([6, 6], 6)
    assert group.loop.step_seconds() == pytest.approx(1.0)


def test_dylu_s_period_clock_starts_after_the_sync_quorum() -> None:
    """Each inner step takes 1 s on the device; every sync quorum waits 10 s for slower groups.
    The speed DyLU plans from is this group's own 1 s per step: the wait at the sync point is
    not in it (a group always measured slower by its wait would get fewer steps each
    period)."""
    clock = FakeClock()
    group = Group(Cluster(), 1, clock=clock.perf_counter)
    start_quorum = group.manager.start_quorum

    def waiting_quorum(accept: Any) -> bool:
        clock.now += 10.0
        return start_quorum(accept)

    group.manager.start_quorum = waiting_quorum  # type: ignore[method-assign]
    with training([group]):
        for _ in range(12):
            clock.now += 1.0
            group.step()
    assert group.loop.sync_points == 3
    assert group.loop.step_seconds() == pytest.approx(1.0)


class _LateProbe:
    """DyLU's speed probe whose quorum is still forming when the period ends: finishing it
    waits ``wait_s`` on ``clock``, then it planned nothing."""

    def __init__(self, group: Group, clock: FakeClock, wait_s: float) -> None:
        self.group, self.clock, self.wait_s = group, clock, wait_s

    def done(self) -> bool:
        return False

    def finish(self) -> None:
        self.clock.now += self.wait_s
        self.group.loop.probe_unused()


def test_a_period_that_ends_before_a_late_probe_returns_is_measured_on_its_own_steps() -> None:
    """The probe times step 2 at 1 s; steps 3 and 4 then take 3 s each, and the period ends
    at step 4 while the probe's quorum still forms (it returns 10 s later). The period's
    speed, 7 s over its 3 timed steps, replaces the probe's one-step estimate; the wait for
    the late probe is in neither."""
    clock = FakeClock()
    group = Group(Cluster(), 1, clock=clock.perf_counter)
    group.loop.plan.probe_after(1)
    late = _LateProbe(group, clock, 10.0)
    quorums = SimpleNamespace(
        sync_quorum=lambda: group.manager.start_quorum(None), start_probe=lambda: late
    )
    with torch.enable_grad(), group.loop.hooks(cast(Any, quorums)):
        for seconds in (5.0, 1.0, 3.0, 3.0):  # the first step: one-time costs, untimed
            clock.now += seconds
            group.step()
    assert group.loop.sync_points == 1
    assert group.loop.plan.probed_seconds == pytest.approx(1.0)
    assert group.loop.step_seconds() == pytest.approx(7.0 / 3)


def run_periods(groups: list[Group], periods: int) -> list[list[list[torch.Tensor]]]:
    """Each group takes the inner steps of its period, then all meet at the sync point (as the
    sync quorum makes them); the global copies of each group after every sync point."""
    seen: list[list[list[torch.Tensor]]] = [[] for _ in groups]
    with training(groups):
        for _ in range(periods):
            for i, g in enumerate(groups):
                g.step()
                while g.loop.local_step() != 0:
                    g.step()
                seen[i].append(g.globals_())
    return seen


@pytest.mark.parametrize("update", ["eager", "delayed"])
def test_groups_taking_different_inner_steps_agree_and_weigh_by_tokens(update):
    """DyLU: group 1 takes 2 inner steps per period, group 0 the full 4; they pass sync points
    together, hold identical global copies after each, and group 1 weighs 1/3 in the average."""
    cluster = Cluster()
    groups = [Group(cluster, seed, update=update) for seed in (1, 2)]
    groups[1].loop.plan.plan(2)
    seen = run_periods(groups, 5)
    for a, b in zip(*seen, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert [g.loop.sync_points for g in groups] == [5, 5]
    outcomes = [g.loop.last_outcome() for g in groups]
    assert [o.inner_steps for o in outcomes if o is not None] == [4, 2]
    weights = [o.weight for o in outcomes if o is not None]
    assert weights == pytest.approx([2 / 3, 1 / 3])
    with pytest.raises(ValueError, match="1 to 8 inner steps"):
        groups[0].loop.plan.plan(9)


def test_a_group_healed_in_the_sync_quorum_all_reduces_the_fragment_its_peer_syncs() -> None:
    """Fragments of 20 and 5 values. A group one sync behind heals from its peer inside its
    sync quorum (a minority after a digest mismatch): it must take part in the peer's sync, of
    fragment 1, not start fragment 0's all-reduce (a size mismatch: a hang on nccl)."""
    ahead = Group(Cluster(), 1, fragments=2)
    run([ahead], 2 * 2)  # two sync points: the first sync committed, Manager step 1
    assert ahead.manager.step == 1 and ahead.loop.current_fragment() == 1
    cluster = Cluster()
    behind = Group(cluster, 2, fragments=2)
    behind.manager.heal_from = ahead.manager
    run([behind], 2)  # its first sync point, where it heals
    sent = [cluster.rounds[r][0] for r in sorted(cluster.rounds)]
    assert [t.numel() for t in sent] == [5, 1]  # fragment 1's values, then the token count
    assert behind.loop._in_flight is not None and behind.loop._in_flight.fragment == 1
    assert torch.equal(sent[1], torch.zeros(1))  # it healed: weight 0


def test_ranks_of_a_group_agree_whether_a_sync_in_flight_arrived_before_saving_it() -> None:
    """A checkpoint taken while a sync is in flight keeps its result only if it arrived on
    every rank of the group: here another rank's all-reduce failed (the group's MAX says 1), so
    this rank must not save it as arrived although its own collective succeeded."""
    group = Group(Cluster(), 1)
    run([group], 5)  # a sync in flight since step 4
    flight = group.loop._in_flight
    assert flight is not None and not flight.arrived
    asked: list[int] = []
    group.loop.agree_in_group = lambda failed: asked.append(failed) or 1
    state = group.loop.extra_state()
    assert asked == [0]  # this rank's own collective went through
    assert state["arrived"]["fragment"] == -1 and group.loop.in_flight(0)


def test_outer_state_kept_on_the_cpu_is_saved_from_the_cpu(tmp_path) -> None:
    """outer_state_device=cpu with sharded parameters on an accelerator (here a mesh that says
    cuda, over meta tensors): every tensor of the saved semi-sync state stays on the CPU, none
    is copied next to the model."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    store = dist.HashStore()
    pg = dist.ProcessGroupGloo(store, 0, 1, __import__("datetime").timedelta(seconds=10))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda", mesh_dim_names=("dp_shard",))
        group = Group(Cluster(), 1, outer_momentum_every=2, outer_momentum=0.9)
        run([group], 5)  # a sync in flight: its arrived sum is saved too
        for fragment in group.loop._states:
            fragment.params = {
                name: nn.Parameter(
                    DTensor.from_local(
                        torch.empty_like(p, device="meta"),
                        mesh,
                        [Shard(0)],
                        shape=p.shape,
                        stride=p.stride(),
                    )  # fmt: skip
                )
                for name, p in fragment.params.items()
            }
        group.loop.fragment_parameters = lambda i: group.loop._states[i].params  # type: ignore[method-assign]
        saved = SemiSyncState(*parts(as_trainer(group))).state_dict()
        tensors = [t for t in _leaves(saved) if isinstance(t, torch.Tensor)]
        assert tensors and all(isinstance(t, DTensor) for t in tensors)
        assert {t.to_local().device.type for t in tensors} == {"cpu"}
        # And it round-trips through DCP, from the CPU into the CPU.
        import torch.distributed.checkpoint as dcp

        folder = tmp_path / "cpu_state"
        dcp.save({"semi_sync": saved}, checkpoint_id=folder)
        expected = [t.to_local().clone() for t in tensors]
        for t in tensors:
            t.to_local().zero_()
        dcp.load({"semi_sync": saved}, checkpoint_id=folder)
        assert all(torch.equal(t.to_local(), e) for t, e in zip(tensors, expected, strict=True))
        assert any(e.abs().sum() > 0 for e in expected)
    finally:
        del pg
        dist.destroy_process_group()


def _leaves(tree: Any) -> Iterator[Any]:
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _leaves(value)
    else:
        yield tree


def test_a_period_dylu_ends_early_reports_the_sync_s_own_time_with_gradients_freed(
    monkeypatch,
):
    """DyLU plans 8 steps in 8 s; at 2 s per step the period ends after step 4, which the
    trainer's hooks cannot know before the method's own hook decides it. The sync reported is
    the 0.5 s the sync point took (not the period since the last sync), and the inner
    gradients are already freed when the sync runs."""
    from torchtitan.experiments.fault_tolerance.report import sync_reporter as reporting
    from torchtitan.experiments.fault_tolerance.report.sync_reporter import SyncReporter
    from torchtitan.experiments.fault_tolerance.trainer import SemiSyncTrainer

    clock = FakeClock()
    monkeypatch.setattr(reporting, "time", clock)
    group = Group(Cluster(), 1, clock=clock.perf_counter)
    group.loop.period = group.loop.plan.period = 8
    group.loop.plan.plan(8, seconds=8.0)
    grads_at_sync: list[bool] = []
    start_quorum = group.manager.start_quorum

    def slow_quorum(accept: Any) -> bool:
        grads_at_sync.append(any(p.grad is not None for p in group.model.parameters()))
        clock.now += 0.5
        return start_quorum(accept)

    group.manager.start_quorum = slow_quorum  # type: ignore[method-assign]
    reported: list[float] = []
    reporter = SyncReporter.__new__(SyncReporter)  # its hooks only: no events, no metrics
    reporter.loop, reporter.sync = (
        group.loop,
        SimpleNamespace(transport=SimpleNamespace(flush=lambda: None)),
    )
    reporter.seconds, reporter.pseudo_grad_norm, reporter._clock = 0.0, None, 0.0
    reporter.report = lambda step: reported.append(reporter.seconds)  # type: ignore[method-assign]
    stub = SimpleNamespace(optimizer=group.optimizer, reporter=reporter)
    before = group.optimizer.register_step_post_hook(
        lambda *a: SemiSyncTrainer._before_torchft(stub, *a)  # type: ignore[arg-type]
    )
    with training([group]):
        after = group.optimizer.register_step_post_hook(lambda *a: reporter.after_inner_step(1))
        try:
            for _ in range(4):
                clock.now += 2.0
                group.step()
        finally:
            before.remove()
            after.remove()
    assert group.loop.local_step() == 0 and grads_at_sync == [False]
    assert reported == [pytest.approx(0.5)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("update", ["eager", "delayed"])
def test_on_cuda_non_blocking_copies_to_pinned_host_state_match_blocking_ones(update, monkeypatch):
    """The model on CUDA, the outer state in pinned host memory (``outer_state_device=cpu``):
    the copies between them are queued without blocking, with a wait where the host reads or
    rewrites their tensors. Every sync's global copy equals, bit for bit, that of the same run
    with every copy blocking."""

    def globals_of_run(non_blocking: bool) -> list[list[torch.Tensor]]:
        monkeypatch.setattr(AsyncOuterState, "non_blocking", non_blocking)
        cluster = Cluster()
        groups = [Group(cluster, seed, update=update) for seed in (1, 2)]
        for g in groups:
            g.model.to("cuda")
            g.loop = AsyncDiLoCo(
                g.manager, [g.model], g.optimizer, sync_steps=4, update=update, outer_lr=0.7,
                outer_momentum=0.9, outer_nesterov=True, state_device=torch.device("cpu"),
                tokens_per_step=10,
            )  # fmt: skip
            assert next(iter(g.loop._states[0].global_copy.values())).is_pinned()
            g.step = lambda g=g: _step_on(g, "cuda")  # type: ignore[method-assign]
        seen = run(groups, 12)
        return [[t.cpu() for t in sync] for sync in seen[0]]

    blocking, overlapped = globals_of_run(False), globals_of_run(True)
    assert len(overlapped) == 3
    for a, b in zip(blocking, overlapped, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _step_on(group: Group, device: str) -> None:
    x = torch.randn(8, 4, generator=group.data).to(device)
    loss = group.model(x).pow(2).mean()
    group.optimizer.zero_grad()
    loss.backward()
    group.optimizer.step()


def test_follow_global_moves_the_local_copy_by_the_global_change_and_restarts_the_period() -> None:
    """When an average arrives mid-period: local = local + (global - start), then start =
    global. The group keeps its inner progress since the period began (local - start), and the
    next pseudo-gradient (start - local) is that progress alone, whatever the average did."""

    torch.manual_seed(0)
    module = nn.Linear(3, 2)
    fragment = AsyncOuterState(module, torch.device("cpu"), outer_optimizer(0.7, 0.0, False, 1))
    fragment.non_blocking = False
    start = {n: p.detach().clone() for n, p in module.named_parameters()}
    progress = {n: torch.randn_like(p) for n, p in start.items()}  # inner steps since start
    moved = {n: torch.randn_like(p) for n, p in start.items()}  # what the average did
    with torch.no_grad():
        for name, p in module.named_parameters():
            fragment.period_start[name].copy_(start[name])
            fragment.global_copy[name].copy_(start[name] + moved[name])
            p.copy_(start[name] + progress[name])
    fragment.finish(None, 1.0)  # no outer step: the local copy follows the global copy
    for name, p in module.named_parameters():
        expected = start[name] + moved[name] + progress[name]
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6)
        assert torch.equal(fragment.period_start[name], fragment.global_copy[name])
        next_pseudo_gradient = fragment.period_start[name] - p.detach()
        torch.testing.assert_close(next_pseudo_gradient, -progress[name], rtol=0, atol=1e-6)


class _Probe:
    """A speed probe whose quorum the test finishes by hand (``ProbeInFlight``'s surface)."""

    def __init__(self, after: Any) -> None:
        self.ready = False
        self.finished = 0
        self._after = after

    def done(self) -> bool:
        return self.ready

    def finish(self) -> None:
        self.finished += 1
        self._after()


class _ProbingManager(FakeManager):
    """A FakeManager that starts speed probes and says whether peers may read its state."""

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(cluster)
        self.reads_allowed = True
        self.probes: list[_Probe] = []
        self.after_probe: Any = lambda: None

    def start_probe(self, accept: Any, after: Any) -> _Probe:  # a test's own ``after_probe``
        self.probes.append(_Probe(lambda: self.after_probe()))
        return self.probes[-1]

    def allow_state_dict_read(self) -> None:
        self.reads_allowed = True

    def disallow_state_dict_read(self) -> None:
        self.reads_allowed = False


def _probing_group() -> tuple[Group, _ProbingManager]:
    group = Group(Cluster(), 1)
    manager = _ProbingManager(Cluster())
    group.manager = manager
    group.loop.sync = manager  # type: ignore[assignment]
    group.loop.period = group.loop.plan.period = group.loop.plan.steps = 8
    group.loop.plan.probe_after(1)
    return group, manager


def test_a_probe_forms_while_the_group_trains_and_is_taken_once_all_ranks_have_it() -> None:
    """Probe after step 2 of 8: the group trains on while the probe's quorum forms, asking
    its ranks at every step whether all have it (here another rank is still waiting after
    step 4); it takes the plan after step 5. Until then no peer may read its state (a heal
    in the probe's quorum would read it from that quorum's thread while the model runs)."""
    group, manager = _probing_group()
    pending: list[int] = []
    others_ready = iter([False, True])
    group.loop.agree_in_group = lambda n: pending.append(n) or int(n or not next(others_ready))
    planned: list[int] = []
    manager.after_probe = lambda: planned.append(group.loop.local_step())
    reads = []
    with training([group]):
        for step in range(1, 7):
            group.step()
            reads.append(manager.reads_allowed)
            if step == 3:
                manager.probes[0].ready = True
    assert len(manager.probes) == 1 and manager.probes[0].finished == 1
    assert planned == [5] and pending == [1, 0, 0]
    assert reads == [True, False, False, False, True, True]


def test_a_period_that_ends_before_the_probe_waits_for_it_and_may_be_lengthened() -> None:
    """The probe's quorum is still forming when the group reaches the end of its period (8
    steps): the group measures its speed, waits for the probe there (peers may read its state
    meanwhile), and the plan that brings gives it 3 more steps before the sync point."""
    group, manager = _probing_group()
    group.loop.agree_in_group = lambda n: n
    reads_at_finish: list[bool] = []

    def plan() -> None:
        reads_at_finish.append(manager.reads_allowed)
        group.loop.plan_rest_of_period(3, 0.0)  # no corrections

    manager.after_probe = plan
    with training([group]):
        for _ in range(8):
            group.step()
        assert manager.probes[0].finished == 1 and reads_at_finish == [True]
        assert group.loop.local_step() == 8 and group.loop.steps_this_period() == 11
        assert group.loop.step_seconds() > 0
        for _ in range(3):
            group.step()
        assert group.loop.local_step() == 0 and group.loop.sync_points == 1


def test_the_device_clock_is_read_only_where_dylu_decides() -> None:
    """Each reading of the device's clock waits for the device, so a period of 40 inner steps
    with the speed probe and corrections reads it 12 times, not after every step: the period's
    begin, after the warm-up step (1), the probe (after step 3), its plan (after step 4), the
    corrections (after steps 22, 31, 35, 37, 38, 39), the period's end and the next's begin."""
    clock = FakeClock()
    group = Group(Cluster(), 1, sync_steps=40, clock=clock.perf_counter)
    manager = _ProbingManager(Cluster())
    group.manager = manager
    group.loop.sync = manager  # type: ignore[assignment]
    group.loop.plan.probe_after(2)
    manager.after_probe = lambda: group.loop.plan_rest_of_period(36, 36.0)
    with training([group]):
        for _ in range(40):
            clock.now += 1.0
            group.step()
            for probe in manager.probes:
                probe.ready = True
    assert group.loop.sync_points == 1 and manager.probes[0].finished == 1
    assert group.loop.step_seconds() == pytest.approx(1.0)
    assert clock.reads == 12
