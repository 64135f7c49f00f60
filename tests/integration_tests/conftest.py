from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration_tests.harness import FTJob
from tests.integration_tests.warm_start import Zygote


@pytest.fixture(scope="session", autouse=True)
def warm_starts(zygote: Zygote | None) -> None:
    """The trainers of the integration tests' jobs start warm (the session's ``zygote``,
    ``tests/conftest.py``) unless TORCHTITAN_TEST_COLD_START=1."""


@pytest.fixture
def ft_job(tmp_path: Path) -> Iterator:
    """Factory of real lighthouse + replica-group jobs; every process is killed at teardown."""
    jobs: list[FTJob] = []

    def make(folder: Path | None = None, **kwargs) -> FTJob:
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
        job = FTJob(folder or tmp_path, **kwargs)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.close()
