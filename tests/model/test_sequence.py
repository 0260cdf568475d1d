"""model/sequence.py's Seq: plain positions and one segment equal the causal fast path; segments
keep documents apart (the reference kernel; the others: issue 24)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxfrontier.model import attention
from jaxfrontier.model.sequence import Seq, positions
from jaxfrontier import config as config_lib
from model.test_llama import SHAPE


def _qkv(b=2, t=12, h=2, k=8, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(kk, (b, t, h, k), jnp.float32) for kk in keys]


def test_explicit_plain_positions_and_one_segment_equal_causal():
    q, k, v = _qkv()
    pos = positions(12, 2)
    want = attention.reference_attention(q, k, v)
    got = attention.reference_attention(q, k, v, pos, jnp.zeros((2, 12), jnp.int32))
    np.testing.assert_array_equal(got, want)


def test_segments_keep_documents_apart():
    q, k, v = _qkv()
    seg = jnp.asarray([[0] * 5 + [1] * 7, [0] * 12], jnp.int32)
    pos = jnp.asarray([list(range(5)) + list(range(7)), list(range(12))], jnp.int32)
    got = attention.reference_attention(q, k, v, pos, seg)
    # the second document of row 0 alone
    alone = attention.reference_attention(q[:1, 5:], k[:1, 5:], v[:1, 5:])
    np.testing.assert_allclose(got[:1, 5:], alone, rtol=1e-6, atol=1e-6)
    first = attention.reference_attention(q[:1, :5], k[:1, :5], v[:1, :5])
    np.testing.assert_allclose(got[:1, :5], first, rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # the fast tier: test_explicit_plain_positions_and_one_segment_equal_causal (the kernel level)
@pytest.mark.parametrize('family', ['gpt', 'llama'])
def test_loss_with_explicit_plain_seq_equals_plain(family):
    from jaxfrontier.model import params as params_lib
    c = config_lib.base_config()
    c.model.update(**{**SHAPE, 'family': family})
    s = config_lib.model_shape(c)
    model = params_lib.module_of(family)(s, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, s.seq_len), 0, s.real_vocab_size)
    want = model.loss(tokens, tokens)
    got = model.loss(tokens, tokens, positions_bt=positions(s.seq_len, 2),
                     segments_bt=jnp.zeros((2, s.seq_len), jnp.int32))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert Seq(4).plain and not Seq(4, segments_bt=jnp.zeros((1, 4))).plain
