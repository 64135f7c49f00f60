"""Entry point: ``python -m torchtitan.train [--section.field=value ...]`` (or ``run_train.sh``).

The trainer class is ``torchtitan.trainer.Trainer`` unless the custom args module
(``--job.custom_args_module``) names another one: its function ``trainer_for(config)`` (or its
module attribute ``TRAINER``) returns ``"package.module:ClassName"``. That is how an
experiment swaps in its trainer subclass, chosen by the config.

A custom args module may name a function that gives a command to run instead
(``RUN_INSTEAD = "package.module:function"``, see
:func:`command_instead`): the fault-tolerance experiment's semi-sync method without fault
tolerance runs one replica group against a lighthouse started for it.

Exit status: 0 when training finished; 2 for a bad command line or config (one ``error:`` line,
or tyro's usage box for flag syntax); 1 for a problem found while starting or training (one
``ERROR`` log line naming it: a checkpoint that cannot be loaded, a dataset that is not there);
130 after Ctrl-C. Anything else is a bug and shows its traceback.
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import sys
import traceback
from types import ModuleType
from typing import Any

from torchtitan.config import ConfigError, ConfigManager
from torchtitan.config.manager import custom_module, flag_value, load_toml
from torchtitan.tools.events import EventFile, EventKind, attach_event_file, detach_event_file
from torchtitan.tools.logging import init_logger, logger

#: The run stopped on a problem it names (exit status 1): ``error`` is the exception's type.
RUN_FAILED = EventKind("run.failed", "{error}: {message}", logging.ERROR)
RUN_INTERRUPTED = EventKind(
    "run.interrupted", "Interrupted by the user after step {step}", logging.WARNING
)


def resolve_trainer_class(custom_module: ModuleType | None, config: Any) -> type:
    """The trainer class to run: what the custom module's ``trainer_for(config)`` returns, or
    its ``TRAINER``, else the core Trainer."""
    path = None
    if custom_module is not None and hasattr(custom_module, "trainer_for"):
        path = custom_module.trainer_for(config)
    elif custom_module is not None:
        path = getattr(custom_module, "TRAINER", None)
    if custom_module is None or path is None:
        from torchtitan.trainer import Trainer

        return Trainer
    return named_in(custom_module, "TRAINER", path)


def named_in(custom_module: ModuleType, attribute: str, path: str) -> Any:
    """What the custom module's ``attribute`` names by ``path`` (``"package.module:name"``)."""
    module_name, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ModuleNotFoundError, AttributeError) as e:
        missing = getattr(e, "name", None) if isinstance(e, ModuleNotFoundError) else None
        if missing and not f"{module_name}.".startswith(f"{missing}."):
            raise  # the named module is there; something it imports is not
        raise ConfigError(
            "job.custom_args_module",
            custom_module.__name__,
            f"its {attribute} = {path!r} does not name anything ({e}); write 'package.module:name'",
        ) from e


#: ``check_config``'s exit status when another command should run in place of this one; it
#: prints that command on stdout, one argument per line (``run_train.sh`` runs it).
RUN_INSTEAD_STATUS = 3


def command_instead(argv: list[str]) -> list[str] | None:
    """Extension point: the command to run in place of this one, from the custom args module's
    ``RUN_INSTEAD`` function, given ``argv`` (a job that needs something started first, e.g. a
    lighthouse), decided from the flags and the TOML before anything is parsed; None to run as
    asked (and for ``--help``, which is this command's)."""
    if any(arg in ("-h", "--help") for arg in argv):
        return None
    config_file = flag_value(argv, "job.config_file")
    module = custom_module(argv, load_toml(config_file) if config_file else {})
    if module is not None and hasattr(module, "run_instead"):
        raise ConfigError(
            "job.custom_args_module",
            module.__name__,
            "it defines run_instead(argv); name that function instead, as "
            "RUN_INSTEAD = 'package.module:function'",
        )
    path = getattr(module, "RUN_INSTEAD", None)
    return named_in(module, "RUN_INSTEAD", path)(argv) if module and path else None


def check_config(argv: list[str] | None = None) -> int:
    """Parse and validate the config only, as :func:`main` does before training: 0 when it is
    good, else the exit status (2) after the same one-line error. ``run_train.sh`` runs this
    once before it starts several ranks, so that a bad flag gives one error line rather than
    one per rank plus torchrun's failure report."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        instead = command_instead(args)
        if instead is not None:
            print("\n".join(instead))
            return RUN_INSTEAD_STATUS
        ConfigManager().parse_args(args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    # A collective given up on a peer that is gone may still block a gloo thread: the
    # interpreter's teardown would abort the process on it (SIGABRT); exit past it instead.
    from torchtitan.components.ft.given_up import blocked, exit_if_blocked

    try:
        status = _run(argv)
    except BaseException as e:
        # A bug in a rank under torchrun: its traceback goes to torchrun's error file, so the
        # failure report shows it even when this rank's output is not shown; that file is how
        # loopback_torchrun tells a crash from an error this rank named (exit 1 as well).
        if isinstance(e, Exception) and "TORCHELASTIC_ERROR_FILE" in os.environ:
            from torch.distributed.elastic.multiprocessing.errors import get_error_handler

            get_error_handler().record_exception(e)
        if blocked():  # a bug's traceback first, then the same exit past those threads
            traceback.print_exc()
            exit_if_blocked(1)
        raise
    exit_if_blocked(status)
    return status


def _run(argv: list[str] | None) -> int:
    init_logger()
    manager = ConfigManager()
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if "RANK" not in os.environ:  # one process of its own, not a rank that torchrun started
            instead = command_instead(args)
            if instead is not None:
                sys.stdout.flush()
                os.execv(instead[0], instead)
        config = manager.parse_args(args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if config.job.print_config:
        logger.info(f"Resolved config: {config.to_dict()}")
    logger.info(f"Job: {config.job.description}")

    from torchtitan.components.checkpoint import CheckpointError
    from torchtitan.components.ft import FaultToleranceError, confine_to_host

    trainer = None
    # This rank's event file, from before the trainer is built: a failure while building it
    # is a run.failed event too.
    ft = config.fault_tolerance
    events: EventFile | None = attach_event_file(
        config.job.dump_folder, ft.replica_id if ft.enable else None, int(os.environ.get("RANK", 0))
    )
    try:
        if config.fault_tolerance.enable:
            # torchft's Manager needs a TCP store; everything listens on fault_tolerance.hostname
            confine_to_host(config)
        trainer = resolve_trainer_class(manager.custom_module, config)(config)
        trainer.event_file, events = events, None  # the trainer detaches it when it closes
        trainer.train()
    except (
        ConfigError,
        CheckpointError,
        FaultToleranceError,
        FileNotFoundError,
        ConnectionError,  # a dataset host that cannot be reached (the message names the field)
        ValueError,
    ) as e:
        RUN_FAILED.emit(error=type(e).__name__, message=str(e))
        return 1
    except KeyboardInterrupt:
        step = trainer.train_state.step if trainer is not None else 0
        RUN_INTERRUPTED.emit(step=step)
        return 130
    finally:
        if trainer is not None:
            trainer.close()
            # Free the model (and, through its device mesh, the process groups) while the
            # interpreter is whole: a gloo worker thread that still holds a reference into
            # Python when the interpreter finalizes aborts the process (SIGABRT) after a run
            # that succeeded.
            trainer = None
            gc.collect()
        if events is not None:
            detach_event_file(events)
    return 0


if __name__ == "__main__":
    sys.exit(main())
