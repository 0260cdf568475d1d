"""Text <-> tokens for sampling and bits per byte: the run's tokenizer, or bytes.

A token file names its tokenizer in the header (`tokenizer`: the path of a Hugging Face
tokenizer.json relative to the .bin, written by `python -m jaxfrontier.prepare`); the
built-in corpus and tokenizer-less files of at most 256 tokens are raw bytes.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from jaxfrontier.data import builtin, token_files
from jaxfrontier.errors import UserError


class ByteCodec:
    """UTF-8 bytes as tokens (the built-in corpus)."""

    name = 'bytes'
    eot_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode('utf-8'))

    def decode(self, tokens: list[int]) -> str:
        return bytes(t for t in tokens if t < 256).decode('utf-8', errors='replace')

    def byte_lengths(self, vocab: int) -> np.ndarray:
        return np.ones(vocab, np.int64)


class HFCodec:
    """A Hugging Face `tokenizers` tokenizer.json."""

    def __init__(self, path: str, eot_id: int | None = None):
        from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
        try:
            self.tokenizer = Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001
            raise UserError(f'cannot read the tokenizer {path} ({type(e).__name__}: {e}). Fix: restore the '
                            'tokenizer.json written beside the token file by jaxfrontier.prepare.') from e
        self.name, self.path, self.eot_id = f'tokenizer {path}', path, eot_id

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
    tokenizer = token_file.header.get('tokenizer')
    if tokenizer:
        return HFCodec(os.path.join(os.path.dirname(token_file.path), tokenizer), token_file.header.get('eot_id'))
    if token_file.header['vocab_size'] <= builtin.BYTE_VOCAB:
        return ByteCodec()
    raise UserError(f'the token file {token_file.path} records no tokenizer (header key "tokenizer"), so its '
                    'tokens cannot be turned into text. Fix: write it with python -m jaxfrontier.prepare.')


def run_codec(data: dict[str, Any], vocab_size: int, hf_dir: str | None = None) -> Any:
    """The codec of a run from its saved data config, or of a Hugging Face directory's tokenizer."""
    if hf_dir:
        path = os.path.join(hf_dir, 'tokenizer.json')
        if os.path.isfile(path):
            return HFCodec(path)
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
