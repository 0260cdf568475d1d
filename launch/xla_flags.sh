# XLA and collective-library settings for GPU runs (NVIDIA and AMD), one place for every launch script.
#
# Sourced by launch/frontier_env.sh and launch/slurm.sbatch. Each setting's reason:
# docs/PERFORMANCE.md, "GPU flags". tests/test_xla_flags.py starts XLA with every flag below and
# fails on one the installed jaxlib does not know (XLA aborts at start-up on an unknown flag).
# Flags already in XLA_FLAGS are kept after ours, so a user's value wins (XLA takes the last one);
# JF_XLA_FLAGS=none sets none of them.

if [[ "${JF_XLA_FLAGS:-}" != none ]]; then
  _jf_xla_flags=(
    --xla_gpu_enable_latency_hiding_scheduler=true
    --xla_gpu_enable_pipelined_all_gather=true
    --xla_gpu_enable_pipelined_reduce_scatter=true
    --xla_gpu_enable_pipelined_all_reduce=true
    --xla_gpu_all_gather_combine_threshold_bytes=134217728
    --xla_gpu_reduce_scatter_combine_threshold_bytes=134217728
    --xla_gpu_all_reduce_combine_threshold_bytes=134217728
  )
  export XLA_FLAGS="${_jf_xla_flags[*]}${XLA_FLAGS:+ ${XLA_FLAGS}}"
  unset _jf_xla_flags
fi
# 90 % of each GPU's memory for XLA's pool (JAX's default is 75 %); the rest for cuDNN/MIOpen, NCCL/RCCL.
if [[ -z "${XLA_PYTHON_CLIENT_MEM_FRACTION+set}" ]]; then export XLA_PYTHON_CLIENT_MEM_FRACTION=0.90; fi
