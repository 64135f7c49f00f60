"""The project's one logger. Every module logs through ``logger``; ``init_logger`` sets it up."""

import logging

logger = logging.getLogger("torchtitan")


def init_logger(level: int = logging.INFO) -> None:
    """Log to stderr as ``HH:MM:SS LEVEL message`` (torchrun prefixes each rank's lines)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False
