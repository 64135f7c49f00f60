"""The arithmetic replica groups compare or apply alike gives the same bits on every CPU kernel
set: ATen's portable kernels (``default``, as on a CPU family whose vector code differs), AVX2
and the host's best, at 1 and 2 threads, in passes of any size (``host_arithmetic.py`` lists
the cases: every outer optimizer, async DiLoCo's sync point, a codec's decode and accumulate,
the token weights and the division by their total, a heal's replay).

The outer step is also torch's SGD to the bit where torch's kernels round every operation on
its own (``default``): the one difference is that torch's vectorized kernels contract
``a * x + y`` into a fused multiply-add.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from tests.kernel_sets import kernel_sets, with_kernels
from tests.unit_tests.fresh_interpreter import ROOT
from tests.unit_tests.host_arithmetic import CASES, make_inputs

Results = dict[str, dict[str, str]]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Results]:
    """The digests of every case computed under a kernel set, each set run once."""
    folder = tmp_path_factory.mktemp("host_arithmetic")
    inputs = folder / "inputs.pt"
    torch.save(make_inputs(), inputs)
    found: dict[str, Results] = {}

    def under(kernel_set: str) -> Results:
        if kernel_set not in found:
            out = folder / f"{kernel_set}.json"
            done = subprocess.run(
                [sys.executable, "-m", "tests.unit_tests.host_arithmetic", str(inputs), str(out)],
                cwd=ROOT,
                env=with_kernels(kernel_set),
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert done.returncode == 0, done.stderr[-3000:]
            result = json.loads(out.read_text())
            assert result["capability"].lower() == kernel_set, result["capability"]
            found[kernel_set] = result["cases"]
        return found[kernel_set]

    return under


@pytest.mark.parametrize("kernel_set", kernel_sets())
def test_every_case_has_the_same_bits_as_the_portable_kernels(
    kernel_set: str, results: Callable[[str], Results]
) -> None:
    reference, got = results("default"), results(kernel_set)
    assert set(got) == set(CASES)
    differ = {
        f"{case} ({threads})": (digest, reference[case]["threads=1"])
        for case, by_threads in got.items()
        for threads, digest in by_threads.items()
        if digest != reference[case]["threads=1"]
    }
    assert not differ, f"{kernel_set} against default: {differ}"


def test_async_diloco_passes_give_the_bits_of_the_whole_fragment_operations(
    results: Callable[[str], Results],
) -> None:
    """On one kernel set: the sync point in cache-sized passes equals it in whole-tensor
    operations (each on torch's threads), so the piece size does not enter the bits."""
    found = results(kernel_sets()[-1])
    for update in ("eager", "eager_share", "delayed"):
        assert found[f"sync point {update} passes"] == found[f"sync point {update}"], update


_TORCH_SGD = """
import torch
from torchtitan.experiments.fault_tolerance.outer_optimizer import OuterSGD
assert torch.backends.cpu.get_cpu_capability() == "DEFAULT"
gen = torch.Generator().manual_seed(0)
n = (1 << 18) + 4099
start = torch.randn(n, generator=gen)
grads = [torch.randn(n, generator=gen) * 1e-2 for _ in range(5)]
for momentum, nesterov in [(0.0, False), (0.9, False), (0.9, True)]:
    for flavour in [{"foreach": False}, {"foreach": True}, {"fused": True}]:
        theirs = start.clone()
        sgd = torch.optim.SGD([theirs], lr=0.7, momentum=momentum, nesterov=nesterov, **flavour)
        mine = start.clone()
        again = OuterSGD([mine], lr=0.7, momentum=momentum, nesterov=nesterov)
        for g in grads:
            theirs.grad, mine.grad = g.clone(), g.clone()
            sgd.step()
            again.step()
        assert torch.equal(mine, theirs), (momentum, nesterov, flavour)
        if momentum:
            assert torch.equal(
                again.state[mine]["momentum_buffer"], sgd.state[theirs]["momentum_buffer"]
            )
print("equal")
"""


def test_outer_sgd_is_torch_sgd_bit_for_bit_on_the_portable_kernels() -> None:
    """torch's SGD (for-loop, foreach and fused) and ``OuterSGD``, in a process on ATen's
    portable kernels: the same bits after 5 steps, with and without (Nesterov) momentum."""
    done = subprocess.run(
        [sys.executable, "-c", _TORCH_SGD],
        cwd=ROOT,
        env=with_kernels("default"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip() == "equal", done.stderr[-3000:]
