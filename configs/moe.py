"""Mixture-of-experts models (the Llama family with MoE layers, families/moe.py) with published shapes.

  python -m jaxfrontier.main --config=configs/moe.py:size=tiny --workdir=workdirs/moe_tiny
  python -m jaxfrontier.main --config=configs/moe.py:size=qwen3_30b_a3b --mode=plan --hardware=mi250x
  python -m jaxfrontier.main --config=configs/moe.py:size=mixtral_8x7b,layout=frontier --mode=plan
  python -m jaxfrontier.main --config=configs/moe.py:size=tiny,expert=4 --mode=verify

Sizes (Hugging Face config.json of each): `mixtral_8x7b` (mistralai/Mixtral-8x7B-v0.1: 8 experts, top 2,
softmax router), `qwen3_30b_a3b` and `qwen3_235b_a22b` (Qwen/Qwen3-30B-A3B, -235B-A22B: 128 experts of
width 768 / 1536, top 8, QK-norm, heads 128 wide apart from d / h), and `moe_1t`: a DeepSeek-V3 /
Kimi-K2-like shape of about 1.03 T parameters and 35 B active (61 layers of d 7168, the first dense, 384
routed experts of width 2048 plus one shared, top 8, sigmoid router with a bias moved by its load,
routed scale 2.827) with grouped-query attention (64 query heads of 128, 8 k/v heads) where Kimi K2 has
MLA, which is not built. `tiny`: a small model for tests (8 experts of width 64, top 2, byte vocabulary).

Mesh: every device on data parallelism unless `data/fsdp/tensor/pipeline/expert` are given, or
`layout=frontier`: the layout `--mode=plan --search` chose on Frontier's MI250X GCDs (FRONTIER below;
docs/models.md has the table, predictions of the planner, not measurements).
"""

from jaxfrontier import config as config_lib
from jaxfrontier.errors import ConfigError

# size -> model.* fields (the Llama family's plus the MoE layer's, families/moe.py).
_QWEN3 = dict(vocab_size=151936, head_dim=128, qk_norm=True, rope_theta=1000000.0, norm_eps=1e-6,
              moe_top_k=8, moe_experts=128, moe_router='softmax', moe_norm_topk=True)
SIZES = {
    'tiny': dict(num_layers=2, d_model=128, num_heads=4, num_kv_heads=2, mlp_dim=384, vocab_size=256,
                 moe_experts=8, moe_top_k=2, moe_mlp_dim=64),
    'mixtral_8x7b': dict(num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8, mlp_dim=14336,
                         vocab_size=32000, rope_theta=1000000.0, norm_eps=1e-5, moe_experts=8, moe_top_k=2,
                         moe_router='softmax', moe_norm_topk=True),
    'qwen3_30b_a3b': dict(num_layers=48, d_model=2048, num_heads=32, num_kv_heads=4, mlp_dim=6144,
                          moe_mlp_dim=768, **_QWEN3),
    'qwen3_235b_a22b': dict(num_layers=94, d_model=4096, num_heads=64, num_kv_heads=4, mlp_dim=12288,
                            moe_mlp_dim=1536, **_QWEN3),
    'moe_1t': dict(num_layers=61, d_model=7168, num_heads=64, num_kv_heads=8, head_dim=128, mlp_dim=18432,
                   vocab_size=163840, rope_theta=50000.0, norm_eps=1e-6, moe_experts=384, moe_top_k=8,
                   moe_mlp_dim=2048, moe_shared_experts=1, moe_first_dense=1, moe_router='sigmoid',
                   moe_norm_topk=True, moe_routed_scale=2.827, moe_router_bias=True, moe_bias_rate=0.001),
}
SEQ_LEN = {'mixtral_8x7b': 4096}  # training sequence length; 4,096 elsewhere too (the default below)

# size -> Frontier layout (MI250X GCDs, 8 per node) at a global batch of 1,024 sequences of 4,096 tokens
# (4 M tokens): the fastest that fits of
#   python -m jaxfrontier.main --config=configs/moe.py:size=SIZE,accum=1024 --mode=plan --search \
#       --search_devices=N --hardware=mi250x
# docs/models.md "Mixture of experts on Frontier" has the plan's figures (predictions).
FRONTIER = {
    # 64 GCDs (8 nodes): data 2 x fsdp 32, micro-batch 8 x 2, full remat; EP 1 (8 experts of 14,336: the fsdp
    # gathers hide behind the compute, expert parallelism's token gathers would not).
    # Plan: 53.5 GiB per GCD, 60.7 s per step, 69,142 tokens/s, MFU 46.8 % (89.6 model TFLOP/s per GCD).
    'mixtral_8x7b': dict(tensor=1, pipeline=1, data=2, fsdp=32, expert=1, zero1=False, micro_batch=8, accum=2,
                         remat='full'),
    # 32 GCDs (4 nodes): pipeline 8 (interleaved, 2 chunks) x data 2 x fsdp 2, ZeRO-1, micro-batch 2 x 128.
    # Plan: 51.5 GiB per GCD, 42.8 s per step, 98,058 tokens/s, MFU 44.7 % (85.5 model TFLOP/s per GCD).
    'qwen3_30b_a3b': dict(tensor=1, pipeline=8, data=2, fsdp=2, expert=1, zero1=True, micro_batch=2, accum=128,
                          remat='full', schedule='interleaved', virtual=2),
    # 256 GCDs (32 nodes): data 2 x fsdp 16 x expert 8, ZeRO-1, micro-batch 2 x 2, full remat, ragged dispatch
    # (the search's pick at EP = k; auto would take gather, 24.9 %).
    # Plan: 53.3 GiB per GCD, 56.5 s per step, 74,294 tokens/s, MFU 25.3 % (48.5 model TFLOP/s per GCD).
    'qwen3_235b_a22b': dict(tensor=1, pipeline=1, data=2, fsdp=16, expert=8, zero1=True, micro_batch=2, accum=2,
                            remat='full', dispatch='ragged'),
    # 1,024 GCDs (128 nodes): data 2 x fsdp 16 x expert 32, ZeRO-1, micro-batch 1, full remat, ragged dispatch.
    # Plan: 57.0 GiB per GCD, 42.8 s per step, 97,949 tokens/s, MFU 11.3 % (21.6 model TFLOP/s per GCD):
    # 15.5 s of compute, 27.3 s of exposed communication over the network: 12.9 s the ragged dispatch (k n d
    # per device and layer each way, 3/4 of it to other nodes at 12.5 GB/s per GCD), 11.0 s the fsdp gathers of
    # the expert weights (docs/models.md). With gather (the all-gather of the group's tokens): 91.1 s, 5.3 %.
    'moe_1t': dict(tensor=1, pipeline=1, data=2, fsdp=16, expert=32, zero1=True, micro_batch=1, accum=1,
                   remat='full', dispatch='ragged'),
}


def get_config(arg=None):
    a = config_lib.parse_arg(arg, size='tiny', data=0, fsdp=1, tensor=1, pipeline=1, expert=1, micro_batch=1,
                             accum=1, layout='')
    if a.size not in SIZES:
        raise ConfigError('<arg>.size', a.size, 'unknown MoE size', f'use one of {sorted(SIZES)}')
    c = config_lib.base_config()
    c.model.update(family='llama', tied_embeddings=False, norm_eps=1e-5, rope_theta=10000.0, init_std=0.02,
                   remat='full')
    c.model.update(**SIZES[a.size])
    if a.size == 'tiny':
        c.model.update(seq_len=64, vocab_multiple=128, dtype='float32', remat='none')
        c.mesh.update(data=a.data or 1, fsdp=a.fsdp, tensor=a.tensor, pipeline=a.pipeline, expert=a.expert)
        dp = c.mesh.data * c.mesh.fsdp * c.mesh.expert  # 16 sequences a step
        accum = max(1, 16 // (4 * dp))
        c.train.update(steps=300, global_batch=16, micro_batch=16 // (accum * dp), accum_steps=accum,
                       log_every=25, eval_every=100)
        c.optim.update(lr=3e-3, min_lr=3e-4, warmup_steps=30)
        return c
    c.model.update(seq_len=SEQ_LEN.get(a.size, 4096), vocab_multiple=128, dtype='bfloat16')
    c.mesh.update(data=a.data or 1, fsdp=a.fsdp, tensor=a.tensor, pipeline=a.pipeline, expert=a.expert)
    if a.layout:
        if a.layout != 'frontier' or a.size not in FRONTIER:
            raise ConfigError('<arg>.layout', a.layout, f'no such layout for size {a.size}',
                              f'use layout=frontier with size one of {sorted(FRONTIER)}, or no layout')
        f = FRONTIER[a.size]
        c.mesh.update(data=f['data'], fsdp=f['fsdp'], tensor=f['tensor'], pipeline=f['pipeline'],
                      expert=f['expert'])
        c.sharding.zero1, c.model.remat = f['zero1'], f['remat']
        c.model.moe_dispatch = f.get('dispatch', 'auto')
        c.sharding.sequence_parallel = 'true' if f.get('sp') else 'false'
        c.pipeline.update(schedule=f.get('schedule', '1f1b'), virtual_stages=f.get('virtual', 1))
        a.micro_batch, a.accum = f['micro_batch'], f['accum']
    dp = c.mesh.data * c.mesh.fsdp * c.mesh.expert
    c.train.update(steps=1000, micro_batch=a.micro_batch, accum_steps=a.accum,
                   global_batch=a.micro_batch * a.accum * dp, log_every=10, eval_every=200)
    c.optim.update(lr=3e-4, min_lr=3e-5, warmup_steps=100)
    c.data.kind = 'synthetic'
    return c
