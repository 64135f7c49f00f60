"""The benchmarks, a package run from the repository root: ``python -m benchmarks.<name>``
(``benchmarks/README.md`` lists them, their commands and their figures)."""
