"""Fault tolerance across replica groups with torchft.

Each rank of each replica group (one ``torchrun``, or one process) owns one ``torchft.Manager``.
The managers of rank r in every group form the fault-tolerant replicate dimension: a process
group that torchft rebuilds at every quorum from the groups alive at that moment. What a step,
a dead group, a restarted group, a lighthouse restart and too few groups do, which timeout
governs what, and what listens where: ``docs/fault_tolerance.md``.

The package, one concern per file:

* ``build.py``: ``build_ft_manager`` (from ``[fault_tolerance]``), the torchft Manager and its
  process group (rebuilt on fresh rendezvous keys at every quorum).
* ``manager.py``: ``FTManager``, what the trainer does with the Manager each step.
* ``healing.py``: the state a live group sends to a joiner (DTensors as local shards).
* ``watchdog.py``: log lines while a quorum wait lasts.
* ``network.py``: the lighthouse's address; ``confine_to_host`` keeps this group's listeners on
  ``fault_tolerance.hostname``.
* ``torchft_adapter.py``: every use of torchft internals, version-checked.
* ``errors.py``: ``FaultToleranceError``, which every failure here ends in.
"""

from torchtitan.components.ft.build import (
    QUORUM_RETRY_INTERVAL_S,
    build_ft_manager,
    fresh_rendezvous_address,
)
from torchtitan.components.ft.errors import FaultToleranceError
from torchtitan.components.ft.healing import NOT_HEALED, register_healing_state
from torchtitan.components.ft.manager import FTManager, QuorumPurpose
from torchtitan.components.ft.network import (
    bind_ip,
    confine_to_host,
    lighthouse_address,
    lighthouse_reachable,
    listen_store,
)

__all__ = [
    "NOT_HEALED",
    "QUORUM_RETRY_INTERVAL_S",
    "FTManager",
    "FaultToleranceError",
    "QuorumPurpose",
    "bind_ip",
    "build_ft_manager",
    "confine_to_host",
    "fresh_rendezvous_address",
    "lighthouse_address",
    "lighthouse_reachable",
    "listen_store",
    "register_healing_state",
]
