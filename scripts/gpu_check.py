"""The GPU path, run for real in one go: what ``scripts/gpu_check.sh`` runs on a machine with one
CUDA device, in at most 8 minutes. Everything it measures goes into one folder: a log per step
and ``gpu_check.json``.

Steps (each bounded by its own timeout, each recorded whatever its outcome):

1. ``cuda_tests``: the tests that need CUDA (the codecs' CUDA-against-CPU bit equality, Delayed
   Nesterov on CUDA, async DiLoCo's non_blocking copies to pinned host state against blocking
   ones), with their pass / skip / fail counts.
2. ``throughput``: one replica group (no fault tolerance, FSDP off: one rank) training the debug
   model and the ``1B`` flavor in bf16 (autocast), with and without ``compile.enable``: tokens/s,
   MFU against the device's bf16 dense peak, peak memory, from the run's own step events.
3. ``two_groups``: a lighthouse and two replica groups on the one GPU, async DiLoCo with int8,
   its outer state in pinned host memory (``outer_state_device=cpu``) against on the device:
   both groups' final digests (they must agree) and peak GPU memory per group; with gloo across
   the groups (CUDA tensors) and then with nccl, where two ranks on one device are expected to
   be refused (what failed is recorded: a 2-GPU machine is needed for the nccl cross-group path).

``--dry-run`` runs the same steps on the CPU with the smallest model and a few steps: only the
tests that need CUDA (which then skip; the others run in the test suite anyway), no compile, one
outer-state placement (on the CPU both are host memory). It checks the script, not the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODULE = "--job.custom_args_module=torchtitan.experiments.fault_tolerance.job_config"
CUDA_TESTS = [
    "tests/unit_tests/test_compression.py",
    "tests/unit_tests/test_outer_optimizer.py",
    "tests/unit_tests/test_async_diloco.py",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the logs and the JSON")
    p.add_argument("--dry-run", action="store_true", help="the steps on the CPU, tiny")
    return p.parse_args(argv)


def run(name: str, cmd: list[str], out: Path, timeout_s: float, env: dict | None = None) -> dict:
    """Run ``cmd`` with its output in ``out/<name>.log``; its exit status and seconds."""
    log = out / f"{name}.log"
    start = time.monotonic()
    with open(log, "w") as f:
        try:
            code = subprocess.run(
                cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s,
                env={**os.environ, **(env or {})},
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            code = "timeout"
    return {"exit": code, "seconds": round(time.monotonic() - start, 1), "log": log.name}


def last_lines(path: Path, count: int = 5) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-count:]
    except OSError:
        return []


def events(dump: Path, name: str) -> list[dict[str, Any]]:
    """The events of ``name`` in a run's event files (plain JSON: no project import)."""
    found = []
    for file in sorted((dump / "events").glob("*.jsonl")):
        for line in file.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("event") == name:
                found.append(entry)
    return found


def cuda_tests(out: Path, python: str, dry: bool) -> dict:
    only_cuda = ["-k", "cuda"] if dry else []  # the CUDA tests' names say "cuda"
    result = run("cuda_tests", [python, "-m", "pytest", *CUDA_TESTS, *only_cuda, "-q", "-rs",
                                "-p", "no:cacheprovider"], out, 240)  # fmt: skip
    tail = " ".join(last_lines(out / "cuda_tests.log", 3))
    for word in ("passed", "skipped", "failed", "error"):
        match = re.search(rf"(\d+) {word}", tail)
        result[word] = int(match.group(1)) if match else 0
    return result


def throughput(out: Path, python: str, dry: bool) -> list[dict]:
    flavors = ["debugmodel_small"] if dry else ["debugmodel", "1B"]
    compiles = [False] if dry else [False, True]
    rows = []
    for flavor in flavors:
        for compiled in compiles:
            mode = "compile" if compiled else "eager"
            name = f"throughput_{flavor}_{mode}"
            dump = out / name
            batch, seq, steps = (
                (2, 64, 4) if dry else ((8, 2048, 30) if flavor == "1B" else (16, 2048, 30))
            )
            cmd = [
                python, "-m", "torchtitan.train", f"--job.dump_folder={dump}",
                f"--model.flavor={flavor}", f"--training.steps={steps}",
                f"--training.local_batch_size={batch}", f"--training.seq_len={seq}",
                "--training.mixed_precision_param=bfloat16", "--validation.enable=false",
                f"--metrics.log_freq={1 if dry else 5}",
                f"--compile.enable={str(compiled).lower()}",
                "--lr_scheduler.warmup_steps=2",
            ]  # fmt: skip
            row = {"flavor": flavor, "compile": compiled, **run(name, cmd, out, 150)}
            steps_seen = events(dump, "train.step")
            later = steps_seen[len(steps_seen) // 2 :]  # past compilation and warm-up
            if later:
                fields = [e["fields"] for e in later]
                row["tokens_per_s"] = sorted(f["tps"] for f in fields)[len(fields) // 2]
                mfu = [f["mfu_pct"] for f in fields if f["mfu_pct"] is not None]
                row["mfu_pct"] = sorted(mfu)[len(mfu) // 2] if mfu else None
                row["peak_memory_gib"] = max(f["memory_gib"] for f in fields)
                row["loss_first_last"] = [steps_seen[0]["fields"]["loss"], fields[-1]["loss"]]
            started = events(dump, "train.started")
            if started:
                row["parameters"] = started[0]["fields"]["parameters"]
                row["peak_flops"] = started[0]["fields"]["peak_flops"]
            rows.append(row)
    return rows


def two_groups(out: Path, python: str, dry: bool) -> list[dict]:
    rows = []
    steps = 8 if dry else 40
    flavor = "debugmodel_small" if dry else "debugmodel"
    backends = ["gloo"] if dry else ["gloo", "nccl"]
    for backend in backends:
        for state in ("cpu",) if dry else ("cpu", "device"):
            if backend == "nccl" and state == "device":
                continue  # one nccl try says whether two ranks may share the device
            name = f"two_groups_{backend}_{state}"
            dump = out / name
            cmd = [
                python, "-m", "torchtitan.experiments.fault_tolerance.launcher", "--groups", "2",
                "--", MODULE, f"--job.dump_folder={dump}", f"--model.flavor={flavor}",
                f"--training.steps={steps}", "--training.local_batch_size=4",
                "--training.seq_len=256", "--validation.enable=false", "--metrics.log_freq=4",
                "--metrics.log_param_digest", "--fault_tolerance.semi_sync_method=async_diloco",
                "--fault_tolerance.sync_steps=4", "--fault_tolerance.pseudo_grad_dtype=int8",
                f"--fault_tolerance.outer_state_device={state}",
                f"--fault_tolerance.process_group={backend}",
                "--fault_tolerance.sync_collective_timeout_s=60",
            ]  # fmt: skip
            row: dict[str, Any] = {"backend": backend, "outer_state_device": state}
            row.update(run(name, cmd, out, 150))
            finals: dict[int, str] = {}
            memory: dict[int, float] = {}
            for entry in events(dump, "semi_sync.final_model"):
                if entry.get("rank", 0) == 0:
                    finals[entry["replica"]] = entry["fields"]["digest"]
            for entry in events(dump, "train.step"):
                replica = entry.get("replica", 0)
                memory[replica] = max(memory.get(replica, 0.0), entry["fields"]["memory_gib"])
            row["final_digests"] = finals
            row["groups_agree"] = len(finals) == 2 and len(set(finals.values())) == 1
            row["peak_memory_gib"] = memory
            row["syncs_committed"] = sum(
                1 for e in events(dump, "semi_sync.sync") if e["fields"]["committed"]
            )
            if row["exit"] != 0:
                row["last_lines"] = last_lines(out / row["log"], 8)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    report: dict[str, Any] = {"dry_run": args.dry_run, "started": time.time()}
    try:
        import torch

        report["torch"] = torch.__version__
        if torch.cuda.is_available():
            report["device"] = torch.cuda.get_device_name(0)
    except ImportError as e:
        report["torch"] = f"not importable: {e}"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    report["commit"] = commit or "unknown"
    path = args.out / "gpu_check.json"
    for step, fn in (
        ("cuda_tests", lambda: cuda_tests(args.out, python, args.dry_run)),
        ("throughput", lambda: throughput(args.out, python, args.dry_run)),
        ("two_groups", lambda: two_groups(args.out, python, args.dry_run)),
    ):
        print(f"gpu_check: {step} ...", flush=True)
        try:
            report[step] = fn()
        except Exception as e:  # a broken step must not lose what the others measured
            report[step] = {"error": f"{type(e).__name__}: {e}"}
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"gpu_check: {step}: {json.dumps(report[step])[:400]}", flush=True)
    report["seconds"] = round(time.time() - report["started"], 1)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"gpu_check: wrote {path} after {report['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
