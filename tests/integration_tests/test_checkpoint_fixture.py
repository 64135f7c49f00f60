"""Checkpoints written by earlier code load and continue as they did.

Each fixture in ``tests/assets/checkpoints/`` is a one-group semi-sync job's checkpoint of step
``SAVED``, taken in the middle of a sync (``scripts/make_checkpoint_fixture.py`` wrote it, at
the commit in each ``<name>.json``). The job restarts from it with today's code, twice:

* **frozen** (``fault_injection.freeze_inner_steps``: the inner steps leave the model as it
  is): every sync then depends on the restored state only (global parameters, outer momentum,
  where each period started, the sync in flight, error-feedback residuals), and its digests
  are the same bits on every host (``docs/design.md``, "Bits the groups agree on"; the one
  group's own int4 encodings too, which no kernel set changes: a codec whose encoding did
  could not be pinned so): pinned everywhere;
* **trained**: the losses follow the recorded ones to a relative 1e-5 on every host; the
  digests and losses bit for bit only on a host of a kind recorded in the fixture (the inner
  steps' bits are the host's own: its matrix kernels, its ATen kernels; the jobs of the tests
  and of the recording run one thread per rank), which the test says.

The continuations were recorded with the outer arithmetic of 9c12cd3 (host-independent; the
earlier commit's fused kernel gave other bits), the checkpoints stay the earlier commit's.

A change to a checkpoint key, to what a key holds, or to how a restored sync continues fails
here.
"""

from __future__ import annotations

import hashlib
import json
import platform
import tarfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

from tests.integration_tests.harness import FAULTS_MODULE, SEMI_SYNC_MODULE, FTJob, tail
from tests.integration_tests.test_semi_sync import args, global_digests
from torchtitan.components.checkpoint import CHECKPOINT_RESUMED
from torchtitan.components.metrics import TRAIN_STEP
from torchtitan.experiments.fault_tolerance.events import FINAL_DIGEST, GLOBAL_DIGEST
from torchtitan.experiments.fault_tolerance.sync.quorum import Host
from torchtitan.tools.events import Event

FOLDER = Path(__file__).resolve().parents[1] / "assets" / "checkpoints"
STEPS, SAVED = 12, 6
#: Each fixture's method flags (after ``test_semi_sync.args``'s fast defaults, sync_steps 4).
FIXTURES = {
    # torchft's DiLoCo underneath: 2 fragments, one synced every 2 steps and applied a step
    # later; int4 with error feedback.
    "streaming_int4_ef": [
        "--fault_tolerance.semi_sync_method=diloco",
        "--fault_tolerance.num_fragments=2",
        "--fault_tolerance.fragment_sync_delay=1",
        "--fault_tolerance.fragment_update_alpha=0.5",
        "--fault_tolerance.pseudo_grad_dtype=int4",
        "--fault_tolerance.error_feedback",
    ],
    # Async DiLoCo: at step 6 the sync started at step 4 has arrived and is not applied yet.
    "async_int4_ef": [
        "--fault_tolerance.semi_sync_method=async_diloco",
        "--fault_tolerance.pseudo_grad_dtype=int4",
        "--fault_tolerance.error_feedback",
    ],
}
#: The continuation whose every sync depends on the restored state only.
FROZEN = [FAULTS_MODULE, "--fault_injection.freeze_inner_steps"]
#: How close the trained continuation's losses stay to the recorded ones on any host.
LOSS_RTOL = 1e-5


def train_args(flags: list[str], frozen: bool = False) -> list[str]:
    """A fixture job's flags: ``flags`` on the tests' fast defaults, ``STEPS`` steps, one
    checkpoint every ``SAVED`` steps; ``frozen``: inner steps at learning rate 0."""
    return args(
        FROZEN[0] if frozen else SEMI_SYNC_MODULE,
        "diloco",  # the fixture's own method flags come after and win
        *flags,
        *FROZEN[1:] if frozen else [],
        f"--training.steps={STEPS}",
        "--checkpoint.enable",
        f"--checkpoint.interval={SAVED}",
        "--checkpoint.keep_latest_k=0",
    )


def this_host() -> str:
    """What a trained continuation's bits depend on besides the code: the machine, torch, the
    ATen kernels, and the CPU's model and features (which pick the matrix kernels)."""
    found: dict[str, str] = {}
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            found.setdefault(key.strip(), value.strip())
    model = found.get("model name") or platform.processor() or "unknown CPU"
    flags = " ".join(sorted((found.get("flags") or found.get("Features", "")).split()))
    features = hashlib.sha256(flags.encode()).hexdigest()[:12]
    return f"{Host.this()}; {model} (features {features})"


def what_followed(events: Iterable[Event]) -> dict[str, Any]:
    """What a run did after step ``SAVED``: every step's loss, the global digest of every sync,
    the final model's digest."""
    after = [e for e in events if e.step is not None and e.step > SAVED]
    (final,) = [e["digest"] for e in after if e.name == FINAL_DIGEST.name]
    digests = global_digests(e for e in after if e.name == GLOBAL_DIGEST.name)
    return {
        "final_digest": final,
        "losses": {str(e.step): e["loss"] for e in after if e.name == TRAIN_STEP.name},
        "global_digests_after_saved": {str(n): d for n, d in digests.items()},
    }


def continue_fixture(
    name: str, folder: Path, frozen: bool, job_of: Callable[..., FTJob]
) -> dict[str, Any]:
    """Restart a one-group job from fixture ``name``'s checkpoint (in ``folder``, a fresh
    one) and return what followed."""
    dump = folder / "dump"
    into = dump / "checkpoint" / "replica_0"
    into.mkdir(parents=True)
    with tarfile.open(FOLDER / f"{name}.tar.xz", "r:xz") as archive:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4: refuse links and odd paths
            archive.extractall(into, filter="data")
        else:
            archive.extractall(into)  # noqa: S202  # our own archive
    job = job_of(
        folder / "job", groups=1, dump_folder=dump, train_args=train_args(FIXTURES[name], frozen)
    )
    job.start()
    assert job.wait_exit(0, timeout=300) == 0, tail(job.latest(0).text())
    events = job.events(0)
    assert [e.step for e in events if e.name == CHECKPOINT_RESUMED.name] == [SAVED]
    job.close()
    return what_followed(events)


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_a_checkpoint_of_earlier_code_continues_as_recorded(
    ft_job: Callable[..., FTJob], tmp_path: Path, name: str
) -> None:
    record = json.loads((FOLDER / f"{name}.json").read_text())
    assert record["flags"] == FIXTURES[name] and record["saved_step"] == SAVED

    frozen = continue_fixture(name, tmp_path / "frozen", True, ft_job)
    expected = {k: v for k, v in record["frozen"].items() if k in frozen}
    del frozen["losses"]  # the forward pass's bits are the host's
    assert frozen == expected, (name, "frozen", frozen, expected)

    trained = continue_fixture(name, tmp_path / "trained", False, ft_job)
    recorded = record["trained"]
    for step, loss in recorded[0]["losses"].items():
        assert trained["losses"][step] == pytest.approx(loss, rel=LOSS_RTOL), (name, step)
    host = this_host()
    pinned = [entry for entry in recorded if entry["host"] == host]
    for entry in pinned:
        assert trained == {k: entry[k] for k in trained}, (name, host, trained, entry)
    print(
        f"{name}: the checkpoint of step {SAVED} written at {record['commit']} continues to "
        f"step {STEPS}: frozen, the global digests {frozen['global_digests_after_saved']}; "
        f"trained, the losses within {LOSS_RTOL:g}"
        + (
            f" and the digests bit for bit (recorded on this host: {host})"
            if pinned
            else f"; its digests are this host's own (not recorded for {host})"
        )
    )
