# Frontier (OLCF) environment for jaxfrontier: modules, RCCL over Slingshot, caches.
#
# Sourced by launch/frontier.sbatch; in an interactive allocation: `source launch/frontier_env.sh`.
# Every setting, its source and its reason: docs/frontier.md ("Every setting and its source").
# Change a default by exporting the variable before sourcing:
#   JF_CPE_MODULE         the Cray programming environment release (default cpe/26.03, OLCF's pair
#                         for rocm/7.0.2)
#   JF_ROCM_MODULE        the ROCm 7 module jax[rocm7-local] was installed against (`module avail rocm`)
#   JF_RCCL_PLUGIN_MODULE OLCF's RCCL network plugin module, loaded after rocm (default rccl-net-plugin)
#   JF_RCCL_PLUGIN_DIR    your own build of the aws-ofi-nccl plugin (the directory of librccl-net.so),
#                         used instead of the module
#   JF_JAX_CACHE          JAX's compilation cache, on Lustre so that every node and every requeue
#                         reads it (default /lustre/orion/<project>/scratch/$USER/jax_cache; the
#                         project is JF_PROJECT, default the job's account)
#   JF_NODE_LOCAL         node-local storage (default /mnt/bb/$USER: `-C nvme`) for MIOpen's database and
#                         the fast checkpoint tier: --config.checkpoint.fast_dir='$JF_NODE_LOCAL/fast'
#                         (exported, so every task expands it on its own node; docs/checkpoints.md)
#   JF_VENV               the virtualenv holding jaxfrontier (default .venv in the repository)
# A libfabric/RCCL variable that is already set (by the plugin module or by you) is kept.

_jf_nodes="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}"
_jf_user="${USER:-$(id -un)}"

module load PrgEnv-gnu
module load "${JF_CPE_MODULE:-cpe/26.03}"
module load "${JF_ROCM_MODULE:-rocm/7.0.2}"
module load craype-accel-amd-gfx90a
if [[ -n "${JF_RCCL_PLUGIN_DIR:-}" ]]; then
  export LD_LIBRARY_PATH="${JF_RCCL_PLUGIN_DIR}${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
elif ! module load "${JF_RCCL_PLUGIN_MODULE:-rccl-net-plugin}"; then
  echo "jaxfrontier: could not load module ${JF_RCCL_PLUGIN_MODULE:-rccl-net-plugin} (RCCL's network plugin):" \
       "multi-node jobs will stop at start (NCCL_NET=OFI). Fix: \`module avail rccl-net-plugin\` and set" \
       "JF_RCCL_PLUGIN_MODULE, or JF_RCCL_PLUGIN_DIR=<your aws-ofi-nccl build>/lib" >&2
fi
# cpe/<release> modules need their libraries first at run time (OLCF, "Programming environment").
if [[ -n "${CRAY_LD_LIBRARY_PATH:-}" ]]; then
  export LD_LIBRARY_PATH="${CRAY_LD_LIBRARY_PATH}${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
fi

_jf_default() {  # export $1=$2 unless $1 is already set
  if [[ -z "${!1+set}" ]]; then export "$1=$2"; fi
}
# RCCL over the four Slingshot NICs through libfabric (HPE's RCCL tuning guide for Slingshot).
_jf_default NCCL_SOCKET_IFNAME hsn0,hsn1,hsn2,hsn3
_jf_default NCCL_NET_GDR_LEVEL PHB
_jf_default NCCL_CROSS_NIC 1
if (( _jf_nodes > 1 )); then
  _jf_default NCCL_NET OFI  # a missing plugin stops RCCL at start instead of falling back to TCP sockets
fi
_jf_default HSA_FORCE_FINE_GRAIN_PCIE 1
_jf_default FI_MR_CACHE_MONITOR userfaultfd
_jf_default FI_CXI_DISABLE_HOST_REGISTER 1
_jf_default FI_CXI_DEFAULT_CQ_SIZE 131072
_jf_default FI_CXI_DEFAULT_TX_SIZE 2048
_jf_default FI_CXI_RX_MATCH_MODE hybrid
_jf_default FI_CXI_RDZV_PROTO alt_read  # needs the job's `--network=disable_rdzv_get`
_jf_default FI_CXI_RDZV_EAGER_SIZE 0
_jf_default FI_CXI_RDZV_THRESHOLD 0
_jf_default FI_CXI_RDZV_GET_MIN 0
unset -f _jf_default

# JAX's compilation cache on Lustre, per project and user: JAX writes entries from process 0 only,
# so a node-local cache would never hit on the other nodes, and would be empty after a requeue.
_jf_project="${JF_PROJECT:-${SLURM_JOB_ACCOUNT:-}}"
if [[ -n "${JF_JAX_CACHE:-}" ]]; then
  export JAX_COMPILATION_CACHE_DIR="${JF_JAX_CACHE}"
elif [[ -n "${_jf_project}" ]]; then
  export JAX_COMPILATION_CACHE_DIR="${JF_LUSTRE:-/lustre/orion}/${_jf_project,,}/scratch/${_jf_user}/jax_cache"
else
  echo "jaxfrontier: no project known (JF_PROJECT, SLURM_JOB_ACCOUNT): JAX's compilation cache is off" >&2
fi

# MIOpen's database (and the fast checkpoint tier) on node-local NVMe: written by every process, so not on a
# shared directory.
if [[ -z "${JF_NODE_LOCAL:-}" && -n "${SLURM_JOB_ID:-}" && ! -d "/mnt/bb/${_jf_user}" ]]; then
  echo "error: /mnt/bb/${_jf_user} does not exist: this job has no node-local NVMe. Fix: allocate with" \
       "-C nvme (sbatch/salloc -C nvme ...), or set JF_NODE_LOCAL to a node-local directory" >&2
  unset _jf_nodes _jf_user _jf_project
  return 2
fi
export JF_NODE_LOCAL="${JF_NODE_LOCAL:-/mnt/bb/${_jf_user}}"  # checkpoint.fast_dir='$JF_NODE_LOCAL/fast' reads it
export MIOPEN_USER_DB_PATH="${JF_NODE_LOCAL}/miopen"
export MIOPEN_CUSTOM_CACHE_DIR="${MIOPEN_USER_DB_PATH}"

# One GCD per task is Slurm's binding, in ROCR_VISIBLE_DEVICES: nothing inherited may narrow it further.
unset CUDA_VISIBLE_DEVICES HIP_VISIBLE_DEVICES
export PYTHONUNBUFFERED=1  # nothing lost when a process is killed
JF_VENV="${JF_VENV:-${PWD}/.venv}"
source "$(dirname "${BASH_SOURCE[0]}")/xla_flags.sh"  # GPU XLA flags (docs/PERFORMANCE.md, "GPU flags")
if [[ -f "${JF_VENV}/bin/activate" ]]; then source "${JF_VENV}/bin/activate"; fi
unset _jf_nodes _jf_user _jf_project
