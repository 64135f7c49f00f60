"""Sites of replica groups on emulated links: what a dead group costs its site, and the bytes a
site sends over the slow link per sync with 1, 2 and 3 groups.

    .venv/bin/python -m benchmarks.sites              # the headline's figures (~15 min)
    .venv/bin/python -m benchmarks.sites --smoke      # ~3 min; checks the plumbing

Steps of the debug model that compute for most of their time (``--seq-len``, ``--batch``): a
site's step quorum and its all-reduce cost tens of milliseconds here, as they do beside the
seconds a GPU step takes.

Topology (``benchmarks/netns.py``): each site is a network namespace with one link of
``--link-mbit`` to the hub (the slow link, shaped both ways); the site's groups and its
lighthouse run inside it and reach each other on the site's own address (the kernel's local
route: the site's fast network); the job's lighthouse runs in the hub. So the site's link
carries exactly what crosses sites: syncs, the job's quorums and heartbeats, heals between
sites. Site s's groups share core s mod 2. DiLoCo, ``sync_steps`` ``--sync-steps``.

Part 1 (``--kills`` repeats): 2 sites x 2 groups, ``--steps`` steps. Once group 1 of site 0
has taken ``--kill-at-step`` steps, SIGKILL it and restart it ``--restart-after`` seconds
later (the other groups train on meanwhile: the job is long enough for its return). Per
repeat:

* share: site 0's compute seconds (both its groups', ``benchmarks/timed_trainer.py``) from the
  kill to the restarted group's first step, over the same in the equally long window before
  the kill: about (G - 1) / G = 0.5 when the survivor trains on without waiting, 0 for a site
  that stops until the group is back;
* the other site's wait share in that window: 1 - its groups' mean compute seconds over the
  window's wall seconds, and what the kill added to it (the same share in the window before,
  less): here most of it is the 2 cores shared by 4 groups and each step's quorum;
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
from benchmarks.timed_trainer import TIMING
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
    parser.add_argument("--steps", type=int, default=100, help="part 1's steps per repeat")
    parser.add_argument("--kill-at-step", type=int, default=40, help="part 1's kill")
    parser.add_argument("--bytes-steps", type=int, default=30, help="part 2's steps per run")
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="local batch size")
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    if args.smoke:
        # Steps of milliseconds: enough of them left after the kill for the group's return.
        args.kills, args.steps, args.kill_at_step, args.bytes_steps = 1, 160, 30, 5
        args.restart_after = 0.5
        args.flavor, args.seq_len, args.batch = "debugmodel_small", 64, 4
        args.groups_per_site = [1, 2]
    return args


def train_args(folder: Path, args: argparse.Namespace, steps: int) -> list[str]:
    return [
        common.TIMED_MODULE,
        "--fault_tolerance.semi_sync_method=diloco",
        f"--fault_tolerance.sync_steps={args.sync_steps}",
        f"--model.flavor={args.flavor}",
        f"--training.seq_len={args.seq_len}",
        f"--training.local_batch_size={args.batch}",
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
    namespace, site s's groups on core s mod 2 (a site computes on its own hardware: a
    restarting group's start-up takes its own site's core, not the other site's), telling
    their peers their site's address."""
    per_site = groups_per_site

    def launch_group(index: int, spec: ProcessSpec) -> ProcessSpec:
        site = index // per_site
        spec = common.pin_to_core(site % 2, spec)
        argv = [*spec.argv, f"--fault_tolerance.hostname={netns.group_ip(site)}"]
        env = {**spec.env, "GLOO_SOCKET_IFNAME": netns.GROUP_IFACE}
        return in_namespace(wan, wan.group_ns(site))(ProcessSpec(argv, env))

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
        if all(job.latest(r).poll() is not None for r in range(job.groups) if r != replica):
            raise RuntimeError(f"the other groups finished before group {replica}: raise --steps")
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


def compute_seconds(found: list[Event], start: float, end: float) -> float:
    """Seconds a group computed within [start, end] (``time.monotonic()``), from its timing
    events (``compute_s`` summed so far by each process, at each step's end ``t``): the growth
    of each process's sum over its steps that ended in the window."""
    total = 0.0
    for pid in {e.pid for e in found}:
        mine = [e for e in found if e.pid == pid]
        inside = [e for e in mine if start <= e["t"] <= end]
        before = [e for e in mine if e["t"] < start]
        if inside:
            first = before[-1]["compute_s"] if before else 0.0  # a process sums from 0
            total += float(inside[-1]["compute_s"] - first)
    return total


def kill_repeat(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One kill of group 1 of site 0 (see the module docstring). The share and the wait are
    compute seconds over wall seconds (``timed_trainer``): on this machine's 2 cores the
    groups' steps speed up when one dies, which a steps-per-second ratio would count."""
    victim = 1
    site_groups, other_groups = (0, 1), (2, 3)
    with netns.Wan(SITES, args.link_mbit) as wan:
        with site_job(folder, wan, 2, train_args(folder, args, args.steps)) as job:
            start_job(job, wan)
            wait_for(job, victim, TRAIN_STEP, args.kill_at_step, args.timeout)
            job.kill_group(victim)
            killed = time.monotonic()
            time.sleep(args.restart_after)
            restarted: Process = job.start_group(victim)
            started = time.monotonic()
            first = wait_for(job, victim, TIMING, 1, args.timeout, restarted.started_at)[0]
            wait_done(job, args.timeout)
            digests = final_digests(job)
        back = float(first["t"])
        window = back - killed
        timing = {r: events(job, r, TIMING) for r in range(job.groups)}
        during = sum(compute_seconds(timing[r], killed, back) for r in site_groups)
        before = sum(compute_seconds(timing[r], killed - window, killed) for r in site_groups)
        other = [compute_seconds(timing[r], killed, back) / window for r in other_groups]
        other_before = [
            compute_seconds(timing[r], killed - window, killed) / window for r in other_groups
        ]
    return {
        "window_s": round(window, 2),
        "site_compute_s_during": round(during, 3),
        "site_compute_s_before": round(before, 3),
        "share": round(during / before, 4) if before else None,
        "other_site_utilisation": [round(u, 4) for u in other],
        "other_site_utilisation_before": [round(u, 4) for u in other_before],
        "other_site_wait_share": round(1 - statistics.mean(other), 4),
        # What the kill added to it: the same groups' wait share in the window before.
        "other_site_extra_wait_share": round(
            statistics.mean(other_before) - statistics.mean(other), 4
        ),
        "restart_to_first_step_s": round(back - started, 2),
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
    common.stop_cleanly_on_sigterm()  # a SIGTERM still ends the job's processes and namespaces
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
