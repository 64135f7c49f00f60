"""What fixes the shapes of a sync's collectives, so that groups can compare it before any.

Each rank all-reduces with the same rank of every other group, bucket by bucket. That pairs up
only with equal ranks, shards, buckets and wire dtype; otherwise gloo fails (or the mismatch
passes for disagreeing global parameters) and nccl hangs or returns garbage.
:class:`CollectiveShape` travels in every sync quorum's member record, and a mismatch stops the
starting groups with one line naming both sides and the field to change (:func:`mismatch`). A
healing group also reads its peer's in the heal's metadata before anything is sent.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from torchtitan.distributed.tensors import local_tensor
from torchtitan.experiments.fault_tolerance.job_config import PSEUDO_GRAD_DTYPES
from torchtitan.experiments.fault_tolerance.transport.codecs import (
    parse_sparse_name,
    sparse_name,
)

#: How a shape starts in the heal transport's metadata.
SHAPE_PREFIX = "collective-shape:"


@dataclass(frozen=True)
class CollectiveShape:
    """One rank's side of a sync's collectives (all int64, for the member record)."""

    #: Ranks of the group (``NGPU``).
    ranks: int
    #: Fragments of the model, each synced on its own.
    fragments: int
    #: This rank's values of all fragments (its shards).
    shard_values: int
    #: fp32 values in a bucket (``sync_bucket_mb``).
    bucket_values: int
    #: The wire dtype (:func:`dtype_code`): which codec, with its settings.
    dtype: int
    #: A 64-bit key of every fragment's tensors' local shapes, in order.
    layout: int

    @classmethod
    def of(
        cls, fragments: Sequence[nn.Module], ranks: int, bucket_values: int, dtype: str
    ) -> CollectiveShape:
        shapes = [
            [tuple(local_tensor(p).shape) for p in fragment.parameters()] for fragment in fragments
        ]
        digest = hashlib.blake2b(repr(shapes).encode(), digest_size=8).digest()
        return cls(
            ranks=ranks,
            fragments=len(fragments),
            shard_values=sum(local_tensor(p).numel() for f in fragments for p in f.parameters()),
            bucket_values=bucket_values,
            dtype=dtype_code(dtype),
            layout=int.from_bytes(digest, "little", signed=True),
        )

    def to_text(self) -> str:
        """The shape as the heal transport's metadata (a string torchft hands a joiner)."""
        return SHAPE_PREFIX + ",".join(str(v) for v in dataclasses.astuple(self))

    @classmethod
    def from_text(cls, text: str) -> CollectiveShape | None:
        """The shape in a peer's metadata (None: it has none, e.g. another transport's)."""
        if not text.startswith(SHAPE_PREFIX):
            return None
        return cls(*(int(v) for v in text.removeprefix(SHAPE_PREFIX).split(",")))

    def describe(self) -> str:
        return (
            f"{self.ranks} rank(s), {self.fragments} fragment(s), shards of "
            f"{self.shard_values:,} values, buckets of {self.bucket_values * 4 / 2**20:g} MiB, "
            f"pseudo-gradients as {dtype_name(self.dtype)}"
        )


def dtype_code(dtype: str) -> int:
    """A wire dtype as one int64: its ``PSEUDO_GRAD_DTYPES`` index in the low 4 bits, and for
    sparse its bits, keep and chunk above (:func:`dtype_name` reads it)."""
    sparse = parse_sparse_name(dtype)
    if sparse is None:
        return PSEUDO_GRAD_DTYPES.index(dtype)
    chunk, keep, bits = sparse
    return PSEUDO_GRAD_DTYPES.index("sparse") | bits << 4 | keep << 8 | chunk << 32


def dtype_name(code: int) -> str:
    name = PSEUDO_GRAD_DTYPES[code & 0xF]
    if name != "sparse":
        return name
    return sparse_name(code >> 32, (code >> 8) & 0xFFFFFF, (code >> 4) & 0xF)


def mismatch(shapes: Sequence[tuple[str, CollectiveShape]], mine: CollectiveShape) -> str:
    """Why the others' ``(name, shape)`` cannot pair with ``mine``, naming both sides and the
    field to change; "" when all match."""
    for name, other in shapes:
        if other == mine:
            continue
        if other.ranks != mine.ranks:
            field = "NGPU (the ranks of each replica group)"
        elif other.dtype != mine.dtype:
            field = "fault_tolerance.pseudo_grad_dtype (and the sparse_* fields)"
        elif other.bucket_values != mine.bucket_values:
            field = "fault_tolerance.sync_bucket_mb"
        elif other.fragments != mine.fragments:
            field = "fault_tolerance.num_fragments (or module_fqns_per_model_fragment)"
        else:
            field = (
                "model (model.name, model.flavor), sharding (parallelism) and fragments "
                "(module_fqns_per_model_fragment)"
            )
        return (
            f"the collectives of {name} cannot pair with this group's: it has "
            f"{other.describe()}; this group has {mine.describe()}. Start every group with the "
            f"same {field}."
        )
    return ""
