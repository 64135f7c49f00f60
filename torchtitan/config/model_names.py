"""The model families and flavors a config may name, known without importing the models.

``model.name`` and ``model.flavor`` are validated against this table, so that parsing a config
never imports ``torchtitan.models`` (torch and every model). A family added to the train-spec
registry (``torchtitan/models/__init__.py``) is added here too, with its flavors in the same
order; ``tests/unit_tests/test_model.py`` checks that the two agree.
"""

from __future__ import annotations

#: Model family -> its flavors (the keys of its train spec's ``model_args``).
MODEL_FLAVORS: dict[str, tuple[str, ...]] = {
    "llama3": ("debugmodel", "debugmodel_small", "1B", "8B", "70B", "405B"),
}


def add_flavors(family: str, flavors: tuple[str, ...]) -> None:
    """Let a config name ``flavors`` of ``family`` in this process: for a program that
    registers model arguments of its own (the benchmarks' wide models) before parsing."""
    known = MODEL_FLAVORS.get(family, ())
    MODEL_FLAVORS[family] = known + tuple(f for f in flavors if f not in known)


#: Flavors that are a published model's shape, with the vocabulary of its tokenizer: they need
#: ``model.tokenizer_path`` (the byte tokenizer would replace the vocabulary by 258 tokens).
#: The 1B flavor is not one of them: it is run with the byte tokenizer for throughput checks.
PUBLISHED_VOCABULARY: dict[tuple[str, str], int] = {
    ("llama3", "8B"): 128256,
    ("llama3", "70B"): 128256,
    ("llama3", "405B"): 128256,
}
