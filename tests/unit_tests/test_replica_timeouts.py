"""Every timeout of the replicate process group comes from the fields that govern it, and
reaches c10d and torchft (nccl's intercepted here: no CUDA needed); a heal travels in bounded
pieces (real gloo groups)."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.gloo_groups import run_groups
from torchtitan.components.ft import torchft_adapter as tft
from torchtitan.components.ft.build import fresh_rendezvous_process_group
from torchtitan.components.ft.timeouts import NONBLOCKING_TIMEOUT_ENV, ReplicaTimeouts
from torchtitan.experiments.fault_tolerance.heal.pieces import MAX_PIECES, PiecewiseGroup


def test_each_timeout_comes_from_the_field_that_governs_it() -> None:
    """Semi-sync (sync_collective_timeout_s 300, timeout_s 600): one operation may take 600 s
    (a heal's piece), c10d's watchdog waits twice that plus a minute. Without semi-sync a
    collective is a step's all-reduce (process_group_timeout_ms)."""
    semi = ReplicaTimeouts.of(10_000, 600.0, 300.0)
    assert semi.rendezvous == timedelta(seconds=10)
    assert semi.collective == timedelta(seconds=300)
    assert semi.operation == timedelta(seconds=600)
    assert semi.watchdog == timedelta(seconds=1260)
    assert semi.nccl_environment() == {NONBLOCKING_TIMEOUT_ENV: "600"}
    steps = ReplicaTimeouts.of(10_000, 60.0)
    assert steps.collective == timedelta(seconds=10) and steps.operation == timedelta(seconds=60)


def test_with_the_default_fields_the_watchdog_outlasts_a_sync_longer_than_a_heal() -> None:
    """The fields' defaults (sync_collective_timeout_s 300, timeout_s 60): a sync's bucket may
    take 300 s, longer than a heal's piece, so the longest operation, and with it
    ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` and c10d's watchdog, follow the collective's 300 s, not
    the heal's 60 s (a watchdog sized on the heal would tear a slow but healthy sync down)."""
    from torchtitan.config import ConfigManager

    job = ConfigManager().parse_args(
        [
            "--job.custom_args_module=torchtitan.experiments.fault_tolerance.job_config",
            "--fault_tolerance.enable",
            "--fault_tolerance.group_size=2",
            "--fault_tolerance.semi_sync_method=diloco",
        ]
    )
    ft = job.fault_tolerance
    assert (ft.sync_collective_timeout_s, ft.timeout_s) == (300.0, 60.0)  # the defaults
    timeouts = ReplicaTimeouts.of(
        ft.process_group_timeout_ms, ft.timeout_s, ft.sync_collective_timeout_s
    )
    assert timeouts.operation == timedelta(seconds=300) > timeouts.heal
    assert timeouts.watchdog == timedelta(seconds=660)
    assert timeouts.nccl_environment() == {NONBLOCKING_TIMEOUT_ENV: "300"}


class _Options:
    """Stands in for c10d's ``ProcessGroupNCCL.Options`` (absent from CPU builds of torch)."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(blocking=True)
        self._timeout = timedelta(minutes=10)  # c10d's default
        self.global_ranks_in_group: list[int] = []
        self.group_name = ""


def test_the_nccl_group_gets_its_timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the project hands torchft's nccl group, intercepted where it meets c10d: the
    communicator's options carry the watchdog's timeout (c10d's default is 10 min per
    operation, from its queueing: a full heal of 8B at 1 Gbit/s takes 21 min), the environment
    ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` (which also bounds creating a heal's point-to-point
    communicator), the group its timer around issuing an operation, a wait that names no
    timeout the collective's, and a new group's rendezvous the short one."""
    monkeypatch.delenv(NONBLOCKING_TIMEOUT_ENV, raising=False)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", SimpleNamespace(Options=_Options), raising=False)
    from torchft.process_group import ProcessGroupWrapper

    # torchft's nccl group cannot be built without CUDA: the wrapper it extends stands in.
    monkeypatch.setattr(tft, "reconfigurable_group_class", lambda backend: ProcessGroupWrapper)
    built: list[tuple[Any, ...]] = []
    store_timeout_at_build: list[timedelta] = []

    def build(*args: Any) -> str:
        built.append(args)
        store_timeout_at_build.append(args[0].timeout)
        return "group"

    monkeypatch.setattr(tft, "build_nccl_group", build)
    timeouts = ReplicaTimeouts.of(5_000, 1800.0, 300.0)
    pg = fresh_rendezvous_process_group("nccl", timeouts)
    import os

    assert os.environ[NONBLOCKING_TIMEOUT_ENV] == "1800"
    assert pg._timeout == timedelta(seconds=1800)  # torchft's timer around issuing
    store = dist.HashStore()
    pg._global_ranks, pg._quorum_id, pg._group_rank, pg._group_world_size = [1, 3], 7, 1, 2
    pg._use_abort = True  # what torchft's nccl group sets from NCCL's version (>= 2.25)
    assert pg._create_pg(store, 1, 2) == "group"
    ((_, rank, size, options),) = built
    assert (rank, size) == (1, 2)
    assert options._timeout == timedelta(seconds=3660) == timeouts.watchdog
    assert options.config.blocking is False
    assert options.global_ranks_in_group == [1, 3]
    assert options.group_name == "torchft_quorum_7_rank_1"
    # A member that never joins the group: the rendezvous's timeout while the group is built;
    # then the store only pairs a heal's point-to-point communicators, on the heal's timeout.
    assert store_timeout_at_build == [timedelta(seconds=5)]
    assert store.timeout == timedelta(seconds=1800) == timeouts.operation
    work = pg._wrap_work(object(), dist.AllreduceOptions())
    assert work._timeout == timedelta(seconds=300)  # the quorum's exchange, say
    monkeypatch.setenv(NONBLOCKING_TIMEOUT_ENV, "42")  # the user's value stays
    fresh_rendezvous_process_group("nccl", timeouts)
    assert os.environ[NONBLOCKING_TIMEOUT_ENV] == "42"


def test_a_heal_travels_in_pieces_with_few_queued() -> None:
    """A 1,000-byte tensor and a 100-value fp32 one through the heal's group with 96-byte
    pieces, 2 queued at most: each arrives whole and exact, in 11 and 5 operations, never
    more than 2 queued; a tensor too large for MAX_PIECES pieces gets larger ones."""

    def group(rank: int, pg: Any) -> tuple[list[torch.Tensor], int, int]:
        heal = PiecewiseGroup(pg, timedelta(seconds=30), piece_bytes=96, in_flight=2)
        sent = [torch.arange(1000, dtype=torch.int64).to(torch.uint8), torch.randn(100)]
        with heal.heal():
            if rank == 0:
                works = [heal.send([t], 1, tag=3 + i) for i, t in enumerate(sent)]
                got = sent
            else:
                got = [torch.empty_like(t) for t in sent]
                works = [heal.recv([t], 0, tag=3 + i) for i, t in enumerate(got)]
            for work in works:
                work.wait(timedelta(seconds=30))
        assert not heal._queued  # nothing of the heal is held after it
        return got, heal.issued, heal.most_queued

    (sent, issued, most), (got, issued_1, most_1) = run_groups(2, group, timeout_s=60)
    assert all(torch.equal(a, b) for a, b in zip(sent, got, strict=True))
    assert issued == issued_1 == 11 + 5
    assert most <= 2 and most_1 <= 2
    from torchtitan.experiments.fault_tolerance.heal.pieces import pieces_of

    big = torch.empty(MAX_PIECES * 10 + 1, dtype=torch.uint8)
    assert len(pieces_of(big, 4)) <= MAX_PIECES
    assert sum(p.numel() for p in pieces_of(big, 4)) == big.numel()


class _Issued:
    """A piece's work in a fake group: records when it is waited for."""

    def __init__(self, log: list[tuple[str, int]], number: int) -> None:
        self.log, self.number = log, number

    def wait(self, timeout: Any = None) -> bool:
        self.log.append(("waited", self.number))
        return True

    def is_completed(self) -> bool:  # gloo's: done once waited for
        return True

    def exception(self) -> None:
        return None


def test_a_heal_waits_for_its_oldest_piece_before_it_issues_another() -> None:
    """A 10-piece tensor sent with at most 3 pieces in flight: piece k is issued only after
    piece k - 3 was waited for (the queue's length alone could not tell a sender that drops
    its oldest piece unwaited), and each piece is waited for once."""
    log: list[tuple[str, int]] = []

    class Group:
        def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> _Issued:
            number = sum(1 for event, _ in log if event == "issued")
            log.append(("issued", number))
            return _Issued(log, number)

    heal = PiecewiseGroup(Group(), timedelta(seconds=30), piece_bytes=10, in_flight=3)
    with heal.heal():
        heal.send([torch.zeros(100, dtype=torch.uint8)], 1, tag=0).wait()
    issued = [n for event, n in log if event == "issued"]
    assert issued == list(range(10))
    for k in range(3, 10):
        assert log.index(("waited", k - 3)) < log.index(("issued", k)), log
    assert sorted(n for event, n in log if event == "waited") == list(range(10))
