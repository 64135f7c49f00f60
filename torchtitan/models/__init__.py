"""Registry of model families: ``model.name`` in the config is a key of it.

The config checks names and flavors against ``torchtitan/config/model_names.py`` without
importing this package: a family added here is added there too (a unit test compares them)."""

from torchtitan.models.llama3 import llama3_train_spec
from torchtitan.protocols.train_spec import TrainSpec

__all__ = ["get_train_spec", "train_spec_names"]

_TRAIN_SPECS: dict[str, TrainSpec] = {llama3_train_spec.name: llama3_train_spec}


def train_spec_names() -> list[str]:
    """Names of the known model families, sorted."""
    return sorted(_TRAIN_SPECS)


def get_train_spec(name: str) -> TrainSpec:
    """The train spec of model family ``name``; KeyError naming the known ones otherwise."""
    try:
        return _TRAIN_SPECS[name]
    except KeyError:
        raise KeyError(
            f"model.name={name!r} is not a known model family; known: "
            f"{', '.join(train_spec_names())}"
        ) from None
