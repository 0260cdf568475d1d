"""Checkpoints: the Orbax tier (async saves, restore onto any mesh, integrity); `fast/`; `interop/`.

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

Three parts, each importing only the ones above it here (and nothing from training/):

  the Orbax tier (this package's modules, bottom to top)
    integrity   CRC32C per chunk, finiteness of a step's health and of a state
    format      directories, format, model fields, CheckpointError
    target      abstract trees with shardings; the parameters alone on a mesh (ParamPlacement)
    reshard     how saved arrays are read onto another mesh or layer split
    readers     a step directory's meta and arrays without a manager (TensorStore slices)
    restore     the checkpoint a run resumes from (roll-back, superseded steps), resume messages
    manager     Checkpointer: the Orbax manager, saves and their health, wait, close
  interop/      other formats, on top of the readers: safetensors (writer, export_params, load_safetensors),
                Hugging Face (hf_files: a directory's files checked; hf: export and import one layer at a
                time through the family's converter), init_from (checkpoint.init_params_from: a safetensors
                file, a Hugging Face directory or a checkpoint)
  fast/         the node-local fast tier: files (one process's shards of a step, a manifest with a checksum
                per shard), peer (the copy to a peer process over the interconnect), tiers (FastTier: saves
                every few steps, restore across tiers)

Preemption (run/control/preemption.py): `PreemptionWatcher` turns the configured signals (SIGTERM from Slurm at the time
limit, or an early warning such as `--signal=USR1@120`) into a flag; the loop finishes its
step, saves, waits for the commit and returns. See docs/checkpoints.md.
"""
