"""Where glibc puts large host allocations: mapped on their own (returned to the system when
freed) or in its heap (kept for reuse).

glibc maps an allocation of at least its threshold on its own pages and returns them when it is
freed; a smaller one comes from its heap, whose freed pages stay with the process. By default
the threshold moves: each time a mapped allocation is freed it rises to that size (up to
32 MiB), so after a few frees a training step's gradients, and everything else below 32 MiB,
come from the heap. That is what a step wants (its gradients are allocated and freed at every
step, and the heap's pages are already there), and not what a sync wants: its temporaries
(pseudo-gradients, packed buckets) are allocated once, mostly in other sizes and between
long-lived tensors (the outer momentum is created in the first sync), and freed a whole period
before they are needed again. Left in the heap they fragment it, and the pages it keeps add
0.2-0.3 x the parameters' bytes to a DiLoCo job's peak (``benchmarks/memory.py``).

:func:`map_large` fixes the threshold at :data:`MAPPED_FROM` for a sync, :func:`heap_large`
puts it back at glibc's ceiling afterwards (the dynamic threshold is then off, at the value it
reaches by itself). Elsewhere than glibc (macOS, musl) both do nothing.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

#: During a sync: allocations of this size or more are mapped on their own.
MAPPED_FROM = 1 << 20
#: Otherwise: glibc's own ceiling for its dynamic threshold (``DEFAULT_MMAP_THRESHOLD_MAX``).
HEAP_BELOW = 32 << 20
#: ``mallopt``'s parameter for the threshold (glibc's ``malloc.h``).
_M_MMAP_THRESHOLD = -3


@functools.cache
def _mallopt() -> Callable[[int, int], int] | None:
    try:
        return ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):  # not glibc
        return None


def _set_threshold(nbytes: int) -> bool:
    mallopt = _mallopt()
    return mallopt is not None and mallopt(_M_MMAP_THRESHOLD, nbytes) == 1


def map_large() -> bool:
    """From now on allocations of :data:`MAPPED_FROM` bytes or more are mapped on their own.
    Returns whether the allocator took it (False: not glibc)."""
    return _set_threshold(MAPPED_FROM)


def heap_large() -> bool:
    """From now on allocations below :data:`HEAP_BELOW` bytes come from the heap."""
    return _set_threshold(HEAP_BELOW)
