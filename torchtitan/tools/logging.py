"""The project's one logger. Every module logs through ``logger``; ``init_logger`` sets it up."""

import logging
import os

logger = logging.getLogger("torchtitan")


def init_logger(level: int = logging.INFO) -> None:
    """Log to stderr with a rank prefix (``[rank N]``) when running under torchrun."""
    rank = os.environ.get("RANK")
    prefix = f"[rank{rank}] " if rank is not None else ""
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(message)s", "%H:%M:%S")
    )
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False
