"""Observation of a run: what it reports while it trains.

  report        a fetched step as a metrics row (perf numbers, NaN check, eval line); the start-up phases
  metrics       perf metrics, metrics.jsonl / TensorBoard / progress bar and their sinks, the NaN check
  goodput       productive time over wall time, where the rest went (over restarts too)
  stragglers    each process's step time compared over the coordination service
  wandb_log     Weights & Biases (the `wandb` extra)
  profile       a jax.profiler trace of a range of steps
  memory_check  the compiled step's memory against the device's, before the first step
"""
