"""Continue training a Hugging Face model: the model from a directory's config.json, its weights as the start.

  python -m jaxfrontier.main --config=configs/hf.py:path=models/Llama-3.2-1B,seq_len=2048,fsdp=8 \
      --config.data.kind=tokens --config.data.path=data/mine.bin --workdir=workdirs/ft
  python -m jaxfrontier.main --config=configs/hf.py:path=models/Llama-3.2-1B,fsdp=8,cpu_devices=8 ...  # on a CPU

The directory (GPT-2, Llama, Mistral, Qwen2 or Qwen3: config.json + model.safetensors, as
transformers' save_pretrained writes it) gives model.*: the family, layers, width, heads and kv
heads, MLP width, vocabulary, tied head, and for Llama the RMSNorm epsilon, RoPE theta and Llama 3.1
scaling, q/k/v biases (Qwen2), QK-norm and the head width (Qwen3). `checkpoint.init_params_from` is
the same directory, so step 0 starts from its weights (checkpoint/interop/hf.py; a config the family
cannot express is refused with one line). Tokenise your data with the directory's tokenizer
(`python -m jaxfrontier.prepare --tokenizer=models/Llama-3.2-1B`) so the token ids mean the same.
`seq_len` (default the model's max_position_embeddings / n_positions) is the training context; a
GPT-2 may not exceed its position table. Mesh: `data/fsdp/context/tensor/pipeline` (each 1 unless
given); `cpu_devices=N` simulates N devices on a CPU (mesh.cpu_devices: their product, e.g.
fsdp=8,cpu_devices=8). Training computes in bf16 with full remat, as on a GPU (the run's `state:`
line says so; `--config.model.dtype=float32` to change); `--mode=sample`, `eval` and `lm_eval` compute
in float32 on a CPU whatever model.dtype (main's --cpu_fp32), so that greedy sampling there continues
as transformers' fp32 does. Everything else is the base config's, overridable on the command line.
"""

from jaxfrontier import config as config_lib
from jaxfrontier.checkpoint.interop import hf_files
from jaxfrontier.errors import ConfigError


ARGS = dict(path='', seq_len=0, data=0, fsdp=1, context=1, tensor=1, pipeline=1, micro_batch=1, accum=1, cpu_devices=0)


def get_config(arg=None):
    return from_args(config_lib.parse_arg(arg, **ARGS))


def from_args(a):
    """The config of parsed arguments (ARGS' keys); configs/sft.py starts from it."""
    if not a.path:
        raise ConfigError('<arg>.path', a.path, 'no Hugging Face directory named',
                          'use --config=configs/hf.py:path=<directory with config.json and model.safetensors>')
    if not hf_files.looks_like_hf(a.path):
        raise ConfigError('<arg>.path', a.path, 'not a Hugging Face model directory (config.json with a model_type, '
                          'model.safetensors)', 'name the directory transformers\' save_pretrained wrote')
    hf = hf_files.read_config(a.path)
    fields = hf_files.converter_of(hf, a.path).model_fields(hf, a.path)
    c = config_lib.base_config()
    c.model.update(fields, dtype='bfloat16', remat='full', vocab_multiple=128)
    if a.seq_len:
        c.model.seq_len = a.seq_len
    c.checkpoint.init_params_from = a.path
    c.mesh.update(data=a.data or 1, fsdp=a.fsdp, context=a.context, tensor=a.tensor, pipeline=a.pipeline,
                  cpu_devices=a.cpu_devices)
    dp = c.mesh.data * c.mesh.fsdp
    c.train.update(steps=1000, micro_batch=a.micro_batch, accum_steps=a.accum,
                   global_batch=a.micro_batch * a.accum * dp, log_every=10, eval_every=200)
    c.optim.update(lr=3e-5, min_lr=3e-6, warmup_steps=50)  # a trained model: a fine-tuning rate
    c.data.kind = 'tokens'
    return c
