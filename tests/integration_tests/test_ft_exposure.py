"""A local fault-tolerant job listens on 127.0.0.1 only, never on torchft's default ports.

The listening TCP sockets of every process of a running job are read from ``/proc/<pid>/fd``
and ``/proc/net/tcp{,6}``. With one rank per group (this test) that covers the lighthouse,
torchft's manager servers, each group's own TCP store and gloo. Two ranks per group (torchrun's
stores, in-group gloo) are checked the same way by ``test_ft_sync``'s FSDP test while it runs,
and a launcher run by ``test_ft_launcher``.
"""

from __future__ import annotations

from tests.integration_tests.harness import FAST_ARGS, PACED_ARGS, check_loopback_only, command_line
from torchtitan.components.metrics import TRAIN_STEP


def test_local_job_listens_on_loopback_only(ft_job):
    job = ft_job(train_args=[*FAST_ARGS, *PACED_ARGS, "--training.steps=200"]).start()
    for replica in (0, 1):
        job.wait_for_event(replica, TRAIN_STEP, timeout=240, where=lambda e: e.step == 2)
    sockets = check_loopback_only(job.pids())
    print(f"\n[ft test] {len(sockets)} listening sockets, all on loopback:")
    for pid, address, port in sorted(sockets):
        print(f"  {address}:{port}  pid {pid}  {command_line(pid)[:70]}")
    # The lighthouse, and per group its manager server, store and gloo: the check saw the
    # job's real listeners, not an empty list.
    assert len(sockets) >= 1 + 2 * 3
