"""On a GPU: a sync's wait for its collective (``delivery.wait_delivered``) waits for the
collective's result, not for the training kernels queued meanwhile. A world-size-1 nccl group
built as the trainer builds it (``build.fresh_rendezvous_process_group``), with seconds of
compute queued on the training stream while the collective runs on a stream of its own. Skipped
without CUDA; run by ``scripts/gpu_check.sh``, which reads the figures from
``$GPU_CHECK_OUT/sync_wait.json``."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from torchtitan.components.ft import torchft_adapter as tft
from torchtitan.components.ft.build import fresh_rendezvous_process_group
from torchtitan.components.ft.delivery import wait_delivered
from torchtitan.components.ft.timeouts import ReplicaTimeouts

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not dist.is_nccl_available(), reason="needs CUDA and nccl"
)

QUEUED_S = 2.0


def cycles_per_second() -> float:
    """GPU clock cycles in a second, timed here with ``torch.cuda._sleep``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 50_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1000)


def test_a_sync_wait_takes_milliseconds_behind_seconds_of_queued_compute() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeouts = ReplicaTimeouts.of(60_000, 60.0, collective_timeout_s=60.0)
    pg = fresh_rendezvous_process_group("nccl", timeouts)
    pg.configure(f"127.0.0.1:{store.port}/sync_wait", "0", 0, 1)
    try:
        cycles = int(QUEUED_S * cycles_per_second())
        side = torch.cuda.Stream()
        tensor = torch.ones(2**20, device="cuda")
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)

        def wait_once(named_timeout: bool) -> tuple[float, float, bool]:
            """Seconds the host spent in the wait, the seconds of compute queued then, and
            whether the collective had finished on the device when the wait returned."""
            torch.cuda.synchronize()
            torch.cuda._sleep(cycles)  # the training stream's queued compute
            queued = time.perf_counter()
            with torch.cuda.stream(side):
                work = pg.allreduce([tensor], opts)
                started = time.perf_counter()
                if named_timeout:  # what the transport did before: the device synchronized
                    work.wait(timedelta(seconds=60))
                else:
                    wait_delivered(work, pg)
                waited = time.perf_counter() - started
                landed = bool(tft.backend_work(work).is_completed())
            torch.cuda.synchronize()
            return waited, time.perf_counter() - queued, landed

        wait_once(False)  # the communicator's first collective connects it
        ours, compute, landed = wait_once(False)
        named, _, _ = wait_once(True)
        figures = {
            "queued_compute_s": round(compute, 3),
            "sync_wait_s": round(ours, 4),
            "landed_when_the_wait_returned": landed,
            "wait_naming_a_timeout_s": round(named, 3),
        }
        out = os.environ.get("GPU_CHECK_OUT")
        if out:
            Path(out, "sync_wait.json").write_text(json.dumps(figures, indent=2) + "\n")
        assert compute >= QUEUED_S / 2, figures  # the compute was queued indeed
        # The wait returned with the result there (nccl's own wait returns before it), and
        # without waiting for the training stream.
        assert landed, figures
        assert ours < 0.2, figures
        assert torch.equal(tensor, torch.ones_like(tensor)), "one rank's SUM is its own values"
    finally:
        pg.abort()
