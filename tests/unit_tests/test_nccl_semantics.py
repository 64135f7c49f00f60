"""nccl's failure semantics, by construction: what each wait, group and thread is built with.

gloo raises a failure in ``wait()`` and runs nothing on a device stream; nccl returns from
``wait()`` at once, delivers later, and shows a failure only as the work's exception or the
group's abort. These tests run the code written for nccl against ``nccl_semantics``'s
:class:`NcclLikeGroup` (those semantics over real gloo groups) and observe the environment,
options, streams and timeouts each piece is built with.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from tests.unit_tests.gloo_groups import LoopbackManager, run_groups
from tests.unit_tests.nccl_semantics import NcclLikeGroup
from torchtitan.components.ft import streams
from torchtitan.components.ft import torchft_adapter as tft
from torchtitan.components.ft.build import fresh_rendezvous_process_group
from torchtitan.components.ft.delivery import CollectiveFailed, wait_delivered
from torchtitan.components.ft.timeouts import ReplicaTimeouts
from torchtitan.experiments.fault_tolerance.heal.checkpoint_transport import build_history_transport
from torchtitan.experiments.fault_tolerance.heal.exchange import HEAL_KEY, HealAnswer
from torchtitan.experiments.fault_tolerance.heal.history import ReplayBasis
from torchtitan.experiments.fault_tolerance.heal.pieces import PiecewiseGroup
from torchtitan.experiments.fault_tolerance.join.speeds import ProbeInFlight
from torchtitan.experiments.fault_tolerance.sync.quorum import (
    RUNNING,
    Member,
    RankInGroup,
    exchange,
    in_group_wait,
)
from torchtitan.experiments.fault_tolerance.transport.runner import (
    AsyncCompressedAllReduce,
)

CPU = torch.device("cpu")


# ---- item 1: a peer's death never kills the survivors ----------------------------------------


ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
DUMP = "TORCH_NCCL_DUMP_ON_TIMEOUT"
MONITORING = "TORCH_NCCL_ENABLE_MONITORING"


@pytest.mark.parametrize("user_value", [None, "3"])
def test_the_replicate_group_is_built_to_only_abort_its_communicator_on_an_error(
    monkeypatch: pytest.MonkeyPatch, user_value: str | None
) -> None:
    """c10d's default (3) ends the process when its watchdog sees a peer's closed connection,
    and a flight-recorder dump signal makes the first group's heartbeat monitor end it
    minutes later: before torchft's nccl group exists (c10d reads both when it builds a
    backend), the process asks for 2 (abort the communicator, keep the process) and no dump,
    whatever its environment said."""
    from torchft.process_group import ProcessGroupWrapper

    for name in (ERROR_HANDLING, DUMP):
        if user_value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, user_value)
    seen: list[tuple[str | None, str | None]] = []

    class Recording(ProcessGroupWrapper):  # torchft's nccl group needs CUDA: its base instead
        def __init__(self, timeout: timedelta) -> None:
            seen.append((os.environ.get(ERROR_HANDLING), os.environ.get(DUMP)))
            super().__init__(timeout=timeout)

    monkeypatch.setattr(tft, "reconfigurable_group_class", lambda backend: Recording)
    fresh_rendezvous_process_group("nccl", ReplicaTimeouts.of(5_000, 60.0, 300.0))
    assert seen == [("2", "0")]


def test_fault_tolerance_on_nccl_builds_no_heartbeat_monitor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Set before the process's first nccl group (its monitor watches for every group's dump
    signal and ends the process); only with fault tolerance on a GPU."""
    from torchtitan.config.job_config import JobConfig
    from torchtitan.distributed import parallel_dims

    monkeypatch.delenv(MONITORING, raising=False)
    monkeypatch.setattr(parallel_dims, "pick_device", lambda config: torch.device("cuda", 0))
    config = JobConfig()
    parallel_dims.init_distributed(config)  # one rank: no group at all
    assert MONITORING not in os.environ
    config.fault_tolerance.enable = True
    parallel_dims.init_distributed(config)
    assert os.environ[MONITORING] == "0"


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_collective_that_fails_on_nccl_fails_the_sync_instead_of_landing_half(
    dtype: str,
) -> None:
    """Group 1's collective fails after half its result landed (the watchdog saw the peer's
    connection close and aborted the communicator): its ``wait`` returned normally, so only
    the work's exception tells. The transfer reports the failure (the sync is not committed);
    group 0's, which succeeded, holds the whole sum, read after it landed."""
    numel = 5000
    values = [torch.full((numel,), 1.0 + r) for r in range(2)]

    def group(rank: int, pg: dist.ProcessGroup) -> tuple[list[Exception], torch.Tensor]:
        nccl = NcclLikeGroup(pg)
        runner = AsyncCompressedAllReduce()
        tensor = values[rank].clone()
        if rank == 1:  # its last collective: float32 has one, int8 an all-to-all and a gather
            nccl.fail_next(after=0 if dtype == "float32" else 1)
        work = runner.submit(nccl, tensor, dtype)  # type: ignore[arg-type]
        work.wait()
        runner.shutdown()
        return ([] if work.error is None else [work.error]), tensor

    (errors_0, sum_0), (errors_1, _) = run_groups(2, group, timeout_s=60)
    assert errors_0 == [] and torch.allclose(sum_0, torch.full((numel,), 3.0), atol=0.05)
    assert len(errors_1) == 1 and isinstance(errors_1[0], CollectiveFailed)
    assert "remote process exited" in str(errors_1[0])


# ---- item 2: the quorum exchange reads only what has arrived ---------------------------------


class _TorchftLikeManager(LoopbackManager):
    """torchft's Manager over an nccl group: its all-reduce's ``wait`` returns at once."""

    def allreduce(self, tensor: torch.Tensor, reduce_op: Any = ReduceOp.SUM) -> Any:
        options = dist.AllreduceOptions()
        options.reduceOp = ReduceOp(ReduceOp.SUM)
        return self._pg.allreduce([tensor], options)

    def participating_rank(self) -> int:
        return self.rank


def _exchange_in(plant: str, land_after_s: float = 0.3) -> list[tuple[Any, Any]]:
    def group(rank: int, pg: dist.ProcessGroup) -> tuple[Any, Any]:
        nccl = NcclLikeGroup(pg, land_after_s=land_after_s)
        if plant == "fail" and rank == 1:
            nccl.fail_next()
        if plant == "hang" and rank == 1:
            nccl.hang_next()
        manager = _TorchftLikeManager(nccl, rank, 2)  # type: ignore[arg-type]
        mine = Member(RUNNING, has_digest=1, digest=100 + rank, replica=rank)
        got = exchange(manager, mine, CPU, timedelta(seconds=2))  # type: ignore[arg-type]
        return got, manager.errored()

    return run_groups(2, group, timeout_s=60)


def test_the_quorum_exchange_reads_the_records_once_they_arrived() -> None:
    (got_0, error_0), (got_1, error_1) = _exchange_in("nothing")
    expected = [Member(RUNNING, has_digest=1, digest=100 + r, replica=r) for r in range(2)]
    assert got_0 == expected and got_1 == expected
    assert error_0 is None and error_1 is None


def test_a_quorum_exchange_that_fails_on_nccl_is_no_exchange() -> None:
    """Not zeros or half a sum read as records (a shape that seems to differ, a false
    disagreement): the exchange says it failed and the Manager fails the quorum's commit."""
    (_, error_0), (got_1, error_1) = _exchange_in("fail")
    assert got_1 is None and isinstance(error_1, CollectiveFailed)


def test_a_quorum_exchange_that_never_arrives_ends_at_its_timeout() -> None:
    """A peer that died after the quorum formed: the exchange waits its timeout (2 s here),
    the communicator is aborted, and it says it failed, rather than read what the buffer
    held."""
    start = time.monotonic()
    (_, _), (got_1, error_1) = _exchange_in("hang")
    assert got_1 is None and "timeout" in str(error_1)
    assert time.monotonic() - start < 30


# ---- item 3: DyLU's probe never holds up training's stream ------------------------------------


def test_dylus_probe_exchanges_on_a_stream_of_its_own() -> None:
    """Every thread starts on the training stream: an exchange waited for there would make the
    next inner step wait for every probing group."""
    nccl = NcclLikeGroup(land_after_s=0.0)

    def probe() -> None:
        buffer = torch.zeros(4, dtype=torch.int64)
        options = dist.AllreduceOptions()
        wait_delivered(nccl.allreduce([buffer], options), nccl)

    flight = ProbeInFlight(probe, lambda: None)
    flight.finish()
    (issued,) = nccl.issued
    assert issued.issued_on != streams.DEFAULT
    assert issued.waited_on and streams.DEFAULT not in issued.waited_on
    assert streams.current_stream(CPU) == streams.DEFAULT  # the training thread's is left alone


# ---- item 4: the group's decisions outlast its ranks' work across groups ----------------------


def test_a_groups_ranks_decide_on_a_host_group_that_outlasts_their_work_across_groups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[tuple[str, timedelta]] = []
    reduced: list[tuple[Any, torch.device]] = []
    host_group = object()

    def new_group(*, backend: str, timeout: timedelta) -> Any:
        built.append((backend, timeout))
        return host_group

    def all_reduce(tensor: torch.Tensor, op: Any, group: Any = None) -> None:
        reduced.append((group, tensor.device))

    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    wait = in_group_wait(quorum_s=3600, heal_s=60, collective_s=300)
    rank = RankInGroup.build(torch.device("meta"), 2, wait)  # the device's group is not used
    rank.most([1, 0])
    assert built == [("gloo", wait)] and reduced == [(host_group, CPU)]
    # A quorum, then two operations of the longer kind, then c10d's margin.
    assert wait == timedelta(seconds=3600 + 2 * 300 + 60)
    assert in_group_wait(10, 900, 300) == timedelta(seconds=10 + 2 * 900 + 60)
    assert RankInGroup.build(CPU, 1, wait).host_group is None and len(built) == 1


def test_a_group_of_two_ranks_decides_alike_on_its_host_group() -> None:
    """Two real ranks (gloo): each gets the element-wise largest of both ranks' numbers."""

    def rank(r: int, pg: dist.ProcessGroup) -> list[int]:
        group = RankInGroup(CPU, 2, pg)
        return group.most([r, 5 - r, 7])

    assert run_groups(2, rank) == [[1, 5, 7], [1, 5, 7]]


# ---- the wait itself ----------------------------------------------------------------------


def test_wait_delivered_waits_for_the_result_not_for_wait() -> None:
    nccl = NcclLikeGroup(land_after_s=0.5)
    tensor = torch.arange(6, dtype=torch.float32)
    expected = tensor.clone()
    work = nccl.allreduce([tensor], dist.AllreduceOptions())
    tensor.zero_()  # nccl reads its input when it runs: the landed result is what it read
    started = time.monotonic()
    wait_delivered(work, nccl)
    assert time.monotonic() - started >= 0.4
    assert torch.equal(tensor, expected)


def test_wait_delivered_raises_what_gloo_raises() -> None:
    class Raising:
        def wait(self) -> bool:
            raise RuntimeError("Connection closed by peer")

    with pytest.raises(CollectiveFailed, match="Connection closed by peer"):
        wait_delivered(Raising())


def test_a_wait_with_a_timeout_blocks_until_the_result_is_there() -> None:
    nccl = NcclLikeGroup(land_after_s=0.5)
    tensor = torch.arange(6, dtype=torch.float32)
    expected = tensor.clone()
    work = nccl.allreduce([tensor], dist.AllreduceOptions())
    tensor.zero_()
    wait_delivered(work, nccl, timedelta(seconds=30))
    assert torch.equal(tensor, expected)


def test_a_collective_that_never_lands_fails_at_its_timeout() -> None:
    nccl = NcclLikeGroup()
    nccl.hang_next()
    work = nccl.allreduce([torch.ones(3)], dist.AllreduceOptions())
    started = time.monotonic()
    with pytest.raises(CollectiveFailed, match="timeout"):
        wait_delivered(work, nccl, timedelta(seconds=0.5))
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("timeout", [None, timedelta(seconds=30)])
def test_a_collective_whose_group_was_aborted_meanwhile_did_not_deliver(
    timeout: timedelta | None,
) -> None:
    """torchft's abort (the peer watch's: a group of the quorum is gone) ends the kernels in
    flight without an error on their works: the result is not there, whatever the work says."""
    nccl = NcclLikeGroup()
    nccl.hang_next()
    work = nccl.allreduce([torch.ones(3)], dist.AllreduceOptions())
    threading.Timer(0.3, nccl.abort).start()
    with pytest.raises(CollectiveFailed, match="aborted while it was in flight"):
        wait_delivered(work, nccl, timeout)


# ---- item 6: a heal's waits ---------------------------------------------------------------


def test_a_heal_piece_cut_off_by_a_peers_death_fails_the_heal() -> None:
    """On nccl a receive whose sender died ends with half its bytes and no error in ``wait``:
    the heal must fail rather than load them."""

    def group(rank: int, pg: dist.ProcessGroup) -> str:
        nccl = NcclLikeGroup(pg, land_after_s=0.05)
        heal = PiecewiseGroup(nccl, timedelta(seconds=30), piece_bytes=64, in_flight=2)
        tensor = torch.arange(100, dtype=torch.float32) if rank == 0 else torch.zeros(100)
        if rank == 1:
            nccl.fail_next(after=6)  # the last of its seven pieces
        with heal.heal():
            try:
                (heal.send if rank == 0 else heal.recv)([tensor], 1 - rank, 1).wait()
            except CollectiveFailed as e:
                return str(e)
        return "whole"

    sent, received = run_groups(2, group, timeout_s=60)
    assert sent == "whole" and "remote process exited" in received


def test_a_sender_answers_several_joiners_at_once() -> None:
    """Two joiners that need different answers (say a replay and a full heal): the second's
    first piece must not wait for the first one's whole transfer, which can outlast the
    heal's timeout for one piece. Each answer goes out on a thread and a stream of its own."""
    spans: dict[int, tuple[float, float, str]] = {}

    def answer(basis: ReplayBasis, step: int, state_dict: Any) -> HealAnswer:
        why = f"joiner at sync {basis.sync}"
        return HealAnswer({"user": {HEAL_KEY: {"transfer": "full", "why": why}}}, [])

    exchange = SimpleNamespace(answer=answer, shape=None)

    def group(rank: int, pg: dist.ProcessGroup) -> None:
        if rank > 0:  # a joiner's request: where its own checkpoint is
            request = ReplayBasis(sync=rank).to_tensor(CPU)
            pg.send([request], 0, 0).wait()
            return
        transport = build_history_transport(exchange)(pg, timedelta(seconds=30), CPU)

        def send_answer(answer: HealAnswer, dsts: list[int], *args: Any) -> None:
            start = time.monotonic()
            time.sleep(0.5)  # a transfer
            spans[dsts[0]] = (start, time.monotonic(), streams.current_stream(CPU))

        transport._send_answer = send_answer
        transport.send_checkpoint([1, 2], 3, {}, timedelta(seconds=30))

    run_groups(3, group, timeout_s=60)
    (start_1, end_1, stream_1), (start_2, end_2, stream_2) = spans[1], spans[2]
    assert start_2 < end_1 and start_1 < end_2  # at once, not one after the other
    assert len({stream_1, stream_2, streams.DEFAULT}) == 3


# ---- a synchronous step's gradients ----------------------------------------------------------


@pytest.mark.parametrize("plant", ["nothing", "fail"])
def test_a_steps_gradients_are_averaged_once_they_arrived_or_not_committed(plant: str) -> None:
    """Synchronous fault tolerance's one all-reduce per step: the gradients each group applies
    are the mean that arrived, and a failure that only the work recorded is reported to the
    Manager (so ``should_commit`` says no), never half a sum applied as the step's gradient."""
    from torchtitan.components.ft.manager import FTManager
    from torchtitan.config.job_config import JobConfig

    def group(rank: int, pg: dist.ProcessGroup) -> tuple[torch.Tensor, Any]:
        nccl = NcclLikeGroup(pg)
        if plant == "fail" and rank == 1:
            nccl.fail_next()
        manager = _TorchftLikeManager(nccl, rank, 2)  # type: ignore[arg-type]
        config = JobConfig()
        config.fault_tolerance.lighthouse = "http://127.0.0.1:1"  # never reached: no quorum
        ft = FTManager(config, lambda transport: manager)
        ft.start()
        model = torch.nn.Linear(40, 30)
        for p in model.parameters():
            p.grad = torch.full_like(p, 1.0 + 2 * rank)
        ft.allreduce_gradients(model)
        return torch.cat([p.grad.view(-1) for p in model.parameters()]), manager.errored()

    (grads_0, error_0), (grads_1, error_1) = run_groups(2, group, timeout_s=60)
    assert error_0 is None and torch.equal(grads_0, torch.full_like(grads_0, 2.0))
    if plant == "nothing":
        assert error_1 is None and torch.equal(grads_1, grads_0)
    else:
        assert isinstance(error_1, CollectiveFailed)


# ---- the pieces the above rest on -----------------------------------------------------------


def test_a_side_stream_on_cuda_makes_a_new_stream_current_after_what_was_queued(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Observed where it meets torch.cuda (no GPU here): a new stream, made to wait for the
    thread's current one, is the current stream inside the block, on the block's device."""
    calls: list[tuple[str, Any]] = []

    class Stream:
        def __init__(self, device: Any) -> None:
            calls.append(("new stream", device))

        def wait_stream(self, other: Any) -> None:
            calls.append(("waits for", other))

    class Entered:
        def __init__(self, what: str, value: Any) -> None:
            self.what, self.value = what, value

        def __enter__(self) -> None:
            calls.append((f"enter {self.what}", self.value))

        def __exit__(self, *exc: Any) -> None:
            calls.append((f"exit {self.what}", self.value))

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "training")
    monkeypatch.setattr(torch.cuda, "stream", lambda s: Entered("stream", s))
    monkeypatch.setattr(torch.cuda, "device", lambda d: Entered("device", d))
    cuda = torch.device("cuda", 1)
    with streams.side_stream(cuda):
        calls.append(("body", None))
    kinds = [kind for kind, _ in calls]
    assert kinds[:2] == ["new stream", "waits for"] and calls[1][1] == "training"
    body = kinds.index("body")
    assert "enter stream" in kinds[:body] and "exit stream" in kinds[body:]
    assert ("enter device", cuda) in calls[:body]
    entered = next(value for kind, value in calls if kind == "enter stream")
    assert isinstance(entered, Stream)


def test_answers_sent_at_once_fail_the_heal_when_any_one_fails() -> None:
    from torchtitan.experiments.fault_tolerance.heal.checkpoint_transport import all_at_once

    ran: list[int] = []

    def fine() -> None:
        ran.append(1)

    def broken() -> None:
        raise RuntimeError("joiner 2's piece 3 timed out")

    with pytest.raises(RuntimeError, match="joiner 2"):
        all_at_once([fine, broken], CPU)
    with pytest.raises(RuntimeError, match="joiner 2"):
        all_at_once([broken], CPU)
    all_at_once([fine, fine, fine], CPU)
    assert ran == [1, 1, 1, 1]


def test_answers_sent_at_once_share_the_heals_pieces_in_flight() -> None:
    """Three answers at once through one heal group of 2 pieces in flight: the link never
    carries more than 2 (each thread's piece timeout assumes it), and every piece is waited
    for once."""
    lock = threading.Lock()
    in_flight, most, waits = [0], [0], []

    class Work:
        def __init__(self) -> None:
            with lock:
                in_flight[0] += 1
                most[0] = max(most[0], in_flight[0])

        def wait(self, timeout: Any = None) -> bool:
            time.sleep(0.01)
            with lock:
                in_flight[0] -= 1
                waits.append(self)
            return True

        def is_completed(self) -> bool:
            return True

    class Group:
        def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> Work:
            return Work()

    heal = PiecewiseGroup(Group(), timedelta(seconds=30), piece_bytes=10, in_flight=2)

    def answer() -> None:
        with heal.heal():
            heal.send([torch.zeros(100, dtype=torch.uint8)], 1, tag=0).wait()

    from torchtitan.experiments.fault_tolerance.heal.checkpoint_transport import all_at_once

    all_at_once([answer, answer, answer], CPU)
    assert most[0] == 2 and heal.most_queued == 2
    assert len(waits) == 30 == heal.issued and in_flight[0] == 0
