"""The semi-sync planner's arithmetic, and its command line."""

from __future__ import annotations

import math

import pytest

from torchtitan.experiments.fault_tolerance import plan as planner
from torchtitan.experiments.fault_tolerance.plan import Plan, parse_count


def test_a_sync_sends_a_ring_all_reduce_of_the_encoded_pseudo_gradient() -> None:
    """8B parameters, 4 groups, 1 Gbit/s: fp32 sends 2 x 3/4 x 32 GB = 48 GB per group,
    384 s; int8 about a quarter plus its scales (4 bytes per 128 values)."""
    p = Plan(params=8e9, step_s=2.0, link_mbit=1000, groups=4, sync_steps=100)
    assert p.sync_bytes("float32") == pytest.approx(48e9)
    assert p.sync_s("float32") == pytest.approx(384.0)
    assert p.sync_bytes("int8") == pytest.approx(48e9 / 4 * (1 + 4 / 128))
    assert p.heal_s() == pytest.approx(8e9 * 20 * 8 / 1e9)  # 5 fp32 copies of the model


def test_sparse_sends_its_encoding_to_every_other_group() -> None:
    """An all-gather: (G - 1) x 120 bytes per 4,096 values, under int4's ring all-reduce up to
    36 groups and above it from 37."""
    for groups in (2, 4, 36, 37):
        p = Plan(params=8e9, step_s=2.0, link_mbit=1000, groups=groups, sync_steps=100)
        assert p.sync_bytes("sparse") == pytest.approx((groups - 1) * 8e9 * 120 / 4096)
        assert (p.sync_bytes("sparse") < p.sync_bytes("int4")) == (groups <= 36)
    two = Plan(params=8e9, step_s=2.0, link_mbit=1000, groups=2, sync_steps=100)
    assert two.sync_bytes("sparse") / two.sync_bytes("float32") < 0.01


def test_the_suggested_periods_hide_or_bound_the_sync() -> None:
    p = Plan(params=8e9, step_s=2.0, link_mbit=1000, groups=4, sync_steps=1)
    hide = planner.steps_to_hide(p, "int8")
    assert Plan(8e9, 2.0, 1000, 4, hide).hidden("int8")
    assert not Plan(8e9, 2.0, 1000, 4, hide - 1).hidden("int8")
    bounded = planner.steps_for_idle(p, "int8", idle=0.05)
    assert Plan(8e9, 2.0, 1000, 4, bounded).idle_share("int8") <= 0.05
    assert Plan(8e9, 2.0, 1000, 4, bounded - 1).idle_share("int8") > 0.05


def test_counts_read_as_users_write_them() -> None:
    assert parse_count("8B") == 8e9 and parse_count("125M") == 125e6
    assert parse_count("4.9e6") == 4.9e6 and parse_count("1000") == 1000


def test_the_command_prints_every_dtype_and_refuses_bad_values(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert planner.main(["--params", "8B", "--step-s", "2", "--link-mbit", "1000"]) == 0
    out = capsys.readouterr().out
    assert all(f"\n{d} " in out for d in ("float32", "bfloat16", "int8", "int4"))
    # 2 groups: 8e9 values x 1.03125 B = 66 Gbit, 66 s at 1 Gbit/s: 33 steps of 2 s
    assert "sync_steps 33 (suggested: hides an int8 sync)" in out
    with pytest.raises(SystemExit) as info:
        planner.main(["--params", "8B", "--step-s", "0", "--link-mbit", "1000"])
    assert info.value.code == 2


def test_the_collective_timeout_scales_with_the_ranks_sharing_the_link(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """8B, 4 groups, 1 Gbit/s: one 32 MiB float32 bucket takes 0.40 s with the link to itself;
    with 8 ranks each sending one at once, 3.2 s, and the suggested timeout (4x) follows."""
    one = Plan(8e9, 2.0, 1000, 4, 100, ranks_per_group=1)
    eight = Plan(8e9, 2.0, 1000, 4, 100, ranks_per_group=8)
    assert one.bucket_s() == pytest.approx(1.5 * 32 * 2**20 * 8 / 1e9)
    assert eight.bucket_s() == pytest.approx(8 * one.bucket_s())
    assert eight.bucket_s() == pytest.approx(3.2, abs=0.05)
    args = ["--params", "8B", "--step-s", "2", "--link-mbit", "1000", "--groups", "4"]
    assert planner.main([*args, "--ranks-per-group", "8"]) == 0
    out = capsys.readouterr().out
    assert "sync_collective_timeout_s >= 13 " in out
    assert "while each of the 8 rank(s) sends one" in out
    assert "4 replica groups of 8 rank(s), 1000 Mbit/s from each group" in out
    assert planner.main(args) == 0
    assert "sync_collective_timeout_s >= 2 " in capsys.readouterr().out


@pytest.mark.parametrize(
    "flag, value", [("--ranks-per-group", "0"), ("--ranks-per-group", "-2"), ("--groups", "0")]
)
def test_a_count_below_one_is_refused_with_a_usage_line(
    capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    """``--ranks-per-group 0`` would divide the link by zero: refused with argparse's usage
    and a line naming the flag (exit 2), not a ZeroDivisionError."""
    with pytest.raises(SystemExit) as info:
        planner.main(["--params", "8B", "--step-s", "2", "--link-mbit", "1000", flag, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ") and f"error: {flag}: " in err, err


def test_the_sync_quorum_timeout_covers_a_period_and_a_float32_sync(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A job sends float32 unless told otherwise: the quorum timeout suggested is 4 x (a
    period + a float32 sync), not a compressed sync's shorter time. 1B parameters, 2 groups,
    100 Mbit/s, 10 steps of 1 s: a float32 sync sends 4 GB (320 s); int8's would be 82 s."""
    args = ["--params", "1B", "--step-s", "1", "--link-mbit", "100", "--sync-steps", "10"]
    assert planner.main(args) == 0
    out = capsys.readouterr().out
    plan = Plan(1e9, 1.0, 100, 2, 10)
    expected = math.ceil(planner.HEADROOM * (plan.period_s + plan.sync_s("float32")))
    assert expected == 4 * (10 + 320)
    assert f"sync_quorum_timeout_s >= {expected} " in out
    assert plan.sync_s("int8") < plan.sync_s("float32") / 3


def test_sites_sync_among_sites_and_price_the_site_s_step_all_reduce(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With sites the slow link carries one payload per site (a ring among sites, whatever
    the groups per site), and each step's float32 gradient all-reduce among a site's groups
    goes over the site's network, each rank its shard."""
    sites = Plan(8e9, 2.0, 1000.0, 2, 33, ranks_per_group=8, groups_per_site=4)
    alone = Plan(8e9, 2.0, 1000.0, 2, 33, ranks_per_group=8)
    assert sites.sync_bytes("int8") == alone.sync_bytes("int8")
    # 2 (4 - 1) / 4 x 8e9 x 4 bytes / 8 ranks at 100 Gbit/s each: 0.48 s
    assert sites.step_allreduce_s() == pytest.approx(0.48)
    argv = ["--params", "8B", "--step-s", "2", "--link-mbit", "1000", "--sites", "2",
            "--groups-per-site", "4", "--ranks-per-group", "8"]  # fmt: skip
    assert planner.main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())  # the prose is wrapped
    assert "2 sites of 4 replica groups" in out and "480 ms at 100 Gbit/s per rank" in out
    for bad in (["--groups", "3"], []):
        with pytest.raises(SystemExit):
            planner.parse_args(["--params", "1B", "--step-s", "1", "--link-mbit", "10",
                             "--groups-per-site", "2", *bad])  # fmt: skip
