"""The launcher's pieces that need no training job: arguments, where the groups' events are,
and acting on the steps they report."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from torchtitan.components.metrics import TRAIN_STEP
from torchtitan.experiments.fault_tolerance.launch import launcher, supervisor
from torchtitan.tools.cluster import REPO_ROOT
from torchtitan.tools.events import attach_event_file, detach_event_file
from torchtitan.tools.logging import logger


def test_parse_args_splits_train_args_and_kill_specs():
    args = launcher.parse_args(["--groups", "3", "--kill", "1@10", "--kill", "2@4", "--",
                                "--training.steps=40"])  # fmt: skip
    assert args.groups == 3 and args.kill == [(1, 10), (2, 4)]
    assert args.train_args == ["--training.steps=40"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--kill", "1-10"],
        ["--kill", "5@10"],
        ["--groups", "0"],
        ["--ngpu", "0"],
        ["--min-replicas", "3"],
    ],
)
def test_parse_args_rejects_bad_values(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        launcher.parse_args(["--groups", "2", *argv])
    assert exit_info.value.code == 2
    assert argv[0].lstrip("-").split("-")[0] in capsys.readouterr().err


def test_sites_give_the_groups_and_a_kill_names_a_group_of_a_site() -> None:
    args = launcher.parse_args(["--sites", "2", "--groups-per-site", "3", "--kill", "1:2@10",
                                "--kill", "4@3", "--", "--training.steps=40"])  # fmt: skip
    assert (args.groups, args.groups_per_site) == (6, 3)
    assert args.kill == [(5, 10), (4, 3)]  # group 2 of site 1 is replica 5


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--sites", "2", "--groups-per-site", "2", "--kill", "0:2@5"], "--kill"),
        (["--sites", "2", "--groups-per-site", "2", "--kill", "2:0@5"], "--kill"),
        (["--sites", "2", "--groups-per-site", "2", "--groups", "3"], "--groups"),
        (["--groups-per-site", "2"], "--groups-per-site needs --sites"),
        (["--sites", "0"], "--sites"),
        (["--sites", "2", "--groups-per-site", "0"], "--groups-per-site"),
    ],
)
def test_bad_sites_are_refused_naming_the_flag(argv: list[str], says: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        launcher.parse_args(argv)
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err


def test_a_group_of_a_site_is_started_with_its_site_and_its_sites_lighthouse(
    tmp_path: Path,
) -> None:
    from torchtitan.tools.cluster import LocalJob

    job = LocalJob(tmp_path, groups=4, groups_per_site=2, entry=["true"])
    job.lighthouse_address = "http://127.0.0.1:1"
    job.site_addresses = {0: "http://127.0.0.1:2", 1: "http://127.0.0.1:3"}
    try:
        argv = list(job.start_group(3).popen.args)
    finally:
        job.close()
    assert "--fault_tolerance.groups_per_site=2" in argv
    assert "--fault_tolerance.site_lighthouse=http://127.0.0.1:3" in argv
    assert "--fault_tolerance.group_size=4" in argv and "--fault_tolerance.replica_id=3" in argv


def test_the_groups_dump_folder_is_the_one_their_trainer_takes(tmp_path: Path) -> None:
    folder = supervisor.groups_dump_folder
    assert folder(["--job.dump_folder=/a", "--job.dump-folder", "/b"], env={}) == Path("/b")
    assert folder(["--job.dump_folder=out/x"], env={}) == REPO_ROOT / "out/x"
    # No flag: run_train.sh's TOML (the debug model's) says ./outputs.
    assert folder(["--training.steps=5"], env={}) == REPO_ROOT / "outputs"
    toml = tmp_path / "job.toml"
    toml.write_text('[job]\ndump_folder = "/from/toml"\n')
    assert folder([f"--job.config_file={toml}"], env={}) == Path("/from/toml")
    assert folder([], env={"CONFIG_FILE": str(toml)}) == Path("/from/toml")
    # A TOML the groups will reject: they say why; the launcher still starts them.
    assert folder(["--job.config_file=/missing.toml"], env={}) == REPO_ROOT / "outputs"


def test_kill_at_a_step_acts_on_the_step_events_of_the_latest_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The kind's name, without importing torch into the launcher.
    assert supervisor.STEP_EVENT == TRAIN_STEP.name
    args = launcher.parse_args(["--groups", "2", "--kill", "1@3", "--",
                                f"--job.dump_folder={tmp_path}"])  # fmt: skip
    run = supervisor.Supervisor(args, tmp_path / "logs")
    kills: list[tuple[int, str]] = []
    monkeypatch.setattr(run, "kill", lambda group, why: kills.append((group.replica_id, why)))
    group = run.groups[1]
    level = logger.level
    logger.setLevel(logging.INFO)  # emit() skips a kind whose level is not enabled
    try:

        def steps(*numbers: int) -> None:
            handler = attach_event_file(tmp_path, replica=1, rank=0)
            for step in numbers:
                TRAIN_STEP.emit(step=step, loss=5.0, grad_norm=1.0, memory_gib=0.4, tps=900.0,
                                tflops=0.01, mfu_pct=None, groups=2, color=True)  # fmt: skip
            detach_event_file(handler)

        steps(7, 8)  # an earlier start's (or an earlier job's): not this start's steps
        group.steps = run.step_events(group)
        run.read_steps(group)
        assert (group.steps_this_start, kills) == (0, [])
        steps(1, 2)
        run.read_steps(group)
        assert (group.last_step, group.steps_this_start, kills) == (2, 2, [])
        steps(3)
        run.read_steps(group)
        assert kills == [(1, "at step 3 (--kill)")]
        steps(4)
        run.read_steps(group)
        assert len(kills) == 1 and group.last_step == 4  # each --kill fires once
    finally:
        logger.setLevel(level)


def test_a_semi_sync_command_for_several_groups_without_a_lighthouse_is_still_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """group_size 2 and no TORCHFT_LIGHTHOUSE: two such commands must not each start a
    lighthouse and train apart, so nothing is run in place of it (the config's error stays)."""
    from torchtitan.experiments.fault_tolerance.launch.launcher import command_for_one_group

    semi_sync = [
        "--job.custom_args_module=torchtitan.experiments.fault_tolerance.job_config",
        "--fault_tolerance.semi_sync_method=diloco",
    ]
    assert command_for_one_group(semi_sync) is not None
    assert command_for_one_group([*semi_sync, "--fault_tolerance.group_size=2"]) is None
    assert command_for_one_group([*semi_sync, "--fault_tolerance.enable"]) is None
    assert command_for_one_group([*semi_sync[:1], "--fault_tolerance.semi_sync_method=x"]) is None
    assert command_for_one_group(semi_sync[:1]) is None  # synchronous FT: not semi-sync
    toml = tmp_path / "job.toml"
    toml.write_text('[fault_tolerance]\nsemi_sync_method = "localsgd"\nenable = true\n')
    assert command_for_one_group([semi_sync[0], f"--job.config_file={toml}"]) is None
    toml.write_text('[fault_tolerance]\nsemi_sync_method = "localsgd"\n')
    command = command_for_one_group([semi_sync[0], f"--job.config_file={toml}"])
    assert command is not None and command[-3:] == ["--", semi_sync[0], f"--job.config_file={toml}"]
    assert command[command.index("--groups") + 1] == "1"
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:29610")
    assert command_for_one_group(semi_sync) is None  # a lighthouse is named: join it


@pytest.mark.parametrize(
    ("visible", "args", "expected"),
    [
        ("0,1,2,3", ["--groups", "2", "--ngpu", "2"], ["0,1", "2,3"]),  # a GPU per rank
        ("4,5,6,7", ["--groups", "2"], ["4", "5"]),  # in CUDA_VISIBLE_DEVICES' order
        ("0", ["--groups", "2"], None),  # fewer GPUs than ranks: shared, with a note
        ("", ["--groups", "2"], None),  # no GPU: nothing set
        ("0,1,2,3", ["--groups", "2", "--gpus-per-group", "0"], None),  # asked to share
        ("0,1,2,3", ["--groups", "3", "--gpus-per-group", "1"], ["0", "1", "2"]),
    ],
)
def test_each_group_gets_gpus_of_its_own(
    monkeypatch: pytest.MonkeyPatch, visible: str, args: list[str], expected: list[str] | None
) -> None:
    """On a GPU machine the groups do not all land on cuda:0: the visible GPUs are split."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert launcher.parse_args([*args, "--", "--training.steps=1"]).group_devices == expected


def test_asking_for_more_gpus_than_there_are_is_an_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(SystemExit) as info:
        launcher.parse_args(["--groups", "2", "--gpus-per-group", "2"])
    assert info.value.code == 2
    assert "2 group(s) x 2 GPU(s) need 4 GPUs, 2 are visible" in capsys.readouterr().err


def test_a_group_start_gets_its_own_devices(tmp_path: Path) -> None:
    from torchtitan.tools.cluster import LocalJob

    job = LocalJob(tmp_path, groups=2, group_devices=["0,1", "2,3"])
    job.lighthouse_address = "http://127.0.0.1:1"
    assert [job.group_environment(r)["CUDA_VISIBLE_DEVICES"] for r in (0, 1)] == ["0,1", "2,3"]
    assert "CUDA_VISIBLE_DEVICES" not in LocalJob(tmp_path, groups=2).group_environment(0)


def test_help_is_never_run_elsewhere() -> None:
    """``--help`` on the short semi-sync command line prints this command's help."""
    from torchtitan.train import command_instead

    semi_sync = [
        "--job.custom_args_module=torchtitan.experiments.fault_tolerance.job_config",
        "--fault_tolerance.semi_sync_method=diloco",
    ]
    assert command_instead(semi_sync) is not None
    assert command_instead([*semi_sync, "--help"]) is None
    assert command_instead(["--training.steps=3"]) is None  # no custom module: nothing else


def test_a_custom_module_names_its_command_instead_by_path_and_is_told_when_it_cannot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``RUN_INSTEAD = "package.module:function"`` is called with the command line; a path
    that names nothing, or the function given directly (``run_instead``), is one error naming
    the field, not a command line run as typed."""
    from torchtitan.config import ConfigError
    from torchtitan.train import command_instead

    monkeypatch.syspath_prepend(str(tmp_path))
    cases = {
        "names_it": 'RUN_INSTEAD = "names_it:run"\ndef run(argv):\n    return ["echo", *argv]\n',
        "names_nothing": 'RUN_INSTEAD = "names_nothing:missing"\n',
        "no_such_module": 'RUN_INSTEAD = "no_such_module_anywhere:f"\n',
        "gives_a_function": "def run_instead(argv):\n    return ['echo']\n",
    }
    config = "import dataclasses\n\n@dataclasses.dataclass\nclass JobConfig:\n    pass\n"
    for name, text in cases.items():
        (tmp_path / f"{name}.py").write_text(config + text)
    flags = ["--training.steps=3"]
    assert command_instead(["--job.custom_args_module=names_it", *flags]) == [
        "echo",
        *(["--job.custom_args_module=names_it", *flags]),
    ]
    for name, expected in [
        ("names_nothing", "RUN_INSTEAD = 'names_nothing:missing' does not name anything"),
        ("no_such_module", "does not name anything (No module named 'no_such_module_anywhere')"),
        ("gives_a_function", "name that function instead, as RUN_INSTEAD"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(expected)) as raised:
            command_instead([f"--job.custom_args_module={name}", *flags])
        assert "job.custom_args_module" in str(raised.value)
