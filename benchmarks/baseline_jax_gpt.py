"""Plain jitted JAX GPT training step: the reference jaxfrontier is measured against.

Self-contained on purpose (jax, optax, numpy only), so it measures what XLA does with a
straightforward model, not what jaxfrontier does. Same architecture as jaxfrontier's GPT:
pre-LayerNorm decoder, learned positions, fused-QKV causal attention with biases, GeLU-tanh
MLP of width 4d, final LayerNorm, head tied to the token embedding, fp32 mean cross entropy,
AdamW (clip 1.0, b1 0.9, b2 0.95, wd 0.1 on weights) with warm-up + cosine.

    JAX_PLATFORMS=cpu python benchmarks/baseline_jax_gpt.py --layers 6 --d-model 384

FLOP convention: Megatron-LM (Narayanan et al. 2021) without recompute,
72 B s l h^2 (1 + s/(6h) + V/(16 l h)) per step; `tflops` is that over the median step time.
The `--flat/--attn/--mask/--xent/--qkv/--remat` flags select the formulation variants
compared in the module's investigation; the defaults are the fastest measured on XLA:CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int = 6
    d_model: int = 384
    heads: int = 6
    seq_len: int = 256
    vocab: int = 512
    batch: int = 8
    dtype: str = 'float32'  # compute dtype; parameters and the loss stay fp32
    steps: int = 20
    warmup: int = 3
    scan: bool = False  # lax.scan over stacked layer params instead of an unrolled loop
    flat: bool = True  # feed matmuls [B*T, d] rather than [B, T, d]
    attn: str = 'bthd'  # bthd: einsum on [B,T,H,Dh] | bhtd: transpose first | xla: jax.nn
    mask: str = 'where'  # where: jnp.where on the scores | bias: add a 0/-inf [T,T] bias
    xent: str = 'lse'  # lse: logsumexp - one-hot dot | log_softmax: take_along_axis
    qkv: str = 'd3hk'  # d3hk: w_qkv [d,3,H,Dh] | dd: w_qkv [d,3d]
    remat: bool = False  # jax.checkpoint each block
    lr: float = 6e-4
    min_lr: float = 6e-5
    lr_warmup: int = 10
    lr_decay: int = 1000
    seed: int = 0


def init_params(key, cfg: Config) -> dict:
    """fp32 GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2L), zero biases.

    Block params carry a leading layer axis when `cfg.scan`, else `blocks` is a list of dicts.
    """
    d, h, L = cfg.d_model, cfg.heads, cfg.layers
    k = d // h
    std, proj_std = 0.02, 0.02 / np.sqrt(2 * L)
    qkv_shape = (d, 3, h, k) if cfg.qkv == 'd3hk' else (d, 3 * d)
    k_emb, k_pos, k_blocks = jax.random.split(key, 3)

    def block(bkey):
        kq, ko, kf, kp = jax.random.split(bkey, 4)
        return dict(
            ln1_g=jnp.ones((d,)), ln1_b=jnp.zeros((d,)),
            w_qkv=std * jax.random.normal(kq, qkv_shape), b_qkv=jnp.zeros(qkv_shape[1:]),
            w_o=proj_std * jax.random.normal(ko, (d, d)), b_o=jnp.zeros((d,)),
            ln2_g=jnp.ones((d,)), ln2_b=jnp.zeros((d,)),
            w_fc=std * jax.random.normal(kf, (d, 4 * d)), b_fc=jnp.zeros((4 * d,)),
            w_proj=proj_std * jax.random.normal(kp, (4 * d, d)), b_proj=jnp.zeros((d,)),
        )

    keys = jax.random.split(k_blocks, L)
    blocks = jax.vmap(block)(keys) if cfg.scan else [block(bk) for bk in keys]
    return dict(
        wte=std * jax.random.normal(k_emb, (cfg.vocab, d)),
        wpe=std * jax.random.normal(k_pos, (cfg.seq_len, d)),
        blocks=blocks, lnf_g=jnp.ones((d,)), lnf_b=jnp.zeros((d,)),
    )


def _layer_norm(x, g, b, eps=1e-5):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * g + b).astype(x.dtype)


def _attention(q_bthk, k_bthk, v_bthk, cfg: Config):
    """Causal softmax attention; returns [B, T, H, Dh]."""
    t = q_bthk.shape[1]
    if cfg.attn == 'xla':
        return jax.nn.dot_product_attention(
            q_bthk, k_bthk, v_bthk, is_causal=True, implementation='xla')
    scale = q_bthk.shape[-1] ** -0.5
    causal_tt = jnp.tril(jnp.ones((t, t), bool))
    if cfg.attn == 'bhtd':
        q, kk, v = (a.transpose(0, 2, 1, 3) for a in (q_bthk, k_bthk, v_bthk))  # [B,H,T,Dh]
        s_bhqk = jnp.einsum('bhqd,bhkd->bhqk', q * scale, kk)
    else:
        s_bhqk = jnp.einsum('bqhd,bkhd->bhqk', q_bthk * scale, k_bthk)
    s_bhqk = s_bhqk.astype(jnp.float32)
    if cfg.mask == 'bias':
        s_bhqk = s_bhqk + jnp.where(causal_tt, 0.0, -jnp.inf)
    else:
        s_bhqk = jnp.where(causal_tt, s_bhqk, -jnp.inf)
    p_bhqk = jax.nn.softmax(s_bhqk, axis=-1).astype(q_bthk.dtype)
    if cfg.attn == 'bhtd':
        return jnp.einsum('bhqk,bhkd->bqhd', p_bhqk, v)
    return jnp.einsum('bhqk,bkhd->bqhd', p_bhqk, v_bthk)


def _block(x, p, cfg: Config):
    """One pre-LN block. x is [B*T, d] when cfg.flat, else [B, T, d]."""
    b, t, d, h = cfg.batch, cfg.seq_len, cfg.d_model, cfg.heads
    w_qkv = p['w_qkv'].reshape(d, 3 * d)  # [d, 3*H*Dh]
    y = _layer_norm(x, p['ln1_g'], p['ln1_b'])
    qkv = y @ w_qkv + p['b_qkv'].reshape(3 * d)
    qkv = qkv.reshape(b, t, 3, h, d // h)  # [B, T, 3, H, Dh]
    o_bthk = _attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], cfg)
    o = o_bthk.reshape(x.shape)  # [B*T, d] or [B, T, d]
    x = x + (o @ p['w_o'] + p['b_o'])
    y = _layer_norm(x, p['ln2_g'], p['ln2_b'])
    y = jax.nn.gelu(y @ p['w_fc'] + p['b_fc'])
    return x + (y @ p['w_proj'] + p['b_proj'])


def loss_fn(params, tokens, cfg: Config):
    """Mean next-token cross entropy in fp32; tokens is [B, T+1] int32."""
    b, t, d = cfg.batch, cfg.seq_len, cfg.d_model
    dt = jnp.dtype(cfg.dtype)
    params = jax.tree.map(lambda a: a.astype(dt), params)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = params['wte'][inputs] + params['wpe'][None, :t]  # [B, T, d]
    if cfg.flat:
        x = x.reshape(b * t, d)  # [B*T, d]
    block = lambda x_, p_: _block(x_, p_, cfg)
    if cfg.remat:
        block = jax.checkpoint(block)
    if cfg.scan:
        x, _ = jax.lax.scan(lambda c, p_: (block(c, p_), None), x, params['blocks'])
    else:
        for p in params['blocks']:
            x = block(x, p)
    x = _layer_norm(x, params['lnf_g'], params['lnf_b']).reshape(b * t, d)
    logits_nv = (x @ params['wte'].T).astype(jnp.float32)  # [B*T, V]
    targets_n = targets.reshape(-1)
    if cfg.xent == 'log_softmax':
        logp = jax.nn.log_softmax(logits_nv, axis=-1)
        nll = -jnp.take_along_axis(logp, targets_n[:, None], axis=-1)[:, 0]
    else:
        onehot_nv = jax.nn.one_hot(targets_n, cfg.vocab, dtype=jnp.float32)
        nll = jax.nn.logsumexp(logits_nv, axis=-1) - jnp.sum(logits_nv * onehot_nv, -1)
    return nll.mean()


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """Clip 1.0 + AdamW with warm-up + cosine; decays only weights (names starting 'w')."""
    sched = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, cfg.lr_warmup, max(cfg.lr_decay, cfg.lr_warmup + 1), cfg.min_lr)

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: str(getattr(path[-1], 'key', '')).startswith('w'), params)

    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(sched, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=decay_mask))


def make_train_step(cfg: Config):
    """Returns (jitted step, optimizer); step(params, opt_state, tokens) -> (p, s, loss)."""
    tx = make_optimizer(cfg)

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, cfg)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1)), tx


def model_flops_per_step(cfg: Config) -> float:
    """Megatron-LM model FLOPs, f=3 (forward + backward, no recompute)."""
    b, s, l, h, v = cfg.batch, cfg.seq_len, cfg.layers, cfg.d_model, cfg.vocab
    return 24 * 3 * b * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))


def make_state(cfg: Config):
    """(step, params, opt_state, tokens) ready to run; tokens are a fixed random batch."""
    step, tx = make_train_step(cfg)
    params = jax.jit(init_params, static_argnums=1)(jax.random.PRNGKey(cfg.seed), cfg)
    opt_state = jax.jit(tx.init)(params)
    tokens = jax.random.randint(
        jax.random.PRNGKey(cfg.seed + 1), (cfg.batch, cfg.seq_len + 1), 0, cfg.vocab, jnp.int32)
    return step, params, opt_state, tokens


def run_benchmark(cfg: Config) -> dict:
    """Compiles, runs `cfg.warmup` steps, times `cfg.steps` steps; returns the result dict."""
    step, params, opt_state, tokens = make_state(cfg)
    for _ in range(1 + cfg.warmup):  # the first call compiles
        params, opt_state, loss = step(params, opt_state, tokens)
    jax.block_until_ready(loss)
    times = []
    for _ in range(cfg.steps):
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, tokens)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    flops = model_flops_per_step(cfg)
    n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    return dict(
        impl='baseline_jax_gpt', median_step_s=med, tokens_per_s=cfg.batch * cfg.seq_len / med,
        params=n_params, model_flops_per_step=flops, tflops=flops / med / 1e12,
        loss=float(loss), backend=jax.default_backend(), devices=jax.device_count(),
        config=dataclasses.asdict(cfg))


def parse_args(argv=None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    for f in dataclasses.fields(Config):
        flag = '--' + f.name.replace('_', '-')
        if f.type == 'bool':
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            p.add_argument(flag, type=type(f.default), default=f.default)
    return Config(**vars(p.parse_args(argv)))


if __name__ == '__main__':
    print(json.dumps(run_benchmark(parse_args())))
