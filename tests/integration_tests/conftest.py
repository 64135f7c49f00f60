import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration_tests.harness import FTJob
from tests.integration_tests.warm_start import CHILDREN_ENV, COLD_ENV, SOCKET_ENV, Zygote


@pytest.fixture(scope="session", autouse=True)
def warm_starts() -> Iterator[None]:
    """One zygote per pytest process: the trainers of the tests' jobs start warm (see
    ``warm_start.py``) unless TORCHTITAN_TEST_COLD_START=1."""
    if os.environ.get(COLD_ENV) == "1":
        yield
        return
    # Short: a Unix socket's path has at most 107 bytes.
    with tempfile.TemporaryDirectory(prefix="tt-zygote-") as folder, Zygote(Path(folder)) as z:
        os.environ[SOCKET_ENV], os.environ[CHILDREN_ENV] = z.path, str(z.children)
        try:
            yield
        finally:
            del os.environ[SOCKET_ENV], os.environ[CHILDREN_ENV]


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
