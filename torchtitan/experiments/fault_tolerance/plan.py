"""A back-of-the-envelope plan for a semi-sync job: which ``sync_steps``, which dtype, which
timeouts, for a model size, an inner step time and a link.

    .venv/bin/python -m torchtitan.experiments.fault_tolerance.plan --params 8B --step-s 2 \\
        --link-mbit 1000 --groups 4 --ranks-per-group 8

Per ``pseudo_grad_dtype`` it prints the bytes one group sends per sync and their time on the
link; for the chosen (or suggested) ``sync_steps``, blocking DiLoCo's idle share and whether the
overlapped methods hide the sync; a full heal's time; and the timeouts that fit. Per group and
sync:

* bytes sent: ``2 (G - 1) / G`` (ring all-reduce) times the codec's wire size, scales included;
  ``sparse`` is all-gathered: ``G - 1`` times its encoding. ``--link-mbit`` is what one group
  sends, all its ranks together;
* one bucket's transfer (what ``sync_collective_timeout_s`` bounds): all ranks of a group send at
  once, each with ``1 / --ranks-per-group`` of the link;
* blocking idle share: ``sync / (period + sync)``; overlap hides a sync shorter than a period;
* a full heal: model, AdamW's two moments, global copy, outer momentum: 5 x 4 bytes per param;
* sites of groups (``--sites``, ``--groups-per-site``): the sync runs among the sites (one
  payload per site, whatever its live groups), and each step a site's groups all-reduce their
  float32 gradients over the site's network (``--site-gbit`` per rank): ``2 (G - 1) / G`` x 4
  bytes per parameter per group, each rank sending its shard.

It measures nothing: compute, codec time and real link throughput are the user's to check
(``benchmarks/wan.py`` emulates a link on one machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
import textwrap
from dataclasses import dataclass

from torchtitan.experiments.fault_tolerance.job_config import PSEUDO_GRAD_DTYPES
from torchtitan.experiments.fault_tolerance.transport.codecs import (
    get_codec,
)

#: Values per sample when asking a codec for its wire size per value (a multiple of its blocks).
_SAMPLE = 2**20


def bytes_per_value(dtype: str) -> float:
    """Encoded bytes per value of ``dtype`` on the wire, scales included (the codec's own)."""
    return get_codec(dtype).wire_bytes(_SAMPLE) / _SAMPLE


#: What a full heal carries per parameter: model, two AdamW moments, global copy, momentum.
HEAL_BYTES_PER_PARAM = 5 * 4
#: Blocking DiLoCo's idle share the suggestion aims below.
IDLE_TARGET = 0.05
#: Headroom of the suggested timeouts over the times they bound.
HEADROOM = 4.0
BUCKET_MB = 32.0


@dataclass(frozen=True)
class Plan:
    params: float
    step_s: float
    link_mbit: float
    groups: int
    sync_steps: int
    #: Ranks of one group: each sends its own shard's buckets over the group's link at once.
    ranks_per_group: int = 1
    #: Sites of groups: the groups of one site (1: every group is a site, ``groups`` sites).
    groups_per_site: int = 1
    #: Gbit/s of a site's network per rank (each rank sends its own shard).
    site_gbit: float = 100.0

    def step_allreduce_s(self) -> float:
        """Seconds a site's per-step gradient all-reduce (float32, ring) takes, every rank of
        a group sending its shard at once."""
        g = self.groups_per_site
        per_rank = 2 * (g - 1) / g * self.params * 4 / self.ranks_per_group
        return per_rank * 8 / (self.site_gbit * 1e9)

    def sync_s(self, dtype: str) -> float:
        """Seconds one sync's all-reduce takes on the link."""
        return self.sync_bytes(dtype) * 8 / (self.link_mbit * 1e6)

    def sync_bytes(self, dtype: str) -> float:
        if get_codec(dtype).gathers:  # sparse: its own encoding to each other group
            return (self.groups - 1) * self.params * bytes_per_value(dtype)
        ring = 2 * (self.groups - 1) / self.groups
        return ring * self.params * bytes_per_value(dtype)

    @property
    def period_s(self) -> float:
        return self.sync_steps * self.step_s

    def idle_share(self, dtype: str) -> float:
        """Blocking DiLoCo: the share of wall time the group waits for its sync."""
        sync = self.sync_s(dtype)
        return sync / (self.period_s + sync)

    def hidden(self, dtype: str) -> bool:
        """Whether an overlapped method's sync finishes within one period."""
        return self.sync_s(dtype) <= self.period_s

    def heal_s(self) -> float:
        return self.params * HEAL_BYTES_PER_PARAM * 8 / (self.link_mbit * 1e6)

    def bucket_s(self) -> float:
        """One float32 bucket's transfer (what the collective timeout bounds) while every rank
        of the group sends one."""
        ring = 2 * (self.groups - 1) / self.groups
        share = self.link_mbit * 1e6 / self.ranks_per_group
        return ring * BUCKET_MB * 2**20 * 8 / share


def steps_to_hide(plan: Plan, dtype: str) -> int:
    """The fewest inner steps per period whose compute covers the sync (overlapped methods)."""
    return max(1, math.ceil(plan.sync_s(dtype) / plan.step_s))


def steps_for_idle(plan: Plan, dtype: str, idle: float = IDLE_TARGET) -> int:
    """The fewest inner steps per period with blocking DiLoCo idle at most ``idle``."""
    return max(1, math.ceil(plan.sync_s(dtype) * (1 - idle) / idle / plan.step_s))


def parse_count(text: str) -> float:
    """``8B``, ``125M``, ``4.9e6`` or ``1000000``: a number of parameters."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kKmMbBtT]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r}: give a count such as 8B, 125M or 4.9e6")
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[match.group(2).lower()]
    return float(match.group(1)) * scale


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes / 1e3:.1f} kB"


def _duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def report(plan: Plan, suggested: bool) -> str:
    lines = [
        f"{plan.params:.3g} parameters, {plan.groups} replica groups of {plan.ranks_per_group} "
        f"rank(s), {plan.link_mbit:g} Mbit/s from each group to the others (its ranks share it), "
        f"inner step {plan.step_s:g} s",
        f"sync_steps {plan.sync_steps}{' (suggested: hides an int8 sync)' * suggested}: period "
        f"{_duration(plan.period_s)}",
        "",
        f"{'pseudo_grad_dtype':18} {'sent per sync':>14} {'sync time':>10} "
        f"{'blocking idle':>14} {'overlap hides it':>17} {'H to hide':>10} "
        f"{'H for 5% idle':>14}",
    ]
    for dtype in PSEUDO_GRAD_DTYPES:
        sent, took = _size(plan.sync_bytes(dtype)), _duration(plan.sync_s(dtype))
        lines.append(
            f"{dtype:18} {sent:>14} {took:>10} "
            f"{plan.idle_share(dtype):>13.1%} {'yes' if plan.hidden(dtype) else 'no':>17} "
            f"{steps_to_hide(plan, dtype):>10} {steps_for_idle(plan, dtype):>14}"
        )
    slowest = plan.sync_s("float32")
    if plan.groups_per_site > 1:
        g = plan.groups_per_site
        step_ar = plan.step_allreduce_s()
        lines[0] = (
            f"{plan.params:.3g} parameters, {plan.groups} sites of {g} replica groups of "
            f"{plan.ranks_per_group} rank(s), {plan.link_mbit:g} Mbit/s from each site to the "
            f"others (its carrying group's ranks share it), inner step {plan.step_s:g} s"
        )
        lines += [
            "",
            textwrap.fill(
                f"Sites: each site sends one payload per sync (the table's), whatever its live "
                f"groups. Every step its groups all-reduce their float32 gradients over the "
                f"site's network: {_size(2 * (g - 1) / g * plan.params * 4)} per group, "
                f"{_duration(step_ar)} at {plan.site_gbit:g} Gbit/s per rank "
                f"({step_ar / plan.step_s:.1%} of a step unless overlapped). A dead group costs "
                f"its site 1/{g} of its compute until it is back (it heals from its site, over "
                "the site's network).",
                width=96,
            ),
        ]
    prose = [
        "Blocking DiLoCo (diloco) idles while it syncs. Streaming DiLoCo (num_fragments > 1 and "
        "fragment_sync_delay) and async_diloco overlap the sync with inner steps: it is hidden "
        "when it takes less than the period (per fragment for Streaming). With int8: "
        f"async_diloco needs sync_steps >= {steps_to_hide(plan, 'int8')}, blocking diloco "
        f"sync_steps >= {steps_for_idle(plan, 'int8')} to idle at most {IDLE_TARGET:.0%}.",
        f"A full heal of a restarted group receives "
        f"{_size(plan.params * HEAL_BYTES_PER_PARAM)}: {_duration(plan.heal_s())} on this "
        "link (fault_tolerance.timeout_s must cover it).",
    ]
    lines += ["", *(textwrap.fill(p, width=96) for p in prose), ""]
    lines += [
        "timeouts that fit (fields of [fault_tolerance]):",
        f"  sync_collective_timeout_s >= {math.ceil(HEADROOM * plan.bucket_s())} "
        f"({HEADROOM:g} x one {BUCKET_MB:g} MiB float32 bucket, {_duration(plan.bucket_s())}, "
        f"while each of the {plan.ranks_per_group} rank(s) sends one)",
        f"  sync_quorum_timeout_s >= {math.ceil(HEADROOM * (plan.period_s + slowest))} "
        f"({HEADROOM:g} x a period plus a float32 sync: how long a group may wait for the others)",
        f"  timeout_s >= {math.ceil(HEADROOM * plan.heal_s())} ({HEADROOM:g} x a full heal)",
        "",
        textwrap.fill(
            "Outer optimizer: outer_lr 0.7 with Nesterov outer_momentum 0.9 (the field "
            "defaults, DiLoCo's published setting) is the place to start; with int4, set "
            "error_feedback.",
            width=96,
        ),
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan.experiments.fault_tolerance.plan",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "--params", type=parse_count, required=True, help="parameters, e.g. 8B, 125M, 4.9e6"
    )
    parser.add_argument(
        "--step-s", type=float, required=True, help="seconds of one inner step (all of it)"
    )
    parser.add_argument(
        "--link-mbit",
        type=float,
        required=True,
        help="Mbit/s one group can send to the others: its link between sites, shared by all "
        "its ranks",
    )
    parser.add_argument(
        "--groups",
        type=int,
        default=None,
        help="replica groups (default 2; with --sites, leave it out)",
    )
    parser.add_argument(
        "--sites",
        type=int,
        default=None,
        help="sites of --groups-per-site groups each: the sync runs among sites",
    )
    parser.add_argument(
        "--groups-per-site", type=int, default=1, help="replica groups per site (default 1)"
    )
    parser.add_argument("--site-gbit", type=float, default=100.0,
                        help="Gbit/s of a site's network per rank (default 100)")  # fmt: skip
    parser.add_argument(
        "--ranks-per-group",
        type=int,
        default=1,
        help="ranks (GPUs) of one group, each sending its own shard's buckets at once over the "
        "group's link (default 1)",
    )
    parser.add_argument("--sync-steps", type=int, default=None,
                        help="inner steps per sync to judge (default: suggest one)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.sites is not None:
        if args.groups is not None:
            parser.error("--groups: give --sites and --groups-per-site instead with sites")
        args.groups = args.sites
    elif args.groups_per_site > 1:
        parser.error("--groups-per-site: needs --sites")
    if args.groups is None:
        args.groups = 2
    if args.groups_per_site < 1:
        parser.error("--groups-per-site: must be >= 1")
    if args.site_gbit <= 0:
        parser.error("--site-gbit: must be > 0")
    for name in ("params", "step_s", "link_mbit"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')}: must be > 0")
    if args.groups < 2:
        what = "--sites: a sync needs at least 2 sites" if args.sites else "--groups"
        parser.error(f"{what}: a sync needs at least 2 groups" if what == "--groups" else what)
    if args.ranks_per_group < 1:
        parser.error("--ranks-per-group: must be >= 1")
    if args.sync_steps is not None and args.sync_steps < 1:
        parser.error("--sync-steps: must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = Plan(
        args.params,
        args.step_s,
        args.link_mbit,
        args.groups,
        args.sync_steps or 1,
        args.ranks_per_group,
        args.groups_per_site,
        args.site_gbit,
    )
    suggested = args.sync_steps is None
    if suggested:
        plan = dataclasses.replace(plan, sync_steps=steps_to_hide(plan, "int8"))
    print(report(plan, suggested))
    return 0


if __name__ == "__main__":
    sys.exit(main())
