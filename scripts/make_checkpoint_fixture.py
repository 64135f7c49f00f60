"""Write the checkpoint fixtures: semi-sync checkpoints that later code must load and continue
as recorded (``tests/integration_tests/test_checkpoint_fixture.py``, which defines them).

    .venv/bin/python scripts/make_checkpoint_fixture.py --record
        # records today's continuations of the fixtures' checkpoints on this host
    .venv/bin/python scripts/make_checkpoint_fixture.py --new
        # writes new checkpoints (rewrites tests/assets/checkpoints/), then records

For each fixture, a one-group job (a real lighthouse) trains ``STEPS`` steps and checkpoints at
step ``SAVED``, in the middle of a sync: the checkpoint holds what a restart must bring back
(global parameters, outer momentum, where each period started, a sync in flight,
error-feedback residuals). Its folder goes into ``<name>.tar.xz`` (a few MB). Write new ones
only on purpose: a fixture is the promise that checkpoints already written keep working.

``<name>.json`` records the flags, the commit that wrote the checkpoint, and what restarting
from it did: ``frozen`` (inner steps at learning rate 0: the same bits on every host; a
recording that differs from the one kept is refused, unless the outer arithmetic changed on
purpose: ``--replace-frozen``) and ``trained``, one entry per host kind it was recorded on
(``this_host``). Run ``--record`` under each ``ATEN_CPU_CAPABILITY`` to pin a host's kernel
sets.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.integration_tests.harness import FTJob, tail  # noqa: E402
from tests.integration_tests.test_checkpoint_fixture import (  # noqa: E402
    FIXTURES,
    FOLDER,
    SAVED,
    STEPS,
    continue_fixture,
    this_host,
    train_args,
)


def commit() -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()


def write_checkpoint(name: str, flags: list[str], work: Path) -> None:
    with FTJob(work / name, groups=1, train_args=train_args(flags), warm=False) as job:
        job.start()
        assert job.wait_exit(0, timeout=300) == 0, tail(job.latest(0).text())
        saved = job.dump_folder / "checkpoint" / "replica_0" / f"step-{SAVED}"
        assert saved.is_dir(), saved
        FOLDER.mkdir(parents=True, exist_ok=True)
        with tarfile.open(FOLDER / f"{name}.tar.xz", "w:xz", preset=9) as archive:
            archive.add(saved, arcname=f"step-{SAVED}")
    record = {"commit": commit(), "flags": flags, "steps": STEPS, "saved_step": SAVED}
    (FOLDER / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    size = (FOLDER / f"{name}.tar.xz").stat().st_size
    print(f"[fixture] {name}: checkpoint of step {SAVED}, {size:,} bytes")


def record_continuations(name: str, work: Path, replace_frozen: bool) -> None:
    path = FOLDER / f"{name}.json"
    record: dict[str, Any] = json.loads(path.read_text())
    for before in ("final_digest", "losses", "global_digests_after_saved"):  # the old layout
        record.pop(before, None)

    def job(folder: Path, **kwargs: Any) -> FTJob:
        return FTJob(folder, warm=False, **kwargs)

    frozen = continue_fixture(name, work / name / "frozen", True, job)
    del frozen["losses"]
    kept = record.get("frozen")
    if kept is not None and not replace_frozen:
        same = {k: kept[k] for k in frozen} == frozen
        assert same, f"{name}: the frozen continuation differs from the one kept: {frozen}"
    else:
        record["frozen"] = frozen
    host = this_host()
    trained = continue_fixture(name, work / name / "trained", False, job)
    entries = [e for e in record.get("trained", []) if e["host"] != host]
    record["trained"] = [*entries, {"host": host, **trained}]
    path.write_text(json.dumps(record, indent=1) + "\n")
    final = trained["final_digest"]
    print(f"[fixture] {name}: frozen {frozen['final_digest']}; on {host}: {final}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--record", action="store_true", help="record today's continuations")
    action.add_argument("--new", action="store_true", help="write new checkpoints, then record")
    parser.add_argument(
        "--replace-frozen",
        action="store_true",
        help="replace the frozen continuation kept (the outer arithmetic changed on purpose)",
    )
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="checkpoint_fixture_") as tmp:
        for name, flags in FIXTURES.items():
            if options.new:
                write_checkpoint(name, flags, Path(tmp))
            record_continuations(name, Path(tmp), options.replace_frozen or options.new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
