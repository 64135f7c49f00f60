"""``benchmarks/train_entry.py`` plus per-step timing lines, for ``wan.py`` and ``recovery.py``.

    .venv/bin/python benchmarks/timed_entry.py [--section.field=...]

Instrumentation of this process only (the trainer's code is unchanged; methods are wrapped at
start-up). After every committed step it logs

    [timing] step N compute_s C t T

``C``: seconds spent so far in forward + backward (``Trainer.forward_backward``), gradient
clipping (``Trainer.clip_gradients``) and the inner optimizer's own update (from a step
pre-hook to the optimizer's first post-hook, which runs before torchft's sync hooks), summed
over all steps of this process. ``T``: ``time.monotonic()`` at the end of the step (the same
clock in every process of the machine, also across network namespaces). Compute utilisation over
steps (a, b] is ``(C_b - C_a) / (T_b - T_a)``; everything else in that wall time (quorums,
all-reduces, waiting for peers, data loading, logging) is the non-compute part.

When this process heals, torchft's checkpoint transport is wrapped to log

    [timing] heal recv_bytes B seconds S

(``B``: bytes of the tensors received; ``S``: time in ``recv_checkpoint``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_entry  # noqa: E402  (the benchmarks' flavors and default config)


def install() -> None:
    import torch

    from torchtitan.tools.logging import logger
    from torchtitan.trainer import Trainer

    clock = {"compute": 0.0, "t_pre": 0.0}

    def timed(method: Any) -> Any:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                clock["compute"] += time.perf_counter() - start

        return wrapper

    Trainer.forward_backward = timed(Trainer.forward_backward)  # type: ignore[method-assign]
    Trainer.clip_gradients = timed(Trainer.clip_gradients)  # type: ignore[method-assign]

    build_optimizer = Trainer.build_optimizer

    def build_timed_optimizer(self: Any, model: Any) -> Any:
        optimizer = build_optimizer(self, model)

        def pre(*_: Any) -> None:
            clock["t_pre"] = time.perf_counter()

        def post(*_: Any) -> None:  # the first post-hook: before torchft's (registered later)
            clock["compute"] += time.perf_counter() - clock["t_pre"]

        optimizer.register_step_pre_hook(pre)
        optimizer.register_step_post_hook(post)
        return optimizer

    Trainer.build_optimizer = build_timed_optimizer  # type: ignore[method-assign]

    after_step = Trainer.after_step

    def timed_after_step(self: Any, result: Any) -> None:
        logger.info(
            f"[timing] step {self.train_state.step} compute_s {clock['compute']:.4f} "
            f"t {time.monotonic():.4f}"
        )
        after_step(self, result)

    Trainer.after_step = timed_after_step  # type: ignore[method-assign]

    try:
        from torchft.checkpointing.pg_transport import PGTransport
    except ImportError:
        return
    recv = PGTransport.recv_checkpoint

    def timed_recv(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        state = recv(self, *args, **kwargs)
        seconds = time.perf_counter() - start
        leaves = torch.utils._pytree.tree_leaves(state)
        nbytes = sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
        logger.info(f"[timing] heal recv_bytes {nbytes} seconds {seconds:.3f}")
        return state

    PGTransport.recv_checkpoint = timed_recv  # type: ignore[method-assign]


def main() -> int:
    install()
    return train_entry.main()


if __name__ == "__main__":
    sys.exit(main())
