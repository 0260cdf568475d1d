# Frontier (OLCF) environment for jaxfrontier: modules, RCCL over Slingshot, node-local caches.
#
# Sourced by launch/frontier.sbatch; in an interactive allocation: `source launch/frontier_env.sh`.
# Change a default by exporting the variable before sourcing:
#   JF_ROCM_MODULE      the ROCm 7 module jax[rocm7-local] was installed against (`module avail rocm`)
#   JF_RCCL_PLUGIN_DIR  directory of the aws-ofi-rccl / aws-ofi-nccl libfabric plugin (librccl-net.so);
#                       without it RCCL falls back to TCP sockets between nodes, several times slower
#   JF_NODE_LOCAL       node-local storage for caches (default /mnt/bb/$USER: needs `#SBATCH -C nvme`)
#   JF_VENV             the virtualenv holding jaxfrontier (default .venv in the repository)

module load PrgEnv-gnu
module load "${JF_ROCM_MODULE:-rocm/7.0.2}"
module load craype-accel-amd-gfx90a

# RCCL over the four Slingshot NICs through libfabric (OLCF's guide and the paper's scripts).
export NCCL_SOCKET_IFNAME=hsn0,hsn1,hsn2,hsn3
export NCCL_NET_GDR_LEVEL=3
export NCCL_CROSS_NIC=1
export FI_MR_CACHE_MONITOR=userfaultfd
export FI_CXI_ATS=0
export FI_CXI_DISABLE_HOST_REGISTER=1
export FI_CXI_DEFAULT_CQ_SIZE=131072
export HSA_FORCE_FINE_GRAIN_PCIE=1
export HSA_NO_SCRATCH_RECLAIM=1  # RCCL small-message latency regresses on recent ROCm without it
if [[ -n "${JF_RCCL_PLUGIN_DIR:-}" ]]; then
  export LD_LIBRARY_PATH="${JF_RCCL_PLUGIN_DIR}${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
else
  echo "jaxfrontier: JF_RCCL_PLUGIN_DIR is not set: RCCL will use TCP sockets between nodes (slow)" >&2
fi

# Compilation and MIOpen caches on node-local storage: thousands of processes must not share
# one Lustre directory (the batch script creates these directories on every node).
JF_NODE_LOCAL="${JF_NODE_LOCAL:-/mnt/bb/${USER:-$(id -un)}}"
export MIOPEN_USER_DB_PATH="${JF_NODE_LOCAL}/miopen"
export MIOPEN_CUSTOM_CACHE_DIR="${MIOPEN_USER_DB_PATH}"
export JAX_COMPILATION_CACHE_DIR="${JF_NODE_LOCAL}/jax_cache"

export PYTHONUNBUFFERED=1  # nothing lost when a process is killed
JF_VENV="${JF_VENV:-${PWD}/.venv}"
source "$(dirname "${BASH_SOURCE[0]}")/xla_flags.sh"  # GPU XLA flags (docs/PERFORMANCE.md, "GPU flags")
if [[ -f "${JF_VENV}/bin/activate" ]]; then source "${JF_VENV}/bin/activate"; fi
