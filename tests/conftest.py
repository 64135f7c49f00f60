import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration_tests import warm_start


@pytest.fixture(scope="session")
def zygote() -> Iterator[warm_start.Zygote | None]:
    """One zygote per pytest process, started by the first test that needs it: the trainers
    its tests start begin warm (``tests/integration_tests/warm_start.py``). None with
    TORCHTITAN_TEST_COLD_START=1: every trainer starts cold."""
    if os.environ.get(warm_start.COLD_ENV) == "1":
        yield None
        return
    # Short: a Unix socket's path has at most 107 bytes.
    with (
        tempfile.TemporaryDirectory(prefix="tt-zygote-") as folder,
        warm_start.Zygote(Path(folder)) as z,
    ):
        os.environ[warm_start.SOCKET_ENV] = z.path
        os.environ[warm_start.CHILDREN_ENV] = str(z.children)
        try:
            yield z
        finally:
            del os.environ[warm_start.SOCKET_ENV], os.environ[warm_start.CHILDREN_ENV]


@pytest.fixture
def warm_benchmark_trainers(
    zygote: warm_start.Zygote | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainers a benchmark starts (``benchmarks.ft_common.TRAIN_ENTRY``) begin warm, with
    the pinning and network namespace their launch gives them. Not for a benchmark whose figure
    is its trainers' resource usage (``memory.py``, ``peer_throughput.py``): the process it
    starts is the stand-in, not the trainer (``ft_overhead.py`` records each process's peak RSS
    beside its figures: the stand-in's here, which its smoke test does not read)."""
    if zygote is None:
        return
    from benchmarks import ft_common

    module = ft_common.TRAIN_ENTRY[1:]
    monkeypatch.setattr(ft_common, "TRAIN_ENTRY", [str(warm_start.WARM_PYTHON), *module])
    monkeypatch.setenv("TORCHTITAN_REAL_PYTHON", sys.executable)
