"""FTManager's per-step protocol against a scripted stand-in for torchft's Manager: which
quorums it trains in, how it waits (bounded, and visibly), and what it reports after a stall."""

from __future__ import annotations

import itertools
import socket
import time
from typing import Any

import pytest

from torchtitan.components.ft import FaultToleranceError, FTManager
from torchtitan.components.ft.manager import COMMITTED_AFTER_STALL, QUORUM_WAITING, QuorumPurpose
from torchtitan.components.ft.watchdog import QuorumWaitWatchdog, report_times
from torchtitan.config import JobConfig


class ScriptedManager:
    """Quorums come from a script of (groups in the quorum, step after the quorum); the last
    entry repeats. ``should_commit`` fails after ``report_error``, else commits."""

    def __init__(self, quorums: list[tuple[int, int]], step: int = 0) -> None:
        self.script = list(quorums)
        self.step = step
        self.size = 0
        self.calls: list[str] = []
        self.error: Exception | None = None

    def start_quorum(self, timeout: object = None) -> None:
        self.calls.append("quorum")
        self.size, self.step = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        self.error = None

    def wait_quorum(self) -> None:
        pass

    def num_participants(self) -> int:
        return self.size

    def current_step(self) -> int:
        return self.step

    def report_error(self, e: Exception) -> None:
        self.error = e

    def should_commit(self) -> bool:
        self.calls.append("commit" if self.error is None else "skip")
        if self.error is None:
            self.step += 1
        return self.error is None

    def errored(self) -> Exception | None:
        return self.error

    def shutdown(self, wait: bool = True) -> None:
        pass


def make_ft(
    manager: ScriptedManager,
    groups: int = 2,
    min_replica_size: int = 1,
    quorum_timeout_s: float = 30,
) -> FTManager:
    config = JobConfig()
    ft = config.fault_tolerance
    ft.enable, ft.group_size, ft.replica_id = True, groups, 0
    ft.min_replica_size, ft.quorum_timeout_s = min_replica_size, quorum_timeout_s
    ft.lighthouse = "http://127.0.0.1:1"
    ft_manager = FTManager(config, lambda transport: manager, poll_s=0.01)
    ft_manager.start()
    return ft_manager


def test_new_job_skips_quorums_until_every_group_is_in():
    manager = ScriptedManager([(1, 0), (1, 0), (2, 0)])
    ft = make_ft(manager)
    ft.wait_for_full_quorum()
    # Two quorums of one group were closed without training; the third is kept for step 1.
    assert manager.calls == ["quorum", "skip", "quorum", "skip", "quorum"]
    ft.start_step()
    assert manager.calls[-1] == "quorum"  # no new quorum: the held one is used
    ft.shutdown()


def test_running_job_trains_with_min_replica_size_groups():
    manager = ScriptedManager([(1, 7)], step=7)
    ft = make_ft(manager)
    ft.start_step()
    assert manager.calls == ["quorum"]
    assert ft.should_commit()
    ft.shutdown()


def test_a_joiner_healed_to_a_running_step_goes_on_at_once():
    # A fresh group (step 0) whose quorum healed it to step 12 is in a running job.
    manager = ScriptedManager([(1, 12)], step=0)
    ft = make_ft(manager)
    ft.wait_for_full_quorum()
    assert manager.calls == ["quorum"]
    ft.shutdown()


def test_too_few_groups_wait_then_fail_clearly():
    manager = ScriptedManager([(1, 5)], step=5)
    ft = make_ft(manager, min_replica_size=2, quorum_timeout_s=0.3)
    start = time.monotonic()
    with pytest.raises(FaultToleranceError, match=r"quorum_timeout_s.*min_replica_size"):
        ft.start_step()
    assert time.monotonic() - start < 5
    assert "commit" not in manager.calls  # never trained alone
    ft.shutdown()


def test_new_job_timeout_names_group_size():
    manager = ScriptedManager([(1, 0)])
    ft = make_ft(manager, quorum_timeout_s=0.2)
    with pytest.raises(FaultToleranceError, match="group_size"):
        ft.wait_for_full_quorum()
    ft.shutdown()


def test_quorum_error_names_the_lighthouse():
    class Broken(ScriptedManager):
        def start_quorum(self, timeout: object = None) -> None:
            raise TimeoutError("quorum timed out")

    ft = make_ft(Broken([(1, 0)]))
    with pytest.raises(FaultToleranceError, match=r"http://127\.0\.0\.1:1.*quorum_timeout_s"):
        ft.start_step()
    ft.shutdown()


def test_first_commit_after_a_failure_reports_the_stall(events):
    manager = ScriptedManager([(2, 3), (2, 3), (1, 4)], step=3)
    ft = make_ft(manager)
    ft.start_step()
    assert ft.should_commit()
    ft.start_step()
    manager.report_error(RuntimeError("peer died"))
    assert not ft.should_commit()
    ft.start_step()
    assert ft.should_commit()
    stalls = [e for e in events if e.name == COMMITTED_AFTER_STALL.name]
    assert len(stalls) == 1
    stall = stalls[0]
    assert (stall["groups"], stall["previous_groups"], stall["uncommitted"]) == (1, 2, 1)
    assert stall["unit"] == "step" and stall.step == 5 and stall["stall_s"] >= 0
    ft.shutdown()


def test_a_long_wait_reports_what_it_waits_for(events, monkeypatch):
    monkeypatch.setattr(QuorumWaitWatchdog, "SCHEDULE_S", (0.05,))
    manager = ScriptedManager([(1, 5)], step=5)
    ft = make_ft(manager, min_replica_size=2, quorum_timeout_s=1.0)
    with pytest.raises(FaultToleranceError):
        ft.start_step()
    ft.shutdown()
    waits = [e for e in events if e.name == QUORUM_WAITING.name]
    assert waits, events
    assert waits[0].step == 6 and waits[0]["what"] == "step 6"
    assert waits[0]["reason"] == "min_replica_size" and waits[0]["groups_needed"] == 2
    assert waits[0]["last_quorum_groups"] == 1


@pytest.mark.parametrize(
    ("purpose", "subject"),
    [
        (QuorumPurpose("sync #4", sync=4), {"sync": 4, "what": "sync #4", "step": None}),
        (
            QuorumPurpose("start-up", needs="all 2 replica groups", reason="start-up"),
            {"sync": None, "what": "start-up", "step": None},
        ),
    ],
)
def test_a_wait_for_a_quorum_of_another_purpose_says_so(events, monkeypatch, purpose, subject):
    """A sync's quorum or a start-up's is reported as that (its number, what it needs and
    why), and the next step's quorum as a step again: the purpose is an argument of that one
    wait, not state left behind."""
    monkeypatch.setattr(QuorumWaitWatchdog, "SCHEDULE_S", (0.05,))
    manager = ScriptedManager([(1, 5), (1, 5)], step=5)
    ft = make_ft(manager, min_replica_size=2, quorum_timeout_s=1.0)
    with pytest.raises(FaultToleranceError):
        ft.join_quorum(needed=2, timeout_s=0.5, purpose=purpose)
    with pytest.raises(FaultToleranceError):
        ft.join_quorum(needed=2, timeout_s=0.5)
    ft.shutdown()
    waits = [e for e in events if e.name == QUORUM_WAITING.name]
    first, after = waits[0], waits[-1]
    assert {"sync": first.sync, "what": first["what"], "step": first.step} == subject
    if purpose.needs:
        assert (first["needs"], first["reason"]) == (purpose.needs, purpose.reason)
    else:
        assert first["reason"] == "min_replica_size"
    assert after["what"] == "step 6" and after.step == 6


def test_a_quorum_its_members_do_not_use_is_closed_before_the_next_forms():
    """The caller (an exchange) uses the third quorum of two groups: the two before are closed
    with a failed commit, no collective in them, each before the next forms; the wait it
    returns is the whole of it."""
    manager = ScriptedManager([(2, 5)], step=5)
    ft = make_ft(manager)
    with ft.quorum_rounds(needed=2, timeout_s=5.0, purpose=QuorumPurpose("sync #6")) as rounds:
        for _ in range(3):
            assert rounds.form() == 2
            time.sleep(0.05)
    assert manager.calls == ["quorum", "skip", "quorum", "skip", "quorum"]
    assert rounds.waited >= 0.15
    assert ft.join_quorum(needed=2) >= 0.0 and manager.calls[-1] == "quorum"
    ft.shutdown()


def test_a_caller_that_uses_no_quorum_stops_at_its_own_bound():
    """Quorums of enough groups that the caller never uses (its members disagree each time):
    the wait ends at the caller's ``timeout_s``, not the job's ``quorum_timeout_s``, in an
    error naming the caller's field."""
    manager = ScriptedManager([(2, 5)], step=5)
    ft = make_ft(manager, quorum_timeout_s=20)
    start = time.monotonic()
    with pytest.raises(FaultToleranceError, match=r"sync_quorum_timeout_s\).*had 2 groups but"):
        with ft.quorum_rounds(
            needed=2, timeout_s=0.3, timeout_field="fault_tolerance.sync_quorum_timeout_s"
        ) as rounds:
            while True:
                rounds.form()
    assert time.monotonic() - start < 10
    assert "commit" not in manager.calls
    ft.shutdown()


def test_an_error_in_a_callers_quorum_ends_the_wait_and_its_reports(events, monkeypatch):
    """The caller's exchange raises in the quorum: the error reaches the caller, and the wait's
    watchdog stops (no report of a wait that is over); the next wait is measured afresh."""
    monkeypatch.setattr(QuorumWaitWatchdog, "SCHEDULE_S", (0.1,))
    manager = ScriptedManager([(2, 5)], step=5)
    ft = make_ft(manager)
    with pytest.raises(ValueError, match="the exchange failed"):
        with ft.quorum_rounds(needed=2) as rounds:
            rounds.form()
            raise ValueError("the exchange failed")
    time.sleep(0.6)
    assert not [e for e in events if e.name == QUORUM_WAITING.name]
    assert ft.join_quorum(needed=2) < 0.5
    ft.shutdown()


def test_the_documented_report_schedule() -> None:
    """5 s, then 10, 20, 40, 60 s, then every 60 s: what docs/design.md says."""
    due = report_times(QuorumWaitWatchdog.SCHEDULE_S, QuorumWaitWatchdog.THEN_EVERY_S)
    assert list(itertools.islice(due, 8)) == [5, 10, 20, 40, 60, 120, 180, 240]


def test_watchdog_reports_a_long_wait_rarely(monkeypatch):
    monkeypatch.setattr(QuorumWaitWatchdog, "SCHEDULE_S", (0.1, 0.2, 0.4))
    monkeypatch.setattr(QuorumWaitWatchdog, "THEN_EVERY_S", 0.2)
    seen: list[float] = []
    watchdog = QuorumWaitWatchdog(lambda waited: (seen.append(waited), "waiting")[1], tick_s=0.01)
    watchdog.begin()
    deadline = time.monotonic() + 30  # a starved thread on a loaded machine: just later
    while len(seen) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    waited = watchdog.end()
    reports = len(seen)
    time.sleep(0.1)
    watchdog.stop()
    assert reports >= 4 and len(seen) == reports  # nothing after the wait ended
    # Due at 0.1, 0.2, 0.4 s, then every 0.2 s: never before they are due, never more than
    # are due by the end.
    due = [0.1, 0.2, 0.4] + [0.4 + 0.2 * k for k in range(1, 200)]
    assert all(w >= d for w, d in zip(seen, due, strict=False)), seen
    assert reports <= sum(d <= waited for d in due)


def test_watchdog_is_silent_for_short_waits():
    seen: list[float] = []
    watchdog = QuorumWaitWatchdog(lambda waited: (seen.append(waited), "waiting")[1], tick_s=0.01)
    for _ in range(5):
        watchdog.begin()
        time.sleep(0.02)
        watchdog.end()
    watchdog.stop()
    assert seen == []


class Counter:
    """A subclass's extra state, as a trainer would register it."""

    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


class Registry(ScriptedManager):
    def __init__(self) -> None:
        super().__init__([(1, 0)])
        self.fns: dict[str, tuple] = {}
        self.loaded: dict[str, int] | None = None

    def register_state_dict_fn(self, name: str, load: object, save: object) -> None:
        self.fns[name] = (load, save)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.loaded = state


def test_trainer_sends_subclass_state_to_joiners():
    from types import SimpleNamespace

    from torchtitan.trainer import Trainer

    peer, joiner = make_ft(Registry()), make_ft(Registry())
    peer_trainer = SimpleNamespace(states={}, ft=peer)
    joiner_trainer = SimpleNamespace(states={}, ft=joiner)
    Trainer.register_state(peer_trainer, "extra", Counter(41))
    Trainer.register_state(peer_trainer, "local_only", Counter(1), heal=False)
    Trainer.register_state(joiner_trainer, "extra", Counter(0))
    assert set(peer_trainer.states) == {"extra", "local_only"}  # checkpoints save both
    assert set(peer.manager.fns) == {"extra"}  # healing sends only the first
    load = joiner.manager.fns["extra"][0]
    load(peer.manager.fns["extra"][1]())
    assert joiner_trainer.states["extra"].value == 41
    assert joiner._healed == ["extra"]  # reported in the "[ft] ... healed" line
    peer.shutdown()
    joiner.shutdown()


def test_consecutive_uncommitted_steps_stop_with_the_cause():
    manager = ScriptedManager([(2, 3)], step=3)
    ft = make_ft(manager)
    ft.max_consecutive_failures = 3
    for _ in range(2):
        ft.start_step()
        manager.report_error(RuntimeError("heal transfer timed out"))
        assert not ft.should_commit()
    ft.start_step()
    assert ft.should_commit()  # a commit resets the count
    for _ in range(2):
        ft.start_step()
        manager.report_error(RuntimeError("heal transfer timed out"))
        assert not ft.should_commit()
    ft.start_step()
    manager.report_error(RuntimeError("heal transfer timed out"))
    with pytest.raises(FaultToleranceError) as info:
        ft.should_commit()
    message = str(info.value)
    assert "3 steps in a row were not committed" in message
    assert "max_consecutive_failures=3" in message
    assert "RuntimeError: heal transfer timed out" in message
    ft.shutdown()


def test_a_run_that_committed_nothing_fails():
    manager = ScriptedManager([(2, 3)], step=3)
    ft = make_ft(manager)
    ft.check_progress()  # nothing tried: nothing to say
    ft.start_step()
    manager.report_error(RuntimeError("peer died"))
    assert not ft.should_commit()
    with pytest.raises(FaultToleranceError, match="committed none of its 1 attempts"):
        ft.check_progress()
    ft.start_step()
    assert ft.should_commit()
    ft.check_progress()
    ft.shutdown()


def test_the_manager_starts_only_when_asked_and_gets_what_was_registered_before():
    """...and with the heal transport given at the start (the semi-sync trainer's, built with
    the heal exchange after the FTManager)."""
    built: list[Registry] = []
    transports: list[object] = []

    def build(transport: object) -> Registry:
        transports.append(transport)
        built.append(Registry())
        return built[-1]

    config = JobConfig()
    config.fault_tolerance.enable, config.fault_tolerance.group_size = True, 2
    config.fault_tolerance.lighthouse = "http://127.0.0.1:1"
    ft = FTManager(config, build, poll_s=0.01)
    ft.register_state("extra", Counter(5))
    ft.load_state_dict({"step": 12, "batches_committed": 24})  # from a checkpoint
    assert ft.state_dict() == {"step": 12, "batches_committed": 24}
    assert not built and not ft.started  # not heartbeating yet
    transport = object()  # torchft's transport factory
    ft.start(transport)  # type: ignore[arg-type]  # any factory: passed on, not called here
    ft.start()  # started already: nothing more is built
    assert len(built) == 1 and set(built[0].fns) == {"extra"} and transports == [transport]
    assert built[0].loaded == {"step": 12, "batches_committed": 24}
    ft.shutdown()


def test_an_unreachable_lighthouse_is_named_as_such():
    class Gone(ScriptedManager):
        def start_quorum(self, timeout: object = None) -> None:
            raise TimeoutError("quorum timed out")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    ft = make_ft(Gone([(1, 0)]))
    ft.lighthouse = f"http://127.0.0.1:{port}"
    with pytest.raises(FaultToleranceError) as info:
        ft.start_step()
    message = str(info.value)
    assert f"lighthouse at http://127.0.0.1:{port} is unreachable" in message
    assert "fault_tolerance.quorum_timeout_s=30s" in message
    ft.shutdown()


class _Stream:
    """Stands in for the accelerator's streams: logs each event recorded and each wait."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def record_event(self) -> str:
        event = f"event{sum(1 for e in self.log if e.startswith('record'))}"
        self.log.append(f"record {event} on {self.name}")
        return event

    def wait_event(self, event: str) -> None:
        self.log.append(f"wait {event} on {self.name}")


class _HealingManager(ScriptedManager):
    """A quorum in which a peer heals from this group: torchft's quorum thread sends the state
    from its recovery stream (here: the transport's ``send_checkpoint``, called in the quorum)."""

    def __init__(self, send: object, log: list[str]) -> None:
        super().__init__([(2, 3)], step=3)
        self.send, self.log = send, log

    def start_quorum(self, timeout: object = None) -> None:
        self.log.append("quorum")
        super().start_quorum(timeout)
        with _on_stream(self, "recovery"):
            self.send.send_checkpoint([1], 3, {"model": "..."}, None)  # type: ignore[attr-defined]


_current: list[str] = ["training"]


class _on_stream:  # noqa: N801  # a context manager, like torch.cuda.stream
    def __init__(self, _: object, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        _current.append(self.name)

    def __exit__(self, *exc: object) -> None:
        _current.pop()


@pytest.mark.parametrize("path", ["step", "sync", "probe", "reads_allowed"])
def test_a_heal_reads_the_state_only_after_the_compute_that_writes_it(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """With a (stand-in) accelerator: whichever way a peer heals from this group (synchronous
    FT's step-start quorum, a sync's quorum of every method, DyLU's probe quorum, or a quorum
    in which async DiLoCo lets peers read again after a step), the heal's sender first makes its
    own stream wait for an event recorded on the training stream after the last kernel that
    writes the state was queued: one event wait, no device-wide synchronize."""
    import torch

    from torchtitan.components.ft.build import SendsAfterWrites
    from torchtitan.experiments.fault_tolerance.sync.quorum import SyncQuorum

    log: list[str] = []
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda *_: _Stream(log, _current[-1]))
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *_: log.append("SYNCHRONIZE"))

    class Reader:
        def send_checkpoint(self, *args: object) -> None:
            log.append("first read of the state")

    transport = SendsAfterWrites(Reader(), None)  # type: ignore[arg-type]
    manager = _HealingManager(transport, log)
    ft = make_ft(manager)
    transport.ft = ft  # built before its FTManager, as build_ft_manager's closure does
    log.append("optimizer step queued")
    if path == "step":
        ft.start_step()
    elif path in ("sync", "probe"):
        sync = SyncQuorum(ft, 1, 60.0, transport=None)  # type: ignore[arg-type]
        sync.begin_sync = lambda: None  # type: ignore[method-assign]  # no transfers here
        with sync.sync_rounds() if path == "sync" else sync.probe_rounds() as rounds:
            rounds.form()
    else:
        # Async DiLoCo while DyLU's probe quorum waits for its state: once the training thread
        # lets peers read it (``_finish_probe``), the quorum thread sends it.
        sync = SyncQuorum(ft, 1, 60.0, transport=None)  # type: ignore[arg-type]

        def send_once_allowed() -> None:
            with _on_stream(None, "recovery"):
                transport.send_checkpoint([1], 3, {}, None)

        manager.allow_state_dict_read = send_once_allowed  # type: ignore[attr-defined]
        sync.allow_state_dict_read()
    step = log.index("optimizer step queued")
    recorded = [i for i, e in enumerate(log) if e.startswith("record") and e.endswith("training")]
    waited = [i for i, e in enumerate(log) if e.startswith("wait")]
    read = log.index("first read of the state")
    assert recorded and waited, log
    event = log[recorded[-1]].split()[1]
    assert step < recorded[-1] < waited[-1] < read, log
    assert log[waited[-1]] == f"wait {event} on recovery", log
    assert "SYNCHRONIZE" not in log


class StatefulManager(ScriptedManager):
    """A Manager whose step and registered states can be read back (``state_dict``)."""

    def __init__(self, step: int = 0) -> None:
        super().__init__([(1, step)], step)
        self.fns: dict[str, Any] = {}
        self.down = False

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "batches_committed": 2 * self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]

    def register_state_dict_fn(self, key: str, load: Any, save: Any) -> None:
        self.fns[key] = (load, save)

    def shutdown(self, wait: bool = True) -> None:
        self.down = True


def test_a_manager_that_steps_down_keeps_its_step_and_state_for_the_next_start() -> None:
    """A site's leader that no longer leads shuts its job Manager down; the step it reached
    and every state registered for healing (before and after the first start) go to the
    Manager a later start builds, and its step is answered meanwhile."""
    built: list[StatefulManager] = [StatefulManager(), StatefulManager()]
    config = JobConfig()
    ft = config.fault_tolerance
    ft.enable, ft.group_size, ft.lighthouse = True, 2, "http://127.0.0.1:1"
    ft_manager = FTManager(config, lambda transport: built[len(made)], poll_s=0.01)
    made: list[Any] = []

    def save() -> int:
        return 1

    ft_manager.register_state_dict_fn("before", lambda _: None, save)
    ft_manager.start()
    made.append(built[0])
    ft_manager.register_state_dict_fn("after", lambda _: None, save)
    built[0].step = 7
    ft_manager.step_down()
    assert built[0].down and not ft_manager.started
    assert ft_manager.state_dict() == {"step": 7, "batches_committed": 14}
    ft_manager.step_down()  # nothing to shut down: no-op
    ft_manager.start()
    assert ft_manager.manager is built[1] and built[1].step == 7
    assert set(built[1].fns) == {"before", "after"}
