"""What ``scripts/gpu_check.py`` runs, in order of priority: one (kind, spec) per run, each with
its own timeout (``timeout_s``). The timeouts of one list add up to less than the check's budget
(``--budget-s``, 295 s by default; ``gpu_check.sh`` passes what its hard limit leaves), so that
every run fits even when each one runs to its limit; the start-up (torch's import, the bf16
matmul rate) takes the rest. ``test_gpu_check.py`` holds every list to that. Lists: one GPU's,
two GPUs' (``--gpus 2``), and the dry run of each (the same steps on the CPU, tiny).

What each check covers, and what one GPU cannot, by name: :data:`ONE_GPU_COVERS`,
:data:`NEEDS_TWO_GPUS`, :data:`TWO_GPU_COVERS` (the JSON's ``covers``).

Kinds: ``cuda_tests`` (pytest), ``outer_step`` (``benchmarks/outer_step.py``), ``two_groups``
(a lighthouse and replica groups under the launcher), ``throughput`` (one group, no fault
tolerance). Their keys are read by the function of that name in ``gpu_check.py``.
"""

from __future__ import annotations

from typing import Any

#: The tests that need CUDA. Of most files only the tests named ``cuda`` run (the others run in
#: the suite anyway); of ``WHOLE_FILES`` every test runs. A file not there yet is left out, and
#: the check's JSON names it (``not_there``).
#: ``test_nccl_semantics_cuda.py`` runs last: its last test aborts a communicator, and a device
#: left broken by that would fail no other file's tests.
CUDA_TESTS = [
    "tests/unit_tests/test_sync_wait_cuda.py",
    "tests/unit_tests/test_step_clock.py",
    "tests/unit_tests/test_compression.py",
    "tests/unit_tests/test_outer_optimizer.py",
    "tests/unit_tests/test_async_diloco.py",
    "tests/unit_tests/test_nccl_semantics_cuda.py",
]
NCCL_SEMANTICS = "tests/unit_tests/test_nccl_semantics_cuda.py"
WHOLE_FILES = ["tests/unit_tests/test_sync_wait_cuda.py", "tests/unit_tests/test_step_clock.py",
               NCCL_SEMANTICS]  # fmt: skip
#: What tests write into ``$GPU_CHECK_OUT`` (the check's folder): the row's key, and the file of
#: figures that goes there (None when the test did not run, or not to its end).
TEST_FIGURES = {"sync_wait": "sync_wait.json", "nccl_semantics": "nccl_semantics.json"}

#: What the one-GPU check shows, each by the test that shows it (the JSON adds its outcome).
ONE_GPU_COVERS = {
    "nccl_abort_path": (
        f"{NCCL_SEMANTICS}::test_a_transfer_held_past_its_timeout_fails_the_sync_and_the_next_"
        "one_commits",
        "a world-size-1 nccl group: a sync's transfer held on the device past a 2 s collective "
        "timeout is aborted by torchft's timer, the sync fails as timed out, not committed; "
        "after the next quorum's group is built the next sync commits with the right values",
    ),
    "exchange_after_arrival": (
        f"{NCCL_SEMANTICS}::test_the_quorum_exchange_reads_the_records_once_they_arrived",
        "the quorum's exchange reads its records once they arrived behind compute queued on "
        "its stream, and compute on another stream does not hold it up (no device-wide "
        "synchronize)",
    ),
    "probe_beside_training": (
        f"{NCCL_SEMANTICS}::test_dylus_probe_does_not_wait_for_the_kernels_training_queues_"
        "meanwhile",
        "DyLU's speed probe issues its exchange on a stream of its own and finishes while the "
        "training thread's next kernel still runs",
    ),
    "nccl_wait_semantics": (
        f"{NCCL_SEMANTICS}::test_nccls_wait_returns_before_the_result_and_wait_delivered_once_"
        "it_landed",
        "nccl's wait() returns before the result lands; delivery.wait_delivered once it has",
    ),
    "versions_and_modes": (
        f"{NCCL_SEMANTICS}::test_the_replicate_groups_backend_only_aborts_its_communicator_and_"
        "torchft_aborts",
        "NCCL's version, torchft's abort mode and each process group's error-handling mode "
        "(the replicate group's backend: 2, CleanUpOnly)",
    ),
    "sync_wait": (
        "tests/unit_tests/test_sync_wait_cuda.py::test_a_sync_wait_takes_milliseconds_behind_"
        "seconds_of_queued_compute",
        "a sync's wait returns with its result there, milliseconds behind seconds of training "
        "compute queued meanwhile",
    ),
}
#: What one GPU cannot show: NCCL refuses two ranks of one communicator on one GPU, so every
#: nccl group there has one rank, and nobody to lose. ``gpu_check.sh --gpus 2`` checks these.
NEEDS_TWO_GPUS = {
    "kill_over_nccl": "a replica group SIGKILLed while the groups sync over nccl: the "
    "survivor's communicator is aborted, not its process, and it syncs on",
    "heal_over_nccl": "the restarted group heals from the survivor over nccl (one GPU's heal "
    "run crosses groups over gloo, which cannot carry CUDA tensors)",
    "compressed_transfers_over_nccl": "int8's all-to-all and all-gather between two ranks "
    "(a group of one rank issues none)",
}
#: What the two-GPU check shows, each by its run and the keys of its row (or of its ``kill``
#: verdict) that say so; the JSON adds their values.
TWO_GPU_COVERS = {
    "kill_over_nccl": ("two_groups_nccl_diloco_kill", ("survivor_kept_running",
                       "survivor_syncs_after_the_kill", "group_1_killed_at_step")),
    "heal_over_nccl": ("two_groups_nccl_diloco_kill", ("restarted_group_healed", "heals",
                       "final_digests_equal")),
    "compressed_transfers_over_nccl": ("two_groups_nccl_async_int8", ("exit", "syncs_committed",
                                       "groups_agree")),
}  # fmt: skip
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
    "two_groups_1B_state_cpu, two_groups_1B_state_device": "outer_step measures a sync "
    "point's host seconds and host memory at a 1B-size shard, in a fraction of the time",
    "throughput_1B_compile": "torch.compile runs in two_groups_async_int8_bf16_compile, with "
    "semi-sync on",
    "throughput_debugmodel_eager": "too small a model to say anything about the GPU",
}


def runs(dry: bool, gpus: int = 1) -> list[tuple[str, dict[str, Any]]]:
    """(kind, spec) in order of priority: the list of one GPU or of two (``gpus``), or its dry
    run (the same steps on the CPU, tiny: it checks the script, not the GPU)."""
    if gpus == 2:
        return _two_gpu_runs(dry)
    return _dry_runs() if dry else _gpu_runs()


def _gpu_runs() -> list[tuple[str, dict[str, Any]]]:
    return [
        ("cuda_tests", {"name": "cuda_tests", "timeout_s": 60}),
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


def _two_gpu_runs(dry: bool) -> list[tuple[str, dict[str, Any]]]:
    """Two replica groups over nccl, a GPU each (the dry run: gloo on the CPU, tiny)."""
    if dry:
        base: dict[str, Any] = {"flavor": "debugmodel_small", "backend": "gloo"}
        gpus: list[str] = []
    else:
        base = {"flavor": "debugmodel", "backend": "nccl"}
        gpus = ["--gpus-per-group", "1"]
    return [
        # Group 1 dies at step 10 (4 dry), inside or near a sync, and comes back after 1 s;
        # paced steps keep group 0 running (40 s; 16 s dry) long enough for the restarted
        # group to heal from it. The survivor must sync on (its communicator aborted, its
        # process alive), and both end with the same model.
        ("two_groups", {**base, "name": "two_groups_nccl_diloco_kill", "method": "diloco",
                        "steps": 32 if dry else 160, "sync_steps": 4 if dry else 5,
                        "paced": True, "kill": True, "log_freq": 4 if dry else 10,
                        "timeout_s": 75 if dry else 120,
                        "launcher_args": [*gpus, "--kill", f"1@{4 if dry else 10}",
                                          "--restart-after", "1"],
                        "train_args": [f"--fault_injection.step_sleep_s={0.5 if dry else 0.25}",
                                       HEAL_TIMEOUT]}),
        # int8's all-to-all and all-gather between two ranks over nccl, in bf16.
        ("two_groups", {**base, "name": "two_groups_nccl_async_int8", "method": "async_diloco",
                        "steps": 8 if dry else 40, "timeout_s": 45 if dry else 60,
                        "launcher_args": gpus,
                        "train_args": [INT8, STATE_ON_HOST, BF16_COMPILE[0]]}),
    ]  # fmt: skip
