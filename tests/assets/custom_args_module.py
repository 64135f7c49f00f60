"""A custom args module for the config tests: extends [training] and adds [custom_section]."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan.config import ConfigError
from torchtitan.config import JobConfig as CoreJobConfig


@dataclass
class Training:
    """Training, with the experiment's extra knobs."""

    my_extra_flag: bool = False
    """An extra switch added by the custom module."""

    steps: int = 42
    """Number of training steps (the custom module's own default)."""

    def validate(self, config: CoreJobConfig) -> None:
        super().validate(config)  # type: ignore[misc]  # the core Training's checks, via the MRO
        if self.my_extra_flag and self.steps > 1000:
            raise ConfigError(
                "training.my_extra_flag", True, "only for runs of at most 1000 training.steps"
            )


@dataclass
class CustomSection:
    """A section that only the custom module has."""

    how_many: int = 3
    """How many of something."""

    label: str = "plain"
    """A label for it."""

    fragments: list[list[str]] = field(default_factory=lambda: [["layers.0"], ["layers.1"]])
    """Module FQNs of each model fragment, one inner list per fragment."""

    def validate(self, config: CoreJobConfig) -> None:
        if self.how_many < 0:
            raise ConfigError("custom_section.how_many", self.how_many, "must be >= 0")


@dataclass
class JobConfig:
    training: Training = field(default_factory=Training)
    custom_section: CustomSection = field(default_factory=CustomSection)
