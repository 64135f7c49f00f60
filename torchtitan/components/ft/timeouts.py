"""Every timeout that c10d and torchft apply to the replicate process group, sized in one place
from the fields meant to govern them.

torchft builds its process group with one timeout (``process_group_timeout_ms``) and c10d's
defaults for the rest. At the sizes this project is for (transfers of minutes, a full heal of
an 8B model that takes 21 min at 1 Gbit/s) that is wrong in several places on nccl: c10d's
watchdog tears the process down 10 min after an operation is queued; torchft's abort timer
around issuing an operation, its default wait, ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` (which also
bounds the lazy creation of the point-to-point communicators a heal uses) would all fire after
10 s. :class:`ReplicaTimeouts` names what governs each, and ``build.py`` hands them to torchft
and c10d; nothing else sets them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

#: c10d's watchdog is a backstop behind torchft's own timers, which end an operation cleanly
#: (abort, error recorded, not committed): it must never fire first.
WATCHDOG_MARGIN = timedelta(seconds=60)

NONBLOCKING_TIMEOUT_ENV = "TORCH_NCCL_NONBLOCKING_TIMEOUT"


@dataclass(frozen=True)
class ReplicaTimeouts:
    """The replicate process group's timeouts, from the fields that govern them."""

    #: ``process_group_timeout_ms``: building the group of a new quorum (its rendezvous).
    rendezvous: timedelta
    #: One collective: semi-sync's ``sync_collective_timeout_s`` (a bucket of a sync, the
    #: quorum's exchange), else ``process_group_timeout_ms`` (a step's all-reduce).
    collective: timedelta
    #: ``timeout_s``: each piece of a heal's transfer (sent in bounded pieces).
    heal: timedelta

    @classmethod
    def of(
        cls,
        process_group_timeout_ms: int,
        timeout_s: float,
        collective_timeout_s: float | None = None,
    ) -> ReplicaTimeouts:
        step = timedelta(milliseconds=process_group_timeout_ms)
        collective = (
            step if collective_timeout_s is None else timedelta(seconds=collective_timeout_s)
        )
        return cls(rendezvous=step, collective=collective, heal=timedelta(seconds=timeout_s))

    @property
    def operation(self) -> timedelta:
        """The longest one operation may take, a sync's or a heal's: torchft's abort timer
        around issuing it (on nccl a heal's first send also creates its communicator) and
        ``TORCH_NCCL_NONBLOCKING_TIMEOUT``."""
        return max(self.collective, self.heal)

    @property
    def watchdog(self) -> timedelta:
        """c10d's nccl watchdog (``ProcessGroupNCCL.Options._timeout``), counted from when an
        operation is queued: twice the longest operation plus a margin, so that an operation
        queued behind another one still ends by torchft's timers, not by a crash."""
        return 2 * self.operation + WATCHDOG_MARGIN

    def nccl_environment(self) -> dict[str, str]:
        """What the process environment must hold before torchft's nccl group is built (a
        value the user set stays: the caller uses ``setdefault``)."""
        return {NONBLOCKING_TIMEOUT_ENV: str(int(self.operation.total_seconds()))}

    def apply_nccl_environment(self) -> None:
        for name, value in self.nccl_environment().items():
            os.environ.setdefault(name, value)
