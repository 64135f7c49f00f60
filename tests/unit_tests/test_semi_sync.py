"""Pieces of the semi-sync trainer that need no replica groups: model fragments, the state a
checkpoint carries, healing positions, the digest exchange and the pseudo-gradient norm."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Iterator
from dataclasses import astuple
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from tests.unit_tests.gloo_groups import OpenQuorums
from torchtitan.components.ft import FaultToleranceError
from torchtitan.config import ConfigManager
from torchtitan.experiments.fault_tolerance import events as events_module
from torchtitan.experiments.fault_tolerance.events import HEALED
from torchtitan.experiments.fault_tolerance.join.exchange import (
    MAX_INITIAL_MODEL_ROUNDS,
    QuorumExchange,
    QuorumFindings,
    StartUp,
    initial_model_source,
)
from torchtitan.experiments.fault_tolerance.join.protocol import QuorumProtocol
from torchtitan.experiments.fault_tolerance.method_state import SemiSyncState
from torchtitan.experiments.fault_tolerance.methods.fragments import build_model_fragments
from torchtitan.experiments.fault_tolerance.methods.global_copy import GlobalCopyMethod
from torchtitan.experiments.fault_tolerance.methods.outer_optimizer import OuterSGD
from torchtitan.experiments.fault_tolerance.methods.periodic import DiLoCo, LocalSGD
from torchtitan.experiments.fault_tolerance.report.sync_reporter import SyncReporter
from torchtitan.experiments.fault_tolerance.sync.lineage import Lineage
from torchtitan.experiments.fault_tolerance.sync.quorum import (
    FRESH,
    RESUMED,
    RUNNING,
    Host,
    Member,
    RankInGroup,
    SyncDecision,
    SyncQuorum,
    compare_digests,
    exchange,
)
from torchtitan.experiments.fault_tolerance.trainer import SemiSyncTrainer
from torchtitan.models import get_train_spec
from torchtitan.tools.digest import device_digest
from torchtitan.tools.events import event_of
from torchtitan.trainer import Trainer

SEMI_SYNC = "torchtitan.experiments.fault_tolerance.job_config"


def config(*argv: str) -> Any:
    return ConfigManager().parse_args(
        [
            "--job.custom_args_module",
            SEMI_SYNC,
            "--model.flavor=debugmodel_small",
            "--fault_tolerance.enable",
            "--fault_tolerance.group_size=2",
            "--fault_tolerance.semi_sync_method=diloco",
            "--fault_tolerance.sync_steps=4",
            *argv,
        ]
    )


def small_model() -> nn.Module:
    spec = get_train_spec("llama3")
    torch.manual_seed(0)
    model = spec.model_cls(spec.model_args["debugmodel_small"])
    model.init_weights()
    return model


# ---- fragments -------------------------------------------------------------------------------


def _fragment_names(fragments: list[nn.Module]) -> list[list[str]]:
    return [fragment.fqns() for fragment in fragments]  # type: ignore[operator]


def test_one_fragment_is_the_model_itself() -> None:
    model = small_model()
    assert build_model_fragments(model, config()) == [model]


def test_fragments_by_count_cover_every_parameter_once_in_model_order() -> None:
    model = small_model()
    fragments = build_model_fragments(model, config("--fault_tolerance.num_fragments=2"))
    names = _fragment_names(fragments)
    assert names[0][0] == "tok_embeddings.weight"
    assert all(n.startswith(("tok_embeddings.", "layers.0.")) for n in names[0])
    assert all(n.startswith(("layers.1.", "norm.", "output.")) for n in names[1])
    assert sorted(names[0] + names[1]) == sorted(n for n, _ in model.named_parameters())
    # The fragments hold the model's own parameters, not copies.
    params = dict(model.named_parameters())
    for fragment, fqns in zip(fragments, names, strict=True):
        for p, fqn in zip(fragment.parameters(), fqns, strict=True):
            assert p is params[fqn]


def test_fragments_by_fqn_put_unlisted_parameters_in_the_last() -> None:
    model = small_model()
    job = config(
        "--fault_tolerance.module_fqns_per_model_fragment", "layers.0.attention", "layers.1"
    )
    names = _fragment_names(build_model_fragments(model, job))
    assert all(n.startswith("layers.0.attention.") for n in names[0])
    # The rest of block 0 (its norms and feed-forward), embeddings, norm and output: last.
    assert "layers.0.feed_forward.w1.weight" in names[1]
    assert {"tok_embeddings.weight", "norm.weight", "output.weight"} <= set(names[1])
    assert sorted(names[0] + names[1]) == sorted(n for n, _ in model.named_parameters())


# ---- checkpointed state ----------------------------------------------------------------------


class FakeManager:
    """What DiLoCo needs from a Manager when no sync runs."""

    def __init__(self) -> None:
        self.fns: dict[str, tuple[Any, Any]] = {}

    def register_state_dict_fn(self, key: str, load: Any, save: Any) -> None:
        self.fns[key] = (load, save)

    def current_step(self) -> int:
        return 0


def diloco(model: nn.Module, fragments: int, delay: int = 0) -> tuple[DiLoCo, FakeManager]:
    job = config(f"--fault_tolerance.num_fragments={fragments}")
    parts = build_model_fragments(model, job)
    manager = FakeManager()
    outer = functools.partial(OuterSGD, lr=0.7, momentum=0.9, nesterov=True)
    inner = torch.optim.AdamW(model.parameters())
    loop = DiLoCo(cast(Any, manager), parts, inner, outer, period=4 // fragments, delay=delay)
    return loop, manager


def parts(trainer: Any) -> tuple[Any, Any, Any]:
    """What SemiSyncState is built with, from ``as_trainer``'s view of a trainer."""
    return trainer.algorithm, trainer.sync, trainer.lineage


def as_trainer(loop: DiLoCo) -> Any:
    """What SemiSyncState sees of the trainer: its outer loop."""
    return SimpleNamespace(
        algorithm=loop,
        sync=SimpleNamespace(residuals=None, wait=lambda: None),
        lineage=Lineage(),
    )


def _outer_step(loop: DiLoCo) -> None:
    """One outer step of every fragment on a made-up pseudo-gradient."""
    for i in range(len(loop.fragments)):
        numel = sum(t.numel() for t in loop.global_parameters(i).values())
        loop.replay_outer_step(i, torch.full((numel,), 0.01))
        loop.restore_global_copies(i)


def test_semi_sync_state_round_trips_through_dcp_into_a_fresh_process(tmp_path: Path) -> None:
    model = small_model()
    loop, _ = diloco(model, fragments=2)
    _outer_step(loop)
    loop.set_local_step(1)
    saved_globals = [{k: v.clone() for k, v in loop.global_parameters(i).items()} for i in range(2)]
    momentum = [
        [
            loop.outer_optimizer(i).state[t]["momentum_buffer"].clone()
            for t in loop.global_parameters(i).values()
        ]
        for i in range(2)
    ]
    dcp.save({"semi_sync": SemiSyncState(*parts(as_trainer(loop)))}, checkpoint_id=tmp_path)

    # A new process: same model init, an outer optimizer that never stepped (no momentum).
    fresh, _ = diloco(small_model(), fragments=2)
    assert not fresh.outer_optimizer(0).state
    dcp.load({"semi_sync": SemiSyncState(*parts(as_trainer(fresh)))}, checkpoint_id=tmp_path)
    assert fresh.local_step() == 1
    for i in range(2):
        for name, value in fresh.global_parameters(i).items():
            assert torch.equal(value, saved_globals[i][name])
        stepped = fresh.global_parameters(i).values()
        for t, expected in zip(stepped, momentum[i], strict=True):
            assert torch.equal(fresh.outer_optimizer(i).state[t]["momentum_buffer"], expected)


def test_error_feedback_residuals_come_back_with_a_restart(tmp_path: Path) -> None:
    """What each rank's compression still owed is in the checkpoint and owed again after a
    restart, per fragment, committed and staged alike."""
    from torchtitan.experiments.fault_tolerance.transport.residuals import Residuals

    loop, _ = diloco(small_model(), fragments=2)
    numels = [sum(p.numel() for p in f.parameters()) for f in loop.fragments]
    owed = Residuals()
    for i, numel in enumerate(numels):
        owed.load(i, torch.arange(numel, dtype=torch.float32) + 100 * i)
    owed.load(1, torch.full((numels[1],), 0.5), staged=True)
    trainer = as_trainer(loop)
    trainer.sync.residuals = owed
    dcp.save({"semi_sync": SemiSyncState(*parts(trainer))}, checkpoint_id=tmp_path)

    fresh, _ = diloco(small_model(), fragments=2)
    restarted = as_trainer(fresh)
    restarted.sync.residuals = Residuals()
    dcp.load({"semi_sync": SemiSyncState(*parts(restarted))}, checkpoint_id=tmp_path)
    again = restarted.sync.residuals
    for i, numel in enumerate(numels):
        assert torch.equal(again.flat(i, numel), owed.flat(i, numel))
    assert again.has_staged(1) and not again.has_staged(0)
    staged = again.flat(1, numels[1], staged=True)
    assert torch.equal(staged, torch.full((numels[1],), 0.5))


def test_checkpoint_without_outer_momentum_loads_none(tmp_path: Path) -> None:
    loop, _ = diloco(small_model(), fragments=1)
    dcp.save({"s": SemiSyncState(*parts(as_trainer(loop)))}, checkpoint_id=tmp_path)
    fresh, _ = diloco(small_model(), fragments=1)
    dcp.load({"s": SemiSyncState(*parts(as_trainer(fresh)))}, checkpoint_id=tmp_path)
    assert not fresh.outer_optimizer(0).state


def test_a_checkpoint_from_a_longer_period_is_refused_with_the_fields_to_change() -> None:
    """Written with a larger ``sync_steps``: its inner step is past this job's period, where
    no sync would start again. Loading says which fields to keep instead."""
    loop, _ = diloco(small_model(), fragments=1)  # period 4
    saved = SemiSyncState(*parts(as_trainer(loop))).state_dict()
    saved["local_step"] = 5
    with pytest.raises(ValueError, match="inner step 5 .* period of 4 .*sync_steps"):
        SemiSyncState(*parts(as_trainer(loop))).load_state_dict(saved)
    # At the period's length itself a sync point would have reset it to 0: refused too, with
    # the same line, not loaded to fail later.
    saved["local_step"] = 4
    with pytest.raises(ValueError, match="inner step 4 .* period of 4 .*num_fragments"):
        SemiSyncState(*parts(as_trainer(loop))).load_state_dict(saved)
    saved["local_step"] = 3
    SemiSyncState(*parts(as_trainer(loop))).load_state_dict(saved)
    assert loop.local_step() == 3


def test_checkpoint_taken_with_a_sync_in_flight_drops_that_sync() -> None:
    """Streaming with a delay: a checkpoint between a fragment's prepare and its perform
    cannot hold the in-flight all-reduce. Loading it puts that fragment back to its global
    parameters and restarts the period, as torchft does after a failed sync."""
    model = small_model()
    loop, _ = diloco(model, fragments=2, delay=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # inner steps moved the model away from the global copies
    loop.set_local_step(1)
    loop._states[1].works = ["in flight"]  # what a started all-reduce leaves behind
    state = SemiSyncState(*parts(as_trainer(loop)))
    saved = state.state_dict()
    assert saved["in_flight_fragment"] == 1

    loop._states[1].works = []
    state.load_state_dict(saved)
    assert loop.local_step() == 0
    for name, p in loop.fragment_parameters(1).items():
        assert torch.equal(p, loop.global_parameters(1)[name])
    for name, p in loop.fragment_parameters(0).items():
        assert torch.equal(p, loop.global_parameters(0)[name] + 1.0)


def test_healing_state_is_read_when_sent_not_at_start_up() -> None:
    """DiLoCo's healing state (global copies, outer optimizer) is produced when a peer asks,
    so a joiner gets the state of that moment."""
    loop, manager = diloco(small_model(), fragments=1)
    _, save = manager.fns["StreamingDiLoCoFragment_0"]
    before = {k: v.clone() for k, v in save()["original_parameters"].items()}
    _outer_step(loop)
    after = save()["original_parameters"]
    live = loop.global_parameters(0)
    assert all(torch.equal(after[k], live[k]) for k in live)
    assert not all(torch.equal(before[k], after[k]) for k in live)
    assert save()["outer_optimizer"]["state"]  # the momentum of that step


# ---- healing positions, digests and the exchange ----------------------------------------------


def _stub(local_step: int, starting: bool = False) -> SimpleNamespace:
    resets: list[int] = []
    forgot: list[int] = []
    return SimpleNamespace(
        algorithm=SimpleNamespace(
            local_step=lambda: local_step, forget_global=lambda: forgot.append(1), forgot=forgot
        ),
        ft=SimpleNamespace(manager=SimpleNamespace(current_step=lambda: 7)),
        train_state=SimpleNamespace(step=30),
        period=4,
        start_up=StartUp(FRESH) if starting else None,
        sync=SimpleNamespace(
            reset_error_feedback=lambda: resets.append(1),
            resets=resets,
            site=None,
        ),
        lineage=Lineage(),
        heal=SimpleNamespace(
            event_fields=lambda: {"transfer": "full", "bytes_received": 2**20, "full_because": None}
        ),
    )


def peer(local_step: int, replica_id: int = 0, at_sync: int = 1, starting: int = 0) -> dict:
    return {
        "local_step": local_step,
        "at_sync": at_sync,
        "starting": starting,
        "replica_id": replica_id,
        "lineage_last_shared_sync": 6,
        "lineage_solo_syncs": 2,
        "lineage_solo_since": 1234.5,
    }


def test_a_running_group_heals_at_its_peer_s_position(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    logger = logging.getLogger("torchtitan")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="torchtitan")
    stub = _stub(4)
    try:
        QuorumProtocol.load_peer(stub, peer(4))  # type: ignore[arg-type]
    finally:
        logger.removeHandler(caplog.handler)
    healed = [e for e in map(event_of, caplog.records) if e is not None and e.name == HEALED.name]
    assert healed, caplog.text  # (caplog may see a record twice: through root and here)
    assert (healed[0]["peer"], healed[0].sync, healed[0].step) == (0, 8, 31)
    assert (healed[0]["inner_step"], healed[0]["case"]) == (4, "running")
    assert stub.algorithm.forgot == [1]  # the digest of parameters it no longer holds
    assert stub.sync.resets == [1]  # what its compression owed was for state it no longer has
    # Its model is the peer's from now on, and so is its lineage.
    assert stub.lineage == Lineage(last_shared_sync=6, solo_syncs=2, solo_since=1234.5)


def test_a_sync_quorum_says_whether_this_group_healed_in_it() -> None:
    """torchft loads a peer's state into this group (``load_peer`` among it) in the first of
    two sync quorums: the first says the group healed, the second not (a heal belongs to the
    quorum it happened in, not to every one after it)."""
    stub = _stub(4)
    heals = [True, False]

    def settle(rounds: Any) -> None:
        if heals.pop(0):
            QuorumProtocol.load_peer(cast(Any, stub), peer(4))

    stub.exchange = SimpleNamespace(settle=settle)
    stub.sync.sync_rounds = contextlib.nullcontext
    assert QuorumProtocol.sync_quorum(cast(Any, stub)) is True
    assert QuorumProtocol.sync_quorum(cast(Any, stub)) is False


def test_a_running_group_healed_at_another_position_stops() -> None:
    with pytest.raises(FaultToleranceError, match="inner step 3 of its sync period"):
        QuorumProtocol.load_peer(_stub(4), peer(3, replica_id=1))  # type: ignore[arg-type]
    with pytest.raises(FaultToleranceError, match="starting up"):
        QuorumProtocol.load_peer(_stub(4), peer(4, starting=1))  # type: ignore[arg-type]


def test_a_starting_group_takes_its_peer_s_position() -> None:
    stub = _stub(0, starting=True)
    QuorumProtocol.load_peer(stub, peer(3, replica_id=1))  # type: ignore[arg-type]
    assert stub.start_up.peer == peer(3, replica_id=1)


def test_digests_agree_or_name_a_majority() -> None:
    same = [Member(RUNNING, has_digest=1, digest=5) for _ in range(3)]
    assert compare_digests(same).agree
    odd = [*same[:2], Member(RUNNING, has_digest=1, digest=-9)]
    verdict = compare_digests(odd)
    assert not verdict.agree and verdict.majority == 5
    two = [Member(RUNNING, has_digest=1, digest=5), Member(FRESH, has_digest=1, digest=6)]
    assert compare_digests(two).majority is None  # two groups: nobody to believe
    # Members without a digest are not compared.
    assert compare_digests([Member(RUNNING), *two[:1]]).agree


class SummingManager:
    """One member's view of a SUM all-reduce with other members whose rows are known (its
    replica process group adds theirs, done at once, as gloo's)."""

    def __init__(self, rank: int, others: dict[int, Member]) -> None:
        self.rank, self.others = rank, others
        self._pg = SimpleNamespace(allreduce=self._allreduce)

    def num_participants(self) -> int:
        return len(self.others) + 1

    def participating_rank(self) -> int:
        return self.rank

    def is_participating(self) -> bool:
        return True

    def wait_quorum(self) -> None:
        pass

    def _allreduce(self, tensors: list[torch.Tensor], options: Any) -> Any:
        (buffer,) = tensors
        width = buffer.numel() // self.num_participants()
        for rank, member in self.others.items():
            row = torch.tensor(astuple(member), dtype=torch.int64)
            buffer[rank * width : (rank + 1) * width] += row
        return SimpleNamespace(wait=lambda: True, is_completed=lambda: True, exception=lambda: None)

    def errored(self) -> None:
        return None


def test_exchange_gathers_every_member_in_quorum_order() -> None:
    others = {0: Member(RUNNING, has_digest=1, digest=-(2**63)), 2: Member(RESUMED, 1, 7)}
    mine = Member(FRESH, joined=1, attempts=3, has_digest=1, digest=2**63 - 1)
    got = exchange(SummingManager(1, others), mine, torch.device("cpu"))
    assert got == [others[0], mine, others[2]]


def test_pseudo_gradient_norm_is_the_norm_of_the_outer_gradients() -> None:
    averages = [torch.tensor([3.0, 0.0, 0.0]), torch.tensor([[0.0, 4.0], [0.0, 0.0]])]
    method = SimpleNamespace(_states=[SimpleNamespace(model_device=torch.device("cpu"))])
    GlobalCopyMethod.measure_outer_step(method, averages)  # type: ignore[arg-type]
    squares = GlobalCopyMethod.take_stepped_squares(method)  # type: ignore[arg-type]
    assert GlobalCopyMethod.take_stepped_squares(method) is None  # type: ignore[arg-type]  # taken once
    stub = SimpleNamespace(device=torch.device("cpu"), group_ranks=1)
    assert SyncReporter._pseudo_grad_norm(stub, squares) == pytest.approx(5.0)  # type: ignore[arg-type]
    assert SyncReporter._pseudo_grad_norm(stub, None) is None  # type: ignore[arg-type]


def test_device_digest_sees_one_changed_element_and_not_the_device_order() -> None:
    tensors = [torch.randn(3000), torch.randn(5, 7).bfloat16(), torch.randn(2**20 + 5)]
    digest = device_digest(tensors)
    assert -(2**63) <= digest < 2**63
    assert device_digest([t.clone() for t in tensors]) == digest
    changed = [t.clone() for t in tensors]
    changed[2][2**20 + 1] += 1e-3  # in the second chunk of the big tensor
    assert device_digest(changed) != digest
    assert device_digest(tensors[::-1]) != digest  # order matters


# ---- the emulated straggler -------------------------------------------------------------------


@pytest.mark.parametrize("slowdown, passes", [(1.0, [4]), (2.0, [4, 4]), (2.5, [4, 2, 4])])
def test_emulated_slowdown_computes_more_and_leaves_the_gradients_alone(
    slowdown: float, passes: list[int]
) -> None:
    """``emulate_slowdown`` runs extra forward and backward passes (real compute: whole
    batches, then a fraction of one) before the step's own; the gradients the step applies are
    bit for bit those of a normal step."""
    from torchtitan.components.loss import build_cross_entropy_loss

    job = config(f"--training.emulate_slowdown={slowdown}")
    model = small_model()
    reference = small_model()
    trainer = SemiSyncTrainer.__new__(SemiSyncTrainer)  # only what forward_backward uses
    # (the core trainer's: the straggler runs the same with and without fault tolerance)
    trainer.job_config = job
    trainer.model = model
    trainer.loss_fn = build_cross_entropy_loss(job)
    trainer.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer.autocast_dtype = None  # float32
    seen: list[int] = []
    model.register_forward_pre_hook(lambda _, inputs: seen.append(inputs[0].shape[0]))
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    loss = trainer.forward_backward(inputs, labels)
    assert seen == passes
    trainer.model = reference
    expected = Trainer._forward_backward_once(trainer, inputs, labels)  # a normal step's
    assert torch.equal(loss, expected)
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, r.grad)


class _Disagreeing:
    """What ``QuorumExchange._act_on_disagreement`` and ``_take_one_initial_model`` use of the
    trainer: its Manager (at sync #4), where it announces the step it steps back to, and where
    it says that its next heal is a full one."""

    def __init__(self) -> None:
        self.errors: list[Exception] = []
        self.announced: list[int] = []
        self.full_because: list[str] = []
        manager = SimpleNamespace(current_step=lambda: 3, report_error=self.errors.append)
        self.ft = SimpleNamespace(manager=manager)
        self.train_state = SimpleNamespace(step=0)
        self.heal = SimpleNamespace(expect_full=self.full_because.append)

    def set_manager_step(self, step: int) -> None:
        self.announced.append(step)


def _holding(digests: list[int], role: int = RUNNING, hosts: list[Host] | None = None) -> list:
    """Members with replica ids 0, 1, ... holding ``digests``, on this host or ``hosts``."""
    members = []
    for replica, digest in enumerate(digests):
        member = Member(role, has_digest=1, digest=digest, replica=replica)
        member.give_host(hosts[replica] if hosts else Host.this())
        members.append(member)
    return members


@pytest.mark.parametrize("minority", [True, False])
def test_after_a_disagreement_only_the_minority_steps_back(
    minority: bool, events: list[Any]
) -> None:
    """Three groups, one differs: nobody commits the sync; the group that differs from the
    majority steps its Manager back one sync (so torchft heals it from a majority group),
    and says so; a majority group stays where it is and says that the minority is elsewhere."""
    trainer = _Disagreeing()
    act = QuorumExchange._act_on_disagreement
    act(cast(Any, trainer), _holding([7, 7, 9]), no_majority=False, minority=minority)
    assert len(trainer.errors) == 1  # the sync is not committed, by any group
    names = [e.name for e in events]
    if minority:
        assert trainer.announced == [2] and "semi_sync.differs_from_majority" in names
    else:
        assert trainer.announced == [] and "semi_sync.minority_elsewhere" in names
    assert {e.sync for e in events if e.name.startswith("semi_sync.")} == {4}
    (said,) = [e for e in events if e.name.startswith("semi_sync.")]
    assert said["digests"] == [f"{7:016x}", f"{9:016x}"]
    assert said["groups"][2] == f"replica group 2: {9:016x} ({Host.this()})"


def test_without_a_majority_every_group_stops_naming_each_groups_host() -> None:
    """Two groups, two digests: the error line gives each group's digest beside its machine,
    torch version and CPU kernels, so a user can tell hardware from a bug."""
    hosts = [Host("x86_64", "2.13.0", "AVX512"), Host("aarch64", "2.13.0", "DEFAULT")]
    members = _holding([7, -9], hosts=hosts)
    with pytest.raises(FaultToleranceError, match="no majority") as raised:
        act = QuorumExchange._act_on_disagreement
        act(cast(Any, _Disagreeing()), members, no_majority=True, minority=False)
    message = str(raised.value)
    assert f"replica group 0: {7:016x} (x86_64, torch 2.13.0, AVX512 kernels)" in message
    assert f"replica group 1: {-9 & (2**64 - 1):016x} (aarch64, torch 2.13.0, DEFAULT kernels)" in (
        message
    )


@pytest.mark.parametrize("differs", [True, False])
def test_a_new_job_takes_the_first_groups_initial_model_instead_of_stopping(
    differs: bool, events: list[Any]
) -> None:
    """A new job's groups (all fresh) whose initial models differ (no majority: two hosts'
    kernels): nobody uses the quorum and nobody stops; the group whose model differs from
    replica group 0's steps back (torchft then heals it from group 0 at the next quorum) and
    its next heal is a full one that says why; group 0 stays."""
    trainer = _Disagreeing()
    start_up = StartUp(FRESH)
    members = _holding([5, 6], role=FRESH)
    take = QuorumExchange._take_one_initial_model
    take(cast(Any, trainer), members, start_up, differs)
    assert len(trainer.errors) == 1
    (said,) = [e for e in events if e.name == "semi_sync.initial_models_differ"]
    assert said["source"] == 0 and said["takes_it"] is differs and len(said["groups"]) == 2
    if differs:
        assert trainer.announced == [2] and start_up.initial_model_from == 0
        assert "replica group 0's" in trainer.full_because[0]
    else:
        assert trainer.announced == [] and start_up.initial_model_from is None
        assert not trainer.full_because


def test_initial_models_that_still_differ_after_the_heals_stop_the_job() -> None:
    """A group that took the source's model holds its bits: models that still differ after
    the rounds a heal needs, among the same groups, are no host's draw: every group stops,
    naming them. A round with other members (a group restarted, drawing anew) starts the
    count again."""
    trainer, start_up = _Disagreeing(), StartUp(FRESH)
    members = _holding([5, 6], role=FRESH)
    take = QuorumExchange._take_one_initial_model
    for _ in range(MAX_INITIAL_MODEL_ROUNDS):
        take(cast(Any, trainer), members, start_up, True)
    restarted = _holding([5, 7], role=FRESH)
    restarted[1].heartbeat = 99  # group 1's new start
    for _ in range(MAX_INITIAL_MODEL_ROUNDS):
        take(cast(Any, trainer), restarted, start_up, True)
    with pytest.raises(FaultToleranceError, match="initial models still differ after 3") as e:
        take(cast(Any, trainer), restarted, start_up, True)
    assert f"replica group 1: {7:016x}" in str(e.value) and "training.seed" in str(e.value)


def test_a_new_job_starts_from_the_model_of_the_commonest_host(events: list[Any]) -> None:
    """Group 0 on one kind of host, groups 1 and 2 on another: the source is group 1 (the
    commonest host's lowest replica id: one full heal, not two); with one group per kind,
    the lowest replica id. A group that differs on the source's own kind of host is named:
    its difference is not the kernels'."""
    arm, x86 = Host("aarch64", "2.13.0", "DEFAULT"), Host("x86_64", "2.13.0", "AVX512")
    members = _holding([5, 6, 6], role=FRESH, hosts=[arm, x86, x86])
    assert initial_model_source(members).replica == 1
    assert initial_model_source(members[:2]).replica == 0
    same = _holding([5, 6, 7], role=FRESH, hosts=[arm, x86, x86])
    QuorumExchange._take_one_initial_model(cast(Any, _Disagreeing()), same, StartUp(FRESH), True)
    (said,) = [e for e in events if e.name == "semi_sync.initial_models_differ"]
    assert said["source"] == 1 and said["same_host"] == [2]
    line = events_module.INITIAL_MODELS_DIFFER.render({**said.fields, "step": 0})
    assert "Replica group(s) 2 run the same kind of host as the source" in line


def test_a_group_whose_checkpoints_were_all_rejected_starts_as_a_restarted_one() -> None:
    """Its own state is lost (every checkpoint failed its checksums), so it asks for its first
    quorum as a restarted group, never as a new job's (whose initial model another group
    could take from it, or it from another): with no group to heal from it stops."""
    roles: list[int] = []
    manager = SimpleNamespace(current_step=lambda: 0, errored=lambda: None)
    stub = SimpleNamespace(
        job_config=config(),
        ft=SimpleNamespace(manager=manager, quorum_rounds=lambda **_: contextlib.nullcontext()),
        train_state=SimpleNamespace(step=0),
        algorithm=SimpleNamespace(note_joined=lambda: None),
        exchange=SimpleNamespace(
            set_manager_step=lambda step: None, settle=lambda rounds, up: roles.append(up.role)
        ),
        sync=SimpleNamespace(begin_sync=lambda: None),
        heal=SimpleNamespace(own_state_lost=""),
        rank=RankInGroup(torch.device("cpu")),
        start_up=None,
    )
    with pytest.raises(FaultToleranceError, match="no checkpoint of this group passed"):
        QuorumProtocol.start(cast(Any, stub), heal_in_full="step-8: a checksum failed")
    assert roles == [RESUMED]


def test_a_group_healed_at_the_others_sync_point_reports_its_wait_for_them() -> None:
    """A group that heals from a running group at its sync point joins that sync without a
    sync quorum of its own: the sync's report gives its wait for the others (its start-up
    quorum), not a sync quorum's."""
    manager = SimpleNamespace(current_step=lambda: 4, errored=lambda: None)
    waits: list[float] = []

    def settle(rounds: Any, start_up: StartUp) -> None:
        start_up.peer = peer(local_step=0, replica_id=1, at_sync=1)

    stub = SimpleNamespace(
        job_config=config(),
        ft=SimpleNamespace(manager=manager, quorum_rounds=lambda **_: contextlib.nullcontext()),
        train_state=SimpleNamespace(step=8),
        algorithm=SimpleNamespace(note_joined=lambda: None),
        exchange=SimpleNamespace(set_manager_step=lambda step: None, settle=settle),
        sync=SimpleNamespace(begin_sync=lambda: None, joined_sync=waits.append),
        heal=SimpleNamespace(own_state_lost=""),
        rank=RankInGroup(torch.device("cpu")),
        start_up=None,
    )
    joined = QuorumProtocol.start(cast(Any, stub))
    assert joined is not None and joined.peer == 1
    assert waits == [joined.waited_s]


def test_the_host_travels_in_the_member_record() -> None:
    """Machine, torch release and kernels survive the int64 exchange (a local version
    suffix is dropped); a record without them (a speed probe's) has no host."""
    for host in [Host.this(), Host("aarch64", "2.15.1", "SVE256"), Host("x86_64", "3.0.0", "")]:
        member = Member(RUNNING)
        member.give_host(host)
        row = torch.tensor(astuple(member), dtype=torch.int64).tolist()
        assert Member(*row).host() == host
    assert Member(RUNNING).host() is None
    assert re.fullmatch(r"\d+\.\d+\.\d+", Host.this().torch)
    assert Host.this().kernels == torch.backends.cpu.get_cpu_capability()


def test_groups_on_other_torch_minor_versions_are_told_once_per_mix(events: list[Any]) -> None:
    exchange = SimpleNamespace(_versions_told=())
    tell = QuorumExchange._tell_torch_versions
    same = _holding([1, 1], hosts=[Host("x86_64", "2.13.0", "AVX2"), Host("x", "2.13.1", "AVX2")])
    tell(cast(Any, exchange), same)  # another patch release: nothing to say
    other = _holding([1, 1], hosts=[Host("x86_64", "2.13.0", "AVX2"), Host("x", "2.14.0", "X")])
    tell(cast(Any, exchange), other)
    tell(cast(Any, exchange), other)
    (said,) = [e for e in events if e.name == "semi_sync.torch_versions_differ"]
    assert said["groups"] == ["replica group 0: torch 2.13.0", "replica group 1: torch 2.14.0"]


class _DyLUGroup:
    """What DyLU's schedule and end-of-training checks use: a group that takes 2 inner steps
    per period where the job's period is 4, in its second period (one sync point passed)."""

    dynamic = True
    period = 4

    def __init__(self, local_step: int, done: bool) -> None:
        self.algorithm = SimpleNamespace(
            local_step=lambda: local_step, steps_this_period=lambda: 2, sync_points=1
        )
        self._done = done
        model = nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: step + 1)
        self.job_config = SimpleNamespace(training=SimpleNamespace(steps=8))

    def training_done(self) -> bool:
        return self._done


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step()`")
def test_dylu_moves_the_learning_rate_to_the_jobs_progress_not_the_groups_steps() -> None:
    """Halfway through its second period (1 of 2 inner steps), a DyLU group that takes half
    the job's period is at job step 4 + 2 = 6 of the schedule: the LR of 6 steps taken, not
    of the one step its own counter would give."""
    group = _DyLUGroup(local_step=1, done=False)
    SemiSyncTrainer.advance_schedule(cast(Any, group))
    assert group.lr_scheduler.get_last_lr() == [7.0]  # lambda(6) = 7: six steps taken


@pytest.mark.parametrize(("local_step", "done", "last"), [(0, True, True), (1, True, False),
                                                          (0, False, False)])  # fmt: skip
def test_dylu_training_ends_at_the_planned_sync_point(
    local_step: int, done: bool, last: bool
) -> None:
    """Training ends once the planned sync points are done and the period is whole: at the
    sync point, not one step into the next period (nor earlier)."""
    group = _DyLUGroup(local_step=local_step, done=done)
    assert SemiSyncTrainer._last_step_taken(cast(Any, group), step=5) is last


def test_localsgd_knows_its_global_digest_only_at_a_period_start_and_forgets_it_on_a_heal() -> None:
    """LocalSGD's global parameters are the model's right after a sync: the agreement digest is
    taken then (and when the group joins at a period's start), and is unknown after a heal
    until the next commit."""
    model = small_model()
    loop = LocalSGD(FakeManager(), model, torch.optim.SGD(model.parameters()), 4)
    assert loop.agreement_digest() is None
    loop.note_joined()  # inner step 0: the model is the last average
    at_start = loop.agreement_digest()
    assert at_start == device_digest(model.parameters())
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # a local step: not the global parameters
    assert loop.agreement_digest() == at_start
    loop.forget_global()
    assert loop.agreement_digest() is None
    loop.note_committed()
    assert loop.agreement_digest() == device_digest(model.parameters()) != at_start
    loop.set_local_step(2)
    loop.forget_global()
    loop.note_joined()  # mid-period: the model is not the global parameters
    assert loop.agreement_digest() is None


def test_quorum_findings_travel_as_ints_and_come_back_named() -> None:
    """The group's ranks take the MAX of each finding (one all-reduce of ints): each field
    comes back under its name."""
    found = QuorumFindings(failed=False, disagree=True, no_majority=False, minority=True,
                           planned_steps=7)  # fmt: skip
    assert found.as_ints() == [0, 1, 0, 1, 7, 0, 0, 0, 0, 0]
    assert QuorumFindings.from_ints(found.as_ints()) == found
    other = QuorumFindings(True, False, False, False, 9)
    merged = [max(a, b) for a, b in zip(found.as_ints(), other.as_ints(), strict=True)]
    assert QuorumFindings.from_ints(merged) == QuorumFindings(True, True, False, True, 9)
    healed = QuorumFindings(False, False, False, False, 0, replayed=True)
    full = QuorumFindings(False, False, False, False, 0, healed_in_full=True)
    both = [max(a, b) for a, b in zip(healed.as_ints(), full.as_ints(), strict=True)]
    assert QuorumFindings.from_ints(both).replayed and QuorumFindings.from_ints(both).healed_in_full
    differs = QuorumFindings(False, True, True, False, 0, differs_from_first=True)
    assert QuorumFindings.from_ints(differs.as_ints()) == differs


def test_every_method_implements_its_whole_interface() -> None:
    """OuterLoop and GlobalCopyMethod are abstract; each method is concrete (no stub left to
    raise at run time), and only the methods with global copies are GlobalCopyMethods."""
    import inspect

    from torchtitan.experiments.fault_tolerance.methods.async_diloco import AsyncDiLoCo
    from torchtitan.experiments.fault_tolerance.methods.global_copy import GlobalCopyMethod
    from torchtitan.experiments.fault_tolerance.methods.outer_loop import OuterLoop

    assert inspect.isabstract(OuterLoop) and inspect.isabstract(GlobalCopyMethod)
    for cls in (LocalSGD, DiLoCo, AsyncDiLoCo):
        assert not inspect.isabstract(cls), (cls, cls.__abstractmethods__)
    assert issubclass(DiLoCo, GlobalCopyMethod) and issubclass(AsyncDiLoCo, GlobalCopyMethod)
    assert not issubclass(LocalSGD, GlobalCopyMethod)


def test_a_mismatch_of_the_collectives_shapes_names_both_groups_and_the_field() -> None:
    """What fixes a sync's collectives (ranks, fragments, shards, buckets, dtype) is compared
    field by field; the first difference names both groups' values and the field to change."""
    from torchtitan.experiments.fault_tolerance.transport.shapes import CollectiveShape, mismatch

    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    mine = CollectiveShape.of([model], 1, 300, "int8")
    assert mine.shard_values == 8 * 4 + 4 + 4 * 2 + 2
    assert mismatch([("replica group 0", mine), ("replica group 1", mine)], mine) == ""
    cases = {
        "NGPU": dataclasses.replace(mine, ranks=2, shard_values=mine.shard_values // 2),
        "fault_tolerance.pseudo_grad_dtype": CollectiveShape.of([model], 1, 300, "int4"),
        "fault_tolerance.sync_bucket_mb": CollectiveShape.of([model], 1, 600, "int8"),
        "fault_tolerance.num_fragments": CollectiveShape.of(list(model), 1, 300, "int8"),
        "model.flavor": CollectiveShape.of([torch.nn.Linear(8, 6)], 1, 300, "int8"),
    }
    for field, other in cases.items():
        found = mismatch([("replica group 0", mine), ("replica group 3", other)], mine)
        assert found.startswith("the collectives of replica group 3 cannot pair"), found
        assert field in found, (field, found)
        assert other.describe() in found and mine.describe() in found
        assert CollectiveShape.from_text(other.to_text()) == other


SPARSE = [
    "--fault_tolerance.pseudo_grad_dtype=sparse",
    "--fault_tolerance.error_feedback",
    "--fault_tolerance.outer_momentum=0",
]


@pytest.mark.parametrize(
    ("field", "value"), [("sparse_value_bits", 3), ("sparse_chunk", 2048), ("sparse_keep", 32)]
)
def test_groups_whose_sparse_settings_differ_are_refused_before_any_collective(
    field: str, value: int
) -> None:
    """Sparse pseudo-gradients in both groups, one setting apart: their encodings differ in
    size and meaning, so the shapes the trainer compares in every quorum differ, and the line
    names the dtype and the sparse fields."""
    from torchtitan.experiments.fault_tolerance.job_config import semi_sync_config
    from torchtitan.experiments.fault_tolerance.methods.build import wire_dtype
    from torchtitan.experiments.fault_tolerance.transport.shapes import CollectiveShape, mismatch

    model = small_model()

    def shape(*argv: str) -> CollectiveShape:
        return CollectiveShape.of([model], 1, 300, wire_dtype(semi_sync_config(config(*argv))))

    mine, other = shape(*SPARSE), shape(*SPARSE, f"--fault_tolerance.{field}={value}")
    assert mismatch([("replica group 0", mine)], mine) == ""
    found = mismatch([("replica group 1", other)], mine)
    assert "fault_tolerance.pseudo_grad_dtype (and the sparse_* fields)" in found, found


def test_groups_that_cut_the_model_into_other_fragments_are_refused() -> None:
    """The same three layers in two fragments each, cut after the first layer in one group and
    after the second in the other: as many fragments, the same values on the rank, the same
    buckets and dtype, yet the fragments' transfers would pair different tensors."""
    from torchtitan.experiments.fault_tolerance.transport.shapes import CollectiveShape, mismatch

    layers = [nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)]
    mine = CollectiveShape.of(
        [nn.ModuleList(layers[:1]), nn.ModuleList(layers[1:])], 1, 300, "int8"
    )
    other = CollectiveShape.of(
        [nn.ModuleList(layers[:2]), nn.ModuleList(layers[2:])], 1, 300, "int8"
    )
    assert (mine.fragments, mine.shard_values) == (other.fragments, other.shard_values)
    found = mismatch([("replica group 1", other)], mine)
    assert found.startswith("the collectives of replica group 1 cannot pair"), found
    assert "module_fqns_per_model_fragment" in found


def test_a_delayed_syncs_time_adds_the_step_that_starts_it_to_the_step_that_applies_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Streaming DiLoCo with fragment_sync_delay 1: the sync's hook takes 3 s at the step that
    starts it (its quorum, handing over its pseudo-gradient) and 0.5 s at the step that applies
    it; the inner step between takes 10 s. The sync line's time is 3.5 s: both hooks, not the
    applying step's alone, and not the inner compute."""
    from torchtitan.experiments.fault_tolerance.report import sync_reporter as reporting

    now = [100.0]
    monkeypatch.setattr(reporting, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    position = {"local_step": 3, "starts": True}
    loop = SimpleNamespace(
        local_step=lambda: position["local_step"], starts_sync_here=lambda: position["starts"]
    )
    reported: list[float] = []
    reporter = SyncReporter.__new__(SyncReporter)
    reporter.loop, reporter.sync = (
        cast(Any, loop),
        cast(Any, SimpleNamespace(transport=SimpleNamespace(flush=lambda: None))),
    )
    reporter.new_sync()
    reporter.report = lambda step: reported.append(reporter.seconds)  # type: ignore[method-assign]
    reporter.start_clock()  # inner step 3 of 4: the sync starts in its hook
    now[0] += 3.0
    reporter.after_inner_step(7)
    assert reported == []
    now[0] += 10.0  # inner step 4's compute
    reporter.start_clock()
    position.update(local_step=0, starts=False)  # the sync point: the sync is applied
    now[0] += 0.5
    reporter.after_inner_step(8)
    assert reported == [pytest.approx(3.5)]
    assert reporter.seconds == 0.0  # the next sync starts from nothing


def test_a_digest_taken_piece_by_piece_equals_the_one_pass_digest_past_a_chunk() -> None:
    """A parameter of 2^21 + 7 fp32 values (its bytes span two digest chunks of 2^20 words)
    hashed in the passes' pieces, in any order, gives the chunk hashes of one pass over it."""
    from torchtitan.experiments.fault_tolerance.methods.piece_workers import PASS_PIECE_VALUES
    from torchtitan.tools.digest import PieceHashes, chunk_hashes

    t = torch.randn(2**21 + 7, generator=torch.Generator().manual_seed(4))
    hashes = PieceHashes(t.numel(), 4, torch.device("cpu"))
    starts = list(range(0, t.numel(), PASS_PIECE_VALUES))
    for start in reversed(starts):
        hashes.add(start, t[start : start + PASS_PIECE_VALUES])
    assert hashes.hashes == chunk_hashes(t) and len(hashes.hashes) == 2


class RecordingManager(FakeManager):
    """A Manager whose all-reduces keep what they were handed, arrive at once and never
    commit."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[torch.Tensor] = []

    @contextlib.contextmanager
    def sync_rounds(self) -> Iterator[Any]:
        yield SimpleNamespace(form=lambda: 2)

    def allreduce(self, tensor: torch.Tensor) -> Any:
        self.sent.append(tensor)
        return SimpleNamespace(wait=lambda: None)

    def decide(self) -> SyncDecision:
        return SyncDecision(False, 1, 2, 0, None, None, [])

    def allow_state_dict_read(self) -> None:
        pass

    def disallow_state_dict_read(self) -> None:
        pass


@pytest.mark.parametrize("delay", [0, 1])
def test_diloco_hands_the_transport_its_own_tensors_never_the_models(delay: int) -> None:
    """A transfer abandoned with a failed sync may still write into what it carried: the
    pseudo-gradients DiLoCo all-reduces never share storage with the model, and a failed sync
    leaves the model at the global copy."""
    model = small_model()
    manager = RecordingManager()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = functools.partial(OuterSGD, lr=0.7)
    loop = DiLoCo(cast(Any, manager), [model], inner, outer, period=2, delay=delay)
    start = [p.detach().clone() for p in model.parameters()]
    with loop.hooks(OpenQuorums(manager)):
        for _ in range(2):
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            inner.step()
    owned = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(manager.sent) == len(start)
    assert not {t.untyped_storage().data_ptr() for t in manager.sent} & owned
    for p, before in zip(model.parameters(), start, strict=True):
        assert torch.equal(p, before)  # the failed sync dropped the period


def test_a_rank_decides_what_the_most_of_its_groups_ranks_say() -> None:
    """A sync quorum's decisions in a group of several ranks (a transfer that timed out on
    one rank, DyLU's plan) take the most over the group's ranks, not this rank's alone."""
    others_say = [1]
    rank = SimpleNamespace(most=lambda values: [max(values[0], *others_say)])
    assert SyncQuorum.agree_in_group(cast(Any, SimpleNamespace(rank=rank)), 0) == 1
    others_say[0] = 0
    assert SyncQuorum.agree_in_group(cast(Any, SimpleNamespace(rank=rank)), 0) == 0
    assert SyncQuorum.agree_in_group(cast(Any, SimpleNamespace(rank=None)), 3) == 3
