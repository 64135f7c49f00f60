"""Checkpoints written by earlier code load and continue bit for bit.

Each fixture in ``tests/assets/checkpoints/`` is a one-group semi-sync job's checkpoint of step
``SAVED``, taken in the middle of a sync, with what that same run did afterwards
(``scripts/make_checkpoint_fixture.py`` wrote them, at the commit in each ``<name>.json``). The
job restarts from it with today's code: its losses, global digests and final model must be those
of the run that wrote it. A change to a checkpoint key, to what a key holds, or to how a
restored sync continues fails here.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

from tests.integration_tests.harness import SEMI_SYNC_MODULE, FTJob, tail
from tests.integration_tests.test_semi_sync import args, global_digests
from torchtitan.components.checkpoint import CHECKPOINT_RESUMED
from torchtitan.components.metrics import TRAIN_STEP
from torchtitan.experiments.fault_tolerance.events import FINAL_DIGEST, GLOBAL_DIGEST
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


def train_args(flags: list[str]) -> list[str]:
    """A fixture job's flags: ``flags`` on the tests' fast defaults, ``STEPS`` steps, one
    checkpoint every ``SAVED`` steps."""
    return args(
        SEMI_SYNC_MODULE,
        "diloco",  # the fixture's own method flags come after and win
        *flags,
        f"--training.steps={STEPS}",
        "--checkpoint.enable",
        f"--checkpoint.interval={SAVED}",
        "--checkpoint.keep_latest_k=0",
    )


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


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_a_checkpoint_of_earlier_code_continues_bit_for_bit(
    ft_job: Callable[..., FTJob], tmp_path: Path, name: str
) -> None:
    record = json.loads((FOLDER / f"{name}.json").read_text())
    assert record["flags"] == FIXTURES[name] and record["saved_step"] == SAVED
    dump = tmp_path / "dump"
    folder = dump / "checkpoint" / "replica_0"
    folder.mkdir(parents=True)
    with tarfile.open(FOLDER / f"{name}.tar.xz", "r:xz") as archive:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4: refuse links and odd paths
            archive.extractall(folder, filter="data")
        else:
            archive.extractall(folder)  # noqa: S202  # our own archive
    job = ft_job(
        tmp_path / "job", groups=1, dump_folder=dump, train_args=train_args(FIXTURES[name])
    )
    job.start()
    assert job.wait_exit(0, timeout=300) == 0, tail(job.latest(0).text())
    events = job.events(0)
    assert [e.step for e in events if e.name == CHECKPOINT_RESUMED.name] == [SAVED]
    got = what_followed(events)
    expected = {k: record[k] for k in got}
    assert got == expected, (name, record["commit"], got, expected)
    print(
        f"{name}: the checkpoint of step {SAVED} written at {record['commit']} continues to "
        f"step {STEPS} with the same losses, global digests {got['global_digests_after_saved']} "
        f"and final model {got['final_digest']}"
    )
