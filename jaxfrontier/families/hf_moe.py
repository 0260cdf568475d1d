"""Hugging Face Mixtral and Qwen3-MoE: the Llama family's converter (families/llama.py `HF`) with its
mixture-of-experts layers (families/moe.py), both directions. Not a family (families/__init__.py `SHARED`).

Mixtral's attention is Mistral's, Qwen3-MoE's is Qwen3's (QK-norm, a head width of its own): the dense
converter reads and writes those parts under the dense model type (`ATTENTION`); this module adds the
experts. Both route with a softmax over E experts, keep the top k and weight them by their
probabilities (renormalised over the k: Mixtral always, Qwen3-MoE with `norm_topk_prob`), so with
model.moe_router 'softmax', no shared experts, no router bias and every layer MoE our model computes
theirs. Per MoE layer l (after the layer prefix `model.layers.l.`; E experts of width F):

  ours [l]                 Mixtral (hub)                       Qwen3-MoE (hub)
  mlp/w_router [d, E]      block_sparse_moe.gate.weight [E, d]  mlp.gate.weight [E, d]
  mlp/w_gate [E, d, F]     block_sparse_moe.experts.i.w1.weight  mlp.experts.i.gate_proj.weight [F, d]
  mlp/w_up   [E, d, F]     ...experts.i.w3.weight [F, d]         mlp.experts.i.up_proj.weight [F, d]
  mlp/w_down [E, F, d]     ...experts.i.w2.weight [d, F]         mlp.experts.i.down_proj.weight [d, F]

Export writes these per-expert tensors (what the hub holds and transformers 5's `save_pretrained` writes;
its loader fuses them). Import also reads transformers 5's fused in-memory layout (a state dict saved as
it is): `mlp.gate.weight`, `mlp.experts.gate_up_proj` [E, 2F, d] (gate rows first, then up) and
`mlp.experts.down_proj` [E, d, F]. config.json: Mixtral's `intermediate_size` is the experts' width
F; Qwen3-MoE's is the dense MLP's (`mlp_only_layers`) and F is `moe_intermediate_size`. The
experts' count is `num_local_experts` or `num_experts` (transformers 5 writes the first for both).
`router_aux_loss_coef` is model.moe_lb_coef, a starting value a run may change (`unmatched`);
`output_router_logits` only says whether transformers computes that loss, and export writes false.
Refused as one line: Qwen3-MoE's dense layers (`mlp_only_layers`, `decoder_sparse_step` > 1), Mixtral's
router jitter; on export, what neither architecture has (shared experts, dense first layers, a
sigmoid router or its bias, a routed scale, Mixtral without renormalisation, q/k/v biases).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxfrontier.errors import CheckpointError, ConfigError
from jaxfrontier.families.base import HFConverter, Layout

MIXTRAL = ('MixtralForCausalLM', 'mixtral')
QWEN3_MOE = ('Qwen3MoeForCausalLM', 'qwen3_moe')
ATTENTION = {'mixtral': 'mistral', 'qwen3_moe': 'qwen3'}  # the dense model type whose attention each has
# transformers' defaults where config.json lacks a key: (experts, per token, norm_topk_prob)
DEFAULTS = {'mixtral': (8, 2, True), 'qwen3_moe': (128, 8, False)}
AUX_COEF = 0.001  # router_aux_loss_coef's default (both)
EXPERTS = ('mlp/w_gate', 'mlp/w_up', 'mlp/w_down')
HUB = {'mixtral': ('block_sparse_moe.', ('w1', 'w3', 'w2')), 'qwen3_moe': ('mlp.', ('gate_proj', 'up_proj', 'down_proj'))}


def _refuser(where: str):
    def refuse(key, value, fix):
        raise ConfigError('checkpoint.init_params_from', where,
                          f'its config.json has {key} = {value!r}, which jaxfrontier cannot compute', fix)
    return refuse


def _dense_view(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json as its dense architecture's (Mistral, Qwen3) for the attention, norms and embeddings."""
    head_dim = hf.get('head_dim') or hf['hidden_size'] // hf['num_attention_heads']  # Qwen3-MoE: not 128
    return hf | {'model_type': ATTENTION[hf['model_type']], 'head_dim': head_dim}


def _counts(hf: dict[str, Any]) -> tuple[int, int, int]:
    """(E, k, F) of a MoE config.json as transformers reads it (`_experts` checks them)."""
    kind = hf['model_type']
    e = hf.get('num_local_experts') or hf.get('num_experts') or DEFAULTS[kind][0]
    k = hf.get('num_experts_per_tok') or DEFAULTS[kind][1]
    return e, k, hf['intermediate_size'] if kind == 'mixtral' else hf.get('moe_intermediate_size') or 768


def _experts(hf: dict[str, Any], refuse) -> tuple[int, int, int]:
    """`_counts`, each one line where it is not what our layer computes."""
    local, named = hf.get('num_local_experts'), hf.get('num_experts')
    if local is not None and named is not None and local != named:
        refuse('num_experts', named, f'it differs from num_local_experts = {local}: save the model again')
    e, k, f = _counts(hf)
    if k > e:
        refuse('num_experts_per_tok', k, f'use at most the {e} experts')
    return e, k, f


def _moe_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """Our model.* fields of the experts (the dense converter gives the rest)."""
    refuse, kind = _refuser(where), hf['model_type']
    e, k, f = _experts(hf, refuse)
    if hf.get('router_jitter_noise'):
        refuse('router_jitter_noise', hf['router_jitter_noise'], 'use a model with router_jitter_noise 0.0')
    if hf.get('mlp_only_layers'):
        refuse('mlp_only_layers', hf['mlp_only_layers'], 'dense layers among the MoE ones are not read yet: use a '
               'model whose every layer is MoE (mlp_only_layers [])')
    if hf.get('decoder_sparse_step', 1) not in (1, None):
        refuse('decoder_sparse_step', hf['decoder_sparse_step'], 'use a model whose every layer is MoE '
               '(decoder_sparse_step 1)')
    coef = hf.get('router_aux_loss_coef', AUX_COEF)
    if not 0 <= coef < math.inf:
        refuse('router_aux_loss_coef', coef, 'use a finite number >= 0')
    norm = DEFAULTS[kind][2] if kind == 'mixtral' else hf.get('norm_topk_prob', DEFAULTS[kind][2])
    if not isinstance(norm, bool):
        refuse('norm_topk_prob', norm, 'use true or false')
    return {'moe_experts': e, 'moe_top_k': k, 'moe_mlp_dim': f, 'moe_shared_experts': 0, 'moe_first_dense': 0,
            'moe_router': 'softmax', 'moe_norm_topk': norm, 'moe_routed_scale': 1.0, 'moe_router_bias': False,
            'moe_lb_coef': float(coef)}


def _moe_layouts(hf: dict[str, Any], dense_layout: Layout) -> tuple[Layout, ...]:
    """(the hub's per-expert tensors, transformers 5's fused ones) of one MoE layer, attention first."""
    d, kind = hf['hidden_size'], hf['model_type']
    e, _, f = _counts(hf)
    attention = tuple(row for row in dense_layout if not row[1].startswith('mlp.'))
    prefix, names = HUB[kind]
    shapes = ((f, d), (f, d), (d, f))
    hub = ((('mlp/w_router', f'{prefix}gate.weight', (e, d)),) +
           tuple((ours, f'{prefix}experts.{i}.{name}.weight', shape)
                 for ours, name, shape in zip(EXPERTS, names, shapes) for i in range(e)))
    fused = (('mlp/w_router', 'mlp.gate.weight', (e, d)), ('mlp/w_gate', 'mlp.experts.gate_up_proj', (e, 2 * f, d)),
             ('mlp/w_up', 'mlp.experts.gate_up_proj', (e, 2 * f, d)), ('mlp/w_down', 'mlp.experts.down_proj', (e, d, f)))
    return attention + hub, attention + fused


def _to_hf(dense: Callable, name: str, a: np.ndarray) -> list[np.ndarray]:
    if name == 'mlp/w_router':  # [d, E] -> [E, d]
        return [a.T]
    if name in EXPERTS and a.ndim == 3:  # [E, in, out] -> E x [out, in]
        return [x.T for x in a]
    return dense(name, a)


def _from_hf(dense: Callable, name: str, arrays: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    """`_to_hf`'s inverse; a single 3-d array is transformers 5's fused experts (gate_up [E, 2F, d], down)."""
    if name == 'mlp/w_router':
        return arrays[0].T.reshape(shape)
    if name not in EXPERTS or len(shape) != 3:
        return dense(name, arrays, shape)
    if arrays[0].ndim == 3:
        fused, f = arrays[0], shape[-1]
        part = {'mlp/w_gate': fused[:, :f], 'mlp/w_up': fused[:, f:], 'mlp/w_down': fused}[name]
        return np.ascontiguousarray(part.transpose(0, 2, 1)).reshape(shape)
    return np.stack([x.T for x in arrays]).reshape(shape)


def _check_exportable(dense: Callable, m: dict[str, Any], where: str) -> None:
    dense(m, where)
    if not m.get('moe_experts'):
        return
    for bad, problem in (
            (m['moe_shared_experts'], f'{m["moe_shared_experts"]} shared experts: Mixtral and Qwen3-MoE have none'),
            (m['moe_first_dense'], f'the first {m["moe_first_dense"]} layers dense (Qwen3-MoE\'s mlp_only_layers): '
             'not exported yet'),
            (m['moe_router'] != 'softmax' or m['moe_router_bias'] or m['moe_routed_scale'] != 1.0,
             'a router other than a softmax without bias or scale, which Mixtral and Qwen3-MoE have'),
            (not m['qk_norm'] and not m['moe_norm_topk'], 'moe_norm_topk False without qk_norm: Mixtral always '
             'renormalises the top-k weights (Qwen3-MoE, with QK-norm, may not)'),
            (m['qkv_bias'], 'q/k/v biases, which neither Mixtral nor Qwen3-MoE has')):
        if bad:
            raise CheckpointError(f'{where}: a mixture-of-experts model with {problem}. Fix: none; export safetensors.')


def _hf_config(dense: Callable, expert_width: Callable, m: dict[str, Any], eot_id: int | None) -> dict[str, Any]:
    """MixtralConfig (Qwen3MoeConfig with QK-norm) for a saved MoE config's model.*; the dense one otherwise."""
    out = dense(m, eot_id)
    if not m.get('moe_experts'):
        return out
    moe = {'num_experts_per_tok': m['moe_top_k'], 'router_aux_loss_coef': float(m['moe_lb_coef']),
           'output_router_logits': False}
    drop = ('layer_types', 'max_window_layers', 'attention_bias', 'mlp_bias', 'pretraining_tp')
    out = {key: value for key, value in out.items() if key not in drop}
    if m.get('qk_norm'):
        return out | {'architectures': [QWEN3_MOE[0]], 'model_type': QWEN3_MOE[1], 'attention_bias': False,
                      'num_experts': m['moe_experts'], 'moe_intermediate_size': expert_width(m),
                      'norm_topk_prob': bool(m['moe_norm_topk']), 'decoder_sparse_step': 1, 'mlp_only_layers': [],
                      'use_sliding_window': False, 'sliding_window': None} | moe
    return out | {'architectures': [MIXTRAL[0]], 'model_type': MIXTRAL[1], 'num_local_experts': m['moe_experts'],
                  'intermediate_size': expert_width(m), 'router_jitter_noise': 0.0, 'sliding_window': None} | moe


def with_moe(dense: HFConverter, expert_width: Callable[[Mapping[str, Any]], int]) -> HFConverter:
    """The Llama family's converter `dense` that also reads and writes Mixtral and Qwen3-MoE.

    `expert_width(m)`: the experts' width F of saved model.* `m` (families/moe.py `expert_width`).
    """
    def model_fields(hf, where):
        if hf['model_type'] not in ATTENTION:
            return dense.model_fields(hf, where)
        return dense.model_fields(_dense_view(hf), where) | _moe_fields(hf, where)

    def layouts(hf):
        if hf['model_type'] not in ATTENTION:
            return dense.layer_layouts(hf)
        return _moe_layouts(hf, dense.layer_layouts(_dense_view(hf))[0])

    return dataclasses.replace(
        dense, reads=dense.reads + (MIXTRAL, QWEN3_MOE),
        optional_ints=dense.optional_ints + ('num_local_experts', 'num_experts', 'num_experts_per_tok',
                                             'moe_intermediate_size', 'decoder_sparse_step'),
        numbers=dense.numbers + ('router_aux_loss_coef', 'router_jitter_noise'),
        check_exportable=lambda m, where: _check_exportable(dense.check_exportable, m, where),
        hf_config=lambda m, eot_id: _hf_config(dense.hf_config, expert_width, m, eot_id),
        model_fields=model_fields, layouts=layouts,
        layer_shapes=lambda hf: {theirs: shape for _, theirs, shape in layouts(hf)[0]},
        to_hf=lambda name, a: _to_hf(dense.to_hf, name, a),
        from_hf=lambda name, arrays, shape: _from_hf(dense.from_hf, name, arrays, shape),
        unmatched=dense.unmatched + ('moe_lb_coef',))
