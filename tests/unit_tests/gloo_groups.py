"""Replica groups in one process, one thread each, joined by a real gloo process group.

The semi-sync methods and their sync quorum run unchanged on top: what differs from a real job
is only torchft's Manager, replaced by :class:`LoopbackManager`, which does what semi-sync asks
of it (quorum, step, commit, error, state registration) for one group of one rank, over the
real process group. Collectives, buckets, compression, timeouts and failures are the real ones.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist
from torchft.manager import REPLICA_ID_KEY

from torchtitan.experiments.fault_tolerance.join.speeds import ProbeInFlight
from torchtitan.experiments.fault_tolerance.sync.quorum import SyncQuorum
from torchtitan.experiments.fault_tolerance.transport.peer_watch import PeerWatch
from torchtitan.experiments.fault_tolerance.transport.sync_transport import SyncTransport


def heartbeat_id(rank: int) -> str:
    """The lighthouse id of group ``rank`` in these tests (torchft's ``replica_<R>:<uuid>``)."""
    return f"replica_{rank}:test-start"


class LoopbackManager:
    """torchft's Manager as semi-sync uses it, for one group of one rank in a quorum of all
    ``size`` groups: ``should_commit`` is this group's own verdict (no error since the last
    quorum), and a committed sync advances the step, as in torchft."""

    _use_async_quorum = False

    def __init__(self, pg: dist.ProcessGroup, rank: int, size: int) -> None:
        self._pg = pg
        self.rank = rank
        self.size = size
        self._step = 0
        self._errored: Exception | None = None
        self._commit_failures = 0
        self._quorum_id = 1
        self.fns: dict[str, tuple[Any, Any]] = {}
        self.commits: list[bool] = []
        # The id it heartbeats to the lighthouse under, where torchft keeps it.
        self._store = dist.HashStore()
        self._store.set(REPLICA_ID_KEY, heartbeat_id(rank))

    def start_quorum(self, *args: Any, **kwargs: Any) -> None:
        self._errored = None

    def wait_quorum(self) -> None:
        pass

    def errored(self) -> Exception | None:
        return self._errored

    def report_error(self, error: Exception) -> None:
        self._errored = error

    def should_commit(self, timeout: Any = None) -> bool:
        committed = self._errored is None
        self._step += committed
        self._commit_failures = 0 if committed else self._commit_failures + 1
        self.commits.append(committed)
        return committed

    def num_participants(self) -> int:
        return self.size

    def participating_rank(self) -> int:
        return self.rank

    def is_participating(self) -> bool:
        return True

    def current_step(self) -> int:
        return self._step

    def register_state_dict_fn(self, key: str, load: Any, save: Any) -> None:
        self.fns[key] = (load, save)

    def allow_state_dict_read(self) -> None:
        pass

    def disallow_state_dict_read(self) -> None:
        pass


def open_quorum(sync: SyncQuorum) -> None:
    """A sync quorum with no exchange in it: every group is in it, and none is starting."""
    with sync.sync_rounds() as rounds:
        rounds.form()


class OpenQuorums:
    """``outer_loop.Quorums`` over a sync quorum, with no exchange in them (:func:`open_quorum`);
    a probe plans nothing."""

    def __init__(self, sync: SyncQuorum) -> None:
        self.sync = sync

    def sync_quorum(self) -> bool:
        open_quorum(self.sync)
        return False  # no group heals here

    def start_probe(self) -> ProbeInFlight:
        return ProbeInFlight(self._probe, lambda: None)

    def _probe(self) -> None:
        with self.sync.probe_rounds() as rounds:
            rounds.form()


class OneGroupFT:
    """The core ``FTManager`` as the sync quorum uses it: a quorum of every group, at once."""

    def __init__(self, manager: LoopbackManager) -> None:
        self.manager = manager
        self.replica_id = manager.rank
        self.uncommitted_in_a_row = 0
        self.started = True  # its Manager is built (a group that syncs, not a site's follower)

    @contextlib.contextmanager
    def quorum_rounds(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        yield SimpleNamespace(form=self._form)

    def _form(self) -> int:
        self.manager.start_quorum()
        return self.manager.size

    def should_commit(self, unit: str = "step") -> bool:
        return self.manager.should_commit()

    def register_state_dict_fn(self, key: str, load: Any, save: Any) -> None:
        self.manager.register_state_dict_fn(key, load, save)

    def note_state_written(self) -> None:
        """On a CPU nothing is queued: a heal reads what the host wrote."""


def sync_manager(
    manager: LoopbackManager,
    dtype: str = "float32",
    *,
    error_feedback: bool = False,
    bucket_numel: int = 300,
    timeout_s: float = 30.0,
    fragments: int = 1,
    peers: PeerWatch | None = None,
    keep_delivered: bool = False,
) -> SyncQuorum:
    """The trainer's sync quorum over ``manager``, with buckets of ``bucket_numel`` values;
    ``peers``: what it asks whether a group of the quorum is gone; ``keep_delivered``: the
    transport keeps what each sync delivered (for a heal history)."""
    transport = SyncTransport(
        dtype,
        error_feedback=error_feedback,
        bucket_mb=bucket_numel * 4 / 2**20,
        timeout_s=timeout_s,
        peers=peers,
        keep_delivered=keep_delivered,
    )
    ft: Any = OneGroupFT(manager)
    return SyncQuorum(ft, 1, 60.0, transport=transport, fragments=fragments)


def run_groups(
    size: int, fn: Callable[[int, dist.ProcessGroup], Any], timeout_s: float = 120.0
) -> list[Any]:
    """``fn(rank, pg)`` for ``size`` groups at once, each on its own thread and its own gloo
    process group over one in-memory store; their results in rank order. Raises what a group
    raised, or TimeoutError if one is still running after ``timeout_s``."""
    store = dist.HashStore()
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def body(rank: int) -> None:
        try:
            pg = dist.ProcessGroupGloo(
                dist.PrefixStore("groups", store), rank, size, timedelta(seconds=timeout_s)
            )
            results[rank] = fn(rank, pg)
        except BaseException as e:  # handed to the caller's thread
            errors[rank] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    if any(thread.is_alive() for thread in threads):
        raise TimeoutError(f"a replica group ran past {timeout_s} s")
    for error in errors:
        if error is not None:
            raise error
    return results
