"""Sites of replica groups on emulated links: what a dead group costs its site, and the bytes a
site sends over the slow link per sync with 1, 2 and 3 groups.

    .venv/bin/python -m benchmarks.sites              # the headline's figures (~15 min)
    .venv/bin/python -m benchmarks.sites --smoke      # ~3 min; checks the plumbing

Topology (``benchmarks/netns.py``): each site is a network namespace with one link of
``--link-mbit`` to the hub (the slow link, shaped both ways); the site's groups and its
lighthouse run inside it and reach each other on the site's own address (the kernel's local
route: the site's fast network); the job's lighthouse runs in the hub. So the site's link
carries exactly what crosses sites: syncs, the job's quorums and heartbeats, heals between
sites. Group i runs on core i mod 2. DiLoCo, ``sync_steps`` ``--sync-steps``.

Part 1 (``--kills`` repeats): 2 sites x 2 groups. Once every group has committed 2 syncs,
SIGKILL group 1 of site 0 and restart it ``--restart-after`` seconds later. Per repeat:

* share: site 0's committed steps per second from the kill to the restarted group's first
  step, over the same in the equally long window before the kill (group 0's ``train.step``
  events);
* the other site's wait share in that window: the time its leader spent in sync quorums
  (``quorum_wait_s`` of its syncs in the window) over the window;
* restart -> the restarted group's first step (process start-up and its heal from its site);
* whether every group ended with the same final model.

Part 2: 2 sites x G groups for G in ``--groups-per-site`` (default 1 2 3), no kills: each
site's bytes sent on its link over the run (the kernel's ``tx_bytes``: IP headers, heartbeats
and quorums included) per committed sync, and the syncs' payload as the transport counted it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import ft_common as common
from benchmarks import netns, provenance
from benchmarks.wan import in_namespace
from torchtitan.components.metrics import TRAIN_STEP
from torchtitan.experiments.fault_tolerance.events import FINAL_MODEL, SYNC
from torchtitan.tools.cluster import LighthouseSettings, LocalJob, Process, ProcessSpec
from torchtitan.tools.events import EVENTS_FOLDER, Event, read_events

RESULT = "sites.json"
JOB_LIGHTHOUSE_PORT = 19610  # in the hub namespace (a fresh network stack: always free)
SITE_LIGHTHOUSE_PORT = 19611  # in each site's namespace
SITES = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sites", description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="short runs; results to a temp dir")
    parser.add_argument("--output", type=Path, default=None, help=provenance.output_help(RESULT))
    parser.add_argument("--link-mbit", type=float, default=100.0, help="each site's link")
    parser.add_argument("--kills", type=int, default=3, help="part 1's repeats")
    parser.add_argument("--restart-after", type=float, default=5.0, help="seconds")
    parser.add_argument("--groups-per-site", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--sync-steps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60, help="part 1's steps per repeat")
    parser.add_argument("--bytes-steps", type=int, default=30, help="part 2's steps per run")
    parser.add_argument("--flavor", default="debugmodel_small")
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    if args.smoke:
        args.kills, args.steps, args.bytes_steps = 1, 40, 10
        args.groups_per_site = [1, 2]
    return args


def train_args(folder: Path, args: argparse.Namespace, steps: int) -> list[str]:
    return [
        common.SEMI_SYNC_MODULE,
        "--fault_tolerance.semi_sync_method=diloco",
        f"--fault_tolerance.sync_steps={args.sync_steps}",
        f"--model.flavor={args.flavor}",
        "--training.seq_len=64",
        "--training.local_batch_size=4",
        f"--training.steps={steps}",
        "--validation.enable=false",
        "--metrics.log_freq=1",
        "--metrics.log_param_digest",
        "--metrics.cpu_peak_flops=-1",
        "--metrics.disable_color_printing",
        f"--job.dump_folder={folder / common.GROUPS_DUMP}",
        *common.FT_ARGS,
    ]


def site_job(folder: Path, wan: netns.Wan, groups_per_site: int, train: list[str]) -> LocalJob:
    """The job's lighthouse in the hub, each site's lighthouse and groups in the site's
    namespace; group i on core i mod 2, telling its peers its site's address."""
    per_site = groups_per_site

    def launch_group(index: int, spec: ProcessSpec) -> ProcessSpec:
        site = index // per_site
        spec = common.pin_to_core(index % 2, spec)
        argv = [*spec.argv, f"--fault_tolerance.hostname={netns.group_ip(site)}"]
        return in_namespace(wan, wan.group_ns(site))(ProcessSpec(argv, spec.env))

    return LocalJob(
        folder,
        groups=SITES * per_site,
        entry=common.TRAIN_ENTRY,
        train_args=train,
        threads=1,
        lighthouse=LighthouseSettings(
            min_replicas=1, heartbeat_timeout_ms=2000, host=netns.HUB_IP
        ),  # fmt: skip
        launch_group=launch_group,
        launch_lighthouse=in_namespace(wan, wan.hub),
        groups_per_site=per_site,
    )


def start_job(job: LocalJob, wan: netns.Wan) -> None:
    job.start_lighthouse(JOB_LIGHTHOUSE_PORT)
    if job.groups_per_site > 1:
        for site in range(SITES):
            job.start_site_lighthouse(
                site, netns.group_ip(site), in_namespace(wan, wan.group_ns(site)),
                SITE_LIGHTHOUSE_PORT,
            )  # fmt: skip
    for replica in range(job.groups):
        job.start_group(replica)


def events(job: LocalJob, replica: int, kind: Any, since: float = 0.0) -> list[Event]:
    dump = job.folder / common.GROUPS_DUMP / EVENTS_FOLDER
    return read_events(dump, kind, replica=replica, rank=0, since=since)


def wait_for(job: LocalJob, replica: int, kind: Any, count: int, timeout: float,
             since: float = 0.0) -> list[Event]:  # fmt: skip
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = events(job, replica, kind, since)
        if len(found) >= count:
            return found
        if job.latest(replica).poll() not in (None, 0):
            raise RuntimeError(f"group {replica} failed:\n{job.latest(replica).tail()}")
        time.sleep(0.2)
    raise RuntimeError(f"group {replica}: no {count}x {kind} in {timeout:.0f}s")


def final_digests(job: LocalJob) -> list[str]:
    found = []
    for replica in range(job.groups):
        last = events(job, replica, FINAL_MODEL, job.latest(replica).started_at)
        found.append(last[-1]["digest"] if last else "none")
    return found


def wait_done(job: LocalJob, timeout: float) -> None:
    common.wait_all([job.latest(r) for r in range(job.groups)], timeout)


def kill_repeat(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    victim, survivor, other_leader = 1, 0, 2
    with netns.Wan(SITES, args.link_mbit) as wan:
        with site_job(folder, wan, 2, train_args(folder, args, args.steps)) as job:
            start_job(job, wan)
            for replica in range(job.groups):
                wait_for(job, replica, SYNC, 2, args.timeout)
            job.kill_group(victim)
            killed = time.time()
            time.sleep(args.restart_after)
            restarted: Process = job.start_group(victim)
            first = wait_for(job, victim, TRAIN_STEP, 1, args.timeout, restarted.started_at)[0]
            wait_done(job, args.timeout)
            digests = final_digests(job)
        back = first.time
        window = back - killed
        steps = [e.time for e in events(job, survivor, TRAIN_STEP)]
        during = sum(killed <= t < back for t in steps)
        before = sum(killed - window <= t < killed for t in steps)
        waited = sum(
            e["quorum_wait_s"] for e in events(job, other_leader, SYNC) if killed <= e.time < back
        )
    return {
        "window_s": round(window, 2),
        "steps_during": during,
        "steps_before": before,
        "share": round(during / before, 4) if before else None,
        "other_site_wait_s": round(waited, 3),
        "other_site_wait_share": round(waited / window, 4),
        "restart_to_first_step_s": round(back - restarted.started_at, 2),
        "digests": digests,
        "digests_equal": len(set(digests)) == 1,
    }


def bytes_run(folder: Path, args: argparse.Namespace, groups_per_site: int) -> dict[str, Any]:
    with netns.Wan(SITES, args.link_mbit) as wan:
        job = site_job(folder, wan, groups_per_site, train_args(folder, args, args.bytes_steps))
        with job:
            before = [wan.tx_bytes(site) for site in range(SITES)]
            start_job(job, wan)
            wait_done(job, args.timeout)
            sent = [wan.tx_bytes(site) - before[site] for site in range(SITES)]
            digests = final_digests(job)
    payload: dict[int, dict[int, int]] = {}
    for replica in range(SITES * groups_per_site):
        for e in events(job, replica, SYNC):
            if e["committed"]:
                by_site = payload.setdefault(e.sync or 0, {})
                site = replica // groups_per_site
                by_site[site] = by_site.get(site, 0) + int(e["bytes_sent"])
    syncs = len(payload)
    return {
        "groups_per_site": groups_per_site,
        "syncs": syncs,
        "link_tx_bytes_per_sync": [round(b / syncs) for b in sent],
        "payload_bytes_per_sync": [
            statistics.mean(p.get(site, 0) for p in payload.values()) for site in range(SITES)
        ],
        "digests_equal": len(set(digests)) == 1,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why = netns.unavailable()
    if why is not None:
        print(f"[sites] cannot emulate links here: {why}", file=sys.stderr)
        return 2
    output = args.output or provenance.default_output(RESULT, args.smoke)
    kills, runs = [], []
    with tempfile.TemporaryDirectory(prefix="bench_sites_") as tmp:
        for repeat in range(args.kills):
            found = kill_repeat(Path(tmp) / f"kill{repeat}", args)
            print(f"[sites] kill {repeat}: {found}", flush=True)
            kills.append(found)
        for groups in args.groups_per_site:
            found = bytes_run(Path(tmp) / f"bytes{groups}", args, groups)
            print(f"[sites] {groups} group(s) per site: {found}", flush=True)
            runs.append(found)
    one = next((r for r in runs if r["groups_per_site"] == 1), None)
    for run in runs:
        if one is not None:
            run["link_bytes_vs_one_group"] = [
                round(mine / base, 4)
                for mine, base in zip(
                    run["link_tx_bytes_per_sync"], one["link_tx_bytes_per_sync"], strict=True
                )
            ]
    result = {
        "link_mbit": args.link_mbit,
        "sync_steps": args.sync_steps,
        "flavor": args.flavor,
        "kills": kills,
        "bytes": runs,
    }
    command = provenance.command_line("benchmarks.sites", argv)
    print(f"[sites] wrote {provenance.write_result(output, result, command)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
