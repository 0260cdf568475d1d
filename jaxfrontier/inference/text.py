"""Text <-> tokens for sampling and bits per byte: the run's tokenizer, or bytes.

A token file names its tokenizer in the header (`tokenizer`: the path of a Hugging Face
tokenizer.json relative to the .bin, written by `python -m jaxfrontier.prepare`); the
built-in corpus and tokenizer-less files of at most 256 tokens are raw bytes. A codec's
`eot_ids` end a sampled row: the token file's `eot_id`, or a Hugging Face directory's
`eos_token_id` (generation_config.json first, as transformers' `generate` reads it).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from jaxfrontier.data import builtin, token_files
from jaxfrontier.errors import UserError


class ByteCodec:
    """UTF-8 bytes as tokens (the built-in corpus)."""

    name = 'bytes'
    eot_ids: tuple[int, ...] = ()

    def encode(self, text: str) -> list[int]:
        return list(text.encode('utf-8'))

    def decode(self, tokens: list[int]) -> str:
        return bytes(t for t in tokens if t < 256).decode('utf-8', errors='replace')

    def byte_lengths(self, vocab: int) -> np.ndarray:
        return np.ones(vocab, np.int64)


class HFCodec:
    """A Hugging Face `tokenizers` tokenizer.json."""

    def __init__(self, path: str, eot_ids: tuple[int, ...] = ()):
        from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
        try:
            self.tokenizer = Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001
            raise UserError(f'cannot read the tokenizer {path} ({type(e).__name__}: {e}). Fix: restore the '
                            'tokenizer.json written beside the token file by jaxfrontier.prepare.') from e
        self.name, self.path, self.eot_ids = f'tokenizer {path}', path, tuple(eot_ids)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=False)

    def byte_lengths(self, vocab: int) -> np.ndarray:
        """UTF-8 bytes each token stands for (special tokens: 0); byte-level BPE counts its symbols."""
        byte_level = self.tokenizer.decoder is not None and 'ByteLevel' in str(self.tokenizer.decoder)
        special = {t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special}
        out = np.zeros(vocab, np.int64)
        for i in range(min(vocab, self.tokenizer.get_vocab_size())):
            piece = self.tokenizer.id_to_token(i)
            if piece is None or piece in special:
                continue
            out[i] = len(piece) if byte_level else len(self.tokenizer.decode([i]).encode('utf-8'))
        return out


def token_file_codec(path: str, vocab_size: int) -> Any:
    """The codec of a token file: its header's tokenizer, else bytes when the vocabulary allows."""
    token_file = token_files.open_token_file(path, vocab_size)
    tokenizer = token_files.tokenizer_path(token_file)  # a file beside the .bin (read_header refuses any other)
    if tokenizer:
        eot = token_file.header.get('eot_id')
        return HFCodec(tokenizer, () if eot is None else (int(eot),))
    if token_file.header['vocab_size'] <= builtin.BYTE_VOCAB:
        return ByteCodec()
    raise UserError(f'the token file {token_file.path} records no tokenizer (header key "tokenizer"), so its '
                    'tokens cannot be turned into text. Fix: write it with python -m jaxfrontier.prepare.')


def run_codec(data: dict[str, Any], vocab_size: int, hf_dir: str | None = None) -> Any:
    """The codec of a run from its saved data config, or of a Hugging Face directory's tokenizer."""
    if hf_dir:
        path = os.path.join(hf_dir, 'tokenizer.json')
        if os.path.isfile(path):
            return HFCodec(path, hf_eos_ids(hf_dir))
        if vocab_size <= builtin.BYTE_VOCAB:
            return ByteCodec()
        raise UserError(f'{hf_dir} has no tokenizer.json. Fix: save the tokenizer beside the model '
                        '(tokenizer.save_pretrained(DIR)).')
    if data.get('kind') == 'tokens':
        return token_file_codec(token_files.run_token_path(data), vocab_size)  # a blend: its first file
    if vocab_size < builtin.BYTE_VOCAB:
        raise UserError(f'the run has no tokenizer and a vocabulary of {vocab_size} < 256 bytes. '
                        "Fix: train on data.kind='builtin' or on a token file from jaxfrontier.prepare.")
    return ByteCodec()  # builtin: bytes; synthetic: bytes are as good as anything


def hf_eos_ids(hf_dir: str) -> tuple[int, ...]:
    """`eos_token_id` (one id or a list) of generation_config.json, else of config.json; () if neither has one."""
    for name in ('generation_config.json', 'config.json'):
        try:
            with open(os.path.join(hf_dir, name), encoding='utf-8') as f:
                eos = json.load(f).get('eos_token_id')
        except (OSError, ValueError, AttributeError):
            continue  # absent or unreadable: config.json's own reader (checkpoint/hf_files) names its damage
        ids = eos if isinstance(eos, list) else [eos]
        if eos is not None and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            return tuple(ids)
    return ()
