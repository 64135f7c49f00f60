"""Compressed pseudo-gradients: how a sync's tensors travel in fewer bytes.

* ``codecs``: how one flat fp32 tensor becomes the bytes on the wire (bfloat16, int8, int4),
  and back, identically on every rank.
* ``error_feedback``: a per-key store of what this rank's compression dropped, owed to its
  next round once the sync that dropped it commits.
* ``collective``: the compressed SUM all-reduce over a process group (encode, all-to-all,
  reduce, re-encode, all-gather; every rank ends with the same bits).
* ``runner``: issues them on a background thread, in order, failures reported to the Manager
  as torchft's are; a sync whose peer is gone is abandoned there without waiting for it.

The sync's transport (``fault_tolerance/transport.py``) cuts a sync into transfers and keys
them; nothing here knows what a fragment or a sync is beyond those keys.
"""

from torchtitan.experiments.fault_tolerance.compression.codecs import (
    BLOCK,
    PSEUDO_GRAD_DTYPES,
    SMALLEST_SCALE,
    BlockQuantCodec,
    CastCodec,
    Codec,
    Scratch,
    get_codec,
)
from torchtitan.experiments.fault_tolerance.compression.collective import (
    CompressionStats,
    Delivered,
    chunk_numel,
    compressed_all_reduce,
    decode_delivered,
    is_finite,
)
from torchtitan.experiments.fault_tolerance.compression.error_feedback import ErrorFeedback
from torchtitan.experiments.fault_tolerance.compression.runner import (
    AsyncCompressedAllReduce,
    CompressedWork,
    Packed,
)

__all__ = [
    "BLOCK",
    "PSEUDO_GRAD_DTYPES",
    "SMALLEST_SCALE",
    "AsyncCompressedAllReduce",
    "BlockQuantCodec",
    "CastCodec",
    "Codec",
    "CompressedWork",
    "Packed",
    "CompressionStats",
    "Delivered",
    "ErrorFeedback",
    "Scratch",
    "chunk_numel",
    "compressed_all_reduce",
    "decode_delivered",
    "get_codec",
    "is_finite",
]
