"""The fast checkpoint tier on node-local disk (docs/checkpoints.md, "The fast tier").

  files   one process's part of a step: a file per distinct shard and a manifest written last
  peer    the copy of each process's shards to a peer process over the interconnect (one ppermute)
  tiers   FastTier: save every `checkpoint.fast_every_steps`, restore the newest step of either tier
"""
