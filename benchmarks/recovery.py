"""Recovery and soak of DiLoCo across 2 replica groups, with SIGKILLed groups, and a kill
inside an async DiLoCo sync of 3 groups with compressed pseudo-gradients.

    .venv/bin/python -m benchmarks.recovery                # the README's figures (~18 min)
    .venv/bin/python -m benchmarks.recovery --minutes 3    # shorter soak
    .venv/bin/python -m benchmarks.recovery --smoke        # ~1 min; checks the plumbing

Method: DiLoCo (1 fragment, H = ``--sync-steps``), the semi-synchronous method this project is
about; groups meet only at syncs, so a kill costs at most the work since the last sync.
Lighthouse and groups run on 127.0.0.1 (free ports), group i pinned to core i, heartbeat
timeout ``--heartbeat-timeout-ms``, process-group timeout ``--process-group-timeout-ms`` (the
trainer's default, 10 s: it bounds a survivor's wait in a collective with a peer that died after
joining its quorum). Each group is one ``benchmarks/train_entry.py`` process with the trainers
of ``benchmarks/timed_trainer.py`` (monotonic ``[timing]`` lines per step, received healing
bytes).

Part 1, recovery (``--kills`` times, alternating groups): once both groups have committed syncs,
SIGKILL one group (its whole process group) and measure

* kill -> the survivor's next inner step and next committed sync, the first that the killed
  group took no part in (and that sync's duration);
* restart (``--restart-after`` s later) -> the restarted group's heal: bytes received and
  seconds in torchft's checkpoint transport, and the time from its start to its first committed
  sync (process start-up included).

Then (``--joiner-kills`` times) restart group 1 and kill it again around its first sync:
alternately right after its heal line, and at a random point 0-0.6 s after its last inner step
before that sync (in its quorum, process-group rebuild or heal). Measures the survivor's kill
-> next committed sync: the worst case is bounded by ``--process-group-timeout-ms``.

Part 3, long periods (``--long-period-steps``, ~1 min on an idle machine; the sync quorum
timeout set below the period): SIGKILL a group mid-period, restart it, and report the survivor's
``quorum_wait`` at the sync where the restarted group rejoins (the survivors' stall per rejoin),
next to the period and the waits at the other syncs.

Part 4, async kill (``--async-kills``): 3 groups, async DiLoCo with int4 pseudo-gradients and
error feedback, buckets of ``--async-bucket-mb`` (small: a sync's transfers last seconds on
loopback, as a real one does on a slow link). Right after group 2 logs a sync (it has just
started the next sync's transfers, which its peers then wait on), SIGKILL it; report each
survivor's stall (``ft.committed_after_stall``: previous commit -> first commit without the
killed group) and whether the lighthouse's heartbeats ended its sync in flight
(``semi_sync.peer_gone``) or it had none waiting on the dead group; then restart group 2.

Part 2, soak (``--minutes``): a fresh job; every ``--kill-every`` s (uniform in [0.5, 1.5] of
it, seeded by ``--seed``) SIGKILL a random group and restart it after ``--restart-after`` s. A
kill is postponed while the other group has not yet committed a sync since its own (re)start:
killing the only group that holds the job's state would restart the job from scratch. Reports

* committed ÷ attempted inner steps: attempted = every inner step any process computed (up to
  its last sync attempt; the unfinished period at the end is left out); committed = the steps of
  periods that ended in a committed sync, except a restarted group's first period, which the
  heal overwrites;
* committed ÷ attempted syncs;
* goodput, downtime counted: the committed steps of both groups per wall-second, from the soak
  job's first process start to the end of the soak (start-up, kills, restarts, heals and the
  survivor's waits all inside), divided by the two groups' steps per second without FT. The
  baseline runs in the same invocation, right before the soak and right after it (the mean of
  the two): the same trainer, model and pinning, both groups' processes at once, without a
  lighthouse (``--baseline-steps`` steps, the first ``BASELINE_WARMUP`` left out);
* divergence: syncs whose ``global_digest`` differs between the groups (both took part);
* crashes: processes that exited without being killed by the benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import random
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from pathlib import Path

from benchmarks import ft_common as common
from benchmarks import provenance
from benchmarks.timed_trainer import HEAL_TRANSFER, TIMING
from torchtitan.components.ft.manager import COMMITTED_AFTER_STALL
from torchtitan.experiments.fault_tolerance.events import (
    ASKING_FOR_QUORUM,
    GLOBAL_DIGEST,
    HEALED,
    PEER_GONE,
    SYNC,
)
from torchtitan.tools.cluster import (
    LighthouseSettings,
    LocalJob,
    PeriodicKills,
    Process,
    Restarts,
)
from torchtitan.tools.events import Event

# ---- what a start of a group emitted (its events, oldest first) ------------------------------


def timings(events: Iterable[Event]) -> list[tuple[int, float]]:
    """(step, monotonic time at its end) of every ``bench.timing`` event."""
    return [(e.step, e["t"]) for e in events if e.name == TIMING.name and e.step is not None]


def syncs(events: Iterable[Event]) -> list[Event]:
    """The ``semi_sync.sync`` events, committed or not."""
    return [e for e in events if e.name == SYNC.name]


def committed_syncs(events: Iterable[Event]) -> int:
    return sum(1 for e in syncs(events) if e["committed"])


def healed(events: Iterable[Event]) -> list[Event]:
    """The ``semi_sync.healed`` events: this start took a live peer's state (any case)."""
    return [e for e in events if e.name == HEALED.name]


def committed_sync_after(
    events: Sequence[Event], t: float, without: Collection[int] = ()
) -> tuple[int, float, float, int] | None:
    """(step, monotonic time, sync ms, groups) of the first committed sync whose step ended
    after ``t``, leaving out the syncs of the quorums in ``without``."""
    return next((row for row in _committed_syncs(events, without) if row[1] > t), None)


def recovery_sync(
    events: Sequence[Event],
    t_kill: float,
    killed: Collection[int],
    groups: int,
    back_at: float = math.inf,
) -> tuple[int, float, float, int] | None:
    """The survivor's first committed sync (as :func:`committed_sync_after`) after a kill at
    ``t_kill`` that the killed start took no part in.

    A sync it had taken part in can commit for the survivor a moment after the kill (the
    survivor's step ends after it), and is no recovery. Left out: the syncs of the quorums the
    killed start logged a sync in (``killed``, :func:`quorums_of`: a dead member's quorum
    commits no later sync, and torchft never reuses a quorum id), and the syncs of all
    ``groups`` of the job that ended before the killed group's next start (``back_at``,
    monotonic): until then the killed start is the only one that can have made up the number.
    That covers a start killed after its part in a sync it had not logged yet (a joiner, right
    after its heal line)."""
    return next(
        (
            row
            for row in _committed_syncs(events, killed)
            if row[1] > t_kill and not (row[3] >= groups and row[1] < back_at)
        ),
        None,
    )


def quorums_of(events: Iterable[Event]) -> set[int]:
    """The quorum ids of every sync (committed or not) in ``events``: one start's."""
    return {e["quorum_id"] for e in syncs(events) if e["quorum_id"] is not None}


def _committed_syncs(
    events: Sequence[Event], without: Collection[int] = ()
) -> list[tuple[int, float, float, int]]:
    """(step, monotonic time at the step's end, sync ms, groups) of every committed sync whose
    step's timing is known (its ``bench.timing`` event follows the sync's), but those of the
    quorums in ``without``."""
    times = dict(timings(events))
    return [
        (e.step, times[e.step], round(1000 * e["seconds"], 1), e["groups"])
        for e in syncs(events)
        if e["committed"] and e.step in times and e["quorum_id"] not in without
    ]


def sync_quorum_waits(events: Iterable[Event]) -> list[tuple[int, int, float]]:
    """(sync number, groups, seconds in the sync's quorum) of every sync, committed or not."""
    return [(e.sync, e["groups"], e["quorum_wait_s"]) for e in syncs(events) if e.sync is not None]


# ---- the job ---------------------------------------------------------------------------------


def group_starts(job: LocalJob) -> list[Process]:
    """Every start of every group, in the order they were started."""
    return [p for p in job.processes if p.replica_id is not None]


def crashed(job: LocalJob) -> list[Process]:
    """Starts that exited without being killed by us."""
    return [s for s in group_starts(job) if s.killed_at is None and not s.alive()]


def check_alive(job: LocalJob) -> None:
    for s in crashed(job):
        raise RuntimeError(
            f"group {s.replica_id} ({s.name}) exited with {s.returncode} "
            f"without being killed:\n{s.tail()}"
        )


def wait_until(
    predicate: Callable[[], object],
    timeout: float,
    what: str,
    job: LocalJob,
    poll_s: float = 0.1,
) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        check_alive(job)
        time.sleep(poll_s)
    raise TimeoutError(f"no {what} within {timeout:.0f}s")


def first_after(rows: list[tuple[int, float]], t: float) -> tuple[int, float] | None:
    later = [r for r in rows if r[1] > t]
    return later[0] if later else None


def step_accounting(events: Iterable[Event], finished_by_us: bool) -> dict[str, int]:
    """attempted / committed inner steps and syncs of one start of a group, from its timing,
    sync and healed events in the order it emitted them (see module doc)."""
    attempted = committed = since = sync_count = committed_count = 0
    after_heal = False
    for event in events:
        if event.name == TIMING.name:
            since += 1
        elif event.name == HEALED.name:
            after_heal = True
        elif event.name == SYNC.name:
            period = since + 1  # the sync step's own timing event comes right after
            attempted += period
            sync_count += 1
            if event["committed"]:
                committed_count += 1
                if not after_heal:
                    committed += period
            after_heal = False
            since = -1
    if not finished_by_us:  # killed mid-period: those steps were attempted and lost
        attempted += max(since, 0)
    return {
        "attempted_steps": attempted,
        "committed_steps": committed,
        "attempted_syncs": sync_count,
        "committed_syncs": committed_count,
        "unfinished_period_steps": max(since, 0) if finished_by_us else 0,
    }


def divergence(starts: Iterable[tuple[int, Iterable[Event]]]) -> dict[str, object]:
    """Compare the ``global_digest`` of every sync that more than one group reported;
    ``starts``: (replica id, the events of one of its starts)."""
    by_group: dict[int, dict[int, set[str]]] = {}
    for replica_id, events in starts:
        for e in events:
            if e.name == GLOBAL_DIGEST.name and e.sync is not None:
                by_group.setdefault(replica_id, {}).setdefault(e.sync, set()).add(e["digest"])
    numbers = sorted({k for d in by_group.values() for k in d})
    compared, mismatched = 0, []
    for k in numbers:
        seen = [d[k] for d in by_group.values() if k in d]
        if len(seen) < 2 and all(len(x) == 1 for x in seen):
            continue
        compared += 1
        if len(set().union(*seen)) != 1:
            mismatched.append(k)
    return {"syncs_logged": len(numbers), "syncs_compared": compared, "mismatched": mismatched}


# ---- part 1 --------------------------------------------------------------------------------


#: The replica groups of every FT job here.
GROUPS = 2


@contextlib.contextmanager
def two_groups(folder: Path, args: argparse.Namespace, train_args: list[str]) -> Iterator[LocalJob]:
    """A lighthouse and two groups started with ``train_args``; all stopped at the end."""
    lighthouse = LighthouseSettings(
        heartbeat_timeout_ms=args.heartbeat_timeout_ms, join_timeout_ms=args.join_timeout_ms
    )
    with common.trainer_job(
        folder, GROUPS, train_args, ft_args=ft_args(args), lighthouse=lighthouse
    ) as job:
        yield job.start()


def wait_for_two_more_syncs(
    job: LocalJob, events: common.GroupEvents, args: argparse.Namespace
) -> None:
    """Wait until both groups have committed 2 more syncs: a steady pair to kill from."""

    def committed(g: int) -> int:
        return committed_syncs(events.of(job.latest(g), SYNC))

    base = {g: committed(g) for g in range(2)}
    wait_until(lambda: all(committed(g) >= base[g] + 2 for g in (0, 1)),
               args.timeout, "2 committed syncs in both groups", job)  # fmt: skip


def recovery_part(folder: Path, args: argparse.Namespace, train_args: list[str]) -> list[dict]:
    samples: list[dict] = []
    with two_groups(folder, args, train_args) as job:
        events = common.GroupEvents(job)
        for i in range(args.kills):
            victim = 1 - (i % 2)  # group 1 first, then group 0, ...
            survivor = 1 - victim
            wait_for_two_more_syncs(job, events, args)
            # Kill at a random point of the sync period (not right at a sync).
            time.sleep(random.Random(args.seed + i).uniform(0.0, 1.5))
            killed = job.kill_group(victim)
            t_kill = killed.killed_at
            assert t_kill is not None
            dead = quorums_of(events.of(killed))
            surv = job.latest(survivor)

            def next_committed_sync(
                s: Process = surv, t: float = t_kill, dead: set[int] = dead
            ) -> tuple | None:
                return recovery_sync(events.of(s), t, dead, GROUPS)

            wait_until(lambda: next_committed_sync() is not None, args.timeout,
                       "committed sync of the survivor", job)  # fmt: skip
            step_row = first_after(timings(events.of(surv, TIMING)), t_kill)
            sync_step, sync_t, sync_ms, sync_groups = next_committed_sync()  # type: ignore[misc]
            time.sleep(max(0.0, t_kill + args.restart_after - time.monotonic()))
            restarted = job.start_group(victim)
            # (the step's timing event follows its sync event: wait for both)
            wait_until(lambda r=restarted: committed_sync_after(events.of(r), 0.0) is not None,
                       args.timeout, "first committed sync of the restarted group",
                       job)  # fmt: skip
            emitted = events.of(restarted)
            heal = next((e for e in emitted if e.name == HEAL_TRANSFER.name), None)
            first = committed_sync_after(emitted, 0.0)
            first_step = (timings(emitted) or [(0, 0.0)])[0]
            sample = {
                "killed_group": victim,
                "survivor_next_inner_step_after_kill_s": (
                    round(step_row[1] - t_kill, 3) if step_row else None
                ),
                "survivor_next_committed_sync_after_kill_s": round(sync_t - t_kill, 3),
                "survivor_that_sync_ms": sync_ms,
                "survivor_that_sync_groups": sync_groups,
                "restart_after_s": args.restart_after,
                "restarted_first_step_after_start_s": round(first_step[1] - restarted.started, 3),
                "heal_bytes": heal["bytes"] if heal else None,
                "heal_transfer_s": round(heal["seconds"], 3) if heal else None,
                "healed_line": bool(healed(emitted)),
                "restarted_first_committed_sync_after_start_s": (
                    round(first[1] - restarted.started, 3) if first else None
                ),
                "kill_to_restarted_group_in_sync_s": (
                    round(first[1] - t_kill, 3) if first else None
                ),
            }
            samples.append(sample)
            print(f"[recovery] kill {i}: {sample}", flush=True)
        rng = random.Random(args.seed)
        for j in range(args.joiner_kills):
            # Alternate: right after the heal, then a random point around the first sync.
            delay = -1.0 if j % 2 == 0 else rng.uniform(0.0, 0.6)
            # The last one leaves no healthy pair behind: nothing follows it in this job.
            last = j == args.joiner_kills - 1
            sample = kill_a_joiner_at_its_first_sync(job, events, args, delay, restart=not last)
            samples.append(sample)
            print(f"[recovery] joiner kill {j}: {sample}", flush=True)
        if crashed(job):
            raise RuntimeError("a survivor crashed during part 1")
    return samples


def kill_a_joiner_at_its_first_sync(
    job: LocalJob,
    events: common.GroupEvents,
    args: argparse.Namespace,
    delay_s: float,
    restart: bool = True,
) -> dict:
    """The worst moments for a survivor: a restarted group dies around its first sync, where
    it joins the survivor's quorum, the process group is rebuilt with it and the survivor
    sends it the state. ``delay_s`` < 0: kill right after its heal; else ``delay_s`` after
    its last inner step before that sync. Measures the survivor's kill -> next committed sync
    (bounded by the process-group timeout where the survivor waits in a collective for the
    dead peer). With ``restart``, restarts the group and waits for its first committed sync:
    a healthy pair for what follows."""
    victim, survivor = 1, 0
    wait_for_two_more_syncs(job, events, args)
    job.kill_group(victim)
    time.sleep(args.restart_after)
    joiner = job.start_group(victim)
    if delay_s < 0:
        wait_until(lambda: healed(events.of(joiner, HEALED)), args.timeout,
                   "the restarted group's heal", job, poll_s=0.02)  # fmt: skip
    else:
        before_sync = args.sync_steps - 1
        wait_until(lambda: len(timings(events.of(joiner, TIMING))) >= before_sync, args.timeout,
                   f"the restarted group's step {before_sync}", job, poll_s=0.02)  # fmt: skip
        time.sleep(delay_s)
    healed_before_kill = bool(healed(events.of(joiner, HEALED)))
    job.kill_group(victim)
    t_kill = joiner.killed_at
    assert t_kill is not None
    dead = quorums_of(events.of(joiner))
    surv = job.latest(survivor)
    wait_until(lambda: recovery_sync(events.of(surv), t_kill, dead, GROUPS) is not None,
               args.timeout, "committed sync of the survivor", job)  # fmt: skip
    after_kill = recovery_sync(events.of(surv), t_kill, dead, GROUPS)
    assert after_kill is not None  # waited for above
    _, sync_t, sync_ms, sync_groups = after_kill
    failed = [e for e in syncs(events.of(surv, SYNC)) if not e["committed"]]
    if restart:
        time.sleep(args.restart_after)
        restarted = job.start_group(victim)
        wait_until(lambda: committed_sync_after(events.of(restarted), 0.0) is not None,
                   args.timeout, "first committed sync of the restarted group",
                   job)  # fmt: skip
    return {
        "killed_group": victim,
        "kill_point": "right after its heal line"
        if delay_s < 0
        else f"{delay_s:.2f} s after its step {args.sync_steps - 1}",
        "joiner_had_healed": healed_before_kill,
        "joiner_killed_after_start_s": round(t_kill - joiner.started, 3),
        "survivor_next_committed_sync_after_kill_s": round(sync_t - t_kill, 3),
        "survivor_that_sync_ms": sync_ms,
        "survivor_that_sync_groups": sync_groups,
        "survivor_failed_syncs_so_far": len(failed),
        "process_group_timeout_ms": args.process_group_timeout_ms,
    }


# ---- part 3: long periods ------------------------------------------------------------------


def long_period_part(folder: Path, args: argparse.Namespace, train_args: list[str]) -> dict:
    """Periods of ``--long-period-steps`` inner steps (a minute on an idle machine, as on GPUs
    with H=20 at seconds per step). Kill a group at a random point of a period, restart it after
    ``--restart-after`` s: the survivor's extra wait at the sync where the group rejoins (its
    ``quorum_wait``) must be the restarted group's transfer, bounded by seconds, not by the
    period. The sync quorum timeout is set below the period, so a survivor that waited for a
    period would fail."""
    long_args = [a for a in train_args if not a.startswith("--fault_tolerance.sync_steps=")]
    long_args += [
        f"--fault_tolerance.sync_steps={args.long_period_steps}",
        f"--fault_tolerance.sync_quorum_timeout_s={args.long_period_sync_timeout_s}",
    ]
    samples: list[dict] = []
    with two_groups(folder, args, long_args) as job:
        events = common.GroupEvents(job)
        periods: list[float] = []  # the survivor's sync-to-sync times so far
        for i in range(args.long_period_kills):
            victim, survivor = 1, 0
            surv = job.latest(survivor)
            # (a committed sync of the survivor with its step's timing, which follows the sync)
            wait_until(lambda n=1 + i, s=surv: committed_syncs(events.of(job.latest(1), SYNC)) >= 1
                       and len(_committed_syncs(events.of(s))) >= n,
                       args.timeout * 4, "a committed sync in both groups", job)  # fmt: skip
            sync_times = [t for _, t, *_ in _committed_syncs(events.of(surv))]
            periods = [b - a for a, b in zip(sync_times, sync_times[1:], strict=False)]
            period = periods[-1] if periods else 0.0
            time.sleep(random.Random(args.seed + i).uniform(0.1, 0.6) * max(period, 1.0))
            t_kill = job.kill_group(victim).killed_at
            assert t_kill is not None
            time.sleep(args.restart_after)
            restarted = job.start_group(victim)
            wait_until(lambda r=restarted: healed(events.of(r, HEALED)),
                       args.timeout * 4, "the restarted group's heal", job)  # fmt: skip
            rejoin = healed(events.of(restarted, HEALED))[0].sync

            def waits_at_rejoin(
                s: Process = surv, k: int | None = rejoin
            ) -> list[tuple[int, int, float]]:
                return [w for w in sync_quorum_waits(events.of(s, SYNC)) if w[0] == k]

            wait_until(waits_at_rejoin, args.timeout, "the survivor's rejoin sync", job)
            _, rejoin_groups, rejoin_wait = waits_at_rejoin()[0]
            asked = events.of(restarted, ASKING_FOR_QUORUM)
            sample = {
                "killed_group": victim,
                "rejoin_sync": rejoin,
                "rejoin_sync_groups": rejoin_groups,
                "survivor_quorum_wait_at_rejoin_s": rejoin_wait,
                "period_s_before_kill": round(period, 2),
                "restart_after_s": args.restart_after,
                # The wall-clock time of day, as the console line shows it.
                "restarted_asked_at": (
                    time.strftime("%H:%M:%S", time.localtime(asked[0].time)) if asked else None
                ),
                "sync_quorum_timeout_s": args.long_period_sync_timeout_s,
            }
            samples.append(sample)
            print(f"[long period] kill {i}: {sample}", flush=True)
        if crashed(job):
            raise RuntimeError("a group crashed during the long-period part")
        waits = [s["survivor_quorum_wait_at_rejoin_s"] for s in samples]
        rejoins = {s["rejoin_sync"] for s in samples}
        quiet = [
            w for n, _, w in sync_quorum_waits(events.of(job.latest(0), SYNC)) if n not in rejoins
        ]
    return {
        "sync_steps": args.long_period_steps,
        "period_s_median": round(sorted(periods)[len(periods) // 2], 2) if periods else None,
        "samples": samples,
        "survivor_quorum_wait_at_rejoin_s_max": max(waits) if waits else None,
        "survivor_quorum_wait_other_syncs_s_median": (
            sorted(quiet)[len(quiet) // 2] if quiet else None
        ),
    }


# ---- part 4 --------------------------------------------------------------------------------

#: The groups of part 4.
ASYNC_GROUPS = 3


def async_kill_part(folder: Path, args: argparse.Namespace, train_args: list[str]) -> dict:
    """Part 4 (see the module docstring): group 2 of 3 SIGKILLed inside an async int4 sync."""
    async_args = [
        *(a for a in train_args if not a.startswith("--fault_tolerance.semi_sync_method")),
        "--fault_tolerance.semi_sync_method=async_diloco",
        "--fault_tolerance.pseudo_grad_dtype=int4",
        "--fault_tolerance.error_feedback",
        f"--fault_tolerance.sync_bucket_mb={args.async_bucket_mb}",
    ]
    lighthouse = LighthouseSettings(
        heartbeat_timeout_ms=args.heartbeat_timeout_ms, join_timeout_ms=args.join_timeout_ms
    )
    victim, samples = ASYNC_GROUPS - 1, []
    with common.trainer_job(
        folder, ASYNC_GROUPS, async_args, ft_args=ft_args(args), lighthouse=lighthouse
    ) as job:
        job.start()
        events = common.GroupEvents(job)
        for i in range(args.async_kills):

            def committed(g: int) -> int:
                return committed_syncs(events.of(job.latest(g), SYNC))

            base = {g: committed(g) for g in range(ASYNC_GROUPS)}
            wait_until(lambda b=base: all(committed(g) >= b[g] + 2 for g in b), args.timeout,
                       "2 committed syncs in every group", job)  # fmt: skip
            logged = len(syncs(events.of(job.latest(victim))))
            wait_until(lambda n=logged: len(syncs(events.of(job.latest(victim)))) > n,
                       args.timeout, "a sync of the victim", job, poll_s=0.02)  # fmt: skip
            killed_at = time.time()
            job.kill_group(victim)
            sample: dict[str, object] = {"kill": i}
            for g in range(ASYNC_GROUPS - 1):
                survivor = job.latest(g)

                def stall(s: Process = survivor, t: float = killed_at) -> Event | None:
                    found = [e for e in events.of(s, COMMITTED_AFTER_STALL) if e.time > t]
                    return found[0] if found else None

                wait_until(lambda f=stall: f() is not None, args.timeout,
                           f"group {g}'s first commit after the kill", job)  # fmt: skip
                seen = stall()
                assert seen is not None
                gone = [e for e in events.of(survivor, PEER_GONE) if e.time > killed_at]
                sample[f"group_{g}"] = {
                    "stall_s": round(seen["stall_s"], 3),
                    "commit_after_kill_s": round(seen.time - killed_at, 3),
                    "groups_then": seen["groups"],
                    "ended_by": (
                        "heartbeat"
                        if gone
                        else "not by heartbeat (its transfers failed at once or were done)"
                    ),
                    "peer_gone_after_kill_s": round(gone[0].time - killed_at, 3) if gone else None,
                }
            samples.append(sample)
            print(f"[async kill] {sample}", flush=True)
            if i < args.async_kills - 1:
                time.sleep(args.restart_after)
                restarted = job.start_group(victim)
                wait_until(lambda r=restarted: committed_syncs(events.of(r, SYNC)) > 0,
                           args.timeout, "a committed sync of the restarted group",
                           job)  # fmt: skip
        if crashed(job):
            raise RuntimeError("a survivor crashed during part 4")
    stalls = [
        sample[f"group_{g}"]["stall_s"]  # type: ignore[index]
        for sample in samples
        for g in range(ASYNC_GROUPS - 1)
    ]
    return {
        "settings": {
            "method": "async DiLoCo (eager), int4 + error feedback",
            "groups": ASYNC_GROUPS,
            "sync_bucket_mb": args.async_bucket_mb,
            "sync_collective_timeout_s": "300 (the default)",
        },
        "samples": samples,
        "survivor_stall_s": {"max": max(stalls), "min": min(stalls), "n": len(stalls)},
    }


# ---- part 2 --------------------------------------------------------------------------------


def survivor_stalls(
    kills: list[dict], t_begin: float, starts: list[Process], emitted_by: dict[str, list[Event]]
) -> list[float]:
    """For each kill, the seconds from the kill to the survivor's next committed sync (also
    written into the kill's record); kills after which the survivor committed none are left
    out."""
    stalls = []
    for k in kills:
        t_kill = t_begin + k["t"]
        back_at = min(
            (s.started for s in starts if s.replica_id == k["group"] and s.started > t_kill),
            default=math.inf,
        )
        candidates = [
            recovery_sync(emitted_by[s.name], t_kill, k["victim_quorums"], GROUPS, back_at)
            for s in starts
            if s.replica_id != k["group"] and s.started < t_kill
        ]
        found = [c for c in candidates if c is not None]
        if found:
            k["survivor_next_committed_sync_s"] = round(min(c[1] for c in found) - t_kill, 3)
            stalls.append(k["survivor_next_committed_sync_s"])
    return stalls


def kill_and_record(job: LocalJob, events: common.GroupEvents, victim: int, t_begin: float) -> dict:
    """SIGKILL the latest start of ``victim``; what it had done since it started."""
    killed = job.kill_group(victim)
    assert killed.killed_at is not None
    emitted = events.of(killed)
    return {
        "group": victim,
        "t": round(killed.killed_at - t_begin, 2),
        # Where the victim was: a restarted group killed before its first committed sync may
        # have been in a quorum with the survivor.
        "victim_steps_since_start": len(timings(emitted)),
        "victim_committed_syncs_since_start": committed_syncs(emitted),
        "victim_is_a_restart": killed is not job.starts[victim][0],
        # Its syncs' quorums: one of them may commit for the survivor just after the kill.
        "victim_quorums": sorted(quorums_of(emitted)),
    }


#: Steps of each baseline process left out of its rate (start-up, first allocations).
BASELINE_WARMUP = 5


def without_ft(train_args: list[str], steps: int) -> list[str]:
    """The soak's trainer flags without its fault-tolerance ones, for ``steps`` steps."""
    kept = [a for a in train_args if not a.startswith(("--fault_tolerance.", "--training.steps"))]
    return [*kept, f"--training.steps={steps}"]


def steps_per_second(events: Iterable[Event], warmup: int = BASELINE_WARMUP) -> float:
    """Inner steps per second of one process after its first ``warmup`` steps."""
    rows = timings(events)
    (s0, t0), (s1, t1) = rows[warmup - 1], rows[-1]
    return (s1 - s0) / (t1 - t0)


def baseline_part(folder: Path, args: argparse.Namespace, train_args: list[str]) -> list[float]:
    """Each group's steps per second without FT, both processes at once on their cores."""
    argv = without_ft(train_args, args.baseline_steps)
    with common.trainer_job(folder, 2, argv, ft_args=()) as job:
        procs = [
            common.start_alone(job, f"no_ft_g{i}", argv, functools.partial(common.pin_to_core, i))
            for i in range(2)
        ]
        common.wait_all(procs, args.timeout)
    return [round(steps_per_second(common.trainer_events(p, TIMING)), 4) for p in procs]


def goodput_with_downtime(
    committed_steps: int, wall_s: float, baseline_steps_per_s: Sequence[float]
) -> float:
    """Committed steps per wall-second over the whole soak ÷ the groups' summed rate
    without FT."""
    return committed_steps / wall_s / sum(baseline_steps_per_s)


def soak_part(folder: Path, args: argparse.Namespace, train_args: list[str]) -> dict:
    kills: list[dict] = []
    with two_groups(folder, args, train_args) as job:
        events = common.GroupEvents(job)
        wait_until(lambda: all(committed_syncs(events.of(job.latest(g), SYNC)) for g in (0, 1)),
                   args.timeout, "a first committed sync in both groups", job)  # fmt: skip
        t_begin = time.monotonic()
        t_end = t_begin + args.minutes * 60
        # Intervals uniform in [0.5, 1.5] x --kill-every, victims drawn from --seed.
        schedule = PeriodicKills(args.kill_every, args.seed, t_begin, jitter=0.5)
        restarts = Restarts(args.restart_after)
        postponed = 0
        while time.monotonic() < t_end:
            now = time.monotonic()
            check_alive(job)
            for g in restarts.take_due(now):
                job.start_group(g)
            if schedule.due(now):
                victim = schedule.choose([0, 1])
                other = job.latest(1 - victim)
                other_ready = (
                    not restarts.pending(1 - victim)
                    and other.alive()
                    and committed_syncs(events.of(other, SYNC)) >= 1
                )
                if restarts.pending(victim) or not other_ready:
                    postponed += 1
                    schedule.reschedule(now, delay_s=1.0)
                else:
                    kills.append(kill_and_record(job, events, victim, t_begin))
                    restarts.schedule(victim, now)
                    print(f"[soak] {now - t_begin:6.1f}s SIGKILL group {victim}", flush=True)
                    schedule.reschedule(now)
            time.sleep(0.1)
        t_stop = time.monotonic()
        crashes = [
            {"group": s.replica_id, "name": s.name, "code": s.returncode} for s in crashed(job)
        ]
        starts = group_starts(job)
        live = [s for s in starts if s.alive()]
        for s in live:  # the end of the soak: stop them (their unfinished period is left out)
            job.kill_group(s.replica_id)  # type: ignore[arg-type]
        emitted_by = {s.name: events.of(s) for s in starts}
        per_start = []
        for s in starts:
            acc = step_accounting(emitted_by[s.name], finished_by_us=s in live)
            acc.update(group=s.replica_id, name=s.name, healed=bool(healed(emitted_by[s.name])))
            per_start.append(acc)
        totals = {
            k: sum(a[k] for a in per_start)
            for k in ("attempted_steps", "committed_steps", "attempted_syncs", "committed_syncs")
        }
        stalls = survivor_stalls(kills, t_begin, starts, emitted_by)
        t_job = min(s.started for s in starts)
        div = divergence(
            [(s.replica_id, emitted_by[s.name]) for s in starts if s.replica_id is not None]
        )
    return {
        "minutes": args.minutes,
        "kills": kills,
        "kills_postponed_checks": postponed,
        "restarts": len(starts) - 2,
        "totals": totals,
        "committed_over_attempted_steps": round(
            totals["committed_steps"] / max(1, totals["attempted_steps"]), 4
        ),
        "committed_over_attempted_syncs": round(
            totals["committed_syncs"] / max(1, totals["attempted_syncs"]), 4
        ),
        "wall_s_from_job_start": round(t_stop - t_job, 2),
        "wall_s_before_the_first_kill_window": round(t_begin - t_job, 2),
        "survivor_kill_to_next_committed_sync_s": stalls,
        "divergence": div,
        "crashes": crashes,
        "per_start": per_start,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, short soak (CI)")
    p.add_argument("--minutes", type=float, default=10.0, help="soak length (default 10)")
    p.add_argument("--kill-every", type=float, default=30.0, help="mean seconds between kills")
    p.add_argument("--restart-after", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kills", type=int, default=2, help="kills measured in part 1")
    p.add_argument("--baseline-steps", type=int, default=300,
                   help="steps of each no-FT process of the soak's goodput baseline")  # fmt: skip
    p.add_argument("--joiner-kills", type=int, default=2,
                   help="part 1: kills of a restarted group around its first sync")  # fmt: skip
    p.add_argument("--sync-steps", type=int, default=5, help="DiLoCo H")
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heartbeat-timeout-ms", type=int, default=2000)
    p.add_argument("--join-timeout-ms", type=int, default=10000)
    p.add_argument("--process-group-timeout-ms", type=int, default=10000,
                   help="the trainer's default; the other benchmarks use 60000")  # fmt: skip
    p.add_argument(
        "--long-period-steps",
        type=int,
        default=300,
        help="DiLoCo H of part 3 (300 debug-model steps: about a minute)",
    )
    p.add_argument(
        "--long-period-sync-timeout-s",
        type=float,
        default=30.0,
        help="sync_quorum_timeout_s of part 3: below the period on purpose",
    )
    p.add_argument("--long-period-kills", type=int, default=2)
    p.add_argument(
        "--async-kills",
        type=int,
        default=3,
        help="part 4: kills of a group inside an async int4 sync, 3 groups",
    )
    p.add_argument(
        "--async-bucket-mb",
        type=float,
        default=0.02,
        help="part 4's sync_bucket_mb: a sync's transfers last seconds",
    )
    p.add_argument("--skip-async", action="store_true", help="no part 4")
    p.add_argument("--skip-long-period", action="store_true", help="no part 3")
    p.add_argument("--skip-recovery", action="store_true", help="soak only")
    p.add_argument("--skip-soak", action="store_true", help="part 1 only")
    p.add_argument("--timeout", type=float, default=240, help="seconds for any one wait")
    p.add_argument("--max-load", type=float, default=1.5)
    p.add_argument("--out", type=Path, help=provenance.output_help("recovery.json"))
    p.add_argument("--logs", type=Path, default=None,
                   help="keep the logs in this folder (default: a temporary one)")  # fmt: skip
    args = p.parse_args(argv)
    if args.smoke:
        # The smoke's defaults; what the command line gives is kept. A 6 s soak with a kill
        # every 1.5-4.5 s kills at least once.
        p.set_defaults(flavor="debugmodel_small", seq_len=32, batch=2, sync_steps=4, kills=1,
                       joiner_kills=1, minutes=0.1, kill_every=3.0, restart_after=1.0,
                       max_load=float("inf"), baseline_steps=20, async_kills=1,
                       async_bucket_mb=0.002)  # fmt: skip
        args = p.parse_args(argv)
        # Part 3 is part 1 with longer periods: tests/integration_tests/
        # test_semi_sync_reliability.py runs that scenario (and CI's time is short).
        args.skip_long_period = True
    args.out = args.out or provenance.default_output("recovery.json", args.smoke)
    return args


def ft_args(args: argparse.Namespace) -> list[str]:
    """The benchmarks' FT settings, with this run's process-group timeout: it bounds how long a
    survivor can wait inside a collective for a peer that died after joining its quorum."""
    flag = "--fault_tolerance.process_group_timeout_ms="
    return [a for a in common.FT_ARGS if not a.startswith(flag)] + [
        f"{flag}{args.process_group_timeout_ms}"
    ]


def on_a_quiet_machine(
    part: Callable[[Path, argparse.Namespace, list[str]], dict],
    folder: Path,
    args: argparse.Namespace,
    train_args: list[str],
) -> dict:
    """Run a part once the machine is quiet (``--max-load``), with the load before and after."""
    load = common.wait_for_quiet_machine(args.max_load, 120)
    found = part(folder, args, train_args)
    found["load_avg_1min_before"] = round(load, 2)
    found["load_avg_1min_after"] = round(common.load_average(), 2)
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    train_args = [
        common.TIMED_MODULE,
        "--fault_tolerance.semi_sync_method=diloco",
        f"--fault_tolerance.sync_steps={args.sync_steps}",
        f"--model.flavor={args.flavor}",
        f"--training.seq_len={args.seq_len}",
        f"--training.local_batch_size={args.batch}",
        "--training.steps=1000000",
        "--metrics.log_freq=50",
        "--metrics.log_param_digest",
        "--validation.enable=false",
        "--metrics.cpu_peak_flops=-1",
    ]
    result: dict[str, object] = {
        "benchmark": "recovery",
        "settings": {
            "method": f"DiLoCo, 1 fragment, H={args.sync_steps}",
            "groups": 2,
            "flavor": args.flavor,
            "seq_len": args.seq_len,
            "local_batch_size": args.batch,
            "network": "127.0.0.1 (no shaping)",
            "lighthouse": f"min_replicas 1, heartbeat_timeout_ms {args.heartbeat_timeout_ms}, "
            f"join_timeout_ms {args.join_timeout_ms}",
            "restart_after_s": args.restart_after,
            "kill_every_s": f"uniform in [{0.5 * args.kill_every:g}, {1.5 * args.kill_every:g}]",
            "seed": args.seed,
            "ft_args": ft_args(args),
        },
        "targets": {
            "committed_over_attempted_steps": ">= 0.80",
            "goodput_with_downtime": "reported (no target)",
            "divergence": "none",
            "survivor_crashes": 0,
            "async_kill_survivor_stall_s": "seconds (a few heartbeat timeouts and periods), "
            "not sync_collective_timeout_s",
        },
    }
    command = provenance.command_line(__file__, argv)
    with tempfile.TemporaryDirectory(prefix="recovery_") as tmp_dir:
        tmp = str(args.logs) if args.logs else tmp_dir
        if not args.skip_recovery:
            load = common.wait_for_quiet_machine(args.max_load, 120)
            result["recovery"] = {
                "load_avg_1min_before": round(load, 2),
                "samples": recovery_part(Path(tmp) / "recovery", args, train_args),
                "load_avg_1min_after": round(common.load_average(), 2),
            }
            provenance.write_result(args.out, result, command)
        if not args.skip_async:
            part = on_a_quiet_machine(async_kill_part, Path(tmp) / "async_kill", args, train_args)
            result["async_kill"] = part
            print(f"[async kill] survivors' stalls {part['survivor_stall_s']}", flush=True)
            provenance.write_result(args.out, result, command)
        if not args.skip_long_period:
            part = on_a_quiet_machine(long_period_part, Path(tmp) / "long_period", args, train_args)
            result["long_period"] = part
            print(f"[long period] {part}", flush=True)
            provenance.write_result(args.out, result, command)
        if not args.skip_soak:
            load = common.wait_for_quiet_machine(args.max_load, 120)
            before = baseline_part(Path(tmp) / "baseline_before", args, train_args)
            soak = soak_part(Path(tmp) / "soak", args, train_args)
            soak["load_avg_1min_before"] = round(load, 2)
            soak["load_avg_1min_after"] = round(common.load_average(), 2)
            after = baseline_part(Path(tmp) / "baseline_after", args, train_args)
            baseline = [(b + a) / 2 for b, a in zip(before, after, strict=True)]
            goodput = goodput_with_downtime(
                soak["totals"]["committed_steps"],
                soak["wall_s_from_job_start"],
                baseline,
            )
            soak["no_ft_steps_per_s"] = {"before": before, "after": after}
            soak["goodput_with_downtime"] = round(goodput, 4)
            soak["targets_met"] = {
                "committed_over_attempted_steps": soak["committed_over_attempted_steps"] >= 0.8,
                "no_divergence": not soak["divergence"]["mismatched"],  # type: ignore[index]
                "no_crash": not soak["crashes"],
            }
            result["soak"] = soak
            print(
                f"[soak] committed/attempted steps {soak['committed_over_attempted_steps']:.3f} "
                f"syncs {soak['committed_over_attempted_syncs']:.3f}  goodput with downtime "
                f"{goodput:.3f} (no-FT steps/s before {before}, after {after})  kills "
                f"{len(soak['kills'])}  divergence {soak['divergence']}  crashes {soak['crashes']}",
                flush=True,
            )
    path = provenance.write_result(args.out, result, command)
    print(f"[recovery] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
