"""The sparse codec: what it keeps, how it lays the bytes out, and that it drops nothing for good.

The all-gather and the averaging over real gloo groups are tested with the other dtypes
(``test_compression.py``, ``test_sync_averaging.py``); here the codec alone.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.unit_tests.test_compression import encode_staged
from torchtitan.experiments.fault_tolerance.transport.codecs import (
    SparseCodec,
    get_codec,
    parse_sparse_name,
    sparse_name,
)
from torchtitan.experiments.fault_tolerance.transport.residuals import ResidualKey, Residuals


def _values(numel: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen).exp()


def test_the_defaults_cost_120_bytes_per_4096_values() -> None:
    codec = get_codec("sparse")
    assert (codec.chunk, codec.keep, codec.bits) == (4096, 64, 2)  # type: ignore[attr-defined]
    # Two fp32 levels, 64 two-bit codes, 64 twelve-bit indices.
    assert codec.wire_bytes(4096) == 8 + 16 + 96
    assert codec.wire_bytes(4097) == 2 * 120
    numel = 4096 * 1000
    assert codec.wire_bytes(numel) / (4 * numel) < 0.0074


@pytest.mark.parametrize("settings", [(4096, 64, 2), (64, 4, 1), (100, 7, 3), (2, 2, 4)])
def test_names_round_trip_and_settings_are_checked(settings: tuple[int, int, int]) -> None:
    name = sparse_name(*settings)
    assert parse_sparse_name(name) == settings
    assert get_codec(name).name == name
    assert parse_sparse_name("int4") is None
    assert parse_sparse_name("sparse-cx-k1-b2") is None
    with pytest.raises(ValueError, match="keep must be in"):
        SparseCodec(64, 65, 2)
    with pytest.raises(ValueError, match="value bits"):
        SparseCodec(64, 4, 5)


@pytest.mark.parametrize("settings", [(4096, 64, 2), (64, 4, 1), (100, 7, 3), (64, 64, 2)])
@pytest.mark.parametrize("numel", [1, 63, 64, 65, 1000, 3 * 4096 + 5])
def test_each_chunk_keeps_its_largest_values_and_the_residual_is_the_rest(
    settings: tuple[int, int, int], numel: int
) -> None:
    chunk, keep, bits = settings
    codec = SparseCodec(*settings)
    x = _values(numel)
    packed = codec.encode(x)
    assert packed.numel() == codec.wire_bytes(numel)
    decoded = codec.decode(packed, numel)
    residual = torch.empty(numel)
    again = torch.empty_like(packed)
    codec.encode_into(x, again, numel, residual=residual)
    assert torch.equal(again, packed)  # the same bytes with or without the residual
    assert torch.equal(residual, x - decoded)  # everything not sent, bit for bit
    for start in range(0, numel, chunk):
        part, got = x[start : start + chunk], decoded[start : start + chunk]
        kept = got != 0
        assert int(kept.sum()) <= min(keep, part.numel())
        if part.numel() > keep:
            # Nothing dropped is larger than anything kept.
            assert part[~kept].abs().max() <= part[kept].abs().min()
        # A kept value keeps its sign, and lies within its chunk's kept magnitudes (those of
        # the zeros a short last chunk is padded with included).
        assert torch.equal(got[kept].sign(), part[kept].sign())
        top = part[kept].abs()
        low = top.min() if part.numel() >= keep else 0.0
        assert got[kept].abs().min() >= low and got[kept].abs().max() <= top.max()
        # At most 2 ** (bits - 1) magnitudes.
        assert got[kept].abs().unique().numel() <= 2 ** (bits - 1)


def test_a_level_is_the_mean_of_its_bin_and_a_zero_chunk_decodes_to_zeros() -> None:
    codec = SparseCodec(8, 4, 2)
    x = torch.tensor([0.0, 1.0, -2.0, 0.1, 9.0, 0.0, -10.0, 0.2] + [0.0] * 8)
    decoded = codec.decode(codec.encode(x), x.numel())
    # Kept: 1, -2, 9, -10. Magnitudes from 1 to 10, two bins split at 5.5: means 1.5 and 9.5.
    expected = torch.tensor([0.0, 1.5, -1.5, 0.0, 9.5, 0.0, -9.5, 0.0] + [0.0] * 8)
    assert torch.equal(decoded, expected)


@pytest.mark.parametrize("bits", [2, 3])
def test_a_chunk_with_few_nonzero_values_sends_its_kept_zeros_as_exact_zeros(bits: int) -> None:
    """Fewer nonzero values than ``keep``: the zeros kept decode to 0 (no drift where the
    pseudo-gradient is 0), the nonzero values to levels of their own."""
    codec = SparseCodec(64, 16, bits)
    x = torch.zeros(128)
    x[[3, 9, 40]] = torch.tensor([0.01, -1.0, 0.5])  # chunk 0: 3 nonzero of 16 kept
    x[64:] = _values(64, seed=5)  # chunk 1: all nonzero
    residual = torch.empty(128)
    packed = torch.empty(codec.wire_bytes(128), dtype=torch.uint8)
    codec.encode_into(x, packed, 128, residual=residual)
    decoded = codec.decode(packed, 128)
    zero = x[:64] == 0
    assert torch.equal(decoded[:64][zero], torch.zeros(int(zero.sum())))
    assert torch.equal(residual[:64][zero], torch.zeros(int(zero.sum())))
    assert torch.equal(decoded[:64][~zero].sign(), x[:64][~zero].sign())
    assert int((decoded[64:] != 0).sum()) == 16
    assert torch.equal(residual, x - decoded)


def test_with_kept_zeros_the_bins_span_the_nonzero_magnitudes_and_decode_to_their_means() -> None:
    """3 bits: level 0 is the kept zeros, three bins share the nonzero magnitudes from the
    smallest (3) to the largest (9), 2 wide: {3, 4} decode to their mean 3.5, 5 to 5, 9 to 9.
    (Bins from 0 would put 3, 4 and 5 together; the default 2 bits has one bin and cannot
    tell.)"""
    codec = SparseCodec(16, 8, 3)
    x = torch.zeros(16)
    x[[1, 4, 6, 11]] = torch.tensor([3.0, -4.0, 5.0, -9.0])  # 4 nonzero of 8 kept
    decoded = codec.decode(codec.encode(x), x.numel())
    expected = torch.zeros(16)
    expected[[1, 4, 6, 11]] = torch.tensor([3.5, -3.5, 5.0, -9.0])
    assert torch.equal(decoded, expected)


def test_indices_and_codes_are_packed_low_bits_first() -> None:
    codec = SparseCodec(16, 2, 2)  # 4-bit indices: two per byte; two 2-bit codes in one byte
    x = torch.zeros(16)
    x[3], x[12] = -5.0, 1.0
    packed = codec.encode(x)
    levels = packed[:8].view(torch.float32)
    codes, indices = packed[8:9], packed[9:]
    assert sorted(levels.tolist()) == [1.0, 5.0]
    index = [int(indices[0]) & 0xF, int(indices[0]) >> 4]
    assert sorted(index) == [3, 12]
    code = [int(codes[0]) & 0x3, (int(codes[0]) >> 2) & 0x3]
    by_index = dict(zip(index, code, strict=True))
    assert by_index[3] == 0b11  # negative, the upper level
    assert by_index[12] == 0b00  # positive, the lower level


def test_error_feedback_delivers_every_value_eventually() -> None:
    """With the residual added back, the running sum of what was sent tracks the sum of the
    inputs: the gap is the residual, which stays bounded instead of growing."""
    codec = get_codec("sparse")
    residuals = Residuals()
    numel = 3 * 4096
    target = _values(numel, seed=1)
    sent = torch.zeros(numel)
    gaps = []
    for round_ in range(200):
        packed = encode_staged(residuals, ResidualKey(0, 0), target, codec)
        residuals.commit()
        sent += codec.decode(packed, numel)
        gaps.append(float((sent - (round_ + 1) * target).abs().max()))
    # After R rounds the gap is one residual, not R times what a round drops.
    assert gaps[-1] < 0.05 * 200 * float(target.abs().max())
    assert gaps[-1] <= 2 * max(gaps[:100])


def test_a_non_finite_input_decodes_to_non_finite_values() -> None:
    codec = get_codec("sparse")
    x = torch.full((5000,), math.nan)
    decoded = codec.decode(codec.encode(x), 5000)
    assert not torch.isfinite(decoded).all()


@pytest.mark.parametrize("numel", [1, 64 * 5 + 3, 64 * 12])
def test_working_in_pieces_gives_the_bytes_of_one_pass(numel: int) -> None:
    whole, pieces = SparseCodec(64, 4, 2), SparseCodec(64, 4, 2)
    whole.piece_chunks, pieces.piece_chunks = 10**6, 3
    x = _values(numel, seed=2)
    previous = torch.randn(numel)
    results = []
    for codec in (whole, pieces):
        packed = torch.empty(codec.wire_bytes(numel), dtype=torch.uint8)
        residual = torch.empty(numel)
        codec.encode_into(x, packed, numel, residual=residual)
        summed = previous.clone()
        codec.decode_into(packed, numel, summed, accumulate=True)
        head = torch.empty(numel // 2)
        codec.decode_into(packed, numel, head)
        results.append((packed, residual, summed, head))
    for expected, got in zip(*results, strict=True):
        assert torch.equal(got, expected)


def test_a_decayed_residual_is_added_back_scaled_and_the_new_one_is_all_not_sent() -> None:
    """SparseLoCo's beta: the owed residual fades by ``decay`` before it is added, and what the
    next encode does not send is owed in full."""
    codec = get_codec("sparse")
    residuals, key = Residuals(decay=0.9), ResidualKey(0, 0)
    numel = 5000
    first, second = _values(numel, seed=3), _values(numel, seed=4)
    encode_staged(residuals, key, first, codec)
    residuals.commit()
    owed = residuals.flat(0, numel)
    packed = encode_staged(residuals, key, second, codec)
    residuals.commit()
    corrected = second + owed * 0.9
    assert torch.equal(residuals.flat(0, numel), corrected - codec.decode(packed, numel))
    with pytest.raises(ValueError, match="decay"):
        Residuals(decay=0.0)
