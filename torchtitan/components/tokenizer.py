"""Tokenizers: the built-in byte-level one, and any Hugging Face ``tokenizer.json``.

``build_tokenizer(job_config)`` picks one from ``model.tokenizer_path``: empty gives the
``ByteTokenizer`` (no files needed), otherwise an ``HFTokenizer`` loaded from that path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from torchtitan.config.job_config import JobConfig


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and the model need from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included (the model's embedding rows)."""
        ...

    @property
    def bos_id(self) -> int:
        """Id of the beginning-of-sequence token."""
        ...

    @property
    def eos_id(self) -> int:
        """Id of the end-of-sequence token."""
        ...

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        """Token ids of ``text``, with BOS first and EOS last unless switched off."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (the inverse of ``encode`` up to special tokens)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are bytes, 256 is BOS, 257 is EOS (vocabulary 258).

    Needs no files and round-trips any text exactly. ``decode`` drops BOS/EOS and replaces
    byte sequences that are not valid UTF-8 (e.g. a character cut in half) with U+FFFD.
    """

    BOS = 256
    EOS = 257

    @property
    def vocab_size(self) -> int:
        return 258

    @property
    def bos_id(self) -> int:
        return self.BOS

    @property
    def eos_id(self) -> int:
        return self.EOS

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, self.BOS)
        if add_eos:
            ids.append(self.EOS)
        return ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


# Special-token spellings of common model families, most specific first. GPT-2 style
# tokenizers have only ``<|endoftext|>``, which then serves as BOS too.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<|startoftext|>", "<bos>", "[BOS]", "<|bos|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>", "[EOS]", "<|eos|>")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer, loaded from a ``tokenizer.json``.

    ``path`` is the file itself or a folder holding it. BOS/EOS come from ``bos_token`` /
    ``eos_token`` of a ``tokenizer_config.json`` next to it if there is one, else from the
    tokenizer's special tokens (``<s>``/``</s>``, ``<|begin_of_text|>``/``<|end_of_text|>``,
    ``<|endoftext|>``...). When only one of the two is found it serves as both (GPT-2 style);
    when neither is, a ``ValueError`` lists the special tokens there are.
    """

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _HFTokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {str(path)!r}")
        self.path = file
        self._tok = _HFTokenizer.from_file(str(file))
        bos, eos = self._find_bos_eos(file.parent / "tokenizer_config.json")
        self._bos_id, self._eos_id = bos, eos

    def _find_bos_eos(self, config_file: Path) -> tuple[int, int]:
        bos = eos = None
        if config_file.is_file():
            config = json.loads(config_file.read_text(encoding="utf-8"))
            bos = self._id_of(config.get("bos_token"))
            eos = self._id_of(config.get("eos_token"))
        specials = [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]
        if bos is None:
            bos = next((self._id_of(n) for n in _BOS_NAMES if n in specials), None)
        if eos is None:
            eos = next((self._id_of(n) for n in _EOS_NAMES if n in specials), None)
        if bos is None and eos is None:
            raise ValueError(
                f"tokenizer {str(self.path)!r}: cannot tell its BOS/EOS tokens; special tokens "
                f"are {specials}. Add a tokenizer_config.json next to it with "
                '"bos_token" and "eos_token".'
            )
        if bos is None or eos is None:
            logger.info(f"tokenizer {self.path}: one special token serves as both BOS and EOS")
        bos_id = bos if bos is not None else eos
        eos_id = eos if eos is not None else bos
        assert bos_id is not None and eos_id is not None
        return bos_id, eos_id

    def _id_of(self, token: object) -> int | None:
        # tokenizer_config.json spells a token as a string or as {"content": ...}.
        if isinstance(token, dict):
            token = token.get("content")
        return self._tok.token_to_id(token) if isinstance(token, str) else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        # The tokenizer's own post-processor may add BOS too (Llama 3 does): switched off so
        # that add_bos/add_eos alone decide.
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos:
            ids.insert(0, self._bos_id)
        if add_eos:
            ids.append(self._eos_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def build_tokenizer(job_config: JobConfig) -> Tokenizer:
    """The tokenizer of ``model.tokenizer_path``: the byte tokenizer when it is empty.

    Raises ``FileNotFoundError`` when the path does not exist.
    """
    path = job_config.model.tokenizer_path
    if not path:
        return ByteTokenizer()
    if not Path(path).exists():
        raise FileNotFoundError(
            f"model.tokenizer_path={path!r} does not exist; give a tokenizer.json file or a "
            "folder holding one, or leave it empty for the built-in byte tokenizer"
        )
    return HFTokenizer(path)
