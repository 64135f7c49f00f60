"""Bad inputs as a new user would type them into ``./run_train.sh``: each run exits non-zero
with one error line that names the problem (tyro's usage box for command-line syntax), and no
Python traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration_tests.train_runs import SMALL, error_lines, run_train, train_env
from torchtitan.tools.events import EVENTS_FOLDER, read_events
from torchtitan.train import RUN_FAILED


def _fails_clearly(args: list[str], expected: list[str], env: dict[str, str] | None = None) -> str:
    result = run_train([*SMALL, "--training.steps=2", *args], env=env)
    out = result.stdout
    assert result.returncode != 0, out
    assert "Traceback" not in out, out
    for text in expected:
        assert text in out, (text, out)
    return out


def _one_error_line(out: str) -> str:
    lines = error_lines(out)
    assert len(lines) == 1, out
    return lines[0]


def test_missing_config_file(tmp_path: Path) -> None:
    out = _fails_clearly(
        [f"--job.dump_folder={tmp_path}"],
        ["job.config_file", "nope.toml"],
        env=train_env(CONFIG_FILE="nope.toml"),
    )
    assert "no such file" in _one_error_line(out)


def test_unknown_field(tmp_path: Path) -> None:
    out = _fails_clearly(
        [f"--job.dump_folder={tmp_path}", "--training.nope=1"], ["--training.nope"]
    )
    assert "Unrecognized options" in out


def test_wrong_type_on_the_command_line(tmp_path: Path) -> None:
    out = _fails_clearly(
        [f"--job.dump_folder={tmp_path}", "--training.steps=abc"], ["--training.steps", "abc"]
    )
    assert "Error parsing" in out


def test_zero_steps(tmp_path: Path) -> None:
    out = _fails_clearly([f"--job.dump_folder={tmp_path}", "--training.steps=0"], [])
    assert "training.steps: 0 is not allowed; must be >= 1" in _one_error_line(out)


def test_dataset_path_that_does_not_exist(tmp_path: Path) -> None:
    missing = "data/no_such_corpus.txt"  # relative, as typed; run_train.sh runs in the repo
    out = _fails_clearly(
        [
            f"--job.dump_folder={tmp_path}",
            "--training.dataset=local",
            f"--training.dataset_path={missing}",
        ],
        [],
    )
    line = _one_error_line(out)
    assert "training.dataset_path" in line and missing in line and "no such file" in line


def _garbage_checkpoint(dump: Path, step: int = 10) -> Path:
    folder = dump / "checkpoint" / f"step-{step}"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"this is not a checkpoint\n" * 4)
    (folder / "__0_0.distcp").write_bytes(bytes(range(256)) * 8)
    return folder


def test_checkpoint_folder_with_garbage(tmp_path: Path) -> None:
    folder = _garbage_checkpoint(tmp_path)
    out = _fails_clearly([f"--job.dump_folder={tmp_path}", "--checkpoint.enable"], [])
    line = _one_error_line(out)
    assert "CheckpointError" in line and str(folder) in line and ".metadata" in line
    assert "checkpoint.load_step" in line  # says how to get past it


def test_checkpoint_with_garbage_shards(tmp_path: Path) -> None:
    """A real checkpoint whose data files were overwritten: the metadata reads, the load fails."""
    dump = tmp_path / "run"
    args = [f"--job.dump_folder={dump}", "--checkpoint.enable", "--validation.enable=false"]
    first = run_train([*SMALL, "--training.steps=2", *args])
    assert first.returncode == 0, first.stdout
    folder = dump / "checkpoint" / "step-2"
    shards = list(folder.glob("*.distcp"))
    assert shards
    for shard in shards:
        shard.write_bytes(b"\0garbage" * 64)
    result = run_train([*SMALL, "--training.steps=4", *args])
    assert result.returncode != 0 and "Traceback" not in result.stdout, result.stdout
    line = _one_error_line(result.stdout)
    assert "CheckpointError" in line and str(folder) in line, line


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ('[training]\nsteps = "abc"\n', "training.steps: 'abc' is not allowed; expected int"),
        ("[training]\nnope = 1\n", "training.nope: 1 is not allowed; unknown key"),
        ("[training\nsteps = 1\n", "not valid TOML"),
    ],
    ids=["wrong-type", "unknown-key", "syntax"],
)
def test_bad_toml_file(tmp_path: Path, toml: str, expected: str) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(toml)
    out = _fails_clearly(
        [f"--job.dump_folder={tmp_path}"], [], env=train_env(CONFIG_FILE=str(config))
    )
    assert expected in _one_error_line(out)


SEMI_SYNC = "--job.custom_args_module=torchtitan.experiments.fault_tolerance.job_config"


@pytest.mark.parametrize(
    ("args", "field"),
    [
        # The short command line of the semi-sync experiment for 2 groups, without a
        # lighthouse (for one group it runs: test_ft_launcher.py).
        ([SEMI_SYNC, "--fault_tolerance.semi_sync_method=localsgd",
          "--fault_tolerance.group_size=2"],
         "fault_tolerance.semi_sync_method"),
        # A field that would do nothing: the outer optimizer's, with LocalSGD.
        ([SEMI_SYNC, "--fault_tolerance.enable", "--fault_tolerance.group_size=2",
          "--fault_tolerance.semi_sync_method=localsgd", "--fault_tolerance.outer_lr=0.5"],
         "fault_tolerance.outer_lr"),
    ],
    ids=["short-semi-sync-command", "outer-lr-with-localsgd"],
)  # fmt: skip
def test_semi_sync_combinations_that_cannot_work(
    tmp_path: Path, args: list[str], field: str
) -> None:
    result = run_train([*SMALL, f"--job.dump_folder={tmp_path}", *args])
    assert result.returncode == 2, result.stdout
    assert "Traceback" not in result.stdout
    line = _one_error_line(result.stdout)
    assert line.startswith(f"error: {field}: "), line
    if "short" in field or "semi_sync_method" in field:
        assert "./run_launcher.sh --groups 2" in line
        assert "TORCHFT_LIGHTHOUSE=" in line and "--fault_tolerance.replica_id=0" in line


def test_hub_dataset_that_cannot_be_reached(tmp_path: Path) -> None:
    """No network to the Hugging Face Hub (forced offline here): one line, exit 1."""
    out = _fails_clearly(
        [f"--job.dump_folder={tmp_path}", "--training.dataset=allenai/c4"],
        [],
        env=train_env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"),
    )
    line = _one_error_line(out)
    assert "training.dataset='allenai/c4'" in line, line
    assert len(out.strip().splitlines()) <= 3, out  # the job line, the model line, the error
    # The trainer was still being built: the failure is in the event file all the same.
    failed = read_events(tmp_path / EVENTS_FOLDER, RUN_FAILED)
    assert len(failed) == 1 and failed[0]["message"] in line, failed


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (["--parallelism.data_parallel_shard_degree=1"], {"NGPU": "2"},
         "parallelism.data_parallel_shard_degree: 1 is not allowed; this job has 2 rank(s)"),
        (["--training.dataset=local"], {}, "training.dataset: 'local' is not allowed"),
        (["--model.tokenizer_path=no/such/tokenizer.json"], {},
         "model.tokenizer_path: 'no/such/tokenizer.json' is not allowed; no such file"),
        # The 8B TOML as shipped (on CPU here; SMALL's flavor put back to the TOML's).
        (["--model.flavor=8B", "--training.device=cpu"],
         {"CONFIG_FILE": "torchtitan/models/llama3/train_configs/llama3_8b.toml"},
         "model.tokenizer_path: '' is not allowed; llama3 8B is the published shape"),
    ],
    ids=["shard-degree-1-with-2-ranks", "local-without-path", "missing-tokenizer", "8b-toml"],
)  # fmt: skip
def test_values_that_would_fail_later_are_refused_while_parsing(
    tmp_path: Path, args: list[str], env: dict[str, str], says: str
) -> None:
    """Exit 2 and one line, before any rank starts (these used to pass the parse and fail at
    start-up with exit 1, once per rank)."""
    result = run_train([*SMALL, f"--job.dump_folder={tmp_path}", *args], env=train_env(**env))
    assert result.returncode == 2, result.stdout
    assert "Traceback" not in result.stdout
    assert _one_error_line(result.stdout).startswith(f"error: {says}"), result.stdout
