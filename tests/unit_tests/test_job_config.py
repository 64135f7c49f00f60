"""The config system: defaults < TOML < CLI, custom args modules, type checks, validation."""

from __future__ import annotations

import copy as copy_module
import dataclasses
import pickle
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.unit_tests.fresh_interpreter import run_python
from torchtitan.config import ConfigError, ConfigManager, JobConfig, merge_configs, write_toml
from torchtitan.config import job_config as core
from torchtitan.config.manager import parse_nested_list, to_toml

CUSTOM = "tests.assets.custom_args_module"


def parse(*argv: str) -> JobConfig:
    return ConfigManager().parse_args(list(argv))


def write(tmp_path: Path, text: str, name: str = "job.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# --- resolution order -------------------------------------------------------------------------


def test_no_arguments_give_the_dataclass_defaults() -> None:
    manager = ConfigManager()
    config = manager.parse_args([])
    assert config == JobConfig()
    assert manager.custom_module is None


def test_toml_overrides_defaults_with_either_flag_form(tmp_path: Path) -> None:
    path = write(tmp_path, '[training]\nsteps = 7\n[optimizer]\nname = "SGD"\nlr = 1\n')
    for argv in (["--job.config_file", path], [f"--job.config_file={path}"]):
        config = parse(*argv)
        assert config.training.steps == 7
        assert config.optimizer.name == "SGD"
        assert config.optimizer.lr == 1.0 and isinstance(config.optimizer.lr, float)
        assert config.job.config_file == path
        assert config.training.seq_len == JobConfig().training.seq_len


def test_cli_beats_toml(tmp_path: Path) -> None:
    path = write(tmp_path, "[training]\nsteps = 7\nseq_len = 64\n")
    config = parse("--training.steps=9", "--job.config_file", path)
    assert config.training.steps == 9
    assert config.training.seq_len == 64


def test_flag_names_accept_hyphens_and_none_for_optional_fields() -> None:
    config = parse("--training.local-batch-size=3", "--training.seed", "5")
    assert (config.training.local_batch_size, config.training.seed) == (3, 5)
    assert parse("--training.seed", "None").training.seed is None


def test_missing_config_file_names_the_path(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(FileNotFoundError, match="nope.toml"):
        parse("--job.config_file", missing)


# --- TOML errors ------------------------------------------------------------------------------


def test_unknown_toml_key_names_it_and_lists_the_allowed_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "[training]\nstepz = 5\n")
    with pytest.raises(ConfigError) as info:
        parse("--job.config_file", path)
    assert info.value.field == "training.stepz"
    assert "seq_len" in str(info.value) and "steps" in str(info.value)


def test_unknown_toml_section_names_it_and_lists_the_sections(tmp_path: Path) -> None:
    path = write(tmp_path, "[trainig]\nsteps = 5\n")
    with pytest.raises(ConfigError) as info:
        parse("--job.config_file", path)
    assert info.value.field == "trainig"
    assert "training" in str(info.value)


@pytest.mark.parametrize(
    ("section", "line", "field", "expected"),
    [
        ("training", 'steps = "ten"', "training.steps", "int"),
        ("training", "steps = 1.5", "training.steps", "int"),
        ("training", "deterministic = 1", "training.deterministic", "bool"),
        ("training", "steps = true", "training.steps", "int"),
        ("training", "dataset_path = 3", "training.dataset_path", "str"),
        ("optimizer", 'name = "Lion"', "optimizer.name", "'AdamW'"),
        ("optimizer", 'lr = "fast"', "optimizer.lr", "float"),
        ("checkpoint", "exclude_from_loading = [1]", "checkpoint.exclude_from_loading", "str"),
        (
            "checkpoint",
            'exclude_from_loading = "optimizer"',
            "checkpoint.exclude_from_loading",
            "list",
        ),
    ],
)
def test_wrong_type_in_toml_names_field_value_and_expected_type(
    tmp_path: Path, section: str, line: str, field: str, expected: str
) -> None:
    path = write(tmp_path, f"[{section}]\n{line}\n")
    with pytest.raises(ConfigError) as info:
        parse("--job.config_file", path)
    message = str(info.value)
    assert info.value.field == field
    assert message.startswith(f"{field}: ") and "\n" not in message
    assert expected in message


def test_section_that_is_not_a_table_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        parse("--job.config_file", write(tmp_path, "training = 3\n"))
    assert info.value.field == "training"


def test_invalid_toml_syntax_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse("--job.config_file", write(tmp_path, "[training\n"))


# --- CLI --------------------------------------------------------------------------------------


def test_unknown_cli_flag_exits_with_usage_error() -> None:
    with pytest.raises(SystemExit) as info:
        parse("--training.stepz=3")
    assert info.value.code == 2


def test_help_shows_the_dataclass_defaults_and_then_what_the_toml_sets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``(default: ...)`` is what a run without the TOML gets (python -m torchtitan.train,
    torchrun, Slurm); the TOML's values come after, as flags, under the file's name."""
    monkeypatch.setenv("COLUMNS", "400")
    path = write(tmp_path, "[training]\nsteps = 200\nseq_len = 256\n[validation]\nenable = true\n")
    with pytest.raises(SystemExit) as info:
        parse("--job.config_file", path, "--help")
    assert info.value.code == 0
    out = capsys.readouterr().out
    options, _, toml_part = out.partition(f"Values that {path} sets")
    assert "Number of training steps (optimizer steps). (default: 10000)" in options
    assert "Tokens per sequence. (default: 2048)" in options
    assert toml_part.splitlines()[1:] == [
        "  --training.steps=200",
        "  --training.seq_len=256",
        "  --validation.enable=true",
    ]


def test_help_prints_every_field_with_its_docstring(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # no wrapping inside the docstrings we look for
    with pytest.raises(SystemExit) as info:
        parse("--job.custom_args_module", CUSTOM, "--help")
    assert info.value.code == 0
    out = capsys.readouterr().out
    for config_cls in (core.Training, core.FaultTolerance, core.Checkpoint):
        for f in dataclasses.fields(config_cls):
            assert f"--{_section_of(config_cls)}.{f.name}" in out
    assert "Number of training steps (the custom module's own default)." in out
    assert "Sequences per batch on each data-parallel rank." in out
    assert "--training.my_extra_flag" in out
    assert "An extra switch added by the custom module." in out
    assert "--custom_section.fragments" in out
    assert "Module FQNs of each model fragment, one inner list per fragment." in out
    assert "A section that only the custom module has." in out


def _section_of(section_cls: type) -> str:
    return next(f.name for f in dataclasses.fields(JobConfig) if f.default_factory is section_cls)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], False),
        (["--checkpoint.enable"], True),
        (["--checkpoint.enable=true"], True),
        (["--checkpoint.enable=True"], True),
        (["--checkpoint.enable", "true"], True),
        (["--checkpoint.enable=false"], False),
        (["--checkpoint.enable", "False"], False),
        (["--checkpoint.enable", "--training.steps=3"], True),
    ],
)
def test_bool_flag_forms(argv: list[str], expected: bool) -> None:
    assert parse(*argv).checkpoint.enable is expected


def test_bool_flag_turns_off_a_true_default_and_rejects_other_words() -> None:
    field = "--checkpoint.initial_load_model_only"
    assert parse(f"{field}=false").checkpoint.initial_load_model_only is False
    assert parse(field).checkpoint.initial_load_model_only is True
    with pytest.raises(SystemExit) as info:
        parse(f"{field}=maybe")
    assert info.value.code == 2


def test_bare_fault_tolerance_enable_flag() -> None:
    config = parse("--fault_tolerance.enable", "--fault_tolerance.group_size=2")
    assert config.fault_tolerance.enable is True


# --- lists ------------------------------------------------------------------------------------


def test_list_field_from_toml_and_cli(tmp_path: Path) -> None:
    path = write(tmp_path, '[checkpoint]\nexclude_from_loading = ["optimizer"]\n')
    assert parse("--job.config_file", path).checkpoint.exclude_from_loading == ["optimizer"]
    config = parse("--job.config_file", path, "--checkpoint.exclude_from_loading", "a", "b")
    assert config.checkpoint.exclude_from_loading == ["a", "b"]
    config = parse("--job.config_file", path, "--checkpoint.exclude_from_loading")
    assert config.checkpoint.exclude_from_loading == []


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        (["layers.0,layers.1", "norm"], [["layers.0", "layers.1"], ["norm"]]),
        (['[["layers.0", "layers.1"], ["norm"]]'], [["layers.0", "layers.1"], ["norm"]]),
        (["a", ""], [["a"], []]),
        ([], []),
    ],
)
def test_nested_list_on_the_cli(tokens: list[str], expected: list[list[str]]) -> None:
    config = parse("--job.custom_args_module", CUSTOM, "--custom_section.fragments", *tokens)
    assert config.custom_section.fragments == expected


def test_nested_list_json_must_hold_lists_of_strings() -> None:
    with pytest.raises(ValueError, match="not a string"):
        parse_nested_list(['[["a", 1]]'])
    with pytest.raises(ValueError, match="list of lists"):
        parse_nested_list(['["a"]'])


def test_nested_list_from_toml_is_type_checked(tmp_path: Path) -> None:
    good = '[job]\ncustom_args_module = "%s"\n[custom_section]\nfragments = [["a", "b"], ["c"]]\n'
    assert parse("--job.config_file", write(tmp_path, good % CUSTOM)).custom_section.fragments == [
        ["a", "b"],
        ["c"],
    ]
    bad = good.replace('["c"]', "[3]") % CUSTOM
    with pytest.raises(ConfigError) as info:
        parse("--job.config_file", write(tmp_path, bad))
    assert info.value.field == "custom_section.fragments"


# --- custom args module -----------------------------------------------------------------------


def test_custom_module_fields_from_toml_and_cli(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        f'[job]\ncustom_args_module = "{CUSTOM}"\n'
        "[training]\nmy_extra_flag = true\nseq_len = 32\n"
        '[custom_section]\nhow_many = 5\nlabel = "from-toml"\n',
    )
    manager = ConfigManager()
    config = manager.parse_args(["--job.config_file", path, "--custom_section.label=cli"])
    assert manager.custom_module is not None and manager.custom_module.__name__ == CUSTOM
    assert config.training.my_extra_flag is True  # type: ignore[attr-defined]
    assert config.training.seq_len == 32
    assert config.training.steps == 42  # the custom module's default for an overridden field
    assert config.custom_section.how_many == 5  # type: ignore[attr-defined]
    assert config.custom_section.label == "cli"  # type: ignore[attr-defined]
    assert isinstance(config, JobConfig)
    assert isinstance(config.training, core.Training)
    assert isinstance(config.training, manager.custom_module.Training)
    assert config.to_dict()["custom_section"]["fragments"] == [["layers.0"], ["layers.1"]]


def test_custom_module_flag_on_cli_and_its_fields_on_cli() -> None:
    config = parse(f"--job.custom_args_module={CUSTOM}", "--training.my_extra_flag")
    assert config.training.my_extra_flag is True  # type: ignore[attr-defined]


def test_custom_fields_are_unknown_without_the_module(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        parse("--training.my_extra_flag")
    with pytest.raises(ConfigError) as info:
        parse("--job.config_file", write(tmp_path, "[custom_section]\nhow_many = 1\n"))
    assert info.value.field == "custom_section"


def test_custom_validate_runs_and_keeps_core_checks() -> None:
    with pytest.raises(ConfigError) as info:
        parse("--job.custom_args_module", CUSTOM, "--training.steps=0")
    assert info.value.field == "training.steps"
    with pytest.raises(ConfigError) as info:
        parse(
            "--job.custom_args_module", CUSTOM, "--training.my_extra_flag", "--training.steps=2000"
        )
    assert info.value.field == "training.my_extra_flag"
    with pytest.raises(ConfigError) as info:
        parse("--job.custom_args_module", CUSTOM, "--custom_section.how_many=-1")
    assert info.value.field == "custom_section.how_many"


def test_unimportable_custom_module_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        parse("--job.custom_args_module=tests.assets.no_such_module")
    assert info.value.field == "job.custom_args_module"


@dataclass
class _SubclassedFaultTolerance(core.FaultTolerance):
    sync_steps: int = 10
    """Inner steps between syncs."""


@dataclass
class _PlainSection:
    knob: float = 0.5


@dataclass
class _CustomJobConfig:
    fault_tolerance: _SubclassedFaultTolerance = field(default_factory=_SubclassedFaultTolerance)
    compile: _PlainSection = field(default_factory=_PlainSection)


def test_merge_configs_keeps_types_methods_and_is_stable() -> None:
    merged = merge_configs(JobConfig, _CustomJobConfig)
    assert merge_configs(JobConfig, _CustomJobConfig) is merged
    config = merged()
    assert isinstance(config, JobConfig) and isinstance(config, _CustomJobConfig)
    # A section that subclasses ours is used as it is; a plain one is combined with ours.
    assert type(config.fault_tolerance) is _SubclassedFaultTolerance
    assert isinstance(config.compile, core.Compile) and isinstance(config.compile, _PlainSection)
    assert (config.compile.enable, config.compile.knob) == (False, 0.5)  # type: ignore[attr-defined]
    assert callable(config.fault_tolerance.validate)
    assert config.to_dict()["fault_tolerance"]["sync_steps"] == 10
    assert [f.name for f in dataclasses.fields(merged)] == [
        f.name for f in dataclasses.fields(JobConfig)
    ]


def test_merged_config_pickles_and_copies_as_itself() -> None:
    config = parse("--job.custom_args_module", CUSTOM, "--custom_section.label=x")
    for copy in (pickle.loads(pickle.dumps(config)), copy_module.deepcopy(config)):
        assert type(copy) is type(config) and type(copy.training) is type(config.training)
        assert copy == config


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--training.steps=0"], "training.steps"),
        (["--training.local_batch_size=0"], "training.local_batch_size"),
        (["--training.seq_len=0"], "training.seq_len"),
        (["--training.max_norm=-1"], "training.max_norm"),
        (["--training.dataset_path=/no/such/dir"], "training.dataset_path"),
        (["--optimizer.lr=0"], "optimizer.lr"),
        (["--lr_scheduler.warmup_steps=-1"], "lr_scheduler.warmup_steps"),
        (["--lr_scheduler.decay_ratio=1.5"], "lr_scheduler.decay_ratio"),
        (["--lr_scheduler.min_lr_factor=2"], "lr_scheduler.min_lr_factor"),
        (["--checkpoint.interval=0"], "checkpoint.interval"),
        (["--checkpoint.keep_latest_k=-1"], "checkpoint.keep_latest_k"),
        (["--metrics.log_freq=0"], "metrics.log_freq"),
        (["--validation.freq=0"], "validation.freq"),
        (["--validation.steps=0"], "validation.steps"),
        (["--parallelism.data_parallel_shard_degree=0"], "parallelism.data_parallel_shard_degree"),
        (["--model.name=gpt9"], "model.name"),
        (["--model.flavor=huge"], "model.flavor"),
        (["--model.tokenizer_path=/no/such/tokenizer.json"], "model.tokenizer_path"),
        (["--model.flavor=8B"], "model.tokenizer_path"),  # the 8B shape needs its tokenizer
        (["--training.dataset=local"], "training.dataset"),  # local files, but no path
        (["--validation.dataset=local"], "validation.dataset"),
        (["--fault_tolerance.enable"], "fault_tolerance.group_size"),
        (
            [
                "--fault_tolerance.enable",
                "--fault_tolerance.group_size=2",
                "--fault_tolerance.replica_id=2",
            ],
            "fault_tolerance.replica_id",
        ),
        (
            [
                "--fault_tolerance.enable",
                "--fault_tolerance.group_size=2",
                "--fault_tolerance.min_replica_size=3",
            ],
            "fault_tolerance.min_replica_size",
        ),
        (
            [
                "--fault_tolerance.enable",
                "--fault_tolerance.group_size=1",
                "--fault_tolerance.quorum_timeout_s=0",
            ],
            "fault_tolerance.quorum_timeout_s",
        ),
    ],
)
def test_bad_value_raises_config_error_naming_the_field(argv: list[str], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(*argv)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ") and "is not allowed; " in str(info.value)


@pytest.mark.parametrize(("world_size", "degree", "ok"), [
    ("1", "-1", True), ("1", "1", True), ("2", "-1", True), ("2", "2", True),
    ("2", "1", False), ("1", "2", False),
])  # fmt: skip
def test_the_shard_degree_is_checked_against_the_job_size_at_parse_time(
    monkeypatch: pytest.MonkeyPatch, world_size: str, degree: str, ok: bool
) -> None:
    """``WORLD_SIZE`` (torchrun's; run_train.sh sets it to NGPU for its check): FSDP2 shards
    over every rank of the job, so 1 with 2 ranks is refused while parsing, not at start-up."""
    monkeypatch.setenv("WORLD_SIZE", world_size)
    if ok:
        parse(f"--parallelism.data_parallel_shard_degree={degree}")
        return
    with pytest.raises(ConfigError, match=f"this job has {world_size} rank"):
        parse(f"--parallelism.data_parallel_shard_degree={degree}")


def test_torchft_timeout_variables_are_refused_naming_the_field(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """They would change only the timeouts torchft picks itself; the field is the one way."""
    monkeypatch.setenv("TORCHFT_QUORUM_TIMEOUT_SEC", "120")
    with pytest.raises(ConfigError) as info:
        parse("--fault_tolerance.enable", "--fault_tolerance.group_size=2")
    assert info.value.field == "fault_tolerance.quorum_timeout_s"
    assert "TORCHFT_QUORUM_TIMEOUT_SEC=120" in str(info.value)
    parse()  # fault tolerance off: nothing reads it


def test_published_shapes_need_their_tokenizer_and_get_it(tmp_path: Path) -> None:
    """8B with a tokenizer file passes; the 1B flavor runs with the byte tokenizer on purpose."""
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("{}")
    assert parse("--model.flavor=8B", f"--model.tokenizer_path={tokenizer}").model.flavor == "8B"
    assert parse("--model.flavor=1B").model.tokenizer_path == ""


def test_allowed_edge_values_pass() -> None:
    config = parse(
        "--validation.steps=-1",
        "--lr_scheduler.decay_ratio=0",
        "--lr_scheduler.min_lr_factor=1",
        "--training.max_norm=0",
        "--checkpoint.keep_latest_k=0",
        "--fault_tolerance.group_size=0",  # not checked while fault tolerance is off
    )
    assert config.validation.steps == -1


def test_unknown_model_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="llama3"):
        parse("--model.name=gpt9")


def test_unknown_flavor_lists_the_flavors_of_the_family() -> None:
    with pytest.raises(ConfigError, match="flavors of 'llama3': debugmodel, debugmodel_small"):
        parse("--model.flavor=huge")


def test_parsing_a_config_does_not_import_the_models() -> None:
    """The config names models without importing them: no config <-> models import circle,
    and a config parses without torch's start-up cost. A fresh interpreter shows it."""
    check = (
        "import sys\n"
        "import torchtitan.config\n"
        "from torchtitan.config import ConfigManager\n"
        "ConfigManager().parse_args(['--model.flavor=debugmodel_small'])\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('torchtitan.models'))\n"
        "assert not loaded, loaded\n"
    )
    result = run_python(check)
    assert result.returncode == 0, result.stderr


def test_a_semi_sync_config_without_fragments_parses_without_torch() -> None:
    """The experiment's checks build the model (on meta) only to check fragments against it:
    ``run_train.sh``'s check of a multi-rank DiLoCo group before torchrun stays cheap."""
    check = (
        "import sys\n"
        "from torchtitan.config import ConfigManager\n"
        "args = ['--job.custom_args_module=torchtitan.experiments.fault_tolerance.job_config',\n"
        "        '--fault_tolerance.semi_sync_method=diloco', '--fault_tolerance.enable',\n"
        "        '--fault_tolerance.group_size=2', '--fault_tolerance.replica_id=0']\n"
        "ConfigManager().parse_args(args)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "ConfigManager().parse_args([*args, '--fault_tolerance.num_fragments=2',\n"
        "                            '--fault_tolerance.sync_steps=4'])\n"
        "assert 'torch' in sys.modules, 'fragments not checked against the model'\n"
    )
    result = run_python(check)
    assert result.returncode == 0, result.stderr


def test_cuda_without_cuda_is_rejected() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError) as info:
        parse("--training.device=cuda")
    assert info.value.field == "training.device"
    with pytest.raises(ConfigError) as info:
        parse(
            "--fault_tolerance.enable",
            "--fault_tolerance.group_size=1",
            "--fault_tolerance.process_group=nccl",
        )
    assert info.value.field == "fault_tolerance.process_group"


# --- to_dict and TOML round trip --------------------------------------------------------------


def test_to_dict_is_nested_plain_values_without_none() -> None:
    data = JobConfig().to_dict()
    assert data["training"]["steps"] == JobConfig().training.steps
    assert data["checkpoint"]["exclude_from_loading"] == []
    assert "seed" not in data["training"]  # None is left out (TOML has no null)
    assert set(data) == {f.name for f in dataclasses.fields(JobConfig)}


def test_written_toml_loads_back_to_an_equal_config(tmp_path: Path) -> None:
    config = parse(
        "--job.custom_args_module",
        CUSTOM,
        '--job.description=quotes " and \\ and\nnewline',
        "--training.seed=3",
        "--optimizer.lr=1e-05",
        "--lr_scheduler.decay_ratio=0.25",
        "--checkpoint.exclude_from_loading",
        "optimizer",
        "dataloader",
        "--custom_section.fragments",
        "a,b",
        "c",
        "--training.my_extra_flag",
    )
    path = write_toml(config, tmp_path / "out" / "config.toml")
    assert tomllib.loads(path.read_text()) == config.to_dict()
    manager = ConfigManager()
    loaded = manager.parse_args(["--job.config_file", str(path)])
    assert manager.custom_module is not None  # found in the file's [job] table
    # The only difference: job.config_file now names the file that was read.
    assert loaded.job.config_file == str(path)
    assert dataclasses.replace(loaded, job=config.job) == config


def test_to_toml_writes_special_floats_and_keys() -> None:
    config = dataclasses.replace(
        JobConfig(), metrics=dataclasses.replace(JobConfig().metrics, cpu_peak_flops=float("inf"))
    )
    assert tomllib.loads(to_toml(config))["metrics"]["cpu_peak_flops"] == float("inf")


# =============================================================================================
# The semi-sync experiment's custom args module (torchtitan.experiments.fault_tolerance)
# =============================================================================================

SEMI_SYNC = "torchtitan.experiments.fault_tolerance.job_config"
FT_ON = ("--fault_tolerance.enable", "--fault_tolerance.group_size=2")


def parse_semi_sync(*argv: str) -> JobConfig:
    return parse("--job.custom_args_module", SEMI_SYNC, *argv)


def test_semi_sync_fields_from_toml_and_cli(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        f'[job]\ncustom_args_module = "{SEMI_SYNC}"\n'
        '[model]\nflavor = "debugmodel_small"\n'
        "[fault_tolerance]\nenable = true\ngroup_size = 2\n"
        'semi_sync_method = "diloco"\nsync_steps = 6\nouter_lr = 0.5\n'
        'module_fqns_per_model_fragment = [["tok_embeddings", "layers.0"], ["layers.1"]]\n'
        "fragment_sync_delay = 2\nfragment_update_alpha = 0.25\n",
    )
    ft = parse("--job.config_file", path, "--fault_tolerance.outer_momentum=0.5").fault_tolerance
    assert (ft.semi_sync_method, ft.sync_steps, ft.outer_lr, ft.outer_momentum) == (
        "diloco",
        6,
        0.5,
        0.5,
    )
    assert ft.module_fqns_per_model_fragment == [["tok_embeddings", "layers.0"], ["layers.1"]]
    assert (ft.fragment_sync_delay, ft.fragment_update_alpha) == (2, 0.25)
    assert ft.fragment_count() == 2  # type: ignore[attr-defined]
    cli = parse_semi_sync(
        *FT_ON,
        "--fault_tolerance.semi_sync_method=diloco",
        "--fault_tolerance.sync_steps=4",
        "--fault_tolerance.num_fragments=2",
        "--fault_tolerance.fragment_sync_delay=1",
        "--fault_tolerance.fragment_update_alpha=0.5",
        "--fault_tolerance.outer_nesterov=false",
    ).fault_tolerance
    assert (cli.num_fragments, cli.fragment_sync_delay, cli.fragment_update_alpha) == (2, 1, 0.5)
    assert cli.outer_nesterov is False


def test_semi_sync_module_picks_the_trainer_by_the_method() -> None:
    from torchtitan.experiments.fault_tolerance.trainer import SemiSyncTrainer
    from torchtitan.train import resolve_trainer_class
    from torchtitan.trainer import Trainer

    manager = ConfigManager()
    config = manager.parse_args(["--job.custom_args_module", SEMI_SYNC])
    assert config.fault_tolerance.method is None  # type: ignore[attr-defined]  # synchronous
    assert resolve_trainer_class(manager.custom_module, config) is Trainer
    config = manager.parse_args(
        ["--job.custom_args_module", SEMI_SYNC, *FT_ON, "--fault_tolerance.semi_sync_method=diloco"]
    )
    assert resolve_trainer_class(manager.custom_module, config) is SemiSyncTrainer


def test_semi_sync_trainer_without_a_method_is_refused_not_run_synchronously() -> None:
    from torchtitan.experiments.fault_tolerance.trainer import SemiSyncTrainer

    config = parse_semi_sync(*FT_ON)  # synchronous FT: the core Trainer's job
    with pytest.raises(ConfigError) as info:
        SemiSyncTrainer(config)
    assert info.value.field == "fault_tolerance.semi_sync_method"
    assert "core Trainer" in str(info.value)


def test_semi_sync_help_lists_every_field_with_its_docstring(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchtitan.experiments.fault_tolerance import job_config as semi_sync

    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit) as info:
        parse("--job.custom_args_module", SEMI_SYNC, "--help")
    assert info.value.code == 0
    out = capsys.readouterr().out
    for f in dataclasses.fields(semi_sync.FaultTolerance):
        assert f"--fault_tolerance.{f.name}" in out
    flat = " ".join(out.split())
    docstrings = _field_docstrings(semi_sync.FaultTolerance)
    assert set(docstrings) >= {"sync_steps", "fragment_update_alpha", "dynamic_local_steps"}
    for name, text in docstrings.items():
        first_line = " ".join(text.splitlines()[0].split())
        assert first_line in flat, f"{name}'s docstring is not in --help: {first_line!r}"


def _field_docstrings(cls: type) -> dict[str, str]:
    """The docstring under each field of the dataclass ``cls`` (as tyro reads them)."""
    import ast
    import inspect
    import itertools
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(body, ast.ClassDef)
    found = {}
    for node, after in itertools.pairwise(body.body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            found[node.target.id] = after.value.value
    return found


def test_a_straggler_is_emulated_without_fault_tolerance_too() -> None:
    """``training.emulate_slowdown`` is the core's: a baseline without fault tolerance runs as
    slowly as its semi-sync partner."""
    assert parse("--training.emulate_slowdown=2").training.emulate_slowdown == 2.0
    assert parse_semi_sync("--training.emulate_slowdown=2").training.emulate_slowdown == 2.0


@pytest.mark.parametrize("alias", ["localsgd", "local_sgd"])
def test_local_sgd_is_an_alias(alias: str) -> None:
    ft = parse_semi_sync(*FT_ON, f"--fault_tolerance.semi_sync_method={alias}").fault_tolerance
    assert ft.method == "localsgd"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (
            ["--fault_tolerance.semi_sync_method=diloco"],  # fault tolerance off
            "fault_tolerance.semi_sync_method",
        ),
        (
            [*FT_ON, "--fault_tolerance.semi_sync_method=diloco", "--fault_tolerance.sync_steps=0"],
            "fault_tolerance.sync_steps",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=diloco",
                "--fault_tolerance.sync_steps=5",
                "--fault_tolerance.num_fragments=2",
            ],
            "fault_tolerance.sync_steps",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=diloco",
                "--fault_tolerance.sync_steps=4",
                "--fault_tolerance.num_fragments=2",
                "--fault_tolerance.fragment_sync_delay=2",
            ],
            "fault_tolerance.fragment_sync_delay",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=diloco",
                "--fault_tolerance.fragment_sync_delay=-1",
            ],
            "fault_tolerance.fragment_sync_delay",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=diloco",
                "--fault_tolerance.fragment_update_alpha=1.5",
            ],
            "fault_tolerance.fragment_update_alpha",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=diloco",
                "--fault_tolerance.fragment_update_alpha=-0.1",
            ],
            "fault_tolerance.fragment_update_alpha",
        ),
        (
            [
                *FT_ON,
                "--model.flavor=debugmodel_small",  # 2 transformer blocks
                "--fault_tolerance.semi_sync_method=diloco",
                "--fault_tolerance.sync_steps=6",
                "--fault_tolerance.num_fragments=3",
            ],
            "fault_tolerance.num_fragments",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=diloco",
                "--fault_tolerance.num_fragments=0",
            ],
            "fault_tolerance.num_fragments",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=diloco",
                "--fault_tolerance.sync_steps=4",
                "--fault_tolerance.module_fqns_per_model_fragment",
                "tok_embeddings,layers.0",
                "layers.7",
            ],
            "fault_tolerance.module_fqns_per_model_fragment",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=diloco",
                "--fault_tolerance.sync_steps=4",
                "--fault_tolerance.module_fqns_per_model_fragment",
                "layers",
                "layers.1",
            ],
            "fault_tolerance.module_fqns_per_model_fragment",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=diloco",
                "--fault_tolerance.sync_steps=4",
                "--fault_tolerance.module_fqns_per_model_fragment",
                "layers.0",
                "",
            ],
            "fault_tolerance.module_fqns_per_model_fragment",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=diloco",
                "--fault_tolerance.num_fragments=2",
                "--fault_tolerance.module_fqns_per_model_fragment",
                "layers.0",
                "layers.1",
            ],
            "fault_tolerance.num_fragments",
        ),
        (
            [*FT_ON, "--fault_tolerance.semi_sync_method=diloco", "--fault_tolerance.outer_lr=0"],
            "fault_tolerance.outer_lr",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=diloco",
                "--fault_tolerance.outer_momentum=1",
            ],
            "fault_tolerance.outer_momentum",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=localsgd",
                "--fault_tolerance.num_fragments=2",
            ],
            "fault_tolerance.num_fragments",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=localsgd",
                "--fault_tolerance.fragment_update_alpha=0.5",
            ],
            "fault_tolerance.fragment_update_alpha",
        ),
        # Fields that would do nothing: semi-sync fields without a method, the outer
        # optimizer's and quantization with LocalSGD.
        ([*FT_ON, "--fault_tolerance.sync_steps=20"], "fault_tolerance.sync_steps"),
        (["--fault_tolerance.outer_lr=0.5"], "fault_tolerance.outer_lr"),
        ([*FT_ON, "--fault_tolerance.num_fragments=2"], "fault_tolerance.num_fragments"),
        (
            [*FT_ON, "--fault_tolerance.sync_quorum_timeout_s=60"],
            "fault_tolerance.sync_quorum_timeout_s",
        ),
        (
            [*FT_ON, "--fault_tolerance.semi_sync_method=localsgd", "--fault_tolerance.outer_lr=1"],
            "fault_tolerance.outer_lr",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=localsgd",
                "--fault_tolerance.outer_momentum=0",
            ],
            "fault_tolerance.outer_momentum",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=localsgd",
                "--fault_tolerance.outer_nesterov=false",
            ],
            "fault_tolerance.outer_nesterov",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=diloco",
                "--fault_tolerance.sync_quorum_timeout_s=0",
            ],
            "fault_tolerance.sync_quorum_timeout_s",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=diloco",
                "--fault_tolerance.agreement_check_every=-1",
            ],
            "fault_tolerance.agreement_check_every",
        ),
        (
            [*FT_ON, "--fault_tolerance.max_consecutive_failures=-1"],
            "fault_tolerance.max_consecutive_failures",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=diloco",
                "--fault_tolerance.async_update=delayed",
            ],
            "fault_tolerance.async_update",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=localsgd",
                "--fault_tolerance.outer_state_device=device",
            ],
            "fault_tolerance.outer_state_device",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=async_diloco",
                "--fault_tolerance.num_fragments=2",
                "--fault_tolerance.sync_steps=4",
                "--fault_tolerance.fragment_sync_delay=1",
            ],
            "fault_tolerance.fragment_sync_delay",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=async_diloco",
                "--fault_tolerance.fragment_update_alpha=0.5",
            ],
            "fault_tolerance.fragment_update_alpha",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=diloco",
                "--fault_tolerance.dynamic_local_steps",
            ],
            "fault_tolerance.dynamic_local_steps",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=async_diloco",
                "--fault_tolerance.dynamic_local_steps",
                "--fault_tolerance.sync_steps=6",
                "--training.steps=10",
            ],
            "fault_tolerance.dynamic_local_steps",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=localsgd",
                "--training.emulate_slowdown=0.5",
            ],
            "training.emulate_slowdown",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=async_diloco",
                "--fault_tolerance.outer_momentum_every=0",
            ],
            "fault_tolerance.outer_momentum_every",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=localsgd",
                "--fault_tolerance.pseudo_grad_dtype=int8",
            ],
            "fault_tolerance.pseudo_grad_dtype",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=diloco",
                "--fault_tolerance.error_feedback",
            ],
            "fault_tolerance.error_feedback",
        ),
        (
            [*FT_ON, "--fault_tolerance.pseudo_grad_dtype=int4"],
            "fault_tolerance.pseudo_grad_dtype",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=async_diloco",
                "--fault_tolerance.outer_momentum_every=4",
                "--fault_tolerance.outer_momentum=0",
            ],
            "fault_tolerance.outer_momentum_every",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=diloco",
                "--fault_tolerance.outer_momentum_every=4",
            ],
            "fault_tolerance.outer_momentum_every",
        ),
        (  # Delayed Nesterov with momentum but without Nesterov
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=async_diloco",
                "--fault_tolerance.outer_momentum_every=2",
                "--fault_tolerance.outer_momentum=0.9",
                "--fault_tolerance.outer_nesterov=false",
            ],
            "fault_tolerance.outer_momentum_every",
        ),
        (  # sparse without error feedback would drop 98 % of every pseudo-gradient for good
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=diloco",
                "--fault_tolerance.pseudo_grad_dtype=sparse",
            ],
            "fault_tolerance.pseudo_grad_dtype",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=localsgd",
                "--fault_tolerance.pseudo_grad_dtype=sparse",
            ],
            "fault_tolerance.pseudo_grad_dtype",
        ),
        (
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=diloco",
                "--fault_tolerance.pseudo_grad_dtype=int4",
                "--fault_tolerance.sparse_keep=32",
            ],
            "fault_tolerance.sparse_keep",
        ),
        (  # sparse's residual decay takes the place of outer momentum
            [
                *FT_ON,
                "--fault_tolerance.semi_sync_method=diloco",
                "--fault_tolerance.pseudo_grad_dtype=sparse",
                "--fault_tolerance.error_feedback",
            ],
            "fault_tolerance.outer_momentum",
        ),
        *(
            (
                [
                    *FT_ON,
                    "--fault_tolerance.semi_sync_method=async_diloco",
                    "--fault_tolerance.pseudo_grad_dtype=sparse",
                    "--fault_tolerance.error_feedback",
                    "--fault_tolerance.outer_momentum=0",
                    flag,
                ],
                f"fault_tolerance.{flag.split('=')[0].removeprefix('--fault_tolerance.')}",
            )
            for flag in (
                "--fault_tolerance.sparse_chunk=1",
                "--fault_tolerance.sparse_chunk=65537",
                "--fault_tolerance.sparse_keep=0",
                "--fault_tolerance.sparse_keep=4097",
                "--fault_tolerance.sparse_value_bits=0",
                "--fault_tolerance.sparse_value_bits=5",
                "--fault_tolerance.sparse_residual_decay=0",
                "--fault_tolerance.sparse_residual_decay=1.5",
            )
        ),
    ],
)
def test_semi_sync_bad_value_names_the_field(argv: list[str], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_semi_sync(*argv)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ") and "is not allowed; " in str(info.value)


@pytest.mark.parametrize(
    ("field", "value", "choices"),
    [
        ("semi_sync_method", "sgd", ["localsgd", "local_sgd", "diloco", "async_diloco"]),
        ("async_update", "late", ["eager", "eager_share", "delayed"]),
        ("outer_state_device", "gpu", ["cpu", "device"]),
        ("pseudo_grad_dtype", "int2", ["float32", "bfloat16", "int8", "int4", "sparse"]),
    ],
)
def test_a_value_outside_a_fields_choices_is_refused_naming_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, value: str, choices: list[str]
) -> None:
    """On the command line (tyro: exit status 2) and in a TOML (ConfigError), the message names
    the field and every choice; the choices are the field's Literal, written once."""
    method = [] if field == "semi_sync_method" else ["--fault_tolerance.semi_sync_method=diloco"]
    with pytest.raises(SystemExit) as exit_info:
        parse_semi_sync(*FT_ON, *method, f"--fault_tolerance.{field}={value}")
    assert exit_info.value.code == 2
    said = " ".join(capsys.readouterr().err.split())
    assert f"--fault_tolerance.{field}" in said and all(repr(c) in said for c in choices), said
    path = write(
        tmp_path,
        f'[job]\ncustom_args_module = "{SEMI_SYNC}"\n'
        f'[fault_tolerance]\nenable = true\ngroup_size = 2\n{field} = "{value}"\n',
    )
    with pytest.raises(ConfigError) as info:
        parse("--job.config_file", str(path))
    assert info.value.field == f"fault_tolerance.{field}"
    assert all(repr(c) in str(info.value) for c in choices), str(info.value)


def test_async_diloco_parses_with_its_fields() -> None:
    config = parse_semi_sync(
        *FT_ON,
        "--fault_tolerance.semi_sync_method=async_diloco",
        "--fault_tolerance.async_update=delayed",
        "--fault_tolerance.outer_state_device=device",
        "--fault_tolerance.num_fragments=2",
        "--fault_tolerance.sync_steps=4",
        "--fault_tolerance.dynamic_local_steps",
        "--training.emulate_slowdown=1.5",
        "--fault_tolerance.outer_momentum_every=3",
        "--training.steps=12",
    )
    ft = config.fault_tolerance
    assert (ft.method, ft.async_update, ft.outer_state_device) == (  # type: ignore[attr-defined]
        "async_diloco",
        "delayed",
        "device",
    )
    assert ft.dynamic_local_steps and config.training.emulate_slowdown == 1.5  # type: ignore[attr-defined]
    assert ft.outer_momentum_every == 3  # type: ignore[attr-defined]


def test_semi_sync_edge_values_pass() -> None:
    ft = parse_semi_sync(
        *FT_ON,
        "--model.flavor=debugmodel_small",
        "--fault_tolerance.semi_sync_method=diloco",
        "--fault_tolerance.sync_steps=6",
        "--fault_tolerance.num_fragments=2",  # = number of blocks
        "--fault_tolerance.fragment_sync_delay=2",  # = sync_steps / fragments - 1
        "--fault_tolerance.fragment_update_alpha=1",
        "--fault_tolerance.outer_momentum=0",
    ).fault_tolerance
    assert (ft.num_fragments, ft.fragment_sync_delay, ft.fragment_update_alpha) == (2, 2, 1.0)
    # A single FQN list, or one naming a part of a block, is fine (the rest joins the last).
    ft = parse_semi_sync(
        *FT_ON,
        "--fault_tolerance.semi_sync_method=diloco",
        "--fault_tolerance.sync_steps=4",
        "--fault_tolerance.module_fqns_per_model_fragment",
        "layers.0.attention",
        "layers.1,norm",
    ).fault_tolerance
    assert ft.fragment_count() == 2  # type: ignore[attr-defined]
    # Semi-sync fields at their defaults are fine without a method.
    assert parse_semi_sync(*FT_ON).fault_tolerance.semi_sync_method is None


def test_the_short_semi_sync_command_says_how_to_run_it() -> None:
    """The command line a user types first, without fault tolerance: the error gives the
    command of one replica group (flags and TORCHFT_LIGHTHOUSE) and the launcher's."""
    with pytest.raises(ConfigError) as info:
        parse_semi_sync("--fault_tolerance.semi_sync_method=localsgd")
    message = str(info.value)
    assert info.value.field == "fault_tolerance.semi_sync_method"
    assert "\n" not in message
    assert (
        "./run_launcher.sh --groups 2 -- "
        f"--job.custom_args_module={SEMI_SYNC} --fault_tolerance.semi_sync_method=localsgd"
    ) in message
    assert "TORCHFT_LIGHTHOUSE=http://127.0.0.1:29610 ./run_train.sh" in message
    for flag in ("--fault_tolerance.enable", "--fault_tolerance.group_size=2",
                 "--fault_tolerance.replica_id=0"):  # fmt: skip
        assert flag in message


def test_list_fields_take_comma_separated_items() -> None:
    config = parse("--checkpoint.exclude_from_loading", "optimizer,lr_scheduler", "dataloader")
    assert config.checkpoint.exclude_from_loading == ["optimizer", "lr_scheduler", "dataloader"]
    config = parse("--checkpoint.exclude_from_loading=optimizer,lr_scheduler")
    assert config.checkpoint.exclude_from_loading == ["optimizer", "lr_scheduler"]


@pytest.mark.parametrize("method", ["diloco", "async_diloco"])
@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "int4", "sparse"])
def test_compressed_pseudo_gradients_parse_with_error_feedback(method: str, dtype: str) -> None:
    ft = parse_semi_sync(
        *FT_ON,
        f"--fault_tolerance.semi_sync_method={method}",
        f"--fault_tolerance.pseudo_grad_dtype={dtype}",
        "--fault_tolerance.error_feedback",
        *(["--fault_tolerance.outer_momentum=0"] if dtype == "sparse" else []),
    ).fault_tolerance
    assert (ft.pseudo_grad_dtype, ft.error_feedback) == (dtype, True)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("dtype", "decay"), [("int8", 1.0), ("int4", 1.0), ("sparse", 0.9)])
def test_only_sparse_residuals_fade(dtype: str, decay: float) -> None:
    """sparse_residual_decay (default 0.9) is sparse's: the other dtypes owe every value."""
    from torchtitan.experiments.fault_tolerance.methods.build import residual_decay

    ft = parse_semi_sync(
        *FT_ON,
        "--fault_tolerance.semi_sync_method=diloco",
        f"--fault_tolerance.pseudo_grad_dtype={dtype}",
        "--fault_tolerance.error_feedback",
        "--fault_tolerance.outer_momentum=0",
    ).fault_tolerance
    assert residual_decay(ft) == decay  # type: ignore[arg-type]


def test_torchfts_fp8_all_reduce_is_gone(capsys: pytest.CaptureFixture[str]) -> None:
    """``should_quantize`` (torchft's fp8 all-reduce) waited on the training stream and bypassed
    the transport's buckets, peer watch and finite checks: removed, and refused by name."""
    from torchtitan.experiments.fault_tolerance.job_config import FaultTolerance

    assert "should_quantize" not in {f.name for f in dataclasses.fields(FaultTolerance)}
    with pytest.raises(SystemExit):
        parse_semi_sync(
            *FT_ON, "--fault_tolerance.semi_sync_method=diloco", "--fault_tolerance.should_quantize"
        )
    assert "Unrecognized options: --fault_tolerance.should_quantize" in capsys.readouterr().err


# ---- sites of replica groups -------------------------------------------------------------------

SITES_ON = (
    "--fault_tolerance.enable",
    "--fault_tolerance.group_size=4",
    "--fault_tolerance.semi_sync_method=diloco",
    "--fault_tolerance.groups_per_site=2",
    "--fault_tolerance.lighthouse=http://10.0.0.5:29610",
    "--fault_tolerance.site_lighthouse=http://10.1.0.5:29611",
)


@pytest.mark.parametrize(
    ("argv", "field", "says"),
    [
        (  # a site field without sites
            [*FT_ON, "--fault_tolerance.semi_sync_method=diloco",
             "--fault_tolerance.site_lighthouse=http://10.1.0.5:29611"],
            "fault_tolerance.site_lighthouse", "groups_per_site > 1",
        ),
        (
            [*FT_ON, "--fault_tolerance.semi_sync_method=diloco",
             "--fault_tolerance.site_min_groups=2"],
            "fault_tolerance.site_min_groups", "groups_per_site > 1",
        ),
        (
            [*SITES_ON, "--fault_tolerance.groups_per_site=0"],
            "fault_tolerance.groups_per_site", ">= 1",
        ),
        (
            [*SITES_ON, "--fault_tolerance.groups_per_site=3"],
            "fault_tolerance.group_size", "multiple",
        ),
        (
            [*SITES_ON, "--fault_tolerance.site_lighthouse="],
            "fault_tolerance.site_lighthouse", "site's lighthouse",
        ),
        (
            [*SITES_ON, "--fault_tolerance.site_lighthouse=http://10.0.0.5:29610"],
            "fault_tolerance.site_lighthouse", "must differ",
        ),
        (
            [*SITES_ON, "--fault_tolerance.min_replica_size=3"],
            "fault_tolerance.min_replica_size", "counts sites",
        ),
        (
            [*SITES_ON, "--fault_tolerance.site_min_groups=0"],
            "fault_tolerance.site_min_groups", "[1, 2]",
        ),
        (
            [*SITES_ON, "--fault_tolerance.site_min_groups=3"],
            "fault_tolerance.site_min_groups", "[1, 2]",
        ),
        (
            [*SITES_ON, "--fault_tolerance.num_fragments=2", "--fault_tolerance.sync_steps=6",
             "--fault_tolerance.fragment_sync_delay=1"],
            "fault_tolerance.fragment_sync_delay", "groups_per_site > 1",
        ),
        (
            [*SITES_ON, "--fault_tolerance.semi_sync_method=async_diloco",
             "--fault_tolerance.dynamic_local_steps"],
            "fault_tolerance.dynamic_local_steps", "groups_per_site > 1",
        ),
    ],
)  # fmt: skip
def test_a_bad_site_setting_names_its_field(argv: list[str], field: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_semi_sync(*argv)
    assert info.value.field == field
    assert says in str(info.value)


def test_a_group_of_a_site_sees_its_site_and_the_job_sees_sites() -> None:
    """Group 3 of 2 sites x 2 groups is group 1 of site 1: its site's Manager is replica 1 of 2
    at the site's lighthouse needing site_min_groups; the job's is replica 1 (the site) of 2
    sites needing min_replica_size sites; without sites the config is the job's as it is."""
    from torchtitan.experiments.fault_tolerance.job_config import (
        job_level_config,
        semi_sync_config,
        site_step_config,
    )

    config = parse_semi_sync(
        *SITES_ON,
        "--fault_tolerance.replica_id=3",
        "--fault_tolerance.min_replica_size=2",
        "--fault_tolerance.site_min_groups=2",
    )
    ft = semi_sync_config(config)
    assert (ft.sites, ft.site) == (2, 1)
    site = site_step_config(config).fault_tolerance
    assert (site.replica_id, site.group_size, site.min_replica_size) == (1, 2, 2)
    assert site.lighthouse == "http://10.1.0.5:29611"
    job = job_level_config(config).fault_tolerance
    assert (job.replica_id, job.group_size, job.min_replica_size) == (1, 2, 2)
    assert job.lighthouse == "http://10.0.0.5:29610"
    assert semi_sync_config(config).replica_id == 3  # the config itself is left as it is
    first = parse_semi_sync(*SITES_ON, "--fault_tolerance.replica_id=2")  # group 0 of site 1
    assert site_step_config(first).fault_tolerance.replica_id == 0
    assert job_level_config(first).fault_tolerance.replica_id == 1
    plain = parse_semi_sync(*FT_ON, "--fault_tolerance.semi_sync_method=diloco")
    assert job_level_config(plain) is plain
