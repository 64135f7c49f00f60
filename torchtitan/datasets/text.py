"""Packed next-token samples from a document source, and the stateful, rank-aware dataloader.

``build_dataloader(job_config, tokenizer, dp_rank, dp_world_size, split)`` is what the trainer
calls; ``TextDataset`` does the work. Documents come from ``torchtitan.datasets.sources``.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.utils.data import DataLoader, IterableDataset

from torchtitan.datasets.sources import DocumentSource, IndexedSource, build_source

if TYPE_CHECKING:
    from torchtitan.components.tokenizer import Tokenizer
    from torchtitan.config.job_config import JobConfig

Sample = tuple[torch.Tensor, torch.Tensor]


class TextDataset(IterableDataset[Sample]):
    """Documents tokenized (BOS/EOS around each), concatenated and cut into samples of
    ``seq_len + 1`` tokens; yields ``(input_ids, labels)``, two LongTensors ``[seq_len]``, the
    labels shifted by one. Samples do not overlap; a document may span two samples.

    Modes and rank split (``dp_rank`` of ``dp_world_size``; with several replica groups the
    caller folds them in: ``rank = replica_id * dp_world + dp_rank``):

    * ``infinite=True`` (training): loops over epochs. Document ``i`` of an epoch goes to rank
      ``i % world``: each rank tokenizes only its own documents and needs no coordination, and
      the ranks' streams are disjoint within an epoch. Sources readable by index are
      reshuffled every epoch from ``seed`` (same order on every rank); streams keep their order.
      The leftover tokens of an epoch start the next one.
    * ``infinite=False`` (validation): one pass. Every rank packs the same stream of all
      documents, and sample ``j`` goes to rank ``j % world``; the stream is cut at a multiple
      of ``world`` samples, so every rank yields the same number of samples (a validation loop
      with collectives cannot hang on an uneven split). The tail shorter than that is dropped.
      After a full pass the dataset rewinds, so the next pass yields the same samples.

    Iterating continues from the current position (``state_dict()``); one iterator at a time.
    """

    def __init__(
        self,
        source: DocumentSource,
        tokenizer: Tokenizer,
        seq_len: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        infinite: bool = True,
        seed: int = 0,
    ) -> None:
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_world_size={dp_world_size})")
        if seq_len < 1:
            raise ValueError(f"training.seq_len={seq_len} must be at least 1")
        if infinite and isinstance(source, IndexedSource) and source.size < dp_world_size:
            raise ValueError(
                f"dataset {source.name!r} has {source.size} documents, fewer than the "
                f"{dp_world_size} data-parallel ranks it is split over"
            )
        self.source = source
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.rank = dp_rank
        self.world_size = dp_world_size
        self.infinite = infinite
        self.seed = seed
        self.reset()

    def reset(self) -> None:
        """Go back to the first sample of the first epoch."""
        self._epoch = 0
        self._next_document = 0  # documents of this epoch consumed from this rank's stream
        self._buffer: list[int] = []  # tokens read but not yet yielded start at _pos
        self._pos = 0

    def state_dict(self) -> dict[str, Any]:
        """The position after the last yielded sample: small (a few ints and fewer tokens than
        one document plus one sample), no copy of the data."""
        return {
            "dataset": self.source.name,
            "rank": self.rank,
            "world_size": self.world_size,
            "epoch": self._epoch,
            "next_document": self._next_document,
            "buffer": self._buffer[self._pos :],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next sample is the one the saving dataset would have
        yielded next. Refuses a state made for another rank, world size or dataset."""
        saved = f"dataset {state['dataset']!r}, rank {state['rank']} of {state['world_size']}"
        here = f"dataset {self.source.name!r}, rank {self.rank} of {self.world_size}"
        if saved != here:
            raise ValueError(
                f"dataloader state was saved for {saved}; this is {here}. Resume with the same "
                "dataset and data-parallel layout, or skip the data position with "
                'checkpoint.exclude_from_loading=["dataloader"]'
            )
        self._epoch = int(state["epoch"])
        self._next_document = int(state["next_document"])
        self._buffer = [int(t) for t in state["buffer"]]
        self._pos = 0

    def __iter__(self) -> Iterator[Sample]:
        length = self.seq_len + 1
        group = 1 if self.infinite else self.world_size  # samples cut per step of the stream
        offset = 0 if self.infinite else self.rank * length
        from_start = self._epoch == 0 and self._next_document == 0 and not self._buffer
        yielded = False
        while True:
            epoch_from_start = self._next_document == 0
            got_text = False
            for text in self._documents():
                # Count the document before yielding its samples: a state taken at any yield
                # then says "resume after this document, with these leftover tokens".
                self._next_document += 1
                if not text:
                    continue
                got_text = True
                del self._buffer[: self._pos]
                self._pos = 0
                self._buffer.extend(self.tokenizer.encode(text))
                while len(self._buffer) - self._pos >= length * group:
                    start = self._pos + offset
                    tokens = torch.tensor(self._buffer[start : start + length], dtype=torch.long)
                    self._pos += length * group
                    yielded = True
                    yield tokens[:-1], tokens[1:]
            if not self.infinite:
                if from_start and not yielded:
                    raise ValueError(
                        f"dataset {self.source.name!r} is too small: fewer than "
                        f"{group} samples of seq_len + 1 = {length} tokens"
                    )
                self.reset()
                return
            if epoch_from_start and not got_text:
                # Looping again would spin forever without yielding.
                raise ValueError(
                    f"dataset {self.source.name!r} gave rank {self.rank} of {self.world_size} "
                    "no text in a whole epoch: it is empty or has fewer documents than ranks"
                )
            self._epoch += 1
            self._next_document = 0

    def _documents(self) -> Iterator[str]:
        """This rank's documents of the current epoch, from ``_next_document`` on."""
        start, source = self._next_document, self.source
        if self.infinite:
            step, first = self.world_size, self.rank
        else:
            step, first = 1, 0
        if isinstance(source, IndexedSource):
            order = self._epoch_order(source.size)
            for index in order[first + start * step :: step]:
                yield source.read(index)
        else:
            # A stream can only be skipped by reading it: resuming re-reads (without
            # tokenizing) the documents before the resume point.
            yield from islice(source.open(), first + start * step, None, step)

    def _epoch_order(self, size: int) -> list[int]:
        if not self.infinite:
            return list(range(size))
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + self._epoch) % 2**63)
        return torch.randperm(size, generator=generator).tolist()


def _collate(samples: list[Sample]) -> Sample:
    inputs = [s[0] for s in samples]
    labels = [s[1] for s in samples]
    return torch.stack(inputs), torch.stack(labels)


class TextDataLoader(DataLoader):
    """Batches ``(input_ids [B, T], labels [B, T])`` of a ``TextDataset``, read in this process.

    ``state_dict()`` is ``{"dp_rank_<rank>": <dataset state>}``: keyed by rank, so that
    per-rank states do not collide when a checkpoint gathers all ranks' states under one name.
    After ``load_state_dict`` the next batch is exactly the one the saving loader would have
    produced next. ``rewind=True`` (validation) restarts from the first batch on every
    iteration, so every validation sees the same batches.
    """

    # What __init__ was given (DataLoader declares any Dataset): its state is the loader's.
    dataset: TextDataset

    def __init__(self, dataset: TextDataset, batch_size: int, rewind: bool = False) -> None:
        if batch_size < 1:
            raise ValueError(f"local_batch_size={batch_size} must be at least 1")
        # num_workers=0: no prefetching, so the dataset's position is exactly that of the
        # last batch handed out, which is what makes state_dict() exact.
        super().__init__(dataset, batch_size=batch_size, num_workers=0, collate_fn=_collate)
        self.rewind = rewind
        self._key = f"dp_rank_{dataset.rank}"

    def __iter__(self) -> Iterator[Sample]:  # type: ignore[override]  # torch's type is private
        if self.rewind:
            self.dataset.reset()
        return super().__iter__()

    def state_dict(self) -> dict[str, Any]:
        return {self._key: self.dataset.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._key not in state:
            raise ValueError(
                f"dataloader state has no entry for this rank ({self._key}); it holds "
                f"{sorted(state)}. Resume with the same data-parallel layout, or skip the data "
                'position with checkpoint.exclude_from_loading=["dataloader"]'
            )
        self.dataset.load_state_dict(state[self._key])


def build_dataloader(
    job_config: JobConfig,
    tokenizer: Tokenizer,
    dp_rank: int,
    dp_world_size: int,
    split: Literal["train", "validation"] = "train",
) -> TextDataLoader:
    """The dataloader of one data-parallel rank (fold replica groups into ``dp_rank`` /
    ``dp_world_size``).

    ``train``: endless batches of ``training.local_batch_size`` from ``training.dataset``,
    reshuffled per epoch from ``training.seed``; resumable through ``state_dict()``.
    ``validation``: one pass of ``validation.local_batch_size`` batches, the same ones every
    time, from ``validation.dataset`` (all of it for local files, its validation split for the
    embedded corpus and Hub datasets) or, when that is empty, from the held-out split of
    ``training.dataset``. Sequences are ``training.seq_len`` tokens in both.
    """
    training, validation = job_config.training, job_config.validation
    if split == "train":
        source = build_source(training.dataset, training.dataset_path, "train", "training")
        dataset = TextDataset(
            source, tokenizer, training.seq_len, dp_rank, dp_world_size, True, training.seed or 0
        )
        return TextDataLoader(dataset, training.local_batch_size)
    if split != "validation":
        raise ValueError(f"split={split!r}: expected 'train' or 'validation'")
    if validation.dataset or validation.dataset_path:
        source = build_source(
            validation.dataset or training.dataset,
            validation.dataset_path,
            "validation",
            "validation",
            whole=True,
        )
    else:
        source = build_source(training.dataset, training.dataset_path, "validation", "training")
    dataset = TextDataset(source, tokenizer, training.seq_len, dp_rank, dp_world_size, False)
    return TextDataLoader(dataset, validation.local_batch_size, rewind=True)
