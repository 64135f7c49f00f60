"""The heal history (``heal.history``): what a peer keeps of each committed sync, when it can
serve a joiner, and that a replay of it gives the joiner the peers' global copies and outer
momentum bit for bit.

The replay test runs real replica groups (threads over a real gloo process group, as in
``test_sync_averaging``) through torchft's DiLoCo and our transport, with buckets smaller than
the largest tensor (so it travels in pieces), for every pseudo-gradient dtype.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.unit_tests.gloo_groups import LoopbackManager, OpenQuorums, run_groups, sync_manager
from tests.unit_tests.toy_task import (
    BUCKET,
    build_method,
    fragment_count,
    inner_step,
    make_model,
)
from torchtitan.experiments.fault_tolerance.heal.history import (
    BASIS_SLOTS,
    HealHistory,
    HistoryEntry,
    ReplayBasis,
    job_fingerprint,
    plan_replay,
    replay,
)
from torchtitan.experiments.fault_tolerance.job_config import PSEUDO_GRAD_DTYPES
from torchtitan.experiments.fault_tolerance.transport.codecs import (
    get_codec,
)
from torchtitan.experiments.fault_tolerance.transport.collective import (
    Delivered,
    chunk_numel,
)
from torchtitan.tools.digest import device_digest

SYNCS = 4
#: The joiner's checkpoint: right after this sync.
CHECKPOINT_SYNC = 1


def build_loop(
    method: str,
    sync: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    history: HealHistory | None = None,
) -> Any:
    """The method with a Nesterov outer optimizer (its momentum is part of what a replay must
    reproduce); ``async_delayed_nesterov``: Delayed Nesterov, momentum every 2 outer steps."""
    every = 2 if method.endswith("_nesterov") else 1
    return build_method(method.removesuffix("_nesterov"), sync, model, optimizer, outer_lr=0.7,
                        outer_momentum=0.9, outer_momentum_every=every,
                        history=history)  # fmt: skip


def outer_state(loop: Any) -> list[dict[str, Any]]:
    """Each fragment's global copy and outer optimizer state, copied."""
    return [
        {
            "global": {k: v.clone() for k, v in loop.global_parameters(i).items()},
            "outer": copy.deepcopy(loop.outer_optimizer(i).state_dict()),
        }
        for i in range(len(loop.fragments))
    ]


def train_with_history(rank: int, pg: Any, method: str, dtype: str, groups: int) -> dict[str, Any]:
    """One group: ``SYNCS`` committed syncs, each kept in a heal history as the trainer keeps
    it; its outer state right after sync ``CHECKPOINT_SYNC`` (a checkpoint) and at the end."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    manager = LoopbackManager(pg, rank, groups)
    loop: Any = None
    sync = sync_manager(
        manager, dtype, bucket_numel=BUCKET, fragments=fragment_count(method), keep_delivered=True
    )
    history = HealHistory(SYNCS)
    loop = build_loop(method, sync, model, optimizer, history=history)
    data = torch.Generator().manual_seed(100 + rank)
    snapshot: list[dict[str, Any]] | None = None
    try:
        with loop.hooks(OpenQuorums(sync)):
            while manager.current_step() < SYNCS:
                inner_step(model, optimizer, data, lambda x: torch.sin(x[:, :1] * (rank + 1)))
                if manager.current_step() == CHECKPOINT_SYNC and snapshot is None:
                    snapshot = outer_state(loop)
    finally:
        sync.transport.shutdown()
    return {"history": history, "snapshot": snapshot, "final": outer_state(loop)}


def tensors_of(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for k in sorted(value, key=str) for t in tensors_of(value[k])]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_of(v)]
    return []


def assert_bitwise_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    for name, value in a["global"].items():
        assert torch.equal(value.view(torch.int32), b["global"][name].view(torch.int32)), name
    mine, theirs = tensors_of(a["outer"]["state"]), tensors_of(b["outer"]["state"])
    assert len(mine) == len(theirs) and mine, "no outer state to compare"
    for x, y in zip(mine, theirs, strict=True):
        assert x.dtype == y.dtype and torch.equal(
            x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)
        )


CASES = [
    (method, dtype, 2)
    for method in ("diloco", "streaming_diloco", "streaming_diloco_delayed", "async_eager")
    for dtype in PSEUDO_GRAD_DTYPES
]
CASES += [
    ("diloco", "int4", 3),
    ("async_delayed", "int8", 2),
    ("async_eager_share", "float32", 3),
    ("async_delayed_nesterov", "int4", 2),
    ("async_eager_streaming", "int4", 2),
]


@pytest.mark.parametrize(("method", "dtype", "groups"), CASES)
def test_a_replay_of_the_missed_syncs_gives_the_peers_outer_state_bit_for_bit(
    method: str, dtype: str, groups: int
) -> None:
    """A joiner that holds group 0's outer state of sync #1 (its checkpoint) and replays
    group 0's history entries #2..#4 ends with group 0's global copies and outer optimizer
    state, bit for bit: every dtype, 1 or 2 fragments, a delay, async DiLoCo (token-weighted
    averages, Delayed Nesterov), 3 groups."""
    results = run_groups(
        groups, lambda rank, pg: train_with_history(rank, pg, method, dtype, groups)
    )
    peer = results[0]
    history: HealHistory = peer["history"]
    entries = history.after(CHECKPOINT_SYNC)
    count = len(peer["final"])
    assert [e.sync for e in entries] == list(range(CHECKPOINT_SYNC + 1, SYNCS + 1))
    assert all(e.fragment == (e.sync - 1) % count for e in entries)
    # Every group applied the same averages: their finals agree, and each one's history holds
    # the same bytes.
    for other in results[1:]:
        for i in range(count):
            assert_bitwise_equal(other["final"][i], peer["final"][i])
        assert [e.checksum for e in other["history"].after(0)] == [
            e.checksum for e in history.after(0)
        ]

    # The joiner: a fresh model whose global copies and outer state are the checkpoint's.
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    manager = LoopbackManager(None, 0, groups)  # type: ignore[arg-type]  # no collective here
    loop: Any = None
    sync = sync_manager(manager, dtype, fragments=fragment_count(method))
    loop = build_loop(method, sync, model, optimizer)
    try:
        for i, saved in enumerate(peer["snapshot"]):
            for name, value in saved["global"].items():
                loop.global_parameters(i)[name].copy_(value)
            loop.outer_optimizer(i).load_state_dict(copy.deepcopy(saved["outer"]))
        # The peer's plan for this joiner: exactly the missed entries.
        digests = [device_digest(loop.global_parameters(i).values()) for i in range(count)]
        basis = ReplayBasis(CHECKPOINT_SYNC, 7, tuple(digests))
        current = [device_digest(peer["final"][i]["global"].values()) for i in range(count)]
        plan = plan_replay(history, basis, SYNCS, 7, lambda: current)
        assert plan.why_full == "" and plan.entries == entries
        held = replay(plan.entries, loop.replay_outer_steps, loop.replay_device)
        assert held == sum(e.nbytes for e in entries)
        mine = outer_state(loop)
    finally:
        sync.transport.shutdown()
    for i in range(count):
        assert_bitwise_equal(mine[i], peer["final"][i])
    # The history holds what travelled: the encoded bytes every group decoded (one encoding
    # of each transfer, in chunks of whole blocks), not the fp32 average.
    codec = get_codec(dtype)
    for e in entries:
        assert (e.scale == 1.0) == (not method.startswith("async_"))
        for t in e.transfers:
            expected = (
                t.numel * 4
                if dtype == "float32"
                else groups * codec.wire_bytes(chunk_numel(t.numel, groups))
            )
            assert t.nbytes == expected and t.world_size == groups


# ---- the peer's plan -------------------------------------------------------------------------


def entry(sync: int, fragment: int = 0, basis: int = 100, values: int = 8) -> HistoryEntry:
    payload = torch.arange(values, dtype=torch.float32) + sync
    delivered = Delivered("float32", values, 2, 1, payload)
    return HistoryEntry.of(sync, fragment, [delivered], basis + sync)


def history_of(*syncs: int, capacity: int = 3, fragments: int = 1) -> HealHistory:
    history = HealHistory(capacity)
    for s in syncs:
        history.record(entry(s, (s - 1) % fragments))
    return history


FP = 42


def plan(history: HealHistory, basis: ReplayBasis, job: int, current: list[int]) -> str:
    return plan_replay(history, basis, job, FP, lambda: current).why_full


def test_a_joiner_within_the_history_gets_exactly_the_syncs_it_missed() -> None:
    history = history_of(3, 4, 5)  # basis digests 103, 104, 105
    found = plan_replay(history, ReplayBasis(3, FP, (104,)), 5, FP, lambda: [999])
    assert [e.sync for e in found.entries or []] == [4, 5] and found.why_full == ""
    # A checkpoint at the job's own sync replays nothing: it needs only the small state.
    found = plan_replay(history, ReplayBasis(5, FP, (999,)), 5, FP, lambda: [999])
    assert found.entries == [] and found.why_full == ""


def test_each_case_that_cannot_be_replayed_falls_back_to_a_full_heal_saying_why() -> None:
    history = history_of(3, 4, 5)
    current = [999]
    assert plan(history, ReplayBasis.none(), 5, current) == (
        "it has no checkpoint of its own to replay onto"
    )
    assert plan(HealHistory(0), ReplayBasis(4, FP, (105,)), 5, current) == (
        "the peer keeps no heal history (fault_tolerance.heal_history_syncs=0)"
    )
    assert plan(history, ReplayBasis(4, FP + 1, (105,)), 5, current) == (
        "it does not run the job's settings or model (the method's settings or the model's "
        "parameters differ from the peer's)"
    )
    assert plan(history, ReplayBasis(6, FP, (999,)), 5, current) == (
        "its checkpoint (sync #6) is ahead of the job (#5)"
    )
    assert plan(history, ReplayBasis(1, FP, (102,)), 5, current) == (
        "it is 4 syncs behind and the peer keeps 3 (fault_tolerance.heal_history_syncs)"
    )
    # A gap: the peer restarted after sync 3, so its history starts at 5.
    gap = history_of(5, capacity=3)
    assert plan(gap, ReplayBasis(3, FP, (104,)), 5, current) == (
        "the peer's history does not reach back to sync #4 (it starts at #5: the peer "
        "restarted or healed since)"
    )
    assert plan(HealHistory(3), ReplayBasis(3, FP, (104,)), 5, current) == (
        "the peer's history does not reach back to sync #4 (it is empty: the peer restarted or "
        "healed since)"
    )
    # The same job's settings, another run's (or a damaged) model: never replayed onto.
    assert plan(history, ReplayBasis(3, FP, (777,)), 5, current) == (
        "its global parameters of fragment 0 at sync #3 differ from the job's (a checkpoint "
        "of another run, or damaged)"
    )
    assert plan(history, ReplayBasis(3, FP, (104, 1)), 5, current) == (
        "its checkpoint has another number of fragments"
    )


def test_a_damaged_history_entry_is_never_served() -> None:
    history = history_of(3, 4, 5)
    history.after(3)[0].transfers[0].payload[2] += 1  # a flipped value in memory
    assert plan(history, ReplayBasis(3, FP, (104,)), 5, [999]) == (
        "the peer's history entry of sync #4 fails its checksum"
    )


def test_streaming_checks_each_fragment_against_its_own_last_sync() -> None:
    """Two fragments: the joiner's copy of each must match that fragment's state at the
    checkpoint, which is the basis of its first missed sync, or its current copy if none."""
    history = history_of(4, 5, fragments=2)  # sync 4: fragment 1 (basis 104); 5: fragment 0
    current = [500, 600]
    assert plan(history, ReplayBasis(4, FP, (105, 600)), 5, current) == ""
    assert plan(history, ReplayBasis(3, FP, (105, 104)), 5, current) == ""
    assert "fragment 1" in plan(history, ReplayBasis(3, FP, (105, 600)), 5, current)


def test_the_history_keeps_the_last_k_syncs_without_gaps() -> None:
    history = history_of(1, 2, 3, 4, capacity=3)
    assert [e.sync for e in history.after(0)] == [2, 3, 4] and history.first_sync == 2
    history.record(entry(6))  # sync 5 never reached this group: 2..4 lead nowhere now
    assert [e.sync for e in history.after(0)] == [6]
    assert history.nbytes == 8 * 4
    assert len(HealHistory(0)) == 0 and HealHistory(0).after(0) == []


def test_entries_cross_the_wire_intact_and_a_damaged_one_is_seen() -> None:
    original = entry(3, values=300)
    wire = copy.deepcopy(original.to_wire())
    assert not any(isinstance(v, torch.Tensor) for t in wire["transfers"] for v in t.values())
    payloads = [p.clone() for p in original.payloads()]
    assert HistoryEntry.payload_specs(wire) == [(p.numel(), p.dtype) for p in payloads]
    back = HistoryEntry.from_wire(wire, iter(payloads))
    assert back.intact() and torch.equal(back.average(), original.average())
    payloads[0][0] += 1
    assert not HistoryEntry.from_wire(wire, iter(payloads)).intact()
    with pytest.raises(ValueError, match="its description"):  # a payload of another size
        HistoryEntry.from_wire(wire, iter([payloads[0][1:]]))


def test_the_basis_travels_in_a_fixed_tensor() -> None:
    basis = ReplayBasis(12, -5, (1, -2, 3))
    t = basis.to_tensor(torch.device("cpu"))
    assert t.shape == (BASIS_SLOTS,) and ReplayBasis.from_tensor(t) == basis
    assert ReplayBasis.from_tensor(ReplayBasis.none().to_tensor(torch.device("cpu"))).sync == -1
    many = ReplayBasis(3, 1, tuple(range(100)))  # more fragments than the wire holds: none
    assert ReplayBasis.from_tensor(many.to_tensor(torch.device("cpu"))).sync == -1
    assert ReplayBasis.from_tensor(torch.zeros(BASIS_SLOTS, dtype=torch.int64)).sync == -1


def test_the_fingerprint_tells_jobs_apart() -> None:
    assert job_fingerprint(["a", "b"]) == job_fingerprint(["a", "b"])
    assert job_fingerprint(["a", "b"]) != job_fingerprint(["a", "c"])
    assert -(2**63) <= job_fingerprint(["x"]) < 2**63


# ---- both ends of a heal (HealExchange), without the transport ------------------------------


def _exchange_of(loop: Any, history: HealHistory, user_state: dict[str, Any]) -> Any:
    from torchtitan.experiments.fault_tolerance.heal.exchange import HealExchange

    kept: list[str] = []
    manager = SimpleNamespace(
        _user_state_dicts={k: (lambda v=v: v) for k, v in user_state.items()},
        current_step=lambda: 3,  # torchft loaded the peer's step before the user states
    )
    ft = SimpleNamespace(manager=manager, keep_own=kept.extend, kept=kept)
    return HealExchange(history, FP, loop.method, loop.replayer(), ft)  # type: ignore[arg-type]


def _diloco_loop() -> tuple[Any, Any]:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    manager = LoopbackManager(None, 0, 2)  # type: ignore[arg-type]  # no collective here
    sync = sync_manager(manager)
    loop = build_loop("diloco", sync, model, optimizer)
    return loop, sync


def test_a_peer_sends_only_the_missed_averages_and_the_joiner_replays_them() -> None:
    """The peer committed syncs 1..3 (it applied each and kept it); the joiner's checkpoint
    is at sync 1. The answer leaves out the model, the inner optimizer and the fragment's
    global copy; the joiner keeps its own model and optimizer (KEEP_OWN), reloads its own
    fragment state, replays 2..3 and ends on the peer's global copy and momentum."""
    from torchtitan.components.ft.healing import KEEP_OWN
    from torchtitan.experiments.fault_tolerance.heal.exchange import HEAL_KEY, HealTransferError

    numel = sum(p.numel() for p in make_model().parameters())
    averages = [torch.randn(numel, generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3)]
    (peer, peer_sync), (joiner, joiner_sync) = _diloco_loop(), _diloco_loop()
    try:
        peer_side = _exchange_of(peer, HealHistory(3), {})
        for number, average in enumerate(averages, start=1):
            delivered = [Delivered("float32", numel, 2, 1, average.clone())]
            basis = peer.global_digest(0)
            peer_side.history.record(HistoryEntry.of(number, 0, delivered, basis, 1.0))
            peer.replay_outer_step(0, average.clone())
        joiner.replay_outer_step(0, averages[0].clone())  # its checkpoint: after sync 1
        own_fragment = {"outer_optimizer": {}, "original_parameters": {}}
        joiner_side = _exchange_of(
            joiner, HealHistory(3), {"StreamingDiLoCoFragment_0": own_fragment}
        )
        joiner_side.set_basis(1)
        state = {
            "torchft": {"step": 3},
            "user": {
                "model": "peer's model", "optimizer": "peer's moments", "lr_scheduler": {"lr": 1},
                "StreamingDiLoCoFragment_0": "peer's global copy", HEAL_KEY: {"transfer": "none"},
            },
        }  # fmt: skip
        answer = peer_side.answer(joiner_side.basis, 3, state)
        assert sorted(answer.state["user"]) == [HEAL_KEY, "lr_scheduler"]
        assert answer.state["user"][HEAL_KEY]["omitted"] == [
            "model", "optimizer", "StreamingDiLoCoFragment_0"
        ]  # fmt: skip
        # The averages travel after the state, one payload each here (float32: the average).
        assert len(answer.payloads) == 2 and not torch.equal(*answer.payloads)
        taken: list[int] = []
        steps: list[int] = []
        state = joiner._states[0]
        outer_step = state.passes.step
        state.passes.step = lambda *args: (outer_step(*args), steps.append(1))

        def arriving(payloads: list[torch.Tensor]) -> Any:
            for i, payload in enumerate(payloads):
                # Each average is replayed as it arrives: payload i once i outer steps ran.
                assert len(steps) == i
                taken.append(i)
                yield payload.clone()

        received = joiner_side.received(copy.deepcopy(answer.state), arriving(answer.payloads))
        del state.passes.step
        assert taken == [0, 1] and len(steps) == 2
        assert received["user"]["model"] is KEEP_OWN and received["user"]["optimizer"] is KEEP_OWN
        assert received["user"]["StreamingDiLoCoFragment_0"] is own_fragment
        assert joiner_side.ft.kept == ["model", "optimizer"]
        joiner_side.load(received["user"][HEAL_KEY])
        assert joiner_side.replay_failed == "" and joiner_side.receipt.transfer == "replay"
        assert joiner_side.own_state_lost == ""
        assert joiner_side.receipt.syncs == 2
        assert joiner_side.receipt.nbytes == sum(p.numel() * 4 for p in answer.payloads)
        assert_bitwise_equal(outer_state(joiner)[0], outer_state(peer)[0])
        # The model holds the global parameters now.
        for name, p in joiner.fragment_parameters(0).items():
            assert torch.equal(p.detach(), joiner.global_parameters(0)[name])
        assert [e.sync for e in joiner_side.history.after(0)] == [2, 3]  # it can serve them

        # Healed again in a retried start-up quorum: it now asks from sync 3, not 1 (else
        # the same syncs would be applied twice).
        assert joiner_side.basis.sync == 3
        assert joiner_side.take_heal() == "replay" and joiner_side.take_heal() is None

        # A replay that raises (an entry of a fragment this model lacks) fails safe: a full
        # heal next; every payload is still taken (the peer waits for them to be).
        broken = copy.deepcopy(answer.state)
        broken["user"][HEAL_KEY]["entries"][0]["fragment"] = 5
        rest = iter([p.clone() for p in answer.payloads])
        joiner_side.load(joiner_side.received(broken, rest)["user"][HEAL_KEY])
        assert joiner_side.replay_failed.startswith("the replay raised")
        assert joiner_side.basis.sync == -1 and next(rest, None) is None
        # It had begun (the model holds the global copy now): its own state is lost.
        assert joiner_side.own_state_lost.startswith(
            "its replay of the syncs it missed stopped part-way (the replay raised"
        )
        # The full heal that follows says why, and makes the group whole again.
        full = {"torchft": {"step": 3}, "user": {HEAL_KEY: {"transfer": "full", "why": "x"}}}
        joiner_side.load(joiner_side.received(full, iter([]))["user"][HEAL_KEY])
        assert joiner_side.receipt.why_full.startswith("its replay failed before (the replay")
        assert joiner_side.own_state_lost == ""

        # The first average damaged: nothing was replayed, its own state is whole.
        joiner_side.set_basis(1)
        damaged = [p.clone() for p in answer.payloads]
        damaged[0][0] += 1
        joiner_side.load(
            joiner_side.received(copy.deepcopy(answer.state), iter(damaged))["user"][HEAL_KEY]
        )
        assert joiner_side.replay_failed == "the history entry of sync #2 arrived damaged"
        assert joiner_side.own_state_lost == ""

        # An entry damaged on the way: seen before its outer step, the rest still taken.
        joiner_side.set_basis(1)
        damaged = [p.clone() for p in answer.payloads]
        damaged[1][0] += 1
        rest = iter(damaged)
        joiner_side.load(joiner_side.received(copy.deepcopy(answer.state), rest)["user"][HEAL_KEY])
        assert joiner_side.replay_failed == "the history entry of sync #3 arrived damaged"
        assert joiner_side.basis.sync == -1 and next(rest, None) is None
        assert joiner_side.own_state_lost.endswith("(the history entry of sync #3 arrived damaged)")

        # A payload that never arrives fails the heal (torchft's transfer error) and leaves
        # no basis to replay onto: the next heal is a full one.
        joiner_side.set_basis(1)

        def cut_off() -> Any:
            yield answer.payloads[0].clone()
            raise HealTransferError("payload 2 of 2 of the replay did not arrive")

        with pytest.raises(HealTransferError):
            joiner_side.received(copy.deepcopy(answer.state), cut_off())
        assert joiner_side.basis.sync == -1
        assert joiner_side.own_state_lost.startswith(
            "its replay of the syncs it missed stopped part-way (payload 2 of 2"
        )
    finally:
        peer_sync.transport.shutdown()
        joiner_sync.transport.shutdown()


def test_a_committed_sync_without_tokens_is_replayed_as_nothing() -> None:
    """Async DiLoCo commits a sync in which no group had tokens without an outer step; its
    entry (scale 0) must not divide by zero in a replay."""
    steps: list[int] = []
    entries = [entry(2), HistoryEntry.of(3, 0, entry(3).transfers, 103, scale=0.0)]
    held = replay(
        entries, lambda pairs: steps.extend(f for f, _ in pairs), lambda f: torch.device("cpu")
    )
    assert steps == [0] and held == sum(e.nbytes for e in entries)


def test_the_quorum_findings_carry_the_replay_verdicts_through_the_group() -> None:
    from torchtitan.experiments.fault_tolerance.join.exchange import QuorumFindings

    found = QuorumFindings(False, False, False, False, 7, True, False, True)
    assert QuorumFindings.from_ints(found.as_ints()) == found


def test_keep_own_leaves_a_state_untouched() -> None:
    from torchtitan.components.ft.healing import KEEP_OWN, register_healing_state

    loaded: list[Any] = []
    fns: dict[str, Any] = {}
    state = SimpleNamespace(state_dict=lambda: {"w": 1}, load_state_dict=loaded.append)
    manager = SimpleNamespace(register_state_dict_fn=lambda k, load, save: fns.update({k: load}))
    notes: list[str] = []
    register_healing_state(manager, "model", state, on_load=notes.append)  # type: ignore[arg-type]
    fns["model"](KEEP_OWN)
    assert loaded == [] and notes == []
    fns["model"]({"w": 2})
    assert loaded == [{"w": 2}] and notes == ["model"]


def test_a_replay_failure_the_group_agreed_on_is_told_once_and_the_next_heal_is_full() -> None:
    """The quorum's exchange reports a joiner's failed replay (``replay_reported``): the
    failure is consumed (the next quorum does not fail it again) and the next heal is a full
    one that says why."""
    loop, _ = _diloco_loop()
    exchange = _exchange_of(loop, HealHistory(3), {})
    exchange.set_basis(2)
    exchange.replay_failed = "an entry arrived damaged"
    exchange.replay_reported("an entry arrived damaged")
    assert exchange.replay_failed == ""
    assert exchange.basis == ReplayBasis.none()
    assert "its replay failed before (an entry arrived damaged)" in exchange._why_no_basis


def test_a_replays_outer_steps_are_no_syncs_norm() -> None:
    """The outer steps a joiner replays are training's, but no sync of its own: none of them
    is reported as the next sync's pseudo-gradient norm; a sync's own measure is."""
    loop, sync = _diloco_loop()
    try:
        numel = sum(t.numel() for t in loop.global_parameters(0).values())
        average = torch.full((numel,), 0.5)
        loop.replay_outer_step(0, average.clone())  # one step, as training takes it
        loop.replay_outer_steps([(0, average.clone()), (0, average.clone())])
        assert loop.take_stepped_squares() is None
        loop.measure_outer_step(loop.global_parameters(0).values())
        assert loop.take_stepped_squares() is not None
    finally:
        sync.transport.shutdown()
