"""The job configuration: dataclasses per TOML section, and the parser that fills them."""

from torchtitan.config.job_config import ConfigError, JobConfig
from torchtitan.config.manager import ConfigManager, merge_configs, to_toml, write_toml

__all__ = ["ConfigError", "ConfigManager", "JobConfig", "merge_configs", "to_toml", "write_toml"]
