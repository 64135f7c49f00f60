"""The GPU path, run for real in one go: what ``scripts/gpu_check.sh`` runs on a machine with one
CUDA device (or two: ``--gpus 2``), within a time budget (``--budget-s``, default 295 s; the
wrapper's hard limit is 345 s). Everything it measures goes into one folder: a log per run and
``gpu_check.json``, written again after every run, so that a run cut off by the budget loses
nothing measured before it. ``scripts/gpu_check_runs.py`` lists the runs, each with its own
timeout, the timeouts adding up to less than the budget.

Runs, in this order (the most telling first; each bounded by its own timeout and by what is left
of the budget, each recorded whatever its outcome):

1. ``cuda_tests``: the tests that need CUDA, with their pass / skip / fail counts: a sync's wait
   behind seconds of queued compute on a world-size-1 nccl group (it must take milliseconds), the
   step clock, the codecs' CUDA-against-CPU bit equality, Delayed Nesterov on CUDA, async
   DiLoCo's copies to pinned host state, and nccl's semantics on a world-size-1 group
   (``test_nccl_semantics_cuda.py``: the abort path, the quorum's exchange, DyLU's probe, the
   versions and error-handling modes). The figures the tests write (``sync_wait.json``,
   ``nccl_semantics.json``) go into the row.
2. ``outer_step``: ``benchmarks/outer_step.py`` at a 1B-size shard (1.25e9 values) with the
   outer state in pinned host memory: the host seconds of a sync point against its copies',
   pinned and resident host memory.
3. ``two_groups``: a lighthouse and two replica groups on the one GPU, gloo across them: async
   DiLoCo + int8 with bf16 autocast and ``torch.compile`` (steps/s, syncs committed, whether the
   blocks compiled); blocking DiLoCo with group 1 SIGKILLed and restarted, so that it heals from
   group 0: CUDA tensors over gloo (``heal_cuda_over_gloo``: ``healed``, or ``unsupported`` with
   the error line that says why, ...). Per run: both groups' final digests (they must agree),
   committed syncs, heals, peak GPU memory per group.
4. ``throughput``: one replica group (no fault tolerance, one rank) training the ``1B`` flavor in
   bf16, eager: tokens/s, MFU against the datasheet's bf16 peak and the matmul rate measured here
   first, peak memory, from the run's own step events.

``--gpus 2`` (a machine with two GPUs; with fewer it stops at once, saying so): two replica groups
over nccl, a GPU each: DiLoCo with group 1 SIGKILLed and restarted (the survivor must sync on,
the restarted group heal, both end with the same model: ``kill``), then async DiLoCo with int8.

The JSON's ``covers`` says, by name, what this check showed (each with its test's outcome or its
run's verdict) and what one GPU cannot show (``scripts/gpu_check_runs.py`` lists them).

``--dry-run`` runs the same steps on the CPU with the smallest model and a few steps, gloo across
groups (the tests that need CUDA then skip): it checks the script, not the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

from gpu_check_runs import (
    CUDA_TESTS,
    NEEDS_TWO_GPUS,
    NOT_RUN,
    ONE_GPU_COVERS,
    OUTER_STEP_KEYS,
    TEST_FIGURES,
    TWO_GPU_COVERS,
    WHOLE_FILES,
    runs,
)

from torchtitan.tools.cluster.process_tree import process_tree, signal_pids
from torchtitan.tools.events import EVENTS_FOLDER, Event, read_events

REPO = Path(__file__).resolve().parents[1]
SEMI_SYNC_MODULE = "--job.custom_args_module=torchtitan.experiments.fault_tolerance.job_config"
# The experiment's config plus the tests' fault knobs (paced steps), for the healing run.
FAULTS_MODULE = "--job.custom_args_module=tests.integration_tests.faults"
# An error line saying that gloo cannot carry a CUDA tensor (torch's gloo reads and writes the
# tensor's memory from the host: a device pointer gives EFAULT, "Bad address", or is refused).
GLOO_CUDA_ERROR = re.compile(
    r"Bad address|(?i:gloo).*(?i:cuda|device)|(?i:cuda).*(?i:gloo)|(?i:cuda) tensors?.*not supp"
)
ERROR_WORDS = re.compile(r"Error|error|Exception|failed|Bad address|not supported|unsupported")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the logs and the JSON")
    p.add_argument("--dry-run", action="store_true", help="the steps on the CPU, tiny")
    p.add_argument("--budget-s", type=float, default=295.0, help="seconds for all runs together")
    p.add_argument("--gpus", type=int, choices=(1, 2), default=1,
                   help="GPUs of the machine the check is for (2: kills over nccl)")  # fmt: skip
    return p.parse_args(argv)


class Terminated(BaseException):  # not an Exception: a run's error handling must not take it
    """SIGTERM (the wrapper's ``timeout``): stop the run in progress, keep what was measured."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise Terminated


def stop(proc: subprocess.Popen) -> None:
    """End ``proc`` and everything it started. The launcher's lighthouse and groups run in
    sessions of their own, so the tree is collected first; SIGTERM lets the launcher stop its
    groups (10 s of grace), then whatever is left is killed by PID."""
    tree = process_tree(proc.pid)
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        pass
    signal_pids(tree, signal.SIGKILL)
    proc.wait()


class Budget:
    """Seconds left of the whole check; a run gets its own limit or what is left, less a margin
    for writing the JSON."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def limit(self, wanted: float) -> float:
        return max(0.0, min(wanted, self.deadline - time.monotonic() - 5.0))


def run(name: str, cmd: list[str], out: Path, timeout_s: float,
        env: dict[str, str] | None = None) -> dict:  # fmt: skip
    """Run ``cmd`` with its output in ``out/<name>.log``; its exit status and seconds."""
    log = out / f"{name}.log"
    if timeout_s < 10:
        return {"exit": "skipped: budget spent", "seconds": 0.0, "log": None}
    start = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env)
        try:
            code: int | str = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop(proc)
            code = "timeout"
        except Terminated:
            stop(proc)
            raise
    return {"exit": code, "seconds": round(time.monotonic() - start, 1), "log": log.name}


def last_lines(path: Path, count: int = 5) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-count:]
    except OSError:
        return []


def events(dump: Path, name: str) -> list[Event]:
    """The events of ``name`` in a run's dump folder, oldest first."""
    return read_events(dump / EVENTS_FOLDER, name)


def median(values: list[float]) -> float:
    """The middle value (the upper one of an even count); NaN for none."""
    return sorted(values)[len(values) // 2] if values else float("nan")


def read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def test_outcomes(junit: Path) -> dict[str, str]:
    """Each test's outcome in pytest's JUnit XML, by node id (``file::name``): ``passed``, or
    ``skipped``, ``failed`` or ``error`` followed by pytest's message. Empty when there is none."""
    try:
        root = ElementTree.parse(junit).getroot()
    except (OSError, ElementTree.ParseError):
        return {}
    found = {}
    for case in root.iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        outcome = "passed"
        for child in case:
            if child.tag in ("skipped", "failure", "error"):
                word = {"failure": "failed"}.get(child.tag, child.tag)
                outcome = f"{word}: {(child.get('message') or '').strip()[:300]}"
                break
        found[f"{path}::{case.get('name')}"] = outcome
    return found


def cuda_tests(spec: dict, out: Path, python: str, budget: Budget) -> dict:
    """The tests that need CUDA (``CUDA_TESTS``; of most files only those named ``cuda``): counts,
    the seconds of the whole files' tests, the figures they wrote (``TEST_FIGURES``), and each
    test's outcome (``outcomes``, for ``covers``)."""
    files = [f for f in CUDA_TESTS if (REPO / f).exists()]
    keyword = " or ".join(["cuda", *(Path(f).stem for f in WHOLE_FILES if f in files)])
    junit = out / "cuda_tests.xml"
    junit.unlink(missing_ok=True)
    cmd = [python, "-m", "pytest", *files, "-k", keyword, "-q", "-rs", "-p", "no:cacheprovider",
           "--durations=0", "--durations-min=0.05", f"--junitxml={junit.resolve()}"]  # fmt: skip
    for name in TEST_FIGURES.values():
        (out / name).unlink(missing_ok=True)
    env = {**os.environ, "GPU_CHECK_OUT": str(out.resolve())}
    row: dict[str, Any] = {**spec, **run("cuda_tests", cmd, out, budget.limit(spec["timeout_s"]),
                                         env)}  # fmt: skip
    row["not_there"] = [f for f in CUDA_TESTS if f not in files]  # left out, not failed
    log = out / "cuda_tests.log"
    tail = " ".join(last_lines(log, 3))
    for word in ("passed", "skipped", "failed", "error"):
        match = re.search(rf"(\d+) {word}", tail)
        row[word] = int(match.group(1)) if match else 0
    # pytest's --durations lines: "2.51s call     tests/...py::test_name".
    whole = tuple(WHOLE_FILES)
    row["durations_s"] = {
        m.group(2).split("::", 1)[1]: float(m.group(1))
        for line in last_lines(log, 200)
        if (m := re.match(r"([\d.]+)s call\s+(\S+)$", line.strip()))
        and m.group(2).startswith(whole)
    }
    for key, name in TEST_FIGURES.items():  # None: the test did not run (or not to its end)
        row[key] = read_json(out / name)
    row["outcomes"] = test_outcomes(junit)
    if row["failed"] or row["error"]:
        row["last_lines"] = last_lines(log, 15)
    return row


def outer_step_figure(figures: dict, key: str) -> Any:
    """``key`` of the benchmark's JSON: at its top level, else in its summary of this code
    (``versions.this``: ``key``, ``key_median``, ``key_max``), else the median over its runs."""
    this = figures.get("versions", {}).get("this", {})
    for where, name in ((figures, key), (this, key), (this, f"{key}_median"), (this, f"{key}_max")):
        if name in where:
            return where[name]
    values = []
    for one in this.get("runs", []):
        value = one.get(key)
        values.extend(value if isinstance(value, list) else [] if value is None else [value])
    return median(values) if values else None


def outer_step(spec: dict, out: Path, python: str, budget: Budget) -> dict:
    """``benchmarks/outer_step.py``: a sync point's host seconds and host memory. Its JSON goes
    into the row (``figures``), ``OUTER_STEP_KEYS`` first; cut off before it wrote that, the
    ratios it printed per turn."""
    row: dict[str, Any] = dict(spec)
    script = REPO / "benchmarks" / "outer_step.py"
    if not script.exists():
        return {**row, "exit": "skipped: benchmarks/outer_step.py is not there", "seconds": 0.0,
                "log": None}  # fmt: skip
    result = out / "outer_step.json"
    result.unlink(missing_ok=True)
    cmd = [python, "-m", "benchmarks.outer_step", "--numel", str(spec["numel"]),
           "--no-one-thread", "--repeats", str(spec["repeats"]),
           "--json", str(result.resolve()), "--device", spec["device"]]  # fmt: skip
    if "--turns" in script.read_text():  # one process, not one per turn, where it says so
        cmd += ["--turns", str(spec["turns"])]
    row.update(run("outer_step", cmd, out, budget.limit(spec["timeout_s"])))
    figures = read_json(result)
    if figures is not None:
        row.update({key: outer_step_figure(figures, key) for key in OUTER_STEP_KEYS})
        row["missing_keys"] = [key for key in OUTER_STEP_KEYS if row[key] is None]
        row["figures"] = figures
    else:
        printed = [m.group(1) for line in last_lines(out / "outer_step.log", 50)
                   if (m := re.match(r"this: (\[.*\]) memcpy equivalents$", line))]  # fmt: skip
        row["ratios_printed"] = [json.loads(r) for r in printed]
    if row["exit"] != 0:
        row["last_lines"] = last_lines(out / "outer_step.log", 12)
    return row


def steps_per_s(steps: list[Event]) -> float | None:
    """Steps per second of one group, from its second step event on (past compilation)."""
    if len(steps) < 3 or steps[-1].time <= steps[1].time:
        return None
    first, last = steps[1].step, steps[-1].step
    if first is None or last is None:
        return None
    return (last - first) / (steps[-1].time - steps[1].time)


def heal_verdict(row: dict, log: Path, dry: bool) -> dict[str, Any]:
    """Whether the restarted group healed over gloo with its state on the GPU: ``healed``;
    ``unsupported`` with the error line saying gloo cannot carry a CUDA tensor; ``not
    exercised`` (the group came back after its peer had ended); else ``failed``."""
    if dry:
        return {"heal_cuda_over_gloo": "not checked: the dry run's state is on the CPU"}
    if row["heals"]:
        return {"heal_cuda_over_gloo": "healed"}
    for line in last_lines(log, 100_000):
        if GLOO_CUDA_ERROR.search(line) and ERROR_WORDS.search(line):
            return {"heal_cuda_over_gloo": "unsupported", "why": line.strip()[:400]}
    if row["exit"] == 0:
        return {"heal_cuda_over_gloo": "not exercised: no heal (the group came back too late)"}
    return {"heal_cuda_over_gloo": "failed", "why": f"exit {row['exit']}, no heal"}


def kill_verdict(row: dict, dump: Path) -> dict[str, Any]:
    """Group 1 SIGKILLed and restarted (``--kill 1@S``): whether the survivor, group 0, kept
    running and syncing after the kill, whether the restarted group healed, and whether both
    ended with the same model."""
    starts: dict[int, list[Event]] = {}  # group 1's step events, by process (oldest first)
    for entry in events(dump, "train.step"):
        if entry.replica == 1:
            starts.setdefault(entry.pid, []).append(entry)
    if not starts:
        return {"group_1_killed_at_step": None, "survivor_kept_running": False,
                "restarted_group_healed": False, "final_digests_equal": False}  # fmt: skip
    first = next(iter(starts.values()))
    killed_at = first[-1].time  # its last step before the SIGKILL
    after = [e for e in events(dump, "semi_sync.sync") if e.replica == 0 and e.time > killed_at]
    committed = sum(1 for e in after if e.fields["committed"])
    return {
        "group_1_killed_at_step": first[-1].step,
        "group_1_restarts": len(starts) - 1,
        "survivor_syncs_after_the_kill": {"committed": committed,
                                          "not_committed": len(after) - committed},
        "survivor_kept_running": row["exit"] == 0 and committed > 0 and 0 in row["final_digests"],
        "restarted_group_healed": any(h["replica"] == 1 for h in row["heals"]),
        "final_digests_equal": row["groups_agree"],
    }  # fmt: skip


def two_groups(spec: dict, out: Path, python: str, budget: Budget, dry: bool) -> dict:
    """A lighthouse and two replica groups (``spec``: name, flavor, method, backend, steps,
    extra launcher and train arguments; ``compile``: say whether the blocks compiled; ``heal``:
    say whether a heal carried the GPU's tensors over gloo; ``kill``: say what group 1's kill
    did, :func:`kill_verdict`)."""
    name, dump = spec["name"], out / spec["name"]
    train = [
        FAULTS_MODULE if spec.get("paced") else SEMI_SYNC_MODULE, f"--job.dump_folder={dump}",
        f"--model.flavor={spec['flavor']}", f"--training.steps={spec['steps']}",
        f"--training.local_batch_size={spec.get('batch', 4)}",
        f"--training.seq_len={spec.get('seq', 256)}", "--validation.enable=false",
        f"--metrics.log_freq={spec.get('log_freq', 4)}", "--lr_scheduler.warmup_steps=2",
        f"--fault_tolerance.semi_sync_method={spec['method']}",
        f"--fault_tolerance.sync_steps={spec.get('sync_steps', 4)}",
        f"--fault_tolerance.process_group={spec['backend']}",
        # Below the run's own limit: a hung collective is reported by the groups, not cut off.
        f"--fault_tolerance.sync_collective_timeout_s={spec.get('collective_timeout_s', 25)}",
        *(["--metrics.log_param_digest"] if spec.get("digests", True) else []),
        *spec.get("train_args", []),
    ]  # fmt: skip
    cmd = [python, "-m", "torchtitan.experiments.fault_tolerance.launch.launcher", "--groups", "2",
           *spec.get("launcher_args", []), "--", *train]  # fmt: skip
    row: dict[str, Any] = dict(spec)
    row.update(run(name, cmd, out, budget.limit(spec["timeout_s"])))
    log = out / f"{name}.log"
    finals: dict[int, str] = {}
    memory: dict[int, float] = {}
    for entry in events(dump, "semi_sync.final_model"):
        if entry.rank == 0:
            finals[entry.replica or 0] = entry.fields["digest"]
    steps_by_group: dict[int, list[Event]] = {}  # of each group's last process (a restart)
    for entry in events(dump, "train.step"):
        replica = entry.replica or 0
        memory[replica] = max(memory.get(replica, 0.0), entry.fields["memory_gib"])
        seen = steps_by_group.setdefault(replica, [])
        if seen and seen[-1].pid != entry.pid:
            seen.clear()
        seen.append(entry)
    # past each warm-up
    tps = [e.fields["tps"] for group in steps_by_group.values() for e in group[2:]]
    row["final_digests"] = finals
    row["groups_agree"] = len(finals) == 2 and len(set(finals.values())) == 1
    row["peak_memory_gib"] = memory
    row["steps_per_s"] = {r: steps_per_s(group) for r, group in sorted(steps_by_group.items())}
    if spec.get("compile"):
        compiled = re.findall(r"Compiled (\d+) transformer blocks with torch.compile",
                              log.read_text(errors="replace") if log.exists() else "")  # fmt: skip
        row["compiled_blocks_per_process"] = [int(n) for n in compiled]
        row["ran"] = row["exit"] == 0 and bool(compiled) and len(steps_by_group) == 2
    row["syncs_committed"] = sum(1 for e in events(dump, "semi_sync.sync") if e.fields["committed"])
    row["heals"] = [
        {"replica": e.replica, "sync": e.sync, "step": e.step,
         **{k: e.fields.get(k) for k in ("peer", "transfer", "bytes_received", "receive_s")}}
        for e in events(dump, "semi_sync.healed")
    ]  # fmt: skip
    if tps:
        row["median_tokens_per_s_per_group"] = median(tps)
    if spec.get("heal"):
        row.update(heal_verdict(row, log, dry))
    if spec.get("kill"):
        row["kill"] = kill_verdict(row, dump)
    if row["exit"] != 0:
        row["last_lines"] = last_lines(log, 12)
    return row


def throughput(spec: dict, out: Path, python: str, budget: Budget, matmul_peak: float | None,
               ) -> dict:  # fmt: skip
    """One group, no fault tolerance: tokens/s, MFU and peak memory past warm-up."""
    name, flavor, compiled = spec["name"], spec["flavor"], spec["compile"]
    dump = out / name
    cmd = [
        python, "-m", "torchtitan.train", f"--job.dump_folder={dump}",
        f"--model.flavor={flavor}", f"--training.steps={spec['steps']}",
        f"--training.local_batch_size={spec['batch']}", f"--training.seq_len={spec['seq']}",
        "--training.mixed_precision_param=bfloat16", "--validation.enable=false",
        f"--metrics.log_freq={spec['log_freq']}", f"--compile.enable={str(compiled).lower()}",
        "--lr_scheduler.warmup_steps=2",
    ]  # fmt: skip
    row: dict[str, Any] = {**spec, **run(name, cmd, out, budget.limit(spec["timeout_s"]))}
    steps_seen = events(dump, "train.step")
    later = steps_seen[len(steps_seen) // 2 :]  # past compilation and warm-up
    if later:
        fields = [e.fields for e in later]
        row["tokens_per_s"] = median([f["tps"] for f in fields])
        mfu = [f["mfu_pct"] for f in fields if f["mfu_pct"] is not None]
        row["mfu_pct"] = median(mfu) if mfu else None
        row["peak_memory_gib"] = max(f["memory_gib"] for f in fields)
        row["loss_first_last"] = [steps_seen[0].fields["loss"], fields[-1]["loss"]]
    started = events(dump, "train.started")
    if started:
        row["parameters"] = started[0].fields["parameters"]
        row["peak_flops"] = started[0].fields["peak_flops"]
        if row.get("mfu_pct") and row["peak_flops"] and matmul_peak:
            row["mfu_pct_of_measured_matmul"] = row["mfu_pct"] * row["peak_flops"] / matmul_peak
    if row["exit"] != 0:
        row["last_lines"] = last_lines(out / f"{name}.log", 12)
    return row


def measured_matmul_peak() -> float:
    """bf16 FLOP/s of an 8192^3 matmul on random data on the GPU (median of 10 after 3)."""
    import torch

    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * 8192**3 / median(times)


def covers(report: dict[str, Any], gpus: int) -> dict[str, Any]:
    """What this check showed, by name, each with its test's outcome or its run's verdict
    (``not run`` when it did not get there); on one GPU, also what only two GPUs can show."""
    if gpus == 2:
        by_name = {row["name"]: row for row in report.get("two_groups", [])}
        shown = {}
        for name, (run_name, keys) in TWO_GPU_COVERS.items():
            row = by_name.get(run_name)
            verdict: dict[str, Any] | str = "not run"
            if row is not None:
                found = {**row, **row.get("kill", {})}
                verdict = {key: found.get(key) for key in keys}
                if report["dry_run"]:
                    verdict["note"] = "dry run: gloo on the CPU, not nccl"
            shown[name] = {"what": NEEDS_TWO_GPUS[name], "run": run_name, "verdict": verdict}
        return {"two_gpus": shown}
    outcomes = report.get("cuda_tests", {}).get("outcomes", {})
    return {
        "one_gpu": {name: {"what": what, "test": test, "outcome": outcomes.get(test, "not run")}
                    for name, (test, what) in ONE_GPU_COVERS.items()},
        "needs_two_gpus": {name: {"what": what, "why": "NCCL refuses two ranks of one "
                                  "communicator on one GPU: every nccl group here has one rank",
                                  "check": "scripts/gpu_check.sh --gpus 2"}
                           for name, what in NEEDS_TWO_GPUS.items()},
    }  # fmt: skip


def provenance() -> dict[str, Any]:
    """The commit (``git``, else ``GPU_CHECK_COMMIT``: a copied tree may lack ``.git``)."""
    git = ["git", "-C", str(REPO)]
    try:
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True)  # fmt: skip
        if head.returncode == 0:
            status = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True).stdout  # fmt: skip
            return {"commit": head.stdout.strip(), "git_dirty": bool(status.strip())}
    except OSError:  # no git on the machine
        pass
    return {"commit": os.environ.get("GPU_CHECK_COMMIT", "unknown"), "git_dirty": None}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    budget = Budget(args.budget_s)
    python = sys.executable
    report: dict[str, Any] = {"dry_run": args.dry_run, "gpus": args.gpus, "started": time.time(),
                              **provenance()}  # fmt: skip
    path = args.out / "gpu_check.json"

    def save() -> None:
        report["covers"] = covers(report, args.gpus)
        path.write_text(json.dumps(report, indent=2) + "\n")

    matmul_peak: float | None = None
    try:
        import torch

        report["torch"] = torch.__version__
        report["cuda"] = torch.version.cuda
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < args.gpus and not args.dry_run:
            devices = "a CUDA device" if args.gpus == 1 else f"{args.gpus} CUDA devices"
            print(f"gpu_check: --gpus {args.gpus} needs {devices}; torch sees {count} here: "
                  "nothing to check (--dry-run runs its steps on the CPU)", flush=True)  # fmt: skip
            return 3
        if count:
            report["device"] = torch.cuda.get_device_name(0)
            if count > 1:
                report["devices"] = [torch.cuda.get_device_name(i) for i in range(count)]
            if args.gpus == 1:  # the throughput run's MFU against it
                matmul_peak = measured_matmul_peak()
                report["bf16_matmul_tflops_measured"] = round(matmul_peak / 1e12, 1)
    except ImportError as e:
        report["torch"] = f"not importable: {e}"
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.dry_run and args.gpus == 1:
        report["not_run"] = NOT_RUN
    save()
    # A single run's kind is a key of its own; two_groups and throughput are lists.
    report.update({"two_groups": [], "throughput": []})
    label = "start-up"
    try:
        for kind, spec in runs(args.dry_run, args.gpus):
            label = spec["name"]
            print(f"gpu_check: {kind} {label} ...", flush=True)
            try:
                if kind == "cuda_tests":
                    row = cuda_tests(spec, args.out, python, budget)
                elif kind == "outer_step":
                    row = outer_step(spec, args.out, python, budget)
                elif kind == "two_groups":
                    row = two_groups(spec, args.out, python, budget, args.dry_run)
                else:
                    row = throughput(spec, args.out, python, budget, matmul_peak)
            except Exception as e:  # a broken run must not lose what the others measured
                row = {**spec, "error": f"{type(e).__name__}: {e}"}
            if kind in ("two_groups", "throughput"):
                report[kind].append(row)
            else:
                report[kind] = row
            save()
            print(f"gpu_check: {kind} {label}: {json.dumps(row)[:400]}", flush=True)
    except Terminated:
        report["terminated"] = f"SIGTERM during {label}: that run was stopped and not recorded"
        print(f"gpu_check: {report['terminated']}", flush=True)
    report["seconds"] = round(time.time() - report["started"], 1)
    save()
    print(f"gpu_check: wrote {path} after {report['seconds']} s")
    return 1 if "terminated" in report else 0


if __name__ == "__main__":
    sys.exit(main())
