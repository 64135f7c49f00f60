"""On one GPU: nccl's semantics that ``test_nccl_semantics.py`` builds on the CPU, checked on the
real backend with a world-size-1 torchft nccl group built as the trainer builds it
(``build.fresh_rendezvous_process_group``). Seconds of compute queued with
``torch.cuda._sleep`` hold a collective (on the stream it waits for) or stand for training's
next step (on another stream).

What one GPU cannot show: a peer's death during a collective (nccl refuses two ranks of one
communicator on one GPU); ``scripts/gpu_check.sh --gpus 2`` kills a group over nccl.

Every test skips without CUDA. ``scripts/gpu_check.sh`` runs them and reads their figures from
``$GPU_CHECK_OUT/nccl_semantics.json`` (each test adds its own key before it asserts).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchft.process_group import _WorkAcceleratorTimeout

from tests.unit_tests.gloo_groups import LoopbackManager
from tests.unit_tests.test_sync_wait_cuda import cycles_per_second
from torchtitan.components.ft import streams
from torchtitan.components.ft import torchft_adapter as tft
from torchtitan.components.ft.build import REPLICA_NCCL_ENVIRONMENT, fresh_rendezvous_process_group
from torchtitan.components.ft.delivery import wait_delivered
from torchtitan.components.ft.timeouts import ReplicaTimeouts
from torchtitan.experiments.fault_tolerance.join.speeds import ProbeInFlight
from torchtitan.experiments.fault_tolerance.sync.quorum import (
    RUNNING,
    Member,
    exchange,
)
from torchtitan.experiments.fault_tolerance.transport.sync_transport import (
    CollectiveTimeout,
    SyncTransport,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not dist.is_nccl_available(), reason="needs CUDA and nccl"
)

#: Compute queued in front of (or beside) a collective: long against a wait of milliseconds.
QUEUED_S = 1.5
#: The abort path: a transfer held this long past a collective timeout of ``TIMEOUT_S``.
TIMEOUT_S = 2.0
HELD_S = 4.5
#: Where the GPU check finds this file's figures (in ``$GPU_CHECK_OUT``).
FIGURES = "nccl_semantics.json"
#: c10d's ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` values (``ErrorHandlingMode``).
ERROR_HANDLING_MODES = {"0": "NoHandling", "1": "TearDown", "2": "CleanUpOnly", "3": "SkipCleanUp"}
C10D_DEFAULT_MODE = "3"
ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
DUMP_ENV = "TORCH_NCCL_DUMP_ON_TIMEOUT"


def record(key: str, value: Any) -> None:
    """``value`` under ``key`` in ``$GPU_CHECK_OUT/nccl_semantics.json`` (when that is set)."""
    out = os.environ.get("GPU_CHECK_OUT")
    if not out:
        return
    path = Path(out, FIGURES)
    found = json.loads(path.read_text()) if path.exists() else {}
    found[key] = value
    path.write_text(json.dumps(found, indent=2) + "\n")


def queue_compute(seconds: float) -> None:
    """``seconds`` of GPU time on the current stream (the host does not wait)."""
    torch.cuda._sleep(int(seconds * cycles_per_second()))


def sum_options() -> dist.AllreduceOptions:
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
    return options


class OneRank:
    """A world-size-1 torchft nccl group as the trainer builds it, on a store of its own;
    :meth:`new_quorum` reconfigures it as torchft does at a quorum."""

    def __init__(self, collective_s: float) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        timeouts = ReplicaTimeouts.of(60_000, 60.0, collective_timeout_s=collective_s)
        self.pg = fresh_rendezvous_process_group("nccl", timeouts)
        self.quorum = 0
        self.new_quorum()

    def new_quorum(self) -> None:
        self.quorum += 1
        self.pg.configure(f"127.0.0.1:{self.store.port}/nccl_semantics", "0", 0, 1,
                          quorum_id=self.quorum)  # fmt: skip


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., OneRank]]:
    """Builds :class:`OneRank` groups (``collective_s``: the collective timeout), aborted after
    the test."""
    built: list[OneRank] = []

    def build(collective_s: float = 60.0) -> OneRank:
        timeouts = ReplicaTimeouts.of(60_000, 60.0, collective_timeout_s=collective_s)
        for name, value in timeouts.nccl_environment().items():
            monkeypatch.setenv(name, value)  # this group's, not an earlier test's; restored
        for name in REPLICA_NCCL_ENVIRONMENT:  # set by building the group; restored after
            monkeypatch.delenv(name, raising=False)
        built.append(OneRank(collective_s))
        return built[-1]

    yield build
    for group in built:
        group.pg.abort()


class _RecordingBackend:
    """torch's nccl backend class, recording ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` and
    ``TORCH_NCCL_DUMP_ON_TIMEOUT`` at each construction (c10d reads them then)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.Options = real.Options
        self.seen: list[tuple[str | None, str | None]] = []

    def __call__(self, *args: Any) -> Any:
        self.seen.append((os.environ.get(ERROR_HANDLING_ENV), os.environ.get(DUMP_ENV)))
        return self.real(*args)


def _mode(value: str | None) -> dict[str, str]:
    shown = C10D_DEFAULT_MODE if value is None else value
    return {"value": "unset" if value is None else value,
            "mode": ERROR_HANDLING_MODES.get(shown, "unknown")}  # fmt: skip


def test_the_replicate_groups_backend_only_aborts_its_communicator_and_torchft_aborts(
    one_rank: Callable[..., OneRank], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recorded for the GPU check: NCCL's version; torchft's abort mode (``_use_abort``, NCCL
    >= 2.25: every work wrapped in ``_WorkAcceleratorTimeout``, whose timer aborts the group);
    the error-handling mode of the replicate group's backend, as the environment held it when
    c10d built it (and whether it signals flight-recorder dumps), and of the groups built
    before it (the process's own, c10d's default 3 if unset)."""
    recording = _RecordingBackend(dist.ProcessGroupNCCL)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", recording)
    process_value = os.environ.get(ERROR_HANDLING_ENV)
    group = one_rank()
    buffer = torch.ones(4, device="cuda")
    work = group.pg.allreduce([buffer], sum_options())
    wait_delivered(work, group.pg)
    version = torch.cuda.nccl.version()
    figures = {
        "nccl_version": ".".join(map(str, version)) if isinstance(version, tuple) else version,
        "torchft_use_abort": bool(group.pg._use_abort),
        "torchft_work": type(work).__name__,
        "error_handling": {
            "replicate_group": [_mode(mode) for mode, _ in recording.seen],
            "replicate_group_dump_on_timeout": [dump for _, dump in recording.seen],
            "groups_built_before": _mode(process_value),
        },
    }
    record("versions_and_modes", figures)
    assert recording.seen == [("2", "0")], figures
    assert isinstance(work, _WorkAcceleratorTimeout) == group.pg._use_abort, figures
    assert torch.equal(buffer.cpu(), torch.ones(4))


def test_nccls_wait_returns_before_the_result_and_wait_delivered_once_it_landed(
    one_rank: Callable[..., OneRank],
) -> None:
    """``test_nccl_semantics.py``'s model of nccl, on the real backend: ``wait()`` only orders
    the caller's stream, so it returns while the collective is still queued (behind compute
    on the stream it waits for); ``wait_delivered`` returns once the result is there."""
    group = one_rank()
    buffer = torch.full((4,), 3.0, device="cuda")
    wait_delivered(group.pg.allreduce([buffer], sum_options()), group.pg)  # connected
    torch.cuda.synchronize()
    queue_compute(QUEUED_S)
    work = group.pg.allreduce([buffer], sum_options())
    start = time.perf_counter()
    work.wait()
    wait_s = time.perf_counter() - start
    landed_at_wait = bool(tft.backend_work(work).is_completed())
    wait_delivered(work, group.pg)
    delivered_s = time.perf_counter() - start
    landed = bool(tft.backend_work(work).is_completed())
    figures = {"queued_compute_s": QUEUED_S, "wait_s": round(wait_s, 4),
               "landed_when_wait_returned": landed_at_wait,
               "wait_delivered_s": round(delivered_s, 3),
               "landed_when_wait_delivered_returned": landed}  # fmt: skip
    record("wait_and_wait_delivered", figures)
    assert wait_s < QUEUED_S / 4 and not landed_at_wait, figures
    assert landed and delivered_s >= QUEUED_S / 2, figures
    assert torch.equal(buffer.cpu(), torch.full((4,), 3.0))


def test_the_quorum_exchange_reads_the_records_once_they_arrived(
    one_rank: Callable[..., OneRank],
) -> None:
    """Item 2: the exchange's records are read only once they have arrived, here behind
    compute queued on its own stream; and its wait is no device-wide synchronize: compute
    queued on another stream does not hold it up."""
    group = one_rank()
    manager = LoopbackManager(group.pg, 0, 1)
    mine = Member(RUNNING, has_digest=1, digest=0x1234_5678_9ABC, step_us=777, replica=3)
    device = torch.device("cuda", torch.cuda.current_device())
    exchange(manager, mine, device)  # the communicator's first
    torch.cuda.synchronize()
    queue_compute(QUEUED_S)  # in front of the exchange, on the stream it runs on
    start = time.perf_counter()
    behind = exchange(manager, mine, device)
    behind_s = time.perf_counter() - start
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        queue_compute(QUEUED_S)  # beside it: training's stream, in the probe's case
    start = time.perf_counter()
    beside = exchange(manager, mine, device)
    beside_s = time.perf_counter() - start
    torch.cuda.synchronize()
    figures = {"queued_compute_s": QUEUED_S, "exchange_behind_it_s": round(behind_s, 3),
               "exchange_beside_it_s": round(beside_s, 4),
               "records_right": behind == [mine] and beside == [mine]}  # fmt: skip
    record("exchange", figures)
    assert manager.errored() is None
    assert behind == [mine] and beside == [mine], (behind, beside)
    assert behind_s >= QUEUED_S / 2, figures  # its records were queued behind the compute
    assert beside_s < QUEUED_S / 4, figures


def test_dylus_probe_does_not_wait_for_the_kernels_training_queues_meanwhile(
    one_rank: Callable[..., OneRank], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 3: the probe (a thread, which starts on the training stream) exchanges on a stream
    of its own, so it finishes while the training thread's next kernel, queued after the
    probe started, still runs; and it leaves the training thread's stream alone."""
    group = one_rank()
    manager = LoopbackManager(group.pg, 0, 1)
    device = torch.device("cuda", torch.cuda.current_device())
    mine = Member(RUNNING, probe=1, step_us=1234, replica=1)
    exchange(manager, mine, device)  # the communicator's first
    issued_on: list[str] = []
    issue = group.pg.allreduce

    def recording(tensors: list[torch.Tensor], options: Any) -> Any:
        issued_on.append(streams.current_stream(device))
        return issue(tensors, options)

    monkeypatch.setattr(group.pg, "allreduce", recording)
    torch.cuda.synchronize()
    entered, queued = threading.Event(), threading.Event()
    found: dict[str, Any] = {}

    def probe() -> None:
        entered.set()
        assert queued.wait(30), "the training thread queued nothing"
        start = time.perf_counter()
        found["records"] = exchange(manager, mine, device)
        found["seconds"] = time.perf_counter() - start

    flight = ProbeInFlight(probe, lambda: None)
    assert entered.wait(30)
    queued_at = time.perf_counter()
    queue_compute(QUEUED_S)  # the training thread's next inner step
    queued.set()
    deadline = time.monotonic() + 30
    while not flight.done() and time.monotonic() < deadline:
        time.sleep(0.001)
    probe_done_s = time.perf_counter() - queued_at
    done = flight.done()
    still_running = not torch.cuda.current_stream(device).query()
    figures = {"queued_compute_s": QUEUED_S, "probe_exchange_s": found.get("seconds"),
               "probe_done_after_queueing_s": round(probe_done_s, 3),
               "training_kernel_still_running": still_running,
               "issued_on": issued_on}  # fmt: skip
    record("probe", figures)
    assert done, "the probe did not finish within 30 s"
    flight.finish()  # raises what the probe raised
    torch.cuda.synchronize()
    assert found["records"] == [mine]
    assert found["seconds"] < QUEUED_S / 4 and still_running, figures
    assert issued_on and streams.DEFAULT not in issued_on, figures
    assert streams.current_stream(device) == streams.DEFAULT


def test_a_transfer_held_past_its_timeout_fails_the_sync_and_the_next_one_commits(
    one_rank: Callable[..., OneRank], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The abort path: a sync's transfer held on the device past ``sync_collective_timeout_s``
    (2 s; compute queued in front of its collective on the stream the collective waits for,
    as a peer that never joins it would hold it) ends at the lane's wait for its result (the
    c10d work's wait with that timeout aborts the communicator); the sync fails as timed out
    (not committed). After the next quorum's group is built, the next sync
    commits with the right values. Runs last: an abort that broke the device fails only it."""
    group = one_rank(TIMEOUT_S)
    if not group.pg._use_abort:
        record("abort", {"skipped": "NCCL < 2.25: torchft leaves timeouts to c10d's watchdog"})
        pytest.skip("NCCL < 2.25: torchft does not abort; c10d's watchdog ends collectives")
    held_cycles = int(HELD_S * cycles_per_second())
    hold = [True]
    issue = group.pg.allreduce

    def held(tensors: list[torch.Tensor], options: Any) -> Any:
        if hold[0]:  # on the transfer's stream (the lane's), after its finiteness check
            torch.cuda._sleep(held_cycles)
        return issue(tensors, options)

    monkeypatch.setattr(group.pg, "allreduce", held)
    # One rank has nobody to talk to, and the lane would issue no collective at all: claiming
    # two makes it issue its all-reduce, which over the one real rank SUMs its own values.
    monkeypatch.setattr(group.pg, "size", lambda: 2)
    manager = LoopbackManager(group.pg, 0, 1)
    transport = SyncTransport("float32", error_feedback=False, bucket_mb=1.0, timeout_s=TIMEOUT_S)
    values = torch.arange(1000, dtype=torch.float32, device="cuda") / 7

    def sync() -> tuple[torch.Tensor, bool, float]:
        manager.start_quorum()
        transport.begin_sync(manager, 0)
        tensor = values.clone()
        start = time.perf_counter()
        work = transport.allreduce(manager, tensor, average=True)
        transport.flush()
        work.wait()
        seconds = time.perf_counter() - start
        committed = manager.should_commit()
        transport.end_sync(committed)
        return tensor, committed, seconds

    try:
        _, held_committed, held_s = sync()
        timed_out = transport.timed_out
        hold[0] = False
        group.new_quorum()
        tensor, committed, next_s = sync()
        issued = [w.stats is not None and w.stats.bytes_sent > 0 for w in transport.works]
        figures = {"collective_timeout_s": TIMEOUT_S, "held_s": HELD_S,
                   "held_sync_committed": held_committed, "held_sync_s": round(held_s, 3),
                   "timed_out": None if timed_out is None else str(timed_out),
                   "next_sync_committed": committed, "next_sync_s": round(next_s, 3),
                   "next_sync_issued_its_collective": bool(issued) and all(issued),
                   "next_sync_values_right": bool(torch.equal(tensor, values))}  # fmt: skip
        record("abort", figures)
    finally:
        transport.shutdown()
    assert not held_committed and isinstance(timed_out, CollectiveTimeout), figures
    assert TIMEOUT_S <= held_s < HELD_S + 10, figures
    assert committed and transport.timed_out is None and manager.errored() is None, figures
    assert figures["next_sync_issued_its_collective"] and figures["next_sync_values_right"]
