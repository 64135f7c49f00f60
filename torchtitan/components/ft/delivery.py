"""When a collective across replica groups has delivered its result: one wait for every backend.

gloo and nccl fail differently, and code written against one is wrong on the other:

* **gloo**: ``wait()`` blocks the calling thread until the result is in the tensors, and raises
  when the collective failed (a peer gone, its timeout).
* **nccl**: ``wait()`` only makes the caller's current stream wait for the collective and
  returns at once; the result lands later. A failure never raises there: c10d's watchdog (or
  torchft's abort) ends the communicator, leaving the buffers partly reduced, and records the
  error on the work. Only a wait *with a timeout* blocks the host until the collective has
  finished, and raises what the work recorded (aborting the communicator at the timeout).
* **torchft's nccl wrapper** (``_WorkAcceleratorTimeout``) is not waited on: its ``wait`` arms
  an abort timer that is not cancelled when the wait raises (it would later abort whatever
  group is current, the next quorum's), and given a timeout it synchronizes the whole device.

:func:`wait_delivered` is the one wait for a result that the host reads or that is applied:
the c10d work's own ``wait``, with the operation's timeout, so the thread blocks (without the
GIL, and without waiting for the training kernels queued meanwhile) until the result is in its
buffers, and :class:`CollectiveFailed` when it is not, on either backend.
:func:`all_reduce_across_groups` is torchft's ``Manager.allreduce`` built on it;
:class:`AllWorks` is several works waited for as one.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from torchtitan.components.ft import torchft_adapter as tft
from torchtitan.tools.exact_division import divide_

if TYPE_CHECKING:
    from torchft.manager import Manager

#: How often the host asks whether a collective has finished when no timeout is known (an nccl
#: work torchft did not wrap): short at first, then up to this.
LONGEST_POLL_S = 0.01
#: A wait with this timeout on a finished nccl work returns at once or raises what it recorded
#: (c10d takes a timeout of 0 for "none").
FINISHED = timedelta(milliseconds=1)


class CollectiveFailed(RuntimeError):
    """A collective across replica groups did not deliver its whole result."""


class AllWorks:
    """Works waited for in order, as one work (torchft's ``Work``: ``wait`` returns True); each
    is waited for as it waits itself, with ``timeout`` if one is given."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        for work in self.works:
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)
        return True


def wait_delivered(work: Any, pg: Any = None, timeout: timedelta | None = None) -> None:
    """Return once ``work``'s result is in its tensors; raise :class:`CollectiveFailed` when the
    collective failed or did not finish within ``timeout`` (default: the one torchft's nccl
    wrapper gave it; gloo's work carries its own). The tensors are then undefined.

    ``pg``: the process group it ran on (torchft's wrapper): a collective whose group was
    aborted or reconfigured meanwhile (``torchft_adapter.group_generation``) did not deliver."""
    inner = tft.backend_work(work)
    generation = tft.group_generation(pg)
    limit = timeout or tft.work_timeout(work)
    try:
        if limit is not None:
            inner.wait(limit)
        elif not inner.wait() or not inner.is_completed():
            # nccl's wait returned before the result (gloo's blocks, and a second wait on its
            # point-to-point work would wait for another message): poll, then raise what the
            # work recorded.
            poll = 1e-4
            while not inner.is_completed() and tft.group_generation(pg) is generation:
                time.sleep(poll)
                poll = min(2 * poll, LONGEST_POLL_S)
            inner.wait(FINISHED)
    except Exception as e:
        raise CollectiveFailed(f"{type(e).__name__}: {e}") from e
    if tft.group_generation(pg) is not generation:
        raise CollectiveFailed("its process group was aborted while it was in flight")


def all_reduce_across_groups(
    manager: Manager,
    tensor: torch.Tensor,
    *,
    average: bool,
    timeout: timedelta | None = None,
    per_operation: bool = False,
) -> bool:
    """SUM (or, ``average``, the mean over the quorum's groups) of ``tensor`` in place over
    the Manager's replica process group: what torchft's ``Manager.allreduce(...).wait()``
    does (after an error it is a no-op; a group not participating sends zeros; a failure is
    reported to the Manager, so nothing is committed), except that it returns once the result
    is in ``tensor`` and sees a failure that only the work recorded (nccl's watchdog aborting
    the communicator on a peer's death, which torchft's ``errored`` does not report).
    ``timeout``: as :func:`wait_delivered`'s; ``per_operation``: the collective itself gets it
    too (c10d's own bound for this operation, gloo's included, in place of the group's), for
    one that may wait longer than the group's other collectives. Returns whether the result is
    there."""
    if manager.errored() is not None:
        return False
    manager.wait_quorum()
    if not manager.is_participating():
        tensor.zero_()
    pg = tft.replica_process_group(manager)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
    if per_operation and timeout is not None:
        options.timeout = timeout
    try:
        wait_delivered(pg.allreduce([tensor], options), pg, timeout)
    except Exception as e:
        manager.report_error(e)
        return False
    if average:
        divide_(tensor, manager.num_participants())
    return True
