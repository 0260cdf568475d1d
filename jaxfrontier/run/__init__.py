"""A training run: the loop over the step, what controls it and what observes it.

  validation  the run's config, data and vocabulary checked once, before JAX starts (no JAX)
  loop        `train_and_evaluate`: lock, mesh, data, state, compile, the loop, the final save
  after_step  the decisions after each step: report the previous one, save or roll back, stop, evaluate
  control/    run control: the workdir lock, preemption signals, Ctrl-C, the hang watchdog, a full disk
  observe/    observation: metrics rows, goodput, stragglers, W&B, the profiler, the memory check

The step itself (state, optimizer, step, loss scaling, reduction, evaluation) is training/'s;
the planner imports that, never this package.
"""
