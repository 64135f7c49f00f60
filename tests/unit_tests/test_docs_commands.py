"""Every training command the docs tell a user to type is config-checked as typed, so that the
docs cannot drift from the code: a renamed flag, a value the config refuses or a TOML that no
longer parses fails here.

The commands are the ``./run_train.sh``, ``... -m torchtitan.train`` and launcher lines of the
fenced ``bash`` blocks of the README, docs/ and the experiment's README (continuation lines
joined, comments dropped). Each is checked as ``run_train.sh`` checks it before starting
ranks (``check_config``, with ``WORLD_SIZE`` from ``NGPU`` or torchrun's ``--nproc_per_node``);
a launcher line's arguments are parsed by the launcher and its groups' arguments checked as
the launcher passes them on. Placeholders for files a user supplies (a tokenizer) become a real
file; values the shell computes at run time (``$SLURM_ARRAY_TASK_ID``) are dropped.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from torchtitan.config import job_config as core_config
from torchtitan.experiments.fault_tolerance.launch import launcher
from torchtitan.tools.cluster import RUN_TRAIN_CONFIG
from torchtitan.train import RUN_INSTEAD_STATUS, check_config

REPO = Path(__file__).resolve().parents[2]
DOCS = [
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    REPO / "torchtitan" / "experiments" / "fault_tolerance" / "README.md",
]
#: Files the docs ask the user for, as the docs spell them.
PLACEHOLDERS = ("PATH/TO/tokenizer.json", "/shared/llama3/tokenizer.json")
TRAIN = "torchtitan.train"
LAUNCHER = "torchtitan.experiments.fault_tolerance.launch.launcher"
#: The launcher as the docs type it (it runs LAUNCHER with the project's .venv).
LAUNCHER_SCRIPT = "./run_launcher.sh"


@dataclass
class Typed:
    """One command line of the docs: where it is, its environment prefix and its words."""

    doc: str
    line: int
    env: dict[str, str]
    words: list[str]

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {shlex.join(self.words)}"


def _logical_lines(block: str, first_line: int) -> Iterator[tuple[int, str]]:
    pending, start = "", first_line
    for number, line in enumerate(block.splitlines(), first_line):
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending = ""


def _words(line: str) -> list[str]:
    """The line's words; a quoted ``bash -c '...'`` script is split into its own words."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return []
    out: list[str] = []
    for word in words:
        if " " in word and TRAIN in word:
            out.extend(_words(word))
        else:
            out.append(word)
    return out


def _shell_blocks(text: str) -> Iterator[tuple[int, str]]:
    """(first line number, text) of each fenced block marked bash or sh, or not marked."""
    language: str | None = None
    start, lines = 0, []
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            if language is None:
                language, start, lines = line[3:].strip(), number + 1, []
            else:
                if language in ("", "bash", "sh"):
                    yield start, "\n".join(lines)
                language = None
        elif language is not None:
            lines.append(line)


#: How a typed command starts (after its environment variables).
ENTRY_WORDS = (
    "./run_train.sh",
    LAUNCHER_SCRIPT,
    ".venv/bin/python",
    "python",
    ".venv/bin/torchrun",
    "torchrun",
)


def _is_command(words: list[str]) -> bool:
    if not words or not (words[0] in ENTRY_WORDS or words[0] == "srun"):
        return False
    return "./run_train.sh" in words or bool({TRAIN, LAUNCHER, LAUNCHER_SCRIPT} & set(words))


def typed_commands() -> list[Typed]:
    found = []
    for doc in DOCS:
        for first, block in _shell_blocks(doc.read_text()):
            for number, line in _logical_lines(block, first):
                words = _words(line)
                env = {}
                while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
                    name, _, value = words.pop(0).partition("=")
                    env[name] = value
                if _is_command(words):
                    found.append(Typed(str(doc.relative_to(REPO)), number, env, words))
    return found


COMMANDS = typed_commands()


def _after(words: list[str], marker: str) -> list[str]:
    return words[words.index(marker) + 1 :]


def _runtime_values_dropped(args: list[str]) -> list[str]:
    return [a for a in args if "$" not in a]


def _placeholders_filled(args: list[str], tokenizer: Path) -> list[str]:
    filled = []
    for arg in args:
        for placeholder in PLACEHOLDERS:
            arg = arg.replace(placeholder, str(tokenizer))
        filled.append(arg)
    return filled


def _world_size(words: list[str], env: dict[str, str]) -> str:
    for word in words:
        match = re.fullmatch(r"--nproc[_-]per[_-]node=(\d+)", word)
        if match:
            return match.group(1)
    return env.get("NGPU", "1")


def test_the_docs_have_the_commands_this_test_is_for() -> None:
    """The collector finds the commands (an empty list would pass every check below)."""
    kinds = {
        "run_train": [c for c in COMMANDS if "./run_train.sh" in c.words],
        "torchrun": [c for c in COMMANDS if TRAIN in c.words],
        "launcher": [c for c in COMMANDS if {LAUNCHER, LAUNCHER_SCRIPT} & set(c.words)],
    }
    assert all(len(found) >= 2 for found in kinds.values()), kinds


@pytest.mark.parametrize("typed", COMMANDS, ids=lambda c: f"{c.doc}:{c.line}")
def test_a_documented_command_passes_the_config_check(
    typed: Typed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(REPO)  # the docs' relative paths are from the repository
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("{}")
    words = _placeholders_filled(_runtime_values_dropped(typed.words), tokenizer)
    config_file = typed.env.get("CONFIG_FILE", str(RUN_TRAIN_CONFIG))
    if {LAUNCHER, LAUNCHER_SCRIPT} & set(words):
        args = launcher.parse_args(
            _after(words, LAUNCHER if LAUNCHER in words else LAUNCHER_SCRIPT)
        )
        train_args = [
            f"--job.config_file={config_file}",
            *args.train_args,
            "--fault_tolerance.enable",
            f"--fault_tolerance.group_size={args.groups}",
            "--fault_tolerance.replica_id=0",
        ]
        world = str(args.ngpu)
    else:
        entry = TRAIN if TRAIN in words else "./run_train.sh"
        train_args = _after(words, entry)
        if entry != TRAIN:
            train_args = [f"--job.config_file={config_file}", *train_args]
        world = _world_size(words, typed.env)
    if "--help" in train_args:
        return  # --help has a test of its own (test_job_config.py)
    for name in ("TORCHFT_LIGHTHOUSE",):
        if name in typed.env:
            monkeypatch.setenv(name, typed.env[name])
    # The GPU commands are checked as on a GPU machine (the check of the device is not docs).
    monkeypatch.setattr(core_config, "_cuda_available", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("NGPU", world)
    monkeypatch.delenv("RANK", raising=False)
    status = check_config(train_args)
    err = capsys.readouterr().err
    assert status in (0, RUN_INSTEAD_STATUS), f"{typed}\n{err}"
