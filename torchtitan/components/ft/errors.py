"""The error every fault-tolerance failure ends in (one line, exit 1)."""


class FaultToleranceError(RuntimeError):
    """The fault-tolerant job cannot go on: no lighthouse, no quorum in time, bad healing state.
    The message names the address or the config field involved."""
