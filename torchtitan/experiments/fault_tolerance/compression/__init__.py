"""Compressed pseudo-gradients: a sync's tensors in fewer bytes.

* ``codecs``: a flat fp32 tensor to wire bytes (bfloat16, int8, int4) and back, identically on
  every rank.
* ``error_feedback``: per key, what this rank's compression dropped, owed to its next round
  once the sync that dropped it commits.
* ``collective``: the compressed SUM all-reduce (encode, all-to-all, reduce, re-encode,
  all-gather; every rank ends with the same bits).
* ``runner``: issues them in order on a background thread, failures reported to the Manager as
  torchft's are; a sync whose peer is gone is abandoned without waiting for it.

``transport.py`` cuts a sync into keyed transfers; nothing here knows more than those keys.
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
