import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from torchtitan.components.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    build_tokenizer,
)
from torchtitan.config.job_config import JobConfig

TEXTS = ["hello world", "héllo wörld ☃", "the quick brown fox jumps over the lazy dog"] * 5


def make_tokenizer_json(folder: Path, special_tokens: list[str]) -> Path:
    """Train a tiny byte-level BPE and save it as folder/tokenizer.json."""
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def test_byte_tokenizer_round_trips_non_ascii_text() -> None:
    tok = ByteTokenizer()
    text = "héllo wörld ☃ 日本語 🎉\n\ttab"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id == 256 and ids[-1] == tok.eos_id == 257
    assert ids[1:-1] == list(text.encode("utf-8"))
    assert all(0 <= i < tok.vocab_size == 258 for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode(text, add_bos=False, add_eos=False) == ids[1:-1]
    assert tok.encode("", add_bos=True, add_eos=True) == [256, 257]


def test_byte_tokenizer_decodes_a_cut_character_without_raising() -> None:
    tok = ByteTokenizer()
    cut = tok.encode("☃", add_bos=False, add_eos=False)[:2]
    assert tok.decode(cut) == "\ufffd"


def test_hf_tokenizer_from_file_and_folder(tmp_path: Path) -> None:
    file = make_tokenizer_json(tmp_path / "tok", ["<s>", "</s>"])
    for path in (file, file.parent):
        tok = HFTokenizer(path)
        assert isinstance(tok, Tokenizer)
        assert (tok.bos_id, tok.eos_id) == (0, 1)
        assert tok.vocab_size == 300
        text = "héllo the quick fox ☃"
        ids = tok.encode(text)
        assert ids[0] == 0 and ids[-1] == 1 and 0 not in ids[1:-1]
        assert tok.decode(ids[1:-1]) == text
        assert tok.encode(text, add_bos=False, add_eos=False) == ids[1:-1]


def test_hf_tokenizer_reads_bos_eos_from_tokenizer_config(tmp_path: Path) -> None:
    make_tokenizer_json(tmp_path, ["<pad>", "<|start|>", "<|stop|>"])
    config = {"bos_token": {"content": "<|start|>"}, "eos_token": "<|stop|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = HFTokenizer(tmp_path)
    assert (tok.bos_id, tok.eos_id) == (1, 2)


def test_hf_tokenizer_with_only_endoftext_uses_it_for_both(tmp_path: Path) -> None:
    make_tokenizer_json(tmp_path, ["<|endoftext|>"])
    tok = HFTokenizer(tmp_path)
    assert tok.bos_id == tok.eos_id == 0


def test_hf_tokenizer_without_bos_eos_is_a_clear_error(tmp_path: Path) -> None:
    make_tokenizer_json(tmp_path, ["<pad>"])
    with pytest.raises(ValueError, match="BOS/EOS.*<pad>.*tokenizer_config.json"):
        HFTokenizer(tmp_path)


def test_build_tokenizer_picks_by_tokenizer_path(tmp_path: Path) -> None:
    config = JobConfig()
    assert isinstance(build_tokenizer(config), ByteTokenizer)
    config.model.tokenizer_path = str(make_tokenizer_json(tmp_path, ["<s>", "</s>"]).parent)
    assert isinstance(build_tokenizer(config), HFTokenizer)
    config.model.tokenizer_path = str(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="model.tokenizer_path"):
        build_tokenizer(config)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        HFTokenizer(tmp_path / "empty")
