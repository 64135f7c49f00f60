"""A sync's large temporaries are mapped on their own (``tools.host_memory``), so that freeing
them returns their pages; the semi-sync trainer maps them for the method's hook only."""

from __future__ import annotations

import platform
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import torch

from torchtitan.experiments.fault_tolerance.trainer import SemiSyncTrainer
from torchtitan.tools import host_memory

PROBE = """
import sys
import torch
from torchtitan.tools import host_memory

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

assert host_memory.map_large() if sys.argv[1] == "mapped" else host_memory.heap_large()
before = rss_mib()
big, small = [], []
for _ in range(16):
    big.append(torch.ones(1 << 20))  # 4 MiB each, every page touched
    small.append(torch.ones(50_000))  # 200 KB that outlive it, next to it in the heap
held = rss_mib() - before
big.clear()
print(held, rss_mib() - before)
"""


def _probe(mode: str) -> tuple[float, float]:
    """MiB resident while 16 tensors of 4 MiB live, and once they are freed (a fresh process:
    the setting is the whole process's)."""
    found = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120,
        check=True,
    )  # fmt: skip
    held, after = (float(x) for x in found.stdout.split())
    return held, after


def test_large_allocations_mapped_for_a_sync_give_their_pages_back_when_freed() -> None:
    """On glibc (Linux; this project's CI): 64 MiB of 4 MiB tensors, each followed by a smaller
    one that outlives it, are resident while they live. Mapped, freeing them gives the pages
    back; from the heap (between the smaller ones), the process keeps them."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        assert not host_memory.map_large()  # elsewhere it does nothing, and says so
        return
    held, after = _probe("mapped")
    assert held >= 60 and after <= 16, (held, after)
    held, after = _probe("heap")
    assert held >= 60 and after >= 48, (held, after)


def test_the_trainer_maps_large_allocations_for_the_method_s_hook_only(monkeypatch: Any) -> None:
    """Inner step by inner step: the trainer's hook before the method's maps, its hook after
    puts the heap back, so the method's sync allocates mapped and the next step's gradients
    come from the heap."""
    calls: list[str] = []
    monkeypatch.setattr(host_memory, "map_large", lambda: calls.append("map") or True)
    monkeypatch.setattr(host_memory, "heap_large", lambda: calls.append("heap") or True)
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)

    class Method:
        def hooks(self, quorums: Any) -> Any:
            assert quorums is trainer.protocol
            handle = optimizer.register_step_post_hook(lambda *_: calls.append("method"))
            return _Removing(handle)

    reporter = SimpleNamespace(start_clock=lambda: None, after_inner_step=lambda step: None)
    trainer = SimpleNamespace(
        optimizer=optimizer,
        algorithm=Method(),
        protocol=object(),
        reporter=reporter,
        train_state=SimpleNamespace(step=0),
    )
    trainer._before_torchft = lambda *a: SemiSyncTrainer._before_torchft(trainer, *a)  # type: ignore[attr-defined]
    trainer._after_method = lambda *a: SemiSyncTrainer._after_method(trainer, *a)  # type: ignore[attr-defined]
    with SemiSyncTrainer.train_context(trainer):  # type: ignore[arg-type]
        for _ in range(2):
            weight.grad = torch.ones(3)
            optimizer.step()
    assert calls == ["map", "method", "heap"] * 2


class _Removing:
    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def __enter__(self) -> None:
        pass

    def __exit__(self, *_: Any) -> None:
        self.handle.remove()
