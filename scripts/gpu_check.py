"""The GPU path, run for real in one go: what ``scripts/gpu_check.sh`` runs on a machine with one
CUDA device, within a time budget (``--budget-s``, default 330 s). Everything it measures goes
into one folder: a log per run and ``gpu_check.json``, written again after every run, so that a
run cut off by the budget loses nothing measured before it.

Runs, in this order (the most telling first; each bounded by its own timeout and by what is left
of the budget, each recorded whatever its outcome):

1. ``cuda_tests``: the tests that need CUDA (the codecs' CUDA-against-CPU bit equality, Delayed
   Nesterov on CUDA, async DiLoCo's non_blocking copies to pinned host state against blocking
   ones), with their pass / skip / fail counts.
2. ``two_groups``: a lighthouse and two replica groups on the one GPU, gloo across them (CUDA
   tensors): async DiLoCo with int8 on the debug model; blocking DiLoCo (torchft's) with group 1
   SIGKILLed at step 10 and restarted, so that it heals from group 0 on the GPU (paced steps keep
   group 0 running meanwhile); then the ``1B`` flavor under async DiLoCo + int8 with its outer
   state in pinned host memory (``outer_state_device=cpu``) against on the device (peak GPU
   memory per group); last nccl across the groups, where two ranks on one device are expected to
   be refused (what failed is recorded: a 2-GPU machine is needed for that path). Per run: both
   groups' final digests (they must agree), committed syncs, heals, peak GPU memory per group.
3. ``throughput``: one replica group (no fault tolerance, FSDP off: one rank) training the debug
   model and the ``1B`` flavor in bf16 (autocast), eager, and the ``1B`` with ``compile.enable``:
   tokens/s, MFU against the device's bf16 dense peak (the datasheet's, as the trainer prints
   it) and against the bf16 matmul rate measured here first, peak memory, from the run's own step
   events.

The two lists interleave in that order of priority (see ``RUNS``). ``--dry-run`` runs the same
steps on the CPU with the smallest model and a few steps: only the tests that need CUDA (which
then skip; the others run in the test suite anyway), one async and one healing DiLoCo run, one
eager throughput run. It checks the script, not the GPU.
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
from pathlib import Path
from typing import Any

from torchtitan.tools.cluster.process_tree import process_tree, signal_pids
from torchtitan.tools.events import EVENTS_FOLDER, Event, read_events

REPO = Path(__file__).resolve().parents[1]
SEMI_SYNC_MODULE = "--job.custom_args_module=torchtitan.experiments.fault_tolerance.job_config"
# The experiment's config plus the tests' fault knobs (paced steps), for the healing run.
FAULTS_MODULE = "--job.custom_args_module=tests.integration_tests.faults"
CUDA_TESTS = [
    "tests/unit_tests/test_compression.py",
    "tests/unit_tests/test_outer_optimizer.py",
    "tests/unit_tests/test_async_diloco.py",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the logs and the JSON")
    p.add_argument("--dry-run", action="store_true", help="the steps on the CPU, tiny")
    p.add_argument("--budget-s", type=float, default=330.0, help="seconds for all runs together")
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


def run(name: str, cmd: list[str], out: Path, timeout_s: float) -> dict:
    """Run ``cmd`` with its output in ``out/<name>.log``; its exit status and seconds."""
    log = out / f"{name}.log"
    if timeout_s < 10:
        return {"exit": "skipped: budget spent", "seconds": 0.0, "log": None}
    start = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
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


def cuda_tests(out: Path, python: str, budget: Budget) -> dict:
    # Only the tests that need CUDA (their names say "cuda"); the rest run in the suite.
    cmd = [python, "-m", "pytest", *CUDA_TESTS, "-k", "cuda", "-q", "-rs", "-p", "no:cacheprovider"]
    result = run("cuda_tests", cmd, out, budget.limit(90))
    tail = " ".join(last_lines(out / "cuda_tests.log", 3))
    for word in ("passed", "skipped", "failed", "error"):
        match = re.search(rf"(\d+) {word}", tail)
        result[word] = int(match.group(1)) if match else 0
    if result["failed"] or result["error"]:
        result["last_lines"] = last_lines(out / "cuda_tests.log", 15)
    return result


def two_groups(spec: dict, out: Path, python: str, budget: Budget) -> dict:
    """A lighthouse and two replica groups on the one device (``spec``: name, flavor, method,
    backend, outer-state placement, steps, extra launcher and train arguments)."""
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
    cmd = [python, "-m", "torchtitan.experiments.fault_tolerance.launcher", "--groups", "2",
           *spec.get("launcher_args", []), "--", *train]  # fmt: skip
    row: dict[str, Any] = dict(spec)
    row.update(run(name, cmd, out, budget.limit(spec.get("timeout_s", 60))))
    finals: dict[int, str] = {}
    memory: dict[int, float] = {}
    for entry in events(dump, "semi_sync.final_model"):
        if entry.rank == 0:
            finals[entry.replica or 0] = entry.fields["digest"]
    steps_by_group: dict[int, list[float]] = {}
    for entry in events(dump, "train.step"):
        replica = entry.replica or 0
        memory[replica] = max(memory.get(replica, 0.0), entry.fields["memory_gib"])
        steps_by_group.setdefault(replica, []).append(entry.fields["tps"])
    tps = [t for group in steps_by_group.values() for t in group[2:]]  # past each warm-up
    row["final_digests"] = finals
    row["groups_agree"] = len(finals) == 2 and len(set(finals.values())) == 1
    row["peak_memory_gib"] = memory
    row["syncs_committed"] = sum(1 for e in events(dump, "semi_sync.sync") if e.fields["committed"])
    row["heals"] = [
        {"replica": e.replica, "sync": e.sync, "step": e.step,
         **{k: e.fields.get(k) for k in ("peer", "transfer", "bytes_received", "receive_s")}}
        for e in events(dump, "semi_sync.healed")
    ]  # fmt: skip
    if tps:
        row["median_tokens_per_s_per_group"] = median(tps)
    if row["exit"] != 0:
        row["last_lines"] = last_lines(out / f"{name}.log", 12)
    return row


def throughput(spec: dict, out: Path, python: str, budget: Budget, matmul_peak: float | None,
               ) -> dict:  # fmt: skip
    """One group, no fault tolerance: tokens/s, MFU and peak memory past warm-up."""
    flavor, compiled = spec["flavor"], spec["compile"]
    name = f"throughput_{flavor}_{'compile' if compiled else 'eager'}"
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


def runs(dry: bool) -> list[tuple[str, dict]]:
    """(list name, spec) in order of priority."""
    if dry:
        small = {"flavor": "debugmodel_small", "backend": "gloo"}
        return [
            ("two_groups", {**small, "name": "two_groups_async_int8", "method": "async_diloco",
                            "steps": 8, "train_args": ["--fault_tolerance.pseudo_grad_dtype=int8",
                                                       "--fault_tolerance.outer_state_device=cpu"]}),
            ("two_groups", {**small, "name": "two_groups_diloco_heal", "method": "diloco",
                            "steps": 24, "paced": True, "timeout_s": 200,
                            "launcher_args": ["--kill", "1@4", "--restart-after", "1"],
                            "train_args": ["--fault_injection.step_sleep_s=0.5"]}),
            ("throughput", {"flavor": "debugmodel_small", "compile": False, "batch": 2,
                            "seq": 64, "steps": 4, "log_freq": 1, "timeout_s": 120}),
        ]  # fmt: skip
    async_int8 = ["--fault_tolerance.pseudo_grad_dtype=int8"]
    state = "--fault_tolerance.outer_state_device="
    # The 1B: no per-sync digests (hashing 4 GB on the host at each sync); the final one stays.
    big = {"flavor": "1B", "backend": "gloo", "method": "async_diloco", "steps": 8, "batch": 4,
           "seq": 1024, "log_freq": 2, "timeout_s": 90, "collective_timeout_s": 60,
           "digests": False}  # fmt: skip
    return [
        ("two_groups", {"name": "two_groups_async_int8", "flavor": "debugmodel", "backend": "gloo",
                        "method": "async_diloco", "steps": 40,
                        "train_args": [*async_int8, "--fault_tolerance.outer_state_device=cpu"]}),
        # Group 1 dies at step 10 and comes back after 1 s; paced steps (0.25 s) keep group 0
        # running for about 40 s, so that the restarted group heals from it on the GPU.
        ("two_groups", {"name": "two_groups_diloco_heal", "flavor": "debugmodel",
                        "backend": "gloo", "method": "diloco", "steps": 160, "sync_steps": 5,
                        "paced": True, "log_freq": 10, "timeout_s": 90,
                        "launcher_args": ["--kill", "1@10", "--restart-after", "1"],
                        "train_args": ["--fault_injection.step_sleep_s=0.25"]}),
        ("throughput", {"flavor": "debugmodel", "compile": False, "batch": 16, "seq": 2048,
                        "steps": 30, "log_freq": 5, "timeout_s": 45}),
        ("throughput", {"flavor": "1B", "compile": False, "batch": 8, "seq": 2048,
                        "steps": 30, "log_freq": 5, "timeout_s": 70}),
        ("two_groups", {**big, "name": "two_groups_1B_state_cpu",
                        "train_args": [*async_int8, state + "cpu"]}),
        ("two_groups", {**big, "name": "two_groups_1B_state_device",
                        "train_args": [*async_int8, state + "device"]}),
        ("throughput", {"flavor": "1B", "compile": True, "batch": 8, "seq": 2048,
                        "steps": 30, "log_freq": 5, "timeout_s": 120}),
        ("two_groups", {"name": "two_groups_nccl", "flavor": "debugmodel", "backend": "nccl",
                        "method": "async_diloco", "steps": 8, "timeout_s": 40,
                        "train_args": async_int8}),
    ]  # fmt: skip


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
    args.out.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget_s)
    python = sys.executable
    report: dict[str, Any] = {"dry_run": args.dry_run, "started": time.time(), **provenance()}
    path = args.out / "gpu_check.json"

    def save() -> None:
        path.write_text(json.dumps(report, indent=2) + "\n")

    matmul_peak: float | None = None
    try:
        import torch

        report["torch"] = torch.__version__
        report["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            report["device"] = torch.cuda.get_device_name(0)
            matmul_peak = measured_matmul_peak()
            report["bf16_matmul_tflops_measured"] = round(matmul_peak / 1e12, 1)
    except ImportError as e:
        report["torch"] = f"not importable: {e}"
    save()
    label = "cuda_tests"
    try:
        print("gpu_check: cuda_tests ...", flush=True)
        report["cuda_tests"] = cuda_tests(args.out, python, budget)
        save()
        print(f"gpu_check: cuda_tests: {json.dumps(report['cuda_tests'])[:300]}", flush=True)
        report["two_groups"], report["throughput"] = [], []
        for kind, spec in runs(args.dry_run):
            label = spec.get("name") or f"{spec['flavor']} compile={spec['compile']}"
            print(f"gpu_check: {kind} {label} ...", flush=True)
            try:
                if kind == "two_groups":
                    row = two_groups(spec, args.out, python, budget)
                else:
                    row = throughput(spec, args.out, python, budget, matmul_peak)
            except Exception as e:  # a broken run must not lose what the others measured
                row = {**spec, "error": f"{type(e).__name__}: {e}"}
            report[kind].append(row)
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
