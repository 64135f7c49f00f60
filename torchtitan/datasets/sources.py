"""Where documents come from: the embedded corpus, local files, or a Hugging Face Hub dataset.

``build_source(dataset, dataset_path, split)`` returns the documents of one split as either

* an ``IndexedSource`` (documents readable by index, so the training order can be reshuffled
  every epoch): the embedded corpus, and local folders of ``.txt`` files;
* a ``StreamSource`` (documents read in order only; shuffle the files offline): ``.jsonl`` and
  ``.parquet`` files, and Hub datasets (streamed, never downloaded whole).

Splits: the embedded corpus has a held-out validation split. A local folder whose file or folder
names contain ``validation``/``valid``/``val`` (e.g. ``c4-validation.00000.jsonl``) uses those
files for validation and the rest for training; a Hub dataset uses its ``validation`` split.
Otherwise ~5 % of the documents, chosen by a stable hash of their position, are held out for
validation and skipped in training.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from torchtitan.config.job_config import require_dataset_path
from torchtitan.datasets.corpus import corpus_documents, split_of

Split = Literal["train", "validation"]

SUPPORTED_EXTENSIONS = (".txt", ".jsonl", ".parquet")
"""Local file types: ``.txt`` (a file is one document), ``.jsonl`` (one JSON object per line,
field ``text``), ``.parquet`` (column ``text``)."""


@dataclass(frozen=True)
class IndexedSource:
    """``size`` documents, each read by ``read(index)``."""

    name: str
    size: int
    read: Callable[[int], str]


@dataclass(frozen=True)
class StreamSource:
    """Documents read in order: each ``open()`` starts a new pass from the first one."""

    name: str
    open: Callable[[], Iterable[str]]


DocumentSource = IndexedSource | StreamSource


@dataclass(frozen=True)
class HubDataset:
    """How to read one Hub dataset."""

    path: str
    """Repository id on the Hub."""
    config: str | None
    """Config (subset) name that ``load_dataset`` needs, e.g. ``en`` for C4."""
    text_field: str
    """Field holding a document's text."""
    validation_split: str | None
    """Its held-out split; None: hold out ~5 % of ``train``."""


_C4 = HubDataset("allenai/c4", "en", "text", "validation")
_WIKITEXT = HubDataset("Salesforce/wikitext", "wikitext-103-raw-v1", "text", "validation")
KNOWN_HUB_DATASETS: dict[str, HubDataset] = {
    "allenai/c4": _C4,
    "c4": _C4,
    "HuggingFaceFW/fineweb": HubDataset("HuggingFaceFW/fineweb", "sample-10BT", "text", None),
    "HuggingFaceFW/fineweb-edu": HubDataset(
        "HuggingFaceFW/fineweb-edu", "sample-10BT", "text", None
    ),
    "roneneldan/TinyStories": HubDataset("roneneldan/TinyStories", None, "text", "validation"),
    "Salesforce/wikitext": _WIKITEXT,
    "wikitext": _WIKITEXT,
}
"""Hub datasets known by name; any other name is tried with field ``text`` and no config."""


def build_source(
    dataset: str,
    dataset_path: str | None,
    split: Split,
    field: str = "training",
    whole: bool = False,
) -> DocumentSource:
    """The documents of ``split`` of a dataset, as configured by ``<field>.dataset`` and
    ``<field>.dataset_path`` (the names errors refer to).

    ``dataset``: ``embedded``; a Hub dataset name (one of ``KNOWN_HUB_DATASETS`` or any
    ``owner/name``), read from ``dataset_path`` if given (a local copy); anything else (e.g.
    ``local``) with ``dataset_path`` set: local files. ``whole``: use every document of a
    local dataset rather than one split of it (for a dataset that is validation data as a
    whole); Hub datasets still pick their validation split when they have one.
    """
    if dataset == "embedded":
        if dataset_path:
            raise ValueError(
                f"{field}.dataset_path={dataset_path!r} is set but {field}.dataset='embedded' "
                f"reads no files; set {field}.dataset=local to read local files, or unset "
                f"{field}.dataset_path"
            )
        docs = corpus_documents(split)
        return IndexedSource(f"embedded/{split}", len(docs), lambda i: docs[i].text)
    require_dataset_path(dataset, dataset_path, field)
    if dataset_path is not None and not Path(dataset_path).exists():
        raise FileNotFoundError(f"{field}.dataset_path={dataset_path!r} does not exist")
    if dataset in KNOWN_HUB_DATASETS or "/" in dataset:
        return _hub_source(dataset, dataset_path, split, field, whole)
    if dataset_path is None:
        # Not a known name and no local path: the Hub is the only place left to look.
        return _hub_source(dataset, None, split, field, whole)
    return _local_source(dataset, Path(dataset_path), split, field, whole)


# ---------------------------------------------------------------------------- local files


def _local_source(
    dataset: str, path: Path, split: Split, field: str, whole: bool
) -> DocumentSource:
    files = _local_files(path, field)
    root = path if path.is_dir() else path.parent
    rel = {f: f.relative_to(root).as_posix() for f in files}
    # Only inside a folder do names mark validation files; a file given by path is data.
    held_out_files = [f for f in files if _names_validation(rel[f])] if path.is_dir() else []
    hash_split: Split | None = None
    if not whole:
        if held_out_files:
            files = (
                held_out_files
                if split == "validation"
                else [f for f in files if f not in held_out_files]
            )
            if not files:
                raise ValueError(
                    f"{field}.dataset_path={str(path)!r}: every file is named as validation "
                    "data (validation/valid/val), none is left for training"
                )
        else:
            hash_split = split
    name = f"{dataset}/{split}"
    if all(f.suffix == ".txt" for f in files):
        if hash_split is not None:
            files = [f for f in files if split_of(rel[f]) == hash_split]
        kept = files
        return IndexedSource(name, len(kept), lambda i: _read_txt(kept[i]))

    def documents() -> Iterator[str]:
        for f in files:
            for i, text in enumerate(_read_file(f)):
                # A file's documents are held out by position: stable while the file is.
                if hash_split is None or split_of(f"{rel[f]}:{i}") == hash_split:
                    yield text

    return StreamSource(name, documents)


def _local_files(path: Path, field: str) -> list[Path]:
    if path.is_file():
        if path.suffix not in SUPPORTED_EXTENSIONS:
            raise ValueError(
                f"{field}.dataset_path={str(path)!r}: unsupported file type {path.suffix!r}; "
                f"supported: {', '.join(SUPPORTED_EXTENSIONS)}"
            )
        return [path]
    files = sorted(
        (
            p
            for p in path.rglob("*")
            if p.is_file()
            and p.suffix in SUPPORTED_EXTENSIONS
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        ),
        key=lambda p: p.relative_to(path).as_posix(),
    )
    if not files:
        raise ValueError(
            f"{field}.dataset_path={str(path)!r}: no dataset files in this folder; "
            f"supported: {', '.join(SUPPORTED_EXTENSIONS)}"
        )
    return files


def _names_validation(relative_path: str) -> bool:
    words = re.split(r"[^a-z0-9]+", relative_path.lower())
    return any(w in ("validation", "valid", "val") for w in words)


def _read_txt(file: Path) -> str:
    return file.read_text(encoding="utf-8", errors="replace")


def _read_file(file: Path) -> Iterator[str]:
    if file.suffix == ".txt":
        yield _read_txt(file)
    elif file.suffix == ".jsonl":
        with file.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    yield _text_of(json.loads(line), "text", f"{file}:{line_no}")
    else:
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(file)
        if "text" not in parquet.schema_arrow.names:
            raise ValueError(f"{file}: no column 'text' (columns: {parquet.schema_arrow.names})")
        for batch in parquet.iter_batches(columns=["text"], batch_size=1024):
            yield from (t or "" for t in batch.column(0).to_pylist())


def _text_of(row: dict[str, Any], text_field: str, where: str) -> str:
    if text_field not in row:
        raise ValueError(f"{where}: no field {text_field!r} (fields: {sorted(row)})")
    return row[text_field] or ""


# ---------------------------------------------------------------------------- Hub


def _hub_source(
    dataset: str, local_copy: str | None, split: Split, field: str, whole: bool
) -> StreamSource:
    import datasets

    spec = KNOWN_HUB_DATASETS.get(dataset, HubDataset(dataset, None, "text", None))
    where = local_copy or spec.path
    # The Hub client logs a warning for every retry of every request (it retries for ~30 s on
    # an offline machine); the one error below says what matters.
    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    hub_logger.setLevel(logging.ERROR)
    try:
        validation_split = spec.validation_split
        if dataset not in KNOWN_HUB_DATASETS:
            names = datasets.get_dataset_split_names(where, spec.config)
            validation_split = "validation" if "validation" in names else None
        hub_split = validation_split if split == "validation" and validation_split else "train"
        stream = datasets.load_dataset(where, spec.config, split=hub_split, streaming=True)
    except ConnectionError as e:
        reason = " ".join(str(e).split())  # one line, whatever the library put in it
        raise ConnectionError(
            f"{field}.dataset={dataset!r}: the Hugging Face Hub is unreachable ({reason}); "
            f"download the dataset once and set {field}.dataset_path to its folder, or use "
            f"local .txt/.jsonl/.parquet files via {field}.dataset_path"
        ) from e
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"{field}.dataset={dataset!r}: not found on the Hugging Face Hub or at "
            f"{field}.dataset_path ({e}); known names: {', '.join(KNOWN_HUB_DATASETS)}"
        ) from e
    finally:
        hub_logger.setLevel(level)
    # Without a held-out split on the Hub, hold out documents by position (as local files do).
    hash_split: Split | None = None if validation_split or whole else split

    def documents() -> Iterator[str]:
        for i, row in enumerate(stream):
            if hash_split is None or split_of(f"{spec.path}:{i}") == hash_split:
                yield _text_of(row, spec.text_field, f"{dataset} row {i}")

    return StreamSource(f"{dataset}/{split}", documents)
