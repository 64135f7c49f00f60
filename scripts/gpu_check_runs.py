"""What ``scripts/gpu_check.py`` runs, in order of priority: one (kind, spec) per run, each with
its own timeout (``timeout_s``). The timeouts of one list add up to less than the check's budget
(``--budget-s``, 280 s by default; ``gpu_check.sh`` passes what its hard limit leaves), so that
every run fits even when each one runs to its limit; the start-up (torch's import, the bf16
matmul rate) takes the rest. ``test_gpu_check.py`` holds both lists to that.

Kinds: ``cuda_tests`` (pytest), ``outer_step`` (``benchmarks/outer_step.py``), ``two_groups``
(a lighthouse and replica groups under the launcher), ``throughput`` (one group, no fault
tolerance). Their keys are read by the function of that name in ``gpu_check.py``.
"""

from __future__ import annotations

from typing import Any

#: The tests that need CUDA. Of most files only the tests named ``cuda`` run (the others run in
#: the suite anyway); of ``WHOLE_FILES`` every test runs. A file not there yet is left out, and
#: the check's JSON names it (``not_there``).
CUDA_TESTS = [
    "tests/unit_tests/test_sync_wait_cuda.py",
    "tests/unit_tests/test_step_clock.py",
    "tests/unit_tests/test_compression.py",
    "tests/unit_tests/test_outer_optimizer.py",
    "tests/unit_tests/test_async_diloco.py",
]
WHOLE_FILES = ["tests/unit_tests/test_sync_wait_cuda.py", "tests/unit_tests/test_step_clock.py"]
#: What the sync-wait test writes into ``$GPU_CHECK_OUT`` (the check's folder): its figures.
SYNC_WAIT_JSON = "sync_wait.json"
#: The figures of ``benchmarks/outer_step.py``'s JSON that the check puts first in its row.
OUTER_STEP_KEYS = ("host_s", "memcpy_s", "ratio", "pinned_bytes", "pinned_exact_bytes", "rss_bytes")

INT8 = "--fault_tolerance.pseudo_grad_dtype=int8"
STATE_ON_HOST = "--fault_tolerance.outer_state_device=cpu"
BF16_COMPILE = ["--training.mixed_precision_param=bfloat16", "--compile.enable"]
# The heal run: a heal that hangs is reported by the group (torchft's timeout, here 20 s) well
# before the run's own limit cuts it off.
HEAL_TIMEOUT = "--fault_tolerance.timeout_s=20"

#: Runs of earlier versions of the check left out to fit two checks into a lease, and why.
NOT_RUN = {
    "two_groups_nccl": "two ranks on one GPU, which nccl refuses: it needs a machine of 2 GPUs",
    "two_groups_1B_state_cpu, two_groups_1B_state_device": "outer_step measures a sync "
    "point's host seconds and host memory at a 1B-size shard, in a fraction of the time",
    "throughput_1B_compile": "torch.compile runs in two_groups_async_int8_bf16_compile, with "
    "semi-sync on",
    "throughput_debugmodel_eager": "too small a model to say anything about the GPU",
}


def runs(dry: bool) -> list[tuple[str, dict[str, Any]]]:
    """(kind, spec) in order of priority: the GPU's list, or the dry run's (the same steps on
    the CPU, tiny: it checks the script, not the GPU)."""
    return _dry_runs() if dry else _gpu_runs()


def _gpu_runs() -> list[tuple[str, dict[str, Any]]]:
    return [
        ("cuda_tests", {"name": "cuda_tests", "timeout_s": 40}),
        # A sync point at a 1B-size shard (1.25e9 fp32 values, 5 GB) with its outer state in
        # pinned host memory: the host seconds of the outer step against the copies', and the
        # pinned and resident host memory. One turn (``--turns``, where the benchmark has it):
        # at this size each turn takes tens of seconds.
        ("outer_step", {"name": "outer_step", "numel": 1_250_000_000,
                        "repeats": 1, "turns": 1, "device": "cuda", "timeout_s": 55}),
        # Semi-sync with bf16 (autocast) and torch.compile: async DiLoCo with int8 and the
        # outer state on the host; the compilation (cold cache) takes most of the run.
        ("two_groups", {"name": "two_groups_async_int8_bf16_compile", "flavor": "debugmodel",
                        "backend": "gloo", "method": "async_diloco", "steps": 40,
                        "compile": True, "timeout_s": 65,
                        "train_args": [INT8, STATE_ON_HOST, *BF16_COMPILE]}),
        # Group 1 dies at step 10 and comes back after 1 s; paced steps (0.25 s) keep group 0
        # running for about 30 s, so that the restarted group heals from it: CUDA tensors over
        # gloo, the transport across groups.
        ("two_groups", {"name": "two_groups_diloco_heal", "flavor": "debugmodel",
                        "backend": "gloo", "method": "diloco", "steps": 120, "sync_steps": 5,
                        "paced": True, "heal": True, "log_freq": 10, "timeout_s": 55,
                        "launcher_args": ["--kill", "1@10", "--restart-after", "1"],
                        "train_args": ["--fault_injection.step_sleep_s=0.25", HEAL_TIMEOUT]}),
        ("throughput", {"name": "throughput_1B_eager", "flavor": "1B", "compile": False,
                        "batch": 8, "seq": 2048, "steps": 20, "log_freq": 2, "timeout_s": 40}),
    ]  # fmt: skip


def _dry_runs() -> list[tuple[str, dict[str, Any]]]:
    small = {"flavor": "debugmodel_small", "backend": "gloo"}
    return [
        ("cuda_tests", {"name": "cuda_tests", "timeout_s": 40}),
        ("outer_step", {"name": "outer_step", "numel": 2_000_000, "repeats": 2,
                        "turns": 1, "device": "cpu", "timeout_s": 30}),
        # Two processes compiling on a CPU: 40 s on two idle cores, longer beside other work.
        ("two_groups", {**small, "name": "two_groups_async_int8_bf16_compile",
                        "method": "async_diloco", "steps": 8, "compile": True, "timeout_s": 110,
                        "train_args": [INT8, STATE_ON_HOST, *BF16_COMPILE]}),
        ("two_groups", {**small, "name": "two_groups_diloco_heal", "method": "diloco",
                        "steps": 24, "paced": True, "heal": True, "timeout_s": 60,
                        "launcher_args": ["--kill", "1@4", "--restart-after", "1"],
                        "train_args": ["--fault_injection.step_sleep_s=0.5", HEAL_TIMEOUT]}),
        ("throughput", {"name": "throughput_debugmodel_small_eager", "flavor": "debugmodel_small",
                        "compile": False, "batch": 2, "seq": 64, "steps": 4, "log_freq": 1,
                        "timeout_s": 25}),
    ]  # fmt: skip
