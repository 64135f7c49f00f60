"""DyLU (arXiv 2401.09135): how many inner steps each group takes per period, so that the groups
reach the sync point at about the same time, and when a group corrects that within a period.
Pure arithmetic on the groups' measured seconds per inner step; ``async_diloco`` and the quorum
protocol apply it."""

from __future__ import annotations


def dylu_inner_steps(period: int, step_seconds: list[float], mine: float) -> int:
    """DyLU: this group's inner steps for the next period, so that every group reaches the sync
    point at about the same time. ``step_seconds``: every group's seconds per inner step in its
    last period (0: not measured yet, e.g. just (re)started); ``mine``: this group's.

    The slowest group takes the whole steps closest to the time the fastest group needs for
    ``period`` steps; that time (its steps x its step time) is the period's length, and every
    other group takes the whole steps closest to it (up to ``2 * period``). A group then waits
    at most about half of its own step for the others, whatever the speeds. Every group
    computes this from the same exchanged numbers, so the plans fit together. Unmeasured
    groups take ``period`` steps."""
    length = dylu_period_seconds(period, step_seconds)
    if mine <= 0 or length <= 0:
        return period
    return max(1, min(2 * period, round(length / mine)))


def dylu_period_seconds(period: int, step_seconds: list[float]) -> float:
    """The wall-clock length DyLU gives the next period: the slowest group's whole steps
    closest to the time the fastest needs for ``period`` steps (0: nobody measured yet)."""
    measured = [s for s in step_seconds if s > 0]
    if not measured:
        return 0.0
    fastest, slowest = min(measured), max(measured)
    return max(1, round(period * fastest / slowest)) * slowest


def dylu_steps_to_deadline(taken: int, elapsed: float, length: float, period: int) -> int:
    """The whole inner steps this period should take in all, ``taken`` of them done in
    ``elapsed`` seconds, to end closest to ``length`` seconds after it began: this period's
    own speed corrects the plan made from the last one (at least ``taken``, at most
    ``2 * period``)."""
    if taken <= 0 or elapsed <= 0:
        return max(1, taken)
    remaining = round((length - elapsed) * taken / elapsed)
    return max(taken, min(2 * period, taken + remaining))


def dylu_next_correction(taken: int, planned: int) -> int | None:
    """The inner step at which DyLU next corrects a period of ``planned`` steps, ``taken`` of
    them done: halfway through what is left (None once fewer than 2 are left). For 20 steps
    on plan: after steps 10, 15, 17, 18 and 19."""
    left = planned - taken
    return taken + left // 2 if left >= 2 else None
