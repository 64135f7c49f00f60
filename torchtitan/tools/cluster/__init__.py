"""Local fault-tolerant jobs: a torchft lighthouse and replica groups as processes on this
machine, for the launcher, the integration tests and the benchmarks alike.

* ``job.LocalJob``: starts the lighthouse (127.0.0.1, a free or given port) and the groups
  (``run_train.sh`` with the environment a group needs), a log file per start; kills a group's
  whole process tree, kills and restarts the lighthouse on its address; ``close`` kills every
  process it started, also after a failure.
* ``faults``: when to kill which group and when to restart it (``--kill R@S``,
  ``--kill-every T --seed X``, ``--restart-after D`` of the launcher).
* ``process``: one started process (log, exit code, peak memory) and the launch hook that
  changes how a process is started (pinned to a core, inside a network namespace, ...).
* ``process_tree``: finding and killing a job's processes, PID by PID.
* ``listeners``: which of them listen on which address (read from ``/proc``).
* ``ports``: free ports on loopback.
"""

from torchtitan.tools.cluster.faults import PeriodicKills, Restarts, StepKills
from torchtitan.tools.cluster.job import (
    JOB_ENV,
    REPO_ROOT,
    RUN_TRAIN_CONFIG,
    GroupLaunch,
    LocalJob,
    split_devices,
    visible_gpus,
)
from torchtitan.tools.cluster.lighthouse import LighthouseSettings
from torchtitan.tools.cluster.listeners import listening_sockets
from torchtitan.tools.cluster.ports import LOOPBACK, free_port
from torchtitan.tools.cluster.process import Launch, Process, ProcessSpec, strip_ansi
from torchtitan.tools.cluster.process_tree import (
    kill_tree,
    process_tree,
    processes_with_env,
    signal_pids,
)

__all__ = [
    "JOB_ENV",
    "LOOPBACK",
    "REPO_ROOT",
    "RUN_TRAIN_CONFIG",
    "GroupLaunch",
    "Launch",
    "LighthouseSettings",
    "LocalJob",
    "PeriodicKills",
    "Process",
    "ProcessSpec",
    "Restarts",
    "StepKills",
    "free_port",
    "kill_tree",
    "listening_sockets",
    "process_tree",
    "processes_with_env",
    "signal_pids",
    "split_devices",
    "strip_ansi",
    "visible_gpus",
]
