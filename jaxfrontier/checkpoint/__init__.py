"""Checkpoints: asynchronous Orbax saves, restore onto any mesh, integrity; safetensors and Hugging Face.

A run's checkpoints live in `<workdir>/checkpoints/<step>/`, each with two items:

  state/  the whole train state `{'step', 'params', 'opt_state'}` as an Orbax PyTree (OCDBT):
          every process writes the shards it holds, and nothing is gathered on one host.
          Every chunk carries a CRC32C checksum, verified by the process that reads it
          (integrity.py).
  meta/   JSON: the format version, the step, the data position, the resolved config and the
          step's health (loss, gradient and parameter norms, all finite: a non-finite state is
          never committed).

Nothing else is needed to continue exactly: batches are a pure function of (seed, step)
(jaxfrontier/data/loader.py) and so is the dropout randomness (jaxfrontier/training/step.py), so the step
*is* the data position and the RNG state.

Orbax writes a step into `<step>.orbax-checkpoint-tmp-<time>/` and renames it to `<step>/`
only once every process has finished; a step killed half-way is never listed, never restored,
and deleted when the next run starts. Restoring builds every array directly in the target
layout's shardings (`ArrayRestoreArgs(sharding=...)`), so a checkpoint written on one mesh
is read onto any other: each process reads only the slices its devices hold.

Modules, bottom to top (each imports only those above it in this list; nothing from training/):

  integrity   CRC32C per chunk, finiteness of a step's health and of a state
  format      directories, format, model fields, CheckpointError
  target      abstract trees with shardings; the parameters alone on a mesh (ParamPlacement)
  reshard     how saved arrays are read onto another mesh or layer split
  restore     the checkpoint a run resumes from (roll-back, superseded steps), resume messages
  manager     Checkpointer: the Orbax manager, saves and their health, wait, close
  fast_files  the fast tier's files: one process's shards of a step, a manifest with a checksum per shard
  peer        the fast tier's copy to a peer process over the interconnect (one ppermute)
  tiers       FastTier: node-local saves every few steps with a peer's copy, restore across tiers
  readers     a step directory's meta and arrays without a manager (TensorStore slices)
  safetensors the safetensors writer, export_params and load_safetensors
  hf_gpt2, hf_llama  one converter per family: HF config both ways, tensors ours <-> HF, refusals
  hf_files    checks of a HF directory (config.json, safetensors header) against its converter
  hf          Hugging Face export and import (the driver, one layer at a time), on top of readers and safetensors
  init_from   checkpoint.init_params_from: a safetensors file, a Hugging Face directory or a checkpoint

Preemption (training/preemption.py): `PreemptionWatcher` turns the configured signals (SIGTERM from Slurm at the time
limit, or an early warning such as `--signal=USR1@120`) into a flag; the loop finishes its
step, saves, waits for the commit and returns. See docs/checkpoints.md.
"""
