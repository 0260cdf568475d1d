"""Each family's Hugging Face names (family.HFNames), importable before JAX starts.

The family modules declare them (`gpt.FAMILY.hf`, `llama.FAMILY.hf`); they are written here,
apart from the JAX modules, because configs/hf.py and the directory checks
(checkpoint/interop/hf_files.py) read them while the config is being built, before JAX may be
imported (main.py sets XLA_FLAGS and the compilation cache after reading the config). The
conversions themselves (reshapes, transposes) are checkpoint/interop/hf_gpt2.py's and hf_llama.py's.
"""

from __future__ import annotations

from jaxfrontier.model.family import HFNames

# GPT-2 in `transformers` (GPT2LMHeadModel): every parameter maps exactly (checkpoint/interop/hf_gpt2.py).
# HF Conv1D weights are [in, out], our layout after a reshape; wte, wpe and an untied head
# are named by the converter, which also trims the padded vocabulary.
GPT2 = HFNames(
    architecture='GPT2LMHeadModel',
    model_type='gpt2',
    activations=('gelu_new', 'gelu_pytorch_tanh'),  # jax.nn.gelu: the tanh approximation
    layer_prefix='transformer.h.{layer}.',
    block_names=(('ln1/scale', 'ln_1.weight'), ('ln1/bias', 'ln_1.bias'),
                 ('attn/w_qkv', 'attn.c_attn.weight'), ('attn/b_qkv', 'attn.c_attn.bias'),
                 ('attn/w_out', 'attn.c_proj.weight'), ('attn/b_out', 'attn.c_proj.bias'),
                 ('ln2/scale', 'ln_2.weight'), ('ln2/bias', 'ln_2.bias'),
                 ('mlp/w_in', 'mlp.c_fc.weight'), ('mlp/b_in', 'mlp.c_fc.bias'),
                 ('mlp/w_out', 'mlp.c_proj.weight'), ('mlp/b_out', 'mlp.c_proj.bias')),
    top_names=(('ln_f/scale', 'transformer.ln_f.weight'), ('ln_f/bias', 'transformer.ln_f.bias')),
)

# Llama in `transformers` (LlamaForCausalLM; Qwen2ForCausalLM and MistralForCausalLM use the same
# names): torch Linear weights [out, in], our layout transposed with the heads flattened
# (checkpoint/interop/hf_llama.py). A parameter that stacks several HF tensors lists them in the order
# of its stacked axis (w_kv [d, 2, G, K]: k then v); the biases exist with model.qkv_bias.
LLAMA = HFNames(
    architecture='LlamaForCausalLM',
    model_type='llama',
    activations=('silu',),  # SwiGLU's gate
    layer_prefix='model.layers.{layer}.',
    block_names=(('attn_norm/scale', 'input_layernorm.weight'), ('attn/w_q', 'self_attn.q_proj.weight'),
                 ('attn/w_kv', 'self_attn.k_proj.weight'), ('attn/w_kv', 'self_attn.v_proj.weight'),
                 ('attn/b_q', 'self_attn.q_proj.bias'),
                 ('attn/b_kv', 'self_attn.k_proj.bias'), ('attn/b_kv', 'self_attn.v_proj.bias'),
                 ('attn/w_out', 'self_attn.o_proj.weight'), ('mlp_norm/scale', 'post_attention_layernorm.weight'),
                 ('mlp/w_gate', 'mlp.gate_proj.weight'), ('mlp/w_up', 'mlp.up_proj.weight'),
                 ('mlp/w_down', 'mlp.down_proj.weight')),
    top_names=(('norm_f/scale', 'model.norm.weight'),),
)
