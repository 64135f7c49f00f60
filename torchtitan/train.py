"""Entry point: ``python -m torchtitan.train [--section.field=value ...]`` (or ``run_train.sh``).

The trainer class is ``torchtitan.trainer.Trainer`` unless the custom args module
(``--job.custom_args_module``) names another one in its module attribute ``TRAINER``, written
``"package.module:ClassName"``. That is how an experiment swaps in its trainer subclass.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

from torchtitan.config import ConfigError, ConfigManager
from torchtitan.tools.logging import init_logger, logger


def resolve_trainer_class(custom_module: ModuleType | None) -> type:
    """The trainer class to run: the custom module's ``TRAINER``, else the core Trainer."""
    path = getattr(custom_module, "TRAINER", None) if custom_module else None
    if path is None:
        from torchtitan.trainer import Trainer

        return Trainer
    module_name, _, class_name = path.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def _start_local_store() -> None:
    """A single-process job still needs a TCP store for torchft's Manager: torchrun provides
    one (MASTER_ADDR/MASTER_PORT); without torchrun, host one on loopback."""
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    _start_local_store.store = store  # type: ignore[attr-defined]  # keep it alive


def main(argv: list[str] | None = None) -> int:
    init_logger()
    manager = ConfigManager()
    try:
        config = manager.parse_args(argv)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if config.job.print_config:
        logger.info(f"Resolved config: {config.to_dict()}")
    logger.info(f"Job: {config.job.description}")

    from torchtitan.components.checkpoint import CheckpointError

    if config.fault_tolerance.enable:
        _start_local_store()
    trainer = None
    try:
        trainer = resolve_trainer_class(manager.custom_module)(config)
        trainer.train()
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError) as e:
        logger.error(f"{type(e).__name__}: {e}")
        return 1
    finally:
        if trainer is not None:
            trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
