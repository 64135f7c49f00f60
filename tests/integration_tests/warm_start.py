"""Warm starts for the trainers that the integration tests start.

A trainer spends seconds of CPU here before it does anything (3.2-3.5 s, user and system, for
the imports below at a602db2): importing torch, ``torch._dynamo`` (torch's optimizers import
it), DCP, FSDP2 and torchft. The integration tests start about two hundred trainers on a 2-core
machine, so those imports were most of the suite's time. A *zygote* imports all of it once per
pytest worker and forks a trainer for each start.

The process a job starts is still a process of its own: ``warm_python`` (``run_train.sh``'s
``PYTHON``, see :func:`launch`) runs this module as a stand-in that needs only the standard
library. It hands its command line, environment, working folder and standard streams to the
zygote, forwards the signals it gets to the trainer, and exits as the trainer did (the same
status, or killed by the same signal). The trainer runs its module as ``__main__`` at the top of
its stack and leaves through the interpreter's normal shutdown, as ``python -m`` does.

``[-u] -m torchtitan.train``, the benchmarks' ``-m benchmarks.train_entry`` and torchrun
(``-m torchtitan.tools.loopback_torchrun``, whose ranks then start through the stand-in too)
start warm. Anything else the stand-in is asked to run (``run_train.sh``'s config check) runs
cold, in the real interpreter. The trainer takes the stand-in's CPU affinity (``taskset -c 1
warm_python ...`` pins it) and joins the stand-in's network namespace (``ip netns exec NS
warm_python ...`` puts it there), as a cold start under those prefixes would be; only those two:
not the mount namespace ``ip netns exec`` also makes (its ``/sys``), nor cgroup, rlimits, nice or
user, which the tests' jobs do not change.

What differs from a cold start:

* the trainer is the zygote's child (in a session of its own), not the stand-in's, so a
  group's process tree does not hold it. The zygote records each child's PID under its
  stand-in's PID (:func:`children` follows them: ``FTJob.pids``, ``FTJob.group_pids``,
  :func:`kill`), and SIGKILLs a child whose stand-in is gone, with the child's own tree
  (torchrun's ranks' stand-ins, whose ranks follow). That happens just after the stand-in's
  death, not with it: ``FTJob`` kills and waits for the trainers themselves; a benchmark's
  ``LocalJob`` (the smoke runs') does not, so its kills and ``close()`` return while the
  trainer may still live for a few milliseconds, and what it reads from the processes it
  started (``max_rss_mib``) is the stand-in's;
* it shares what the imports left: the zygote's hash seed (random per zygote), and libgomp's
  reading of ``OMP_NUM_THREADS`` at load (the child sets torch's thread count from its own
  environment, as a cold start would read it). Python's and NumPy's global random generators
  are reseeded in the child.

``TORCHTITAN_TEST_COLD_START=1`` starts every trainer cold, as ``run_train.sh`` does for a
user; ``FTJob(warm=False)`` does that for one job.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Iterable
from pathlib import Path

#: The zygote's socket; a stand-in without it runs everything cold.
SOCKET_ENV = "TORCHTITAN_WARM_START"
#: The folder where the zygote records each child's PID, in a file named by its stand-in's PID.
CHILDREN_ENV = "TORCHTITAN_WARM_START_CHILDREN"
#: Set to 1 to start no zygote: every trainer of the tests starts cold.
COLD_ENV = "TORCHTITAN_TEST_COLD_START"
#: The CPU kernels ATen picks at import (the zygote's are those of the tests' process).
_KERNELS = "ATEN_CPU_CAPABILITY"
#: ``run_train.sh``'s ``PYTHON`` for a warm start (a shell script that runs this module).
WARM_PYTHON = Path(__file__).with_name("warm_python")

_TRAIN = "torchtitan.train"
_TORCHRUN = "torchtitan.tools.loopback_torchrun"
_BENCHMARK = "benchmarks.train_entry"
#: The modules whose ``python [-u] -m MODULE`` starts warm.
_WARM_MODULES = (_TRAIN, _TORCHRUN, _BENCHMARK)
# What a trainer imports (or imports later, while it builds itself), loaded by the zygote.
_PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.utils._device",
    "torch.profiler._cupti_monitor",
    "torch.distributed.run",
    "torchft",
    "torchft.checkpointing.pg_transport",
    "typeguard",
    "tyro._backends._tyro_backend",
    "tyro._backends._argparse_formatter",
    "torchtitan.train",
    "torchtitan.trainer",
    "torchtitan.components.checkpoint",
    "torchtitan.experiments.fault_tolerance.trainer",
    "torchtitan.experiments.fault_tolerance.job_config",
    "torchtitan.tools.loopback_torchrun",
    "tests.integration_tests.faults",
    "benchmarks.train_entry",
    "benchmarks.timed_trainer",
]
_MESSAGE = 1 << 20  # the largest message: a request carries a whole environment
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def launch(env: dict[str, str]) -> dict[str, str]:
    """``env`` with ``run_train.sh``'s interpreter set to the stand-in, when a zygote runs and
    ``env`` asks for its kernels: ATen picked the zygote's CPU kernels when it imported torch
    (``ATEN_CPU_CAPABILITY``), so a trainer that asks for others starts cold."""
    if SOCKET_ENV not in os.environ or env.get(_KERNELS) != os.environ.get(_KERNELS):
        return env
    real = env.get("PYTHON", sys.executable)
    return {**env, "PYTHON": str(WARM_PYTHON), "TORCHTITAN_REAL_PYTHON": real}


def children(pids: Iterable[int]) -> list[int]:
    """``pids`` and the live children the zygote forked for the stand-ins among them, with
    their descendants (torchrun's ranks, and theirs in turn)."""
    from torchtitan.tools.cluster.process_tree import process_tree

    folder = os.environ.get(CHILDREN_ENV)
    found = set(pids)
    todo = list(found)
    while folder and todo:
        try:
            child = int(Path(folder, str(todo.pop())).read_text())
        except (FileNotFoundError, ValueError):
            continue
        if os.path.exists(f"/proc/{child}"):
            new = [pid for pid in process_tree(child) if pid not in found]
            found.update(new)
            todo.extend(new)
    return sorted(found)


def kill(pids: Iterable[int], timeout: float = 30) -> None:
    """SIGKILL ``pids`` and wait until each is dead (a zombie counts: its parent reaps it); a
    warm trainer is no child of whoever kills it."""
    from torchtitan.tools.cluster.process_tree import process_state, signal_pids

    pids = list(pids)
    signal_pids(pids)
    deadline = time.monotonic() + timeout
    for pid in pids:
        while process_state(pid) not in ("", "Z"):  # a zombie is dead, its parent reaps it
            if time.monotonic() > deadline:
                raise TimeoutError(f"process {pid} still there {timeout:.0f}s after SIGKILL")
            time.sleep(0.02)


class Zygote:
    """The zygote as a process of its own (a context manager), ready when ``__init__``
    returns; its socket, log and child records are in ``folder``."""

    def __init__(self, folder: Path, timeout: float = 300) -> None:
        import subprocess

        self.path = str(folder / "zygote.sock")
        self.children = folder / "children"
        self.children.mkdir()
        self.log = folder / "zygote.log"
        env = {k: v for k, v in os.environ.items() if k != SOCKET_ENV}
        env[CHILDREN_ENV] = str(self.children)
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.integration_tests.warm_start", "--serve", self.path],
                cwd=Path(__file__).resolve().parents[2],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.path):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the zygote did not start:\n{self.log.read_text()}")
            time.sleep(0.1)

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the zygote; it kills the trainers it forked that still run."""
        import subprocess

        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


# ---- the stand-in ----------------------------------------------------------------------------


def stand_in(args: list[str]) -> int:
    """Run ``python ARGS``: through the zygote when ARGS start a trainer or torchrun (whose
    ranks then start through the stand-in too), else cold."""
    python = os.environ.get("TORCHTITAN_REAL_PYTHON", sys.executable)
    path = os.environ.get(SOCKET_ENV)
    found = _warm_command(args)
    if found is not None and found[0] == _TORCHRUN:
        args = _torchrun_with_warm_ranks(args)
    if path is None or found is None:
        os.execv(python, [python, *args])
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(path)
    request = {
        "args": args,
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "cpus": sorted(os.sched_getaffinity(0)),
    }
    namespace = os.open("/proc/self/ns/net", os.O_RDONLY)  # where the trainer joins
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2, namespace])
    os.close(namespace)
    child = json.loads(conn.recv(_MESSAGE))["pid"]
    exited = False

    def forward(number: int, frame: object) -> None:
        if not exited:
            try:
                os.kill(child, number)
            except ProcessLookupError:
                pass  # exited; its status is on its way

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    reply = conn.recv(_MESSAGE)
    exited = True
    if not reply:
        print("warm_start: the zygote went away before its child exited", file=sys.stderr)
        return 1
    code = int(json.loads(reply)["exit"])
    if code < 0:  # killed by a signal: so is the stand-in, for whoever waits on it
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _warm_command(args: list[str]) -> tuple[str, list[str]] | None:
    """(module, its arguments) when ``python ARGS`` is ``[-u] -m MODULE ...`` for a module
    that starts warm; else None."""
    rest = args[1:] if args[:1] == ["-u"] else args
    if len(rest) >= 2 and rest[0] == "-m" and rest[1] in _WARM_MODULES:
        return rest[1], rest[2:]
    return None


def _torchrun_with_warm_ranks(args: list[str]) -> list[str]:
    """torchrun's arguments with its ranks started through the stand-in: its module flag
    ``-m torchtitan.train`` becomes ``--no-python warm_python -u -m torchtitan.train``."""
    for i in range(2, len(args) - 1):
        if args[i : i + 2] == ["-m", _TRAIN]:
            return [*args[:i], "--no-python", str(WARM_PYTHON), "-u", *args[i:]]
    return args


# ---- the zygote ------------------------------------------------------------------------------


class _BecomeChild(BaseException):  # noqa: N818 (not an error: the fork's child leaves serve())
    """Raised in a freshly forked child: unwinds out of :func:`serve`, whose caller runs the
    request at the top of the stack."""

    def __init__(self, request: dict) -> None:
        super().__init__()
        self.request = request


def serve(path: str) -> None:
    """Import what a trainer imports, then fork a trainer per request on ``path`` until the
    process that started the zygote is gone (or SIGTERM); every child still running then is
    killed. In each child this raises ``_BecomeChild``."""
    import gc
    import importlib
    import selectors

    from torchtitan.tools.cluster.process_tree import kill_tree

    for name in _PRELOAD:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:  # only a module this torch lacks (_cupti_monitor: 2.13)
                raise
    # A child runs its module as __main__, as `python -m` does: not the module loaded above
    # (runpy would warn that it is in sys.modules already).
    for name in _WARM_MODULES:
        sys.modules.pop(name, None)
    gc.collect()
    gc.freeze()  # the children's collections leave the imported objects (shared pages) alone

    records = Path(os.environ[CHILDREN_ENV])
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # ready: whoever waits for the path may connect now
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    # running child -> (its stand-in's connection or None once the stand-in is gone, its record)
    running: dict[int, tuple[socket.socket | None, Path]] = {}
    parent = os.getppid()
    owned = [selector, listener]

    while not stop and os.getppid() == parent:
        for key, _ in selector.select(timeout=1.0):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    pid = _start(conn, running, records, owned, (wake_r, wake_w))
                except (OSError, ValueError) as e:  # a stand-in that died while it asked
                    print(f"warm_start: a request failed: {e!r}", file=sys.stderr, flush=True)
                    conn.close()
                    continue
                selector.register(conn, selectors.EVENT_READ, pid)
            elif key.fileobj == wake_r:
                os.read(wake_r, 512)
            else:  # a stand-in's connection: it sends nothing, so this is its end
                conn, pid = key.fileobj, key.data
                selector.unregister(conn)
                conn.close()
                if pid in running and running[pid][0] is conn:
                    running[pid] = (None, running[pid][1])
                    kill_tree(pid)  # reaped below or in a later round
        _reap(running, selector)
    for pid in running:
        kill_tree(pid)
    for pid, (_, record) in running.items():
        os.waitpid(pid, 0)
        record.unlink(missing_ok=True)


def _start(
    conn: socket.socket,
    running: dict[int, tuple[socket.socket | None, Path]],
    records: Path,
    owned: list,
    pipe: tuple[int, int],
) -> int:
    """Read a stand-in's request from ``conn``, fork its child, record the child's PID under
    the stand-in's and tell the stand-in."""
    data, fds, _, _ = socket.recv_fds(conn, _MESSAGE, 4)
    try:
        if len(fds) != 4:
            raise ValueError(
                f"a request with {len(fds)} of its 4 descriptors (3 standard streams and the "
                "stand-in's network namespace)"
            )
        request = json.loads(data)
        credentials = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        stand_in_pid = struct.unpack("3i", credentials)[0]
        others = [c for c, _ in running.values() if c is not None]
        pid = _fork(request, fds, [*owned, conn, *others], pipe)
    finally:
        for fd in fds:
            os.close(fd)
    record = records / str(stand_in_pid)
    record.write_text(str(pid))
    running[pid] = (conn, record)
    try:
        conn.send(json.dumps({"pid": pid}).encode())
    except OSError:
        pass  # the stand-in is gone: its end is read next, and its child killed
    return pid


def _reap(running: dict[int, tuple[socket.socket | None, Path]], selector) -> None:
    """Collect the children that exited, drop their records and tell their stand-ins how."""
    while running:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid not in running:
            continue
        conn, record = running.pop(pid)
        record.unlink(missing_ok=True)
        if conn is None:
            continue
        try:
            conn.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
        except OSError:
            pass  # the stand-in is gone (its end is read in the next round)
        selector.unregister(conn)
        conn.close()


def _fork(request: dict, fds: list[int], owned: list, pipe: tuple[int, int]) -> int:
    """Fork. In the parent: the child's PID. In the child: set up as a fresh process with the
    request's streams (``fds[:3]``), CPU affinity and network namespace (``fds[3]``), then
    raise ``_BecomeChild``."""
    sys.stdout.flush()
    sys.stderr.flush()
    zygote = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    try:
        _die_with(zygote)
        os.setsid()  # a session of its own, as every process of a local job
        signal.set_wakeup_fd(-1)
        for fd in pipe:
            os.close(fd)
        for resource in owned:
            resource.close()
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)  # the originals are closed by the caller, as in the parent
        os.sched_setaffinity(0, request["cpus"])
        _join_network_namespace(fds[3])
    except BaseException:
        import traceback

        traceback.print_exc()
        os._exit(1)
    raise _BecomeChild(request)


def _join_network_namespace(namespace: int) -> None:
    """Enter the network namespace open as ``namespace`` (the stand-in's) when it is not this
    process's (the stand-in was started by ``ip netns exec NS``); needs the privilege that
    command needs. Called single-threaded: the threads started later inherit it."""
    import ctypes

    theirs, ours = os.fstat(namespace), os.stat("/proc/self/ns/net")
    if (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino):
        return
    clone_newnet = 0x40000000
    if ctypes.CDLL(None, use_errno=True).setns(namespace, clone_newnet) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"setns into the stand-in's network namespace: {os.strerror(error)}")


def _die_with(zygote: int) -> None:
    """SIGKILL this process when the zygote dies: nobody would kill its trainers then."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != zygote:  # it died before the line above
        os._exit(1)


def _run(request: dict) -> None:
    """Become ``python [-u] -m MODULE ARGS`` of the request, in this forked child; called at
    the top of the stack so that the module's exit, exception or Ctrl-C leaves the
    interpreter as it would leave a cold one."""
    import io
    import random
    import runpy

    import numpy
    import torch

    args: list[str] = request["args"]
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    unbuffered = args[:1] == ["-u"] or bool(os.environ.get("PYTHONUNBUFFERED"))
    for fd, name in ((1, "stdout"), (2, "stderr")):  # as the interpreter makes them at start
        raw = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)  # noqa: SIM115
        stream = io.TextIOWrapper(
            raw,  # type: ignore[arg-type]
            encoding=getattr(sys, name).encoding,
            errors=getattr(sys, name).errors,
            line_buffering=name == "stderr" or os.isatty(fd),
            write_through=unbuffered,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    random.seed()
    numpy.random.seed()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    wanted = int(threads) if threads.isdigit() and int(threads) > 0 else _DEFAULT_THREADS
    if wanted != torch.get_num_threads():
        torch.set_num_threads(wanted)
    module, module_args = _warm_command(args)  # type: ignore[misc]
    sys.argv = ["-m", *module_args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


_DEFAULT_THREADS = 0  # torch's thread count in the zygote: a cold start's without OMP_NUM_THREADS


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        try:
            import torch

            _DEFAULT_THREADS = torch.get_num_threads()
            serve(sys.argv[2])
        except _BecomeChild as child:
            request = child.request
            del child
            _run(request)
    else:
        sys.exit(stand_in(sys.argv[1:]))
