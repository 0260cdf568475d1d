"""The same GPT in PyTorch, timed under torch.compile (the row benchmarks/gpu_check.py puts beside ours).

nanoGPT-style and shaped like jaxfrontier's model (jaxfrontier/model/gpt.py): learned position
embeddings, pre-LayerNorm blocks with a fused QKV projection, causal
`F.scaled_dot_product_attention` (fused kernels where PyTorch has them), GELU MLP of width
mlp_ratio x d, final LayerNorm, head tied to the token embedding over the padded vocabulary;
fp32 parameters, bf16 autocast on GPUs, fused AdamW (lr 6e-4, betas 0.9/0.95, weight decay
0.1) and global-norm clipping 1.0, as configs/gpt.py. Importing this module needs torch.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from jaxfrontier import config as config_lib


class Block(nn.Module):
    def __init__(self, d: int, heads: int, mlp: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, mlp), nn.Linear(mlp, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, h, t, hd]
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, d: int, heads: int, layers: int, mlp: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, mlp) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        for module in self.modules():  # GPT-2's N(0, 0.02) weights, zero biases (jaxfrontier's init_std)
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, tokens, targets):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def hf_llama(c) -> nn.Module:
    """transformers' LlamaForCausalLM of config `c`'s Llama shape (sdpa attention, tied embeddings as `c`),
    wrapped so that `forward(tokens, targets)` is the mean next-token loss, as `GPT`'s."""
    import transformers  # pylint: disable=g-import-not-at-top  (the test extra)
    m = c.model
    hf = transformers.LlamaConfig(vocab_size=config_lib.padded_vocab(c), hidden_size=m.d_model,
                                  intermediate_size=m.mlp_dim, num_hidden_layers=m.num_layers,
                                  num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
                                  max_position_embeddings=m.seq_len, rms_norm_eps=m.norm_eps,
                                  rope_theta=m.rope_theta, tie_word_embeddings=m.tied_embeddings,
                                  attn_implementation='sdpa')

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.llama = transformers.LlamaForCausalLM(hf)

        def forward(self, tokens, targets):
            logits = self.llama(input_ids=tokens).logits
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    return Loss()


def make_step(c, model: nn.Module | None = None, compiled: bool = True):
    """One training step of config `c`'s shape: (step() -> loss, info), eager or under torch.compile.

    `model`: a module whose `forward(tokens, targets)` is the mean loss (`hf_llama`); this module's
    GPT by default. The step runs forward, backward, clipping, AdamW and zeroing the gradients on
    one fixed batch; `step()` blocks on the loss (`float`). Nothing is compiled before the first call.
    """
    device = 'cuda' if torch.cuda.is_available() else 'cpu'  # ROCm builds of torch report 'cuda' too
    m, batch = c.model, c.train.micro_batch
    if model is None:
        model = GPT(config_lib.padded_vocab(c), m.seq_len, m.d_model, m.num_heads, m.num_layers,
                    m.mlp_ratio * m.d_model)
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device == 'cuda')
    dtype = torch.bfloat16 if device == 'cuda' else torch.float32

    def step(tokens):
        with torch.autocast(device, dtype=dtype, enabled=device == 'cuda'):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    run = torch.compile(step) if compiled else step
    tokens = torch.randint(0, m.vocab_size, (batch, m.seq_len + 1), device=device)
    info = {'torch': torch.__version__, 'device': device, 'threads': torch.get_num_threads(),
            'params': sum(p.numel() for p in model.parameters())}
    return (lambda: float(run(tokens))), info


def time_step(c, steps: int = 5, warmup: int = 2, model: nn.Module | None = None) -> dict:
    """Median step time, tokens/s and MFU (jaxfrontier's FLOP convention) of config `c`'s model.

    `model`: a module of `c`'s shape whose `forward(tokens, targets)` is the mean loss (`hf_llama`);
    this module's GPT by default. Timed under torch.compile.
    """
    step, info = make_step(c, model)
    device, m, batch = info['device'], c.model, c.train.micro_batch
    t0 = time.perf_counter()
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        loss = step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
        if i == 0:
            compile_s = time.perf_counter() - t0
    step_s = statistics.median(times)
    c.train.global_batch = batch
    model_flops, _ = config_lib.flops_per_step(c)
    import jax  # pylint: disable=g-import-not-at-top  (the device table's peak, as for our rows)
    from jaxfrontier import hardware  # pylint: disable=g-import-not-at-top
    peak, _ = hardware.device_peak_flops(jax.devices()[0], 'bfloat16' if device == 'cuda' else 'float32')
    peak_mem = torch.cuda.max_memory_allocated() / 2**30 if device == 'cuda' else None
    return {'torch': torch.__version__, 'device': device, 'step_s': step_s, 'compile_s': compile_s, 'loss': loss,
            'tokens_per_s': batch * m.seq_len / step_s, 'mfu': model_flops / step_s / peak,
            'allocator_peak_gib': peak_mem}
