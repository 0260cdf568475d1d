"""Weak and strong scaling: the benchmarks/ entry point of `python -m jaxfrontier.scaling` (same flags).

  python benchmarks/scaling.py --config=configs/tiny.py --config.mesh.fsdp=1 --config.mesh.tensor=1 \
      --device_counts=2,4,8 --workdir=workdirs/scaling_tiny
  JF_STUDY=scaling sbatch -A ACCOUNT -N 16 launch/sweep.sbatch configs/175b.py --hardware=mi250x \
      --device_counts=32,64,128        # on a cluster: each count is an srun step of the allocation

Efficiency E(N) = (tokens/s at N / N) / (tokens/s at N0 / N0) against the smallest count N0 that
ran; weak scaling keeps the batch per replica, strong scaling the global batch (docs/sweeps.md).
"""

from jaxfrontier import scaling

if __name__ == '__main__':
    scaling.run()
