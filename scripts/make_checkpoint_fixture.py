"""Write the checkpoint fixtures: semi-sync checkpoints that later code must load and continue
bit for bit (``tests/integration_tests/test_checkpoint_fixture.py``, which defines them).

    .venv/bin/python scripts/make_checkpoint_fixture.py     # rewrites tests/assets/checkpoints/

For each fixture, a one-group job (a real lighthouse) trains ``STEPS`` steps and checkpoints at
step ``SAVED``, in the middle of a sync: the checkpoint holds what a restart must bring back
(global parameters, outer momentum, where each period started, a sync in flight,
error-feedback residuals). Its folder goes into ``<name>.tar.xz`` (a few MB), and
``<name>.json`` records the flags, the commit, and what the same run did after the checkpoint.
Regenerate them only on purpose: a fixture is the promise that checkpoints already written
keep working.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.integration_tests.harness import FTJob, tail  # noqa: E402
from tests.integration_tests.test_checkpoint_fixture import (  # noqa: E402
    FIXTURES,
    FOLDER,
    SAVED,
    STEPS,
    train_args,
    what_followed,
)


def make(name: str, flags: list[str], work: Path) -> None:
    with FTJob(work / name, groups=1, train_args=train_args(flags)) as job:
        job.start()
        assert job.wait_exit(0, timeout=300) == 0, tail(job.latest(0).text())
        followed = what_followed(job.events(0))
        saved = job.dump_folder / "checkpoint" / "replica_0" / f"step-{SAVED}"
        assert saved.is_dir(), saved
        FOLDER.mkdir(parents=True, exist_ok=True)
        with tarfile.open(FOLDER / f"{name}.tar.xz", "w:xz", preset=9) as archive:
            archive.add(saved, arcname=f"step-{SAVED}")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    record = {"commit": commit, "flags": flags, "steps": STEPS, "saved_step": SAVED, **followed}
    (FOLDER / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    size = (FOLDER / f"{name}.tar.xz").stat().st_size
    print(f"[fixture] {name}: {size:,} bytes; final digest {record['final_digest']}")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="checkpoint_fixture_") as tmp:
        for name, flags in FIXTURES.items():
            make(name, flags, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
