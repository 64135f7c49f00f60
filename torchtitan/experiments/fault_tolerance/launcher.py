"""One command for a local fault-tolerant job: a lighthouse plus N replica groups.

    python -m torchtitan.experiments.fault_tolerance.launcher --groups 2 -- --training.steps=100

starts ``torchft_lighthouse`` on 127.0.0.1 (a free port), then N replica groups, each a
``run_train.sh`` (``--ngpu`` ranks) with its own manager port and ``--fault_tolerance.replica_id``.
Every output line is prefixed with its group. Ctrl-C stops everything; the launcher exits 0 when
every group finished, 1 when a group failed for good (exited non-zero without being killed by the
launcher: the other groups go on without it, and the launcher reports it when they are done),
130 after Ctrl-C. Faults can be injected: SIGKILL a group at a step (``--kill R@S``)
or a random group every T seconds (``--kill-every T --seed X``), each restarted after
``--restart-after D`` seconds. A kill takes the group's whole process tree (torchrun starts its
workers in sessions of their own, so killing the process group alone would leave them running).

Everything listens on 127.0.0.1 only; ports are picked free, never torchft's defaults, so two
launchers on one machine cannot join each other's quorum.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP_LINE = re.compile(r"step:\s+(\d+)\s")
_LIGHTHOUSE_PORT = re.compile(r"listening on: http://[^:\s]+:(\d+)")
#: Set in every group's environment: marks the processes of one launcher's job.
JOB_ENV = "TORCHTITAN_FT_LAUNCHER_JOB"


def free_port() -> int:
    """A port the kernel says is free on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- process trees ---------------------------------------------------------------------------


def _parents() -> dict[int, int]:
    """{pid: parent pid} of every process visible in /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name (field 2) may hold spaces and parentheses: split after its end.
        fields = stat[stat.rfind(")") + 2 :].split()
        parents[int(entry)] = int(fields[1])
    return parents


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants, parents before children."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    tree, todo = [], [pid]
    while todo:
        current = todo.pop(0)
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


def processes_with_env(name: str, value: str) -> list[int]:
    """PIDs of this user's processes whose environment has ``name=value`` (finds workers
    that outlived their parent)."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal ``pid`` and every descendant, each by PID (collected first, so that a child
    re-parented when its parent dies is not missed)."""
    for member in process_tree(pid):
        try:
            os.kill(member, sig)
        except ProcessLookupError:
            pass


# ---- the launcher ----------------------------------------------------------------------------


def _print(prefix: str, line: str) -> None:
    sys.stdout.write(f"{prefix} {line}" if line.endswith("\n") else f"{prefix} {line}\n")
    sys.stdout.flush()


@dataclass
class Group:
    """One replica group: its latest process (a session leader) and what the launcher knows."""

    replica_id: int
    proc: subprocess.Popen | None = None
    last_step: int = 0
    steps_this_start: int = 0
    restarts: int = 0
    done: bool = False
    failed: bool = False
    killed_by_us: bool = False
    restart_at: float | None = None


class Launcher:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.groups = [Group(r) for r in range(args.groups)]
        self.lighthouse: subprocess.Popen | None = None
        self.lighthouse_addr = ""
        self.lock = threading.Lock()
        self.kill_plan = dict(args.kill)  # replica_id -> step
        self.rng = random.Random(args.seed)
        self.job_id = os.environ.get(JOB_ENV) or uuid.uuid4().hex

    # ---- processes -----------------------------------------------------------------------

    def start_lighthouse(self) -> None:
        a = self.args
        cmd = [
            str(Path(sys.executable).parent / "torchft_lighthouse"),
            "--min_replicas", str(a.min_replicas),
            "--quorum_tick_ms", "100",
            "--join_timeout_ms", str(a.join_timeout_ms),
            "--heartbeat_timeout_ms", str(a.heartbeat_timeout_ms),
            "--bind", f"127.0.0.1:{free_port()}",
        ]  # fmt: skip
        self.lighthouse = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        assert self.lighthouse.stdout is not None
        deadline = time.monotonic() + 15
        for line in self.lighthouse.stdout:
            match = _LIGHTHOUSE_PORT.search(line)
            if match:
                self.lighthouse_addr = f"http://127.0.0.1:{match.group(1)}"
                break
            if time.monotonic() > deadline:
                break
        if not self.lighthouse_addr:
            raise RuntimeError("torchft_lighthouse did not start (no 'listening on' line)")
        _print("[launcher]", f"lighthouse at {self.lighthouse_addr} (pid {self.lighthouse.pid})")
        threading.Thread(target=self._drain_lighthouse, daemon=True).start()

    def _drain_lighthouse(self) -> None:
        assert self.lighthouse is not None and self.lighthouse.stdout is not None
        for line in self.lighthouse.stdout:
            if self.args.show_lighthouse:
                _print("[lighthouse]", line)

    def start_group(self, group: Group) -> None:
        a = self.args
        env = dict(os.environ)
        env.update(
            NGPU=str(a.ngpu),
            TORCHFT_LIGHTHOUSE=self.lighthouse_addr,
            TORCHFT_MANAGER_PORT=str(free_port()),
            PYTHONUNBUFFERED="1",
        )
        env[JOB_ENV] = self.job_id
        # Groups on one machine share its cores: give each rank its share instead of letting
        # every process start a thread per core and fight over them.
        threads = max(1, (os.cpu_count() or 1) // (a.groups * a.ngpu))
        env.setdefault("OMP_NUM_THREADS", str(threads))
        cmd = [
            str(REPO_ROOT / "run_train.sh"),
            "--fault_tolerance.enable",
            f"--fault_tolerance.replica_id={group.replica_id}",
            f"--fault_tolerance.group_size={a.groups}",
            *a.train_args,
        ]
        group.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            start_new_session=True,
        )  # fmt: skip
        group.killed_by_us = False
        group.restart_at = None
        group.steps_this_start = 0
        what = "started" if group.restarts == 0 else f"restarted (#{group.restarts})"
        _print("[launcher]", f"group {group.replica_id} {what}, pid {group.proc.pid}")
        threading.Thread(target=self._follow, args=(group, group.proc), daemon=True).start()

    def _follow(self, group: Group, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            _print(f"[group {group.replica_id}]", line)
            match = _STEP_LINE.search(_ANSI.sub("", line))
            if match is None:
                continue
            step = int(match.group(1))
            with self.lock:
                if group.proc is not proc:
                    continue
                group.last_step = max(group.last_step, step)
                group.steps_this_start += 1
                target = self.kill_plan.get(group.replica_id)
                if target is not None and step >= target:
                    del self.kill_plan[group.replica_id]
                    self.kill(group, f"at step {step} (--kill)")

    def kill(self, group: Group, why: str) -> None:
        """SIGKILL the group's whole process tree, and schedule its restart."""
        if group.proc is None or group.proc.poll() is not None:
            return
        group.killed_by_us = True
        kill_tree(group.proc.pid)
        group.restart_at = time.monotonic() + self.args.restart_after
        _print("[launcher]", f"SIGKILL group {group.replica_id} {why}; "
               f"restart in {self.args.restart_after:g}s")  # fmt: skip

    def stop_all(self) -> None:
        """SIGTERM every process of the job (trees), SIGKILL what is left after 10 s."""
        procs = [g.proc for g in self.groups if g.proc is not None] + [self.lighthouse]
        live = [p for p in procs if p is not None and p.poll() is None]
        for proc in live:
            kill_tree(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in live:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid)
                proc.wait()
        # Workers whose torchrun died first are no longer in any tree: find them by marker.
        for pid in processes_with_env(JOB_ENV, self.job_id):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # ---- supervision -----------------------------------------------------------------------

    def run(self) -> int:
        self.start_lighthouse()
        for group in self.groups:
            self.start_group(group)
        next_random_kill = (
            time.monotonic() + self.args.kill_every if self.args.kill_every > 0 else None
        )
        while True:
            time.sleep(0.2)
            now = time.monotonic()
            with self.lock:
                for group in self.groups:
                    self._check(group, now)
                # A group that failed on its own is reported at the end; the others are fault
                # tolerant and go on without it (one slow or broken group never takes the job).
                live = [g for g in self.groups if not g.done and not g.failed]
                if not live:
                    break
                if next_random_kill is not None and now >= next_random_kill:
                    running = [g for g in live if g.proc and g.proc.poll() is None]
                    if len(running) > 1:  # never kill the last group standing
                        self.kill(self.rng.choice(running), "(--kill-every)")
                    next_random_kill = now + self.args.kill_every
        failed = [g.replica_id for g in self.groups if g.failed]
        self.stop_all()
        if failed:
            _print("[launcher]", f"FAILED: group(s) {failed}")
            return 1
        restarts = sum(g.restarts for g in self.groups)
        _print("[launcher]", f"all {len(self.groups)} groups finished ({restarts} restart(s))")
        return 0

    def _check(self, group: Group, now: float) -> None:
        if group.done or group.failed or group.proc is None:
            return
        others_finished = any(g.done and g is not group for g in self.groups) and all(
            g.done for g in self.groups if g is not group
        )
        code = group.proc.poll()
        if code is None:
            if others_finished and group.steps_this_start == 0 and group.restarts > 0:
                # A restarted group that has not trained yet cannot join a finished job.
                kill_tree(group.proc.pid)
                group.proc.wait()
                group.done = True
                _print("[launcher]", f"group {group.replica_id}: the job finished before it "
                       "rejoined; stopped")  # fmt: skip
            return
        if group.killed_by_us:
            if others_finished:
                group.done = True
                _print("[launcher]", f"group {group.replica_id}: not restarted, the other "
                       "groups finished the job")  # fmt: skip
            elif group.restart_at is not None and now >= group.restart_at:
                group.restarts += 1
                self.start_group(group)
            return
        if code == 0:
            group.done = True
            _print("[launcher]", f"group {group.replica_id} finished")
        else:
            group.failed = True
            _print("[launcher]", f"group {group.replica_id} exited with code {code}")
            if any(not g.done and not g.failed for g in self.groups):
                _print("[launcher]", f"the other groups go on without group {group.replica_id}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan.experiments.fault_tolerance.launcher",
        description=__doc__.split("\n\n")[0],
        epilog="Arguments after `--` go to every group's run_train.sh (e.g. "
        "--job.custom_args_module=... --fault_tolerance.semi_sync_method=diloco).",
    )
    parser.add_argument("--groups", type=int, default=2, help="replica groups (default 2)")
    parser.add_argument("--ngpu", type=int, default=1, help="ranks per group (NGPU; default 1)")
    parser.add_argument(
        "--min-replicas",
        type=int,
        default=1,
        help="lighthouse --min_replicas: fewest groups for a quorum (default 1). The groups' "
        "own --fault_tolerance.min_replica_size also makes them wait for that many.",
    )
    parser.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=2000,
        help="a group silent this long is dropped from the quorum (default 2000)",
    )
    parser.add_argument(
        "--join-timeout-ms",
        type=int,
        default=10000,
        help="how long the lighthouse waits for heartbeating stragglers (default 10000)",
    )
    parser.add_argument(
        "--kill",
        type=_kill_spec,
        action="append",
        default=[],
        metavar="R@S",
        help="SIGKILL group R once it logs step S (repeatable)",
    )
    parser.add_argument(
        "--kill-every",
        type=float,
        default=0.0,
        metavar="T",
        help="SIGKILL a random running group every T seconds (0: off)",
    )
    parser.add_argument(
        "--restart-after",
        type=float,
        default=5.0,
        metavar="D",
        help="restart a killed group after D seconds (default 5)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of --kill-every's choices")
    parser.add_argument("--show-lighthouse", action="store_true",
                        help="also print the lighthouse's own log")  # fmt: skip
    parser.add_argument("train_args", nargs=argparse.REMAINDER,
                        help="-- then arguments for run_train.sh")  # fmt: skip
    args = parser.parse_args(argv)
    if args.train_args and args.train_args[0] == "--":
        args.train_args = args.train_args[1:]
    if args.groups < 1:
        parser.error(f"--groups: {args.groups} is not allowed; use 1 or more")
    if args.ngpu < 1:
        parser.error(f"--ngpu: {args.ngpu} is not allowed; use 1 or more")
    if not 1 <= args.min_replicas <= args.groups:
        parser.error(f"--min-replicas: {args.min_replicas} must be in [1, --groups={args.groups}]")
    for replica, _ in args.kill:
        if not 0 <= replica < args.groups:
            parser.error(f"--kill: group {replica} does not exist (groups 0..{args.groups - 1})")
    return args


def _kill_spec(text: str) -> tuple[int, int]:
    replica, sep, step = text.partition("@")
    if not sep or not replica.isdigit() or not step.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected R@S, e.g. 1@10")
    return int(replica), int(step)


def main(argv: list[str] | None = None) -> int:
    launcher = Launcher(parse_args(argv))

    def terminate(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)  # a supervisor's SIGTERM cleans up like Ctrl-C
    try:
        return launcher.run()
    except KeyboardInterrupt:
        _print("[launcher]", "interrupted: stopping all groups")
        launcher.stop_all()
        return 130


if __name__ == "__main__":
    sys.exit(main())
