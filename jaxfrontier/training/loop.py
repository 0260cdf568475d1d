"""The train step and the training loop `train_and_evaluate(config, workdir)`.

The loop reads top to bottom: validate -> mesh -> data -> state -> compile -> loop -> final
evaluation. The step is a pure function `train_step(state, tokens) -> (state, metrics)`,
jitted once with donated state and explicit shardings.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import NamedSharding

from jaxfrontier.training import checkpoint as checkpoint_lib
from jaxfrontier.training import preemption as preemption_lib
from jaxfrontier.training import disk
from jaxfrontier.training import export
from jaxfrontier.training import interrupt
from jaxfrontier import config as config_lib
from jaxfrontier.data import dataset as data_lib
from jaxfrontier.model import registry as model_registry
from jaxfrontier import hardware
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.training import memory_check
from jaxfrontier.training import metrics as metrics_lib
from jaxfrontier import pipeline
from jaxfrontier.training import loss_scale
from jaxfrontier.training import profile as profile_lib
from jaxfrontier.training import reduction
from jaxfrontier.training import state as ts
from jaxfrontier.training import workdir_lock
from jaxfrontier.model import params as params_lib

State = dict[str, Any]
_log = checkpoint_lib.log  # process 0 only


def split_micro_batches(tokens_gt: jax.Array, accum_steps: int, dp_size: int) -> jax.Array:
    """[G, T] -> [A, G/A, T] such that every device keeps its own rows (no communication).

    The batch's rows are split into dp_size contiguous blocks, one per data-parallel replica;
    micro-batch a takes rows a*mb .. (a+1)*mb - 1 of every block.
    """
    g, t = tokens_gt.shape
    mb = g // (dp_size * accum_steps)
    x = tokens_gt.reshape(dp_size, accum_steps, mb, t).transpose(1, 0, 2, 3)  # [A, DP, mb, T]
    return mesh_lib.constrain(x.reshape(accum_steps, dp_size * mb, t), (None, 'batch', None))


def _dropout_key(c: ml_collections.ConfigDict, step: jax.Array, micro: jax.Array) -> jax.Array | None:
    """Dropout randomness is a function of (seed, step, micro-batch): no RNG in the state."""
    if c.model.dropout_rate == 0.0:
        return None
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(c.seed), step), micro)


def _accumulate(c: ml_collections.ConfigDict, layout: ts.StateLayout, grad_specs):
    """`(params, micro_abt, step[, scale]) -> (mean loss, mean grads)` over the micro-batches (no pipeline).

    The running sum is held in fp32 with `grad_specs` (where gradients live inside the loop).
    """
    accum, model_def = c.train.accum_steps, layout.model_def

    def micro_loss(params, tokens_bt, key):
        return model_def.bind(params).loss(tokens_bt[:, :-1], tokens_bt[:, 1:], key)

    value_and_grad = jax.value_and_grad(micro_loss)

    def grad_fn(params, tokens_bt, key, scale):
        if scale is None:
            return value_and_grad(params, tokens_bt, key)
        # Loss scaling (float16): the backward pass starts from `scale`, not 1; the loss is unscaled.
        loss, pull = jax.vjp(lambda p: micro_loss(p, tokens_bt, key), params)
        return loss, pull(scale.astype(loss.dtype))[0]

    constrain = lambda tree: jax.lax.with_sharding_constraint(tree, grad_specs)  # noqa: E731

    def accumulate(params, micro_abt, step, scale=None):
        if accum == 1:
            return grad_fn(params, micro_abt[0], _dropout_key(c, step, 0), scale)

        def body(carry, xs):
            loss_sum, grad_sum = carry
            tokens_bt, index = xs
            loss, grads = grad_fn(params, tokens_bt, _dropout_key(c, step, index), scale)
            return (loss_sum + loss, constrain(jax.tree.map(jnp.add, grad_sum, grads))), None

        zeros = constrain(jax.tree.map(jnp.zeros_like, params))
        (loss_sum, grad_sum), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros),
                                               (micro_abt, jnp.arange(accum)))
        return loss_sum / accum, jax.tree.map(lambda g: g / accum, grad_sum)

    return accumulate


def make_loss_and_grads(c: ml_collections.ConfigDict, layout: ts.StateLayout):
    """Returns `loss_and_grads(params, tokens, step, scale=None) -> (loss, grads)` over the accumulation steps.

    The loss is the mean over all tokens of the global batch; gradients are averaged over the
    micro-batches in fp32 and laid out like the optimizer state (`layout.update_shardings`).
    Where reduction.reduce_once holds, each data-parallel replica accumulates its own rows'
    gradients and they cross the `data` axis once per step (jaxfrontier/training/reduction.py).
    """
    accum, dp = c.train.accum_steps, config_lib.data_parallel_size(c)
    once = reduction.reduce_once(c, layout.rules, layout.param_shardings)
    if c.mesh.pipeline > 1:  # reduced once: the pipeline's own map is manual over `data` too
        micro_fn = pipeline.make_pipeline_grads(c, layout.model_def, _dropout_key, layout.rules if once else None)
    else:
        # Per micro-batch reduction: gradients meet the optimizer layout (ZeRO-1: a reduce-scatter)
        # in every step. Reduced once: they stay where the parameters are until the end.
        specs = layout.param_shardings if once else layout.update_shardings
        micro_fn = _accumulate(c, layout, jax.tree.map(lambda s: s.spec, specs))
        if once:
            micro_fn = reduction.data_local(micro_fn, layout.rules)

    def loss_and_grads(params, tokens_gt, step, scale=None):
        scaled = () if scale is None else (scale,)  # float16: gradients come back multiplied by `scale`
        loss, grads = micro_fn(params, split_micro_batches(tokens_gt, accum, dp), step, *scaled)
        return loss, jax.lax.with_sharding_constraint(grads, layout.update_shardings)

    return loss_and_grads


def make_train_step(c: ml_collections.ConfigDict, layout: ts.StateLayout):
    """Returns the pure `train_step(state, tokens) -> (state, metrics)` for this layout."""
    tx, schedule = layout.tx, layout.schedule
    loss_and_grads = make_loss_and_grads(c, layout)

    def train_step(state: State, tokens_gt: jax.Array) -> tuple[State, dict[str, jax.Array]]:
        params, scale_state = state['params'], state.get('loss_scale')
        scale = None if scale_state is None else scale_state['scale']
        loss, grads = loss_and_grads(params, tokens_gt, state['step'], scale)
        if scale_state is not None:
            grads = loss_scale.unscale(c, scale_state, grads)
        updates, opt_state = tx.update(grads, state['opt_state'], params)
        new_params = jax.lax.with_sharding_constraint(optax.apply_updates(params, updates), layout.param_shardings)
        new_state = {'step': state['step'] + 1, 'params': new_params, 'opt_state': opt_state}
        extra = {}
        if scale_state is not None:  # float16: an overflowing step keeps the old params and moments
            (new_state['params'], new_state['opt_state']), new_state['loss_scale'], extra = loss_scale.finish_step(
                c, scale_state, grads, (new_params, opt_state), (params, state['opt_state']))
        metrics = {'train/loss': loss, 'train/grad_norm': optax.tree.norm(grads),
                   'train/param_norm': optax.tree.norm(new_state['params']), 'train/lr': schedule(state['step']),
                   **extra}
        return new_state, metrics

    return train_step


def make_eval_step(c: ml_collections.ConfigDict, layout: ts.StateLayout):
    """Returns `eval_step(params, tokens) -> mean loss`, micro-batched like training."""
    accum, dp = c.train.accum_steps, config_lib.data_parallel_size(c)
    if c.mesh.pipeline > 1:  # a forward-only wave through the stages (pipeline.make_pipeline_eval)
        local = reduction.reduce_once(c, layout.rules, layout.param_shardings, training=False)
        return pipeline.make_pipeline_eval(c, layout.model_def, split_micro_batches, layout.rules if local else None)

    def eval_step(params, tokens_gt):
        model = layout.model_def.bind(params)
        micro_abt = split_micro_batches(tokens_gt, accum, dp)
        return jnp.mean(jax.lax.map(lambda tokens_bt: model.loss(tokens_bt[:, :-1], tokens_bt[:, 1:]), micro_abt))

    return eval_step


def jit_train_step(c: ml_collections.ConfigDict, layout: ts.StateLayout):
    """The jitted train step (donated state, explicit shardings) and abstract (state, batch) to lower it with."""
    batch_sharding = NamedSharding(layout.mesh, mesh_lib.batch_spec(layout.rules))
    batch = jax.ShapeDtypeStruct((c.train.global_batch, c.model.seq_len + 1), jnp.int32, sharding=batch_sharding)
    state = checkpoint_lib.abstract_target(layout)
    train_jit = jax.jit(make_train_step(c, layout), in_shardings=(layout.state_shardings, batch_sharding),
                        out_shardings=(layout.state_shardings, None), donate_argnums=0)
    return train_jit, state, batch


def check_compiles(c: ml_collections.ConfigDict, layout: ts.StateLayout) -> None:
    """One clear error, not an XLA abort, for a layout this jax is known not to compile.

    jax 0.11.2 aborts the process (spmd_partitioner_util.cc:498) on a pipeline map with both
    `data` and `fsdp` > 1 left automatic inside it. The train and eval steps keep `data`
    manual where gradients are reduced once per step (training/reduction.py); dropout rules
    that out for training, since masks are drawn per whole micro-batch.
    """
    old_jax = tuple(int(x) for x in jax.__version__.split('.')[:2]) < (0, 11)
    if old_jax or c.mesh.pipeline == 1 or c.mesh.data == 1 or c.mesh.fsdp == 1:
        return
    if c.model.dropout_rate > 0 and not reduction.reduce_once(c, layout.rules, layout.param_shardings):
        raise config_lib.ConfigError(
            'model.dropout_rate', c.model.dropout_rate,
            f'jax {jax.__version__} aborts compiling a pipeline whose data ({c.mesh.data}) and fsdp ({c.mesh.fsdp}) '
            'axes are both automatic, which dropout needs',
            'set model.dropout_rate=0.0, or mesh.fsdp=1 (sharding.zero1=True shards the optimizer state), or jax 0.10')


def compile_steps(c: ml_collections.ConfigDict, layout: ts.StateLayout):
    """Jits and compiles the train and eval steps ahead of time for this layout."""
    check_compiles(c, layout)
    train_jit, state, batch = jit_train_step(c, layout)
    eval_jit = jax.jit(make_eval_step(c, layout), in_shardings=(layout.param_shardings, batch.sharding))
    with jax.set_mesh(layout.mesh), mesh_lib.use_rules(layout.rules):
        train_compiled = train_jit.lower(state, batch).compile()
        eval_compiled = eval_jit.lower(state['params'], batch).compile()
    return train_compiled, eval_compiled, batch.sharding


def evaluate(eval_step, params, source, c: ml_collections.ConfigDict, batch_sharding) -> jax.Array:
    """Mean loss over config.train.eval_batches fixed validation batches (dispatched async)."""
    losses = [eval_step(params, data_lib.make_global_batch(source, i, batch_sharding, c.train.global_batch))
              for i in range(c.train.eval_batches)]
    return jnp.mean(jnp.stack(losses))


def memory_bytes(compiled) -> dict[str, int]:
    """XLA's per-device memory analysis ({} where there is none); 'total' = arguments + outputs
    + temporaries - aliased."""
    m = compiled.memory_analysis()
    if m is None:
        return {}
    out = {'arguments': m.argument_size_in_bytes, 'outputs': m.output_size_in_bytes,
           'temporaries': m.temp_size_in_bytes, 'aliased': m.alias_size_in_bytes}
    out['total'] = out['arguments'] + out['outputs'] + out['temporaries'] - out['aliased']
    return out


def _memory_summary(compiled) -> dict[str, float]:
    mem = memory_bytes(compiled)
    if not mem:
        return {}
    return {'memory/peak_gib_per_device': mem['total'] / 2**30, 'memory/temp_gib_per_device': mem['temporaries'] / 2**30}


class _Reporter:
    """Turns fetched step metrics into log records: perf numbers, NaN check, writer output."""

    def __init__(self, c: ml_collections.ConfigDict, writer: metrics_lib.MetricsWriter, n_devices: int,
                 first_row: dict[str, float] | None = None):
        self.c, self.writer, self.n_devices = c, writer, n_devices
        self.first_row = dict(first_row or {})  # written once, with the first record: compile time, memory
        self.model_flops, self.hw_flops = model_registry.flops_per_step_from_config(c)
        self.peak, self.peak_source = hardware.device_peak_flops(jax.devices()[0], c.model.dtype)
        self.tokens_per_step = c.train.global_batch * c.model.seq_len
        self.constants = {'pipeline/bubble': pipeline.build_schedule(c).bubble} if c.mesh.pipeline > 1 else {}
        self.last_time, self.last_step, self.last_record = None, None, {}

    def report(self, step: int, metrics: dict[str, jax.Array], eval_loss: jax.Array | None) -> None:
        scalars = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        metrics_lib.check_finite(step, scalars['train/loss'])
        self.writer.advance(step)
        due = step % self.c.train.log_every == 0 or step == self.c.train.steps or eval_loss is not None
        if self.last_time is None:  # the first step's time includes start-up: not a rate
            self.last_time, self.last_step = now, step
        elif due:
            step_time = (now - self.last_time) / (step - self.last_step)
            scalars.update(self.constants)
            scalars.update(metrics_lib.perf_metrics(step_time, self.tokens_per_step, self.n_devices,
                                                    self.model_flops, self.hw_flops, self.peak))
            self.last_time, self.last_step = now, step
        if eval_loss is not None:
            scalars['eval/loss'] = float(eval_loss)
        if due:
            scalars.update(self.first_row)
            self.first_row = {}
            self.writer.write(step, scalars)
            self.last_record = {'step': step, **scalars}


class _CommitLog:
    """Logs `checkpoint: step N committed` once a started save is known to be on disk.

    Known: Orbax reports no save in progress (asked after every step: a host-side flag, no
    sync), the next save starts (Orbax waits for the previous one first), or the final wait.
    """

    def __init__(self, checkpointer: checkpoint_lib.Checkpointer):
        self.checkpointer, self.pending, self.gib = checkpointer, None, None

    def started(self, step: int, state: State) -> None:
        self.poll(committed=True)
        if self.gib is None:
            self.gib = checkpoint_lib.describe_arrays(state)[1]
        self.pending = (step, time.perf_counter())

    def poll(self, committed: bool = False) -> None:
        if self.pending is None:
            return
        if not committed and self.checkpointer.saving():
            return
        step, t0 = self.pending
        self.pending = None
        _log(f'checkpoint: step {step} committed, {self.gib:.3f} GiB, {time.perf_counter() - t0:.1f} s after '
             'its save started')


def write_resolved_config(c: ml_collections.ConfigDict, workdir: str) -> None:
    if jax.process_index() == 0:
        path = os.path.join(workdir, 'config.json')
        with open(path + '.tmp', 'w') as f:
            f.write(c.to_json_best_effort(indent=2, sort_keys=True))
        os.replace(path + '.tmp', path)


def train_and_evaluate(c: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
    """Trains `c` on all devices, writing metrics to `workdir`; returns the last log record.

    The run holds `<workdir>/workdir.lock` from before its first write to the end
    (training/workdir_lock.py): a second run on the same workdir refuses to start.
    """
    locks: list[workdir_lock.WorkdirLock] = []
    try:
        return _train_and_evaluate(c, workdir, locks)
    except Exception as e:  # pylint: disable=broad-except  (a full disk or device: one line, not tracebacks)
        if memory_check.is_out_of_memory(e):
            raise memory_check.out_of_memory_error(e) from e
        full = disk.disk_full(e)
        if full is not None:
            raise disk.disk_full_error(full, workdir) from e
        raise
    finally:
        for lock in locks:
            lock.release()


def _train_and_evaluate(c: ml_collections.ConfigDict, workdir: str, locks: list) -> dict[str, float]:
    # 1. validate everything before writing or compiling anything
    data_lib.resolve_vocab(c)  # model.vocab_size=0: from the token file header
    config_lib.validate(c, jax.device_count())
    data_lib.check_data(c)
    checkpoint_lib.ensure_writable(workdir, f'--workdir={workdir!r}')
    locks.append(workdir_lock.acquire_for_job(workdir, c.train.workdir_lease_s))

    # 2. mesh
    mesh = mesh_lib.mesh_from_config(c)
    _log(f'mesh: {dict(mesh.shape)} over {jax.device_count()} {jax.devices()[0].platform} devices '
         f'({jax.process_count()} process(es))')

    # 3. data
    train_source, val_source = data_lib.make_datasets(c, workdir)
    _log(f'data: train {train_source.describe()}; validation {val_source.describe()}')

    # 4. state, built abstractly, then restored from the newest checkpoint or materialised sharded
    layout = ts.make_layout(c, mesh)
    if c.mesh.pipeline > 1:
        sched = pipeline.build_schedule(c)
        _log(f'pipeline: {sched.name}, P={sched.num_stages} stages x V={sched.virtual} chunks, '
             f'M={sched.num_micro} micro-batches, {sched.num_ticks} ticks, bubble {sched.bubble:.1%}, '
             f'at most {sched.act_slots} stashed micro-batches per stage')
    checkpointer = checkpoint_lib.Checkpointer(c, workdir)
    state, origin = checkpointer.restore_or_init(layout, lambda: ts.init_train_state(c, layout),
                                                   export.load_params)
    _log(f'state: {params_lib.count_params(state["params"]):,} parameters; zero1={c.sharding.zero1}; {origin}')
    write_resolved_config(c, workdir)  # only now: a refused resume leaves the old config.json
    if int(state['step']) >= c.train.steps:  # nothing to do: say so instead of `done: {}`
        checkpointer.close()
        message = (f'nothing ran: the checkpoint restored is at step {int(state["step"])} and train.steps = '
                   f'{c.train.steps}. To train further, raise --config.train.steps above {int(state["step"])}.')
        if jax.process_index() == 0:
            print(message, flush=True)
        return {'restored_step': int(state['step']), 'steps_run': 0}

    # 5. compile
    t0 = time.perf_counter()
    train_step, eval_step, batch_sharding = compile_steps(c, layout)
    compile_s = time.perf_counter() - t0
    memory = _memory_summary(train_step)
    _log(f'compile: {compile_s:.1f} s; ' + ', '.join(f'{k} {v:.3f}' for k, v in memory.items()))
    memory_check.check_fits(train_step, c, layout.abstract_state, layout.state_shardings)

    # 6. loop: dispatch step s, then fetch step s-1's metrics while step s runs; save every N
    done = int(state['step'])
    writer = metrics_lib.MetricsWriter(workdir, c.train.steps, enabled=jax.process_index() == 0,
                                       progress=c.train.progress, initial_step=done)
    reporter = _Reporter(c, writer, jax.device_count(), first_row={'compile/time_s': compile_s, **memory})
    preemption = preemption_lib.PreemptionWatcher(c.checkpoint)
    profiler = profile_lib.StepProfiler(c, workdir)
    pending, stop, step_metrics = None, False, None
    commits = _CommitLog(checkpointer)
    try:
        with preemption, interrupt.first_interrupt_stops(preemption), jax.set_mesh(mesh), \
                mesh_lib.use_rules(layout.rules):
            for step in range(done, c.train.steps):
                batch = data_lib.make_global_batch(train_source, step, batch_sharding, c.train.global_batch)
                with profiler.step(step):
                    state, step_metrics = train_step(state, batch)
                step_metrics = {**step_metrics, **train_source.epochs(step, c.train.global_batch)}
                done = step + 1
                profiler.after(done, step_metrics)
                # Before the next step is dispatched (it donates `state`); a non-finite step is not saved.
                if checkpointer.save(done, state, metrics=step_metrics):
                    commits.started(done, state)
                commits.poll()
                stop = preemption.should_stop(done) and done < c.train.steps
                eval_due = done == c.train.steps or (c.train.eval_every and done % c.train.eval_every == 0)
                eval_loss = (evaluate(eval_step, state['params'], val_source, c, batch_sharding)
                             if eval_due and not stop else None)
                if pending is not None:
                    reporter.report(*pending)
                pending = (done, step_metrics, eval_loss)
                if stop:
                    break
            if pending is not None:
                reporter.report(*pending)
            # 7. final save (end of training or preemption), waited for until committed
            if checkpointer.save(done, state, force=True, metrics=step_metrics):
                commits.started(done, state)
            checkpointer.wait()
            commits.poll(committed=True)
    except metrics_lib.NonFiniteLossError as e:  # seen one step late: name the checkpoint to resume from
        raise checkpointer.with_resume_hint(e) from None
    finally:
        profiler.close()
        writer.close()
        checkpointer.close()
    peaks = [hardware.memory_stats(d).get('peak_bytes_in_use') for d in jax.local_devices()]
    if any(p is not None for p in peaks):  # accelerators: the allocator's measured peak
        memory['memory/measured_peak_gib_per_device'] = max(p for p in peaks if p is not None) / 2**30
    record = {**reporter.last_record, **memory}
    if stop:
        record['preempted_at_step'] = done
        if jax.process_index() == 0:
            print(checkpointer.stop_message(done, preemption.received), flush=True)
    _log('done: ' + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()}))
    return record
