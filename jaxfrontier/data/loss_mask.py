"""The loss mask in a batch's tokens: bit 30 set on a token whose prediction does not count.

A token file may carry a loss mask (docs/data.md: `NAME.mask.bin`, one uint8 per token, 1 = the
prediction *of* this token counts), written by `python -m jaxfrontier.prepare --sft` so that
only the assistant's tokens of a conversation are learned. The trainer's batch stays one int32
array [G, T + 1] of tokens -- every pipeline executor and the data-local reduction pass
micro-batches of tokens around, nothing else -- so the mask travels inside the tokens:

- the loader (data/sources.py) sets `NOT_COUNTED` on each token whose mask is 0, when the run
  uses the file's mask (`data.loss_mask`, resolved to 'on': data/loader.py);
- the step reads it back (model/context.py `TokenOrder`, model/packing.py): `token_ids` strips
  the bit for the embedding, the targets and packing's end-of-text detection, and `counted`
  turns it into loss weights of the predictions (combined with packing's boundary weights).

Vocabularies are far below 2**30 (checked: `MAX_VOCAB`), and int32 holds bit 30, so a token id
never collides with the flag. Without a mask no token has the bit and no program changes: the
step only strips it when the run's config says the data may carry it.

The operations here are plain bitwise operators, so they work on numpy and JAX arrays alike;
this module imports neither JAX nor anything of jaxfrontier (the loader imports it before JAX
starts).
"""

from __future__ import annotations

from typing import Any

import numpy as np

NOT_COUNTED = 1 << 30  # set on a token whose prediction (from the token before it) does not count
MAX_VOCAB = NOT_COUNTED  # token ids must stay below the flag
ID_BITS = NOT_COUNTED - 1  # a token's id: the bits below the flag


def mark(tokens_n: np.ndarray, mask_n: np.ndarray) -> np.ndarray:
    """int32 tokens [n] with NOT_COUNTED set where the file's mask [n] is 0 (uint8, 1 = counts)."""
    tokens_n = np.asarray(tokens_n, np.int32)
    return tokens_n | np.where(np.asarray(mask_n) == 0, np.int32(NOT_COUNTED), np.int32(0))


def token_ids(tokens: Any) -> Any:
    """Tokens (numpy or JAX, any shape) without the flag: the ids the model embeds and predicts."""
    return tokens & ID_BITS


def counted(tokens: Any) -> Any:
    """Whether each token's prediction counts (bool, same shape): the flag is not set."""
    return (tokens & NOT_COUNTED) == 0
