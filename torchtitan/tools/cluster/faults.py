"""When to SIGKILL replica groups and when to restart them: the schedules of fault injection.

They decide; the caller acts (``LocalJob.kill_group`` / ``start_group``) and keeps its own
policy, e.g. never killing the last group standing or not restarting a group once the others
have finished.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence


class StepKills:
    """Kill group R once it has logged step S, for each (R, S) given; each fires once."""

    def __init__(self, plan: Iterable[tuple[int, int]]) -> None:
        self._step_of: dict[int, int] = dict(plan)

    def due(self, replica_id: int, step: int) -> bool:
        """Whether ``replica_id`` must be killed now that it logged ``step`` (consumes it)."""
        target = self._step_of.get(replica_id)
        if target is None or step < target:
            return False
        del self._step_of[replica_id]
        return True


class PeriodicKills:
    """A kill every ``every_s`` seconds (0: never), the victim drawn with a seeded generator.

    With ``jitter`` > 0 each interval is ``every_s * uniform(1 - jitter, 1 + jitter)``, drawn
    from the same generator (a run is repeatable from its seed either way).
    """

    def __init__(self, every_s: float, seed: int, now: float, jitter: float = 0.0) -> None:
        self.every_s = every_s
        self.jitter = jitter
        self.rng = random.Random(seed)
        self.next_at: float | None = None
        if every_s > 0:
            self.reschedule(now)

    def due(self, now: float) -> bool:
        return self.next_at is not None and now >= self.next_at

    def choose(self, candidates: Sequence[int]) -> int:
        """The victim among ``candidates`` (replica ids)."""
        return self.rng.choice(candidates)

    def reschedule(self, now: float, delay_s: float | None = None) -> None:
        """The next kill ``delay_s`` from ``now`` (default: the next interval)."""
        if delay_s is None:
            delay_s = self.every_s
            if self.jitter > 0:
                delay_s *= self.rng.uniform(1 - self.jitter, 1 + self.jitter)
        self.next_at = now + delay_s


class Restarts:
    """Restart each killed group ``after_s`` seconds after its kill."""

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self._at: dict[int, float] = {}

    def schedule(self, replica_id: int, killed_at: float) -> None:
        self._at[replica_id] = killed_at + self.after_s

    def pending(self, replica_id: int) -> bool:
        return replica_id in self._at

    def due(self, replica_id: int, now: float) -> bool:
        at = self._at.get(replica_id)
        return at is not None and now >= at

    def cancel(self, replica_id: int) -> None:
        """Forget a scheduled restart (also once it is done)."""
        self._at.pop(replica_id, None)

    def take_due(self, now: float) -> list[int]:
        """The groups whose restart is due, forgotten as they are returned."""
        due = [r for r in self._at if self.due(r, now)]
        for replica_id in due:
            self.cancel(replica_id)
        return due
