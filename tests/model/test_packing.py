"""Packed documents (model/packing.py): segments and positions from the tokens, the boundary-loss
switch, and a packed window's loss and gradients against each of its documents run alone.

Both families: GPT's learned positions and Llama's RoPE must restart per document, or a document
after the first would see other positions than alone. Tolerances: fp32 rounding (the masked
scores are exp(finfo.min - max) = 0 exactly, so nothing of another document leaks in): the loss
to layout_check's rtol, gradients per tensor to --mode=verify's fp32 bound (a leak across
documents or positions that do not restart moves them by O(1), measured 1.2-1.6).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxfrontier import config as config_lib
from jaxfrontier.model import packing
from jaxfrontier.model import params as params_lib
from jaxfrontier.model.context import TokenOrder
from jaxfrontier.plan import verify
from layout_check import LOSS_RTOL
from model.test_llama import SHAPE  # 3 layers, d 40, 4 heads, seq 24, vocabulary 97, MLP 56

EOT = 5
GRADS_RTOL = verify.TOLERANCES['float32']['grads']  # per tensor, |a - e| / |e|: --mode=verify's fp32 bound
# blockwise (auto on AMD and the CPU) in the fast tier; 8-row blocks over T = 24, so whole block
# pairs across documents are skipped. cudnn needs an NVIDIA GPU (tests/model/test_attention.py).
KERNELS = ('blockwise', pytest.param('reference', marks=pytest.mark.slow), pytest.param('xla', marks=pytest.mark.slow))


def test_documents_segments_positions_and_weights():
    tokens = jnp.asarray([[EOT, 1, 2, EOT, EOT, 3, 4, EOT],   # EOT first, an empty document, EOT last
                          [1, 2, 3, 4, 6, 7, 8, 9]], jnp.int32)  # one document: plain positions
    seq = packing.documents(tokens, EOT)
    np.testing.assert_array_equal(seq.segments_bt, [[0, 1, 1, 1, 2, 3, 3, 3], [0] * 8])
    np.testing.assert_array_equal(seq.positions_bt, [[0, 0, 1, 2, 0, 0, 1, 2], list(range(8))])
    weights = packing.loss_weights(tokens, packing.Packing(EOT))
    np.testing.assert_array_equal(weights, [[0, 1, 1, 0, 0, 1, 1, 0], [1] * 8])
    assert packing.loss_weights(tokens, packing.Packing(EOT, boundary_loss=True)) is None
    window = jnp.concatenate([tokens, jnp.ones((2, 1), jnp.int32)], axis=1)  # [B, T + 1]
    np.testing.assert_allclose(packing.count_scale(window, packing.Packing(EOT)), 16 / 12)
    # Nothing counted: a finite scale (times a loss of 0: 0, not NaN).
    np.testing.assert_allclose(packing.count_scale(jnp.full((1, 4), EOT), packing.Packing(EOT)), 3.0)
    assert packing.count_scale(window, packing.Packing(EOT, boundary_loss=True)) == 1.0


def _windows(t, vocab, seed=0):
    """Two windows [2, T + 1] of documents of distinct lengths; row 1 starts mid-document."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(EOT + 1, vocab, (2, t + 1))
    rows[0, [6, 7, 16]] = EOT  # documents of 7, 1 (empty: the EOT alone) and 9 inputs, then a tail
    rows[1, [3, 20]] = EOT
    return jnp.asarray(rows, jnp.int32)


def _model(family, kernel):
    c = config_lib.base_config()  # init_std 0.3: attention far from uniform, so a leak across documents shows
    c.model.update(**{**SHAPE, 'family': family, 'attention': kernel, 'init_std': 0.3, 'attention_block_q': 8,
                      'attention_block_kv': 8})
    return params_lib.module_of(family)(config_lib.model_shape(c), rngs=nnx.Rngs(0))


def _documents_alone(window, boundary_loss):
    """Each document of the windows as its own row, right-padded (causal attention never looks
    right, so a document's predictions are those of the document alone): (inputs, targets,
    weights) [D, T], the padding weighted 0."""
    rows = []
    for row in np.asarray(window):
        inputs, targets = row[:-1], row[1:]
        ends = [i + 1 for i, tok in enumerate(inputs) if tok == EOT]
        rows += [(inputs[a:b], targets[a:b]) for a, b in zip([0] + ends, ends + [len(inputs)]) if b > a]
    t = window.shape[1] - 1
    pad = lambda x: np.pad(x, (0, t - len(x)), constant_values=EOT + 1)  # noqa: E731
    weights = [pad(np.where(boundary_loss | (x != EOT), 1.0, 0.0)) * (np.arange(t) < len(x)) for x, _ in rows]
    return (jnp.asarray(np.stack([pad(x) for x, _ in rows]), jnp.int32),
            jnp.asarray(np.stack([pad(y) for _, y in rows]), jnp.int32), jnp.asarray(np.stack(weights), jnp.float32))


@pytest.mark.parametrize('kernel', KERNELS)
@pytest.mark.parametrize('family,boundary_loss', [pytest.param('gpt', False, marks=pytest.mark.slow), ('llama', False),
                                                  pytest.param('llama', True, marks=pytest.mark.slow)])
def test_packed_equals_each_document_alone(family, boundary_loss, kernel):
    model = _model(family, kernel)
    graphdef, params = nnx.split(model)
    window = _windows(SHAPE['seq_len'], SHAPE['vocab_size'])
    pk = packing.Packing(EOT, boundary_loss)

    def packed(p):
        loss = TokenOrder(SHAPE['seq_len'], packing=pk).loss(nnx.merge(graphdef, p), window)
        return loss * packing.count_scale(window, pk)

    inputs, targets, weights = _documents_alone(window, boundary_loss)

    def alone(p):  # the mean over counted predictions, each document alone
        return nnx.merge(graphdef, p).loss(inputs, targets, weights_bt=weights) * weights.size / jnp.sum(weights)

    def both(p):  # one program: compiling it once costs less than three
        unpacked = nnx.merge(graphdef, p).loss(window[:, :-1], window[:, 1:],
                                               weights_bt=packing.loss_weights(window[:, :-1], pk))
        return jax.value_and_grad(packed)(p), jax.value_and_grad(alone)(p), unpacked * packing.count_scale(window, pk)

    (loss, grads), (ref_loss, ref_grads), unpacked = jax.jit(both)(params)
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    grads_diff = verify.compare_trees(jax.device_get(grads), jax.device_get(ref_grads), GRADS_RTOL)
    assert grads_diff.passed, grads_diff
    # Not vacuous: unpacked (attention and positions across documents), counting the same
    # predictions, is another loss.
    assert abs(float(unpacked) - float(loss)) > 1e-2
