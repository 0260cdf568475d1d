"""Throughput sweep: the benchmarks/ entry point of `python -m jaxfrontier.sweep` (same flags).

  python benchmarks/sweep.py --config=configs/tiny.py --space tensor=1,2,4 --space pipeline=1,2 \
      --space micro_batch=1,2 --workdir=workdirs/sweep_tiny
  python benchmarks/sweep.py --config=configs/gpt.py:size=1.3b --config.mesh.cpu_devices=0 --hardware=h100 \
      --space tensor=1,2,4,8 --space micro_batch=1,2,4 --space remat=full,save_dots --devices=8

Each trial warms up (--warmup steps), then measures (--steps); records, report and plots go to
--workdir (docs/sweeps.md). FLOP convention: Megatron's formula, model FLOPs f = 3 for MFU, the
paper's hardware counter f = 4 with recomputation (jaxfrontier/run/observe/metrics.py).
"""

from jaxfrontier.sweep import cli as sweep

if __name__ == '__main__':
    sweep.run()
