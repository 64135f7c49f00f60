"""One command for a local fault-tolerant job: a lighthouse plus N replica groups.

    ./run_launcher.sh --groups 2 -- --training.steps=100

Sites of groups: ``./run_launcher.sh --sites 2 --groups-per-site 2 -- ARGS`` starts the job's
lighthouse, one lighthouse per site and 4 groups (group R is group R mod 2 of site R // 2);
``--kill 0:1@10`` addresses group 1 of site 0.

(``run_launcher.sh`` runs this module with the project's ``.venv``) starts
``torchft_lighthouse`` on 127.0.0.1 (a free port), then N replica groups, each a
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

This module is the command line and the exit status; ``supervisor`` runs the job.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from torchtitan.config.manager import flag_value, load_toml, raw_value
from torchtitan.experiments.fault_tolerance.launch.supervisor import Supervisor, say
from torchtitan.tools.cluster import split_devices, visible_gpus


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="./run_launcher.sh",
        description=__doc__.split("\n\n")[0],
        epilog="Arguments after `--` go to every group's run_train.sh (e.g. "
        "--job.custom_args_module=... --fault_tolerance.semi_sync_method=diloco).",
    )
    parser.add_argument(
        "--groups",
        type=int,
        default=None,
        help="replica groups (default 2; with --sites: sites x groups per site)",
    )
    parser.add_argument(
        "--sites",
        type=int,
        default=None,
        help="sites of replica groups (each "
        "with its own lighthouse; default: every group is a site)",
    )
    parser.add_argument("--groups-per-site", type=int, default=1, metavar="G",
                        help="replica groups per site, which average gradients every step "
                        "(default 1)")  # fmt: skip
    parser.add_argument("--ngpu", type=int, default=1, help="ranks per group (NGPU; default 1)")
    parser.add_argument(
        "--gpus-per-group",
        type=int,
        default=None,
        metavar="N",
        help="give each group N GPUs of its own (CUDA_VISIBLE_DEVICES split in order: group 0 "
        "the first N); 0: every group sees them all and puts its ranks on cuda:0.. (groups "
        "share GPUs). Default: --ngpu when the machine has a GPU per rank of every group, "
        "else 0 with a note",
    )
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
        help="SIGKILL group R once it logs step S (repeatable); with sites, SITE:G@S is group "
        "G of site SITE",
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
    if args.groups_per_site < 1:
        parser.error(f"--groups-per-site: {args.groups_per_site} is not allowed; use 1 or more")
    if args.sites is not None:
        if args.sites < 1:
            parser.error(f"--sites: {args.sites} is not allowed; use 1 or more")
        groups = args.sites * args.groups_per_site
        if args.groups is not None and args.groups != groups:
            parser.error(f"--groups: {args.groups} is not --sites x --groups-per-site = {groups}")
        args.groups = groups
    elif args.groups_per_site > 1:
        parser.error("--groups-per-site needs --sites (how many sites)")
    if args.groups is None:
        args.groups = 2
    if args.groups < 1:
        parser.error(f"--groups: {args.groups} is not allowed; use 1 or more")
    try:
        args.kill = [(_replica(where, args.groups_per_site), step) for where, step in args.kill]
    except ValueError as e:
        parser.error(f"--kill: {e}")
    if args.ngpu < 1:
        parser.error(f"--ngpu: {args.ngpu} is not allowed; use 1 or more")
    if not 1 <= args.min_replicas <= args.groups:
        parser.error(f"--min-replicas: {args.min_replicas} must be in [1, --groups={args.groups}]")
    for replica, _ in args.kill:
        if not 0 <= replica < args.groups:
            parser.error(f"--kill: group {replica} does not exist (groups 0..{args.groups - 1})")
    args.group_devices = _group_devices(parser, args)
    return args


def _group_devices(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str] | None:
    """Each group's CUDA_VISIBLE_DEVICES, or None to leave it alone (no GPU, or shared)."""
    gpus = visible_gpus()
    per_group = args.gpus_per_group
    if per_group is None:
        if not gpus:
            return None
        if len(gpus) < args.groups * args.ngpu:
            say(
                "[launcher]",
                f"{args.groups} group(s) x {args.ngpu} rank(s) on {len(gpus)} GPU(s): the groups "
                "share them (--gpus-per-group=N gives each group N of its own)",
            )
            return None
        per_group = args.ngpu
    if per_group < 0:
        parser.error(f"--gpus-per-group: {per_group} is not allowed; use 0 or more")
    if per_group == 0:
        return None
    try:
        return split_devices(gpus, args.groups, per_group)
    except ValueError as e:
        parser.error(f"--gpus-per-group: {per_group} is not allowed; {e}")


def _kill_spec(text: str) -> tuple[str, int]:
    where, sep, step = text.partition("@")
    site, colon, group = where.partition(":")
    numbers = [site, group] if colon else [where]
    if not sep or not all(n.isdigit() for n in numbers) or not step.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected R@S or SITE:G@S, e.g. 1@10")
    return where, int(step)


def _replica(where: str, groups_per_site: int) -> int:
    """The replica id of ``R`` or ``SITE:G`` (group G of site SITE)."""
    site, colon, group = where.partition(":")
    if not colon:
        return int(where)
    if int(group) >= groups_per_site:
        raise ValueError(f"{where}: a site has groups 0..{groups_per_site - 1}")
    return int(site) * groups_per_site + int(group)


def command_for_one_group(train_args: list[str]) -> list[str] | None:
    """The launcher's command for a semi-sync command line typed without fault tolerance
    (``./run_train.sh --job.custom_args_module=... --fault_tolerance.semi_sync_method=localsgd``):
    one replica group against a lighthouse started for it, as the user expects training to
    start. None when fault tolerance is on, when ``group_size`` asks for more groups (two
    groups must never each start a lighthouse and train apart), or when ``TORCHFT_LIGHTHOUSE``
    names one: the config's own checks then say what to do."""
    from torchtitan.experiments.fault_tolerance.job_config import SEMI_SYNC_METHODS

    config_file = flag_value(train_args, "job.config_file")
    toml_data = load_toml(config_file) if config_file else {}
    method = raw_value(train_args, toml_data, "fault_tolerance.semi_sync_method")
    enabled = raw_value(train_args, toml_data, "fault_tolerance.enable")
    group_size = raw_value(train_args, toml_data, "fault_tolerance.group_size")
    if (
        method not in SEMI_SYNC_METHODS
        or str(enabled).lower() == "true"
        or str(group_size) not in ("None", "0", "1")
        or os.environ.get("TORCHFT_LIGHTHOUSE")
    ):
        return None
    launcher = [sys.executable, "-m", "torchtitan.experiments.fault_tolerance.launch.launcher"]
    shown = "./run_launcher.sh"
    print(
        f"[launcher] fault_tolerance.semi_sync_method={method} trains across replica groups "
        "with fault tolerance: starting a lighthouse on 127.0.0.1 and this command as replica "
        f"group 0 of 1. More groups on this machine: {shown} --groups 2 -- ARGS; on several "
        "machines: docs/fault_tolerance.md (one lighthouse, one command per group)",
        file=sys.stderr,
        flush=True,
    )
    ranks = os.environ.get("NGPU", "1")
    return [*launcher, "--groups", "1", "--ngpu", ranks, "--", *train_args]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The groups' output is printed as it comes; the log files it comes through are not kept.
    logs = Path(tempfile.mkdtemp(prefix="ft_launcher_"))
    launcher = Supervisor(args, logs)

    def terminate(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)  # a supervisor's SIGTERM cleans up like Ctrl-C
    try:
        with launcher.job:  # whatever happens, no process of the job outlives the launcher
            try:
                return launcher.run()
            except KeyboardInterrupt:
                say("[launcher]", "interrupted: stopping all groups")
                launcher.stop_all()
                return 130
    finally:
        shutil.rmtree(logs, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
