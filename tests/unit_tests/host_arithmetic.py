"""The arithmetic replica groups compare or apply alike, run on given inputs in this process's
ATen CPU kernels: ``python -m tests.unit_tests.host_arithmetic INPUTS OUT`` writes, for every
case, the digests of what it computed at each thread count, as JSON.

``test_host_arithmetic.py`` runs it under ``ATEN_CPU_CAPABILITY=default``, ``avx2`` and the
host's best (each a process of its own: the variable is read when torch is imported) and
requires the same bits everywhere. The inputs are made once by the test process and loaded
here, so that only the arithmetic under test runs on the kernels being compared. A new
operation whose result groups compare or apply alike gets a case in :data:`CASES`
(``docs/design.md``, "Bits the groups agree on").
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from tests.unit_tests.outer_reference import WholeFragment
from torchtitan.experiments.fault_tolerance.heal.history import HistoryEntry
from torchtitan.experiments.fault_tolerance.methods.async_diloco import AsyncOuterState
from torchtitan.experiments.fault_tolerance.methods.outer_optimizer import (
    DelayedNesterov,
    OuterSGD,
    outer_optimizer,
)
from torchtitan.experiments.fault_tolerance.transport.codecs import get_codec, sparse_name
from torchtitan.experiments.fault_tolerance.transport.collective import (
    Delivered,
    chunk_numel,
)
from torchtitan.tools.digest import tensor_digest
from torchtitan.tools.exact_division import divide_, divided

#: Values per tensor: more than a piece of the passes (2^18) and a digest chunk (2^20), odd, so
#: that every vector width leaves a scalar tail.
NUMEL = (1 << 20) + 4099
#: Replica groups whose transfers are summed.
GROUPS = 3
#: Each group's tokens in a sync (async DiLoCo's weights).
TOKENS = (768, 256, 1280)
DTYPES = ("bfloat16", "int8", "int4", sparse_name(64, 8, 3))


def make_inputs(seed: int = 0) -> dict[str, Any]:
    """The cases' inputs (made in the test process, on its kernels: any host's are fine)."""
    gen = torch.Generator().manual_seed(seed)

    def values(scale: float = 1.0) -> torch.Tensor:
        return torch.randn(NUMEL, generator=gen) * scale

    pseudo = [values(1e-2) for _ in range(GROUPS)]
    total = torch.stack(pseudo).sum(0)
    # A float32 sync delivers the sum itself.
    delivered = {"float32": total}
    for dtype in DTYPES:
        codec = get_codec(dtype)
        if codec.gathers:  # every group's encoding of the whole tensor
            parts = [codec.encode(p) for p in pseudo]
        else:  # group r's re-encoded reduced chunk r (the last padded with zeros)
            chunk = chunk_numel(NUMEL, GROUPS)
            padded = torch.nn.functional.pad(total, (0, GROUPS * chunk - NUMEL))
            parts = [codec.encode(c) for c in padded.split(chunk)]
        delivered[dtype] = torch.cat(parts)
    return {
        "param": values(),
        "grads": [values(1e-2) for _ in range(7)],
        "pseudo": pseudo,
        "local": values(),
        "delivered": delivered,
    }


def _digest(tensors: Iterable[torch.Tensor | None]) -> str:
    return tensor_digest(t for t in tensors if t is not None)


def _steps(optimizer_of: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> Callable:
    def case(inputs: dict[str, Any]) -> str:
        param = inputs["param"].clone()
        optimizer = optimizer_of([param])
        for grad in inputs["grads"]:
            param.grad = grad.clone()
            optimizer.step()
        state = optimizer.state[param]
        return _digest([param, state.get("momentum_buffer"), state.get("grad_sum")])

    return case


def _model(inputs: dict[str, Any]) -> nn.Module:
    model = nn.Module()
    model.register_parameter("weight", nn.Parameter(inputs["local"].clone()))
    return model


def _sync_point(update: str, threads: int, passes: bool) -> Callable:
    """Two of async DiLoCo's sync points on one fragment: the token-weighted sums divided by
    the tokens' total, the outer step (Nesterov), the local copy following the global copy,
    the next pseudo-gradient and period start (``eager``: the outer step's own estimate)."""
    share = {"eager": 1.0, "eager_share": 1 / GROUPS, "delayed": None}[update]

    def case(inputs: dict[str, Any]) -> str:
        model = _model(inputs)
        make = outer_optimizer(0.7, 0.9, True)
        state = AsyncOuterState(model, torch.device("cpu"), make, host_threads=threads)
        with torch.no_grad():
            state.global_copy["weight"].copy_(inputs["param"])
            state.period_start["weight"].copy_(inputs["param"])
        runner = state if passes else WholeFragment(state)
        out = torch.empty(NUMEL)
        for k in range(2):
            sums = sum(
                (p * t for p, t in zip(inputs["pseudo"], TOKENS, strict=True)),
                torch.zeros(NUMEL),
            )
            sums.add_(inputs["grads"][k])
            runner.finish_and_start(sums, float(sum(TOKENS)), out, share, float(TOKENS[0]))
        momentum = state.outer.state[state.global_copy["weight"]]["momentum_buffer"]
        return _digest(
            [*state.global_copy.values(), *state.period_start.values(), model.weight, out, momentum]
        )

    return case


def _decode(dtype: str, world_size: int) -> Callable:
    def case(inputs: dict[str, Any]) -> str:
        codec = get_codec(dtype)
        if world_size == 1:
            one = codec.wire_bytes(NUMEL if codec.gathers else chunk_numel(NUMEL, GROUPS))
            payload = inputs["delivered"][dtype][:one]
            numel = NUMEL if codec.gathers else chunk_numel(NUMEL, GROUPS)
        else:
            payload, numel = inputs["delivered"][dtype], NUMEL
        # As a sync delivered it and a heal replays it: decoded, then divided by the groups.
        return _digest([Delivered(dtype, numel, world_size, world_size, payload).values()])

    return case


def _replay(dtype: str) -> Callable:
    """A heal's replay: three committed syncs' delivered bytes, each divided by the tokens'
    total and stepped into the global copy by Nesterov SGD."""

    def case(inputs: dict[str, Any]) -> str:
        glob = inputs["param"].clone()
        outer = OuterSGD([glob], lr=0.7, momentum=0.9, nesterov=True)
        for sync in range(3):
            entry = HistoryEntry.of(
                sync + 1,
                0,
                [Delivered(dtype, NUMEL, GROUPS, 1.0, inputs["delivered"][dtype])],
                0,
                scale=float(sum(TOKENS)),
            )
            glob.grad = entry.average()
            outer.step()
        return _digest([glob, outer.state[glob]["momentum_buffer"]])

    return case


def _token_weights(inputs: dict[str, Any]) -> str:
    """Each group's pseudo-gradient times its tokens, summed in group order, divided by the
    total (async DiLoCo's token-weighted average)."""
    total = torch.zeros(NUMEL)
    for pseudo, tokens in zip(inputs["pseudo"], TOKENS, strict=True):
        total.add_(pseudo.mul(tokens))
    return _digest([divide_(total, float(sum(TOKENS))), divided(inputs["pseudo"][0], 7.0)])


CASES: dict[str, Callable[[dict[str, Any]], str]] = {
    "sgd": _steps(lambda p: OuterSGD(p, lr=0.7)),
    "sgd momentum": _steps(lambda p: OuterSGD(p, lr=0.7, momentum=0.9)),
    "sgd nesterov": _steps(lambda p: OuterSGD(p, lr=0.7, momentum=0.9, nesterov=True)),
    "delayed nesterov": _steps(lambda p: DelayedNesterov(p, lr=0.7, momentum=0.9, delay=3, c=0.2)),
    "token weights and division": _token_weights,
    **{
        f"sync point {u}{' passes' if passes else ''}": _sync_point(u, 1, passes)
        for u in ("eager", "eager_share", "delayed")
        for passes in (True, False)
    },
    "sync point eager passes on 2 threads": _sync_point("eager", 2, True),
    **{f"decode {d} of {n}": _decode(d, n) for d in DTYPES for n in (1, GROUPS)},
    **{f"replay {d}": _replay(d) for d in ("float32", "int4")},
}


def run(inputs: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Every case's digest at 1 and 2 of torch's intra-op threads."""
    found: dict[str, dict[str, str]] = {name: {} for name in CASES}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, case in CASES.items():
            found[name][f"threads={threads}"] = case(inputs)
    return found


def main(argv: list[str]) -> None:
    source, target = argv
    inputs = torch.load(source, weights_only=True)
    result = {"capability": torch.backends.cpu.get_cpu_capability(), "cases": run(inputs)}
    with open(target, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
