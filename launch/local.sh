#!/bin/bash
# N jaxfrontier processes on this machine, joined by jax.distributed: multi-process development.
#
#   launch/local.sh NUM_PROCESSES [jaxfrontier.main flags...]
#   e.g. launch/local.sh 2 --config=configs/tiny.py --workdir=workdirs/local2   # 2 processes x 4 CPU devices
#
# config.mesh.cpu_devices counts the simulated CPU devices of the whole job; each process creates
# its share (configs/tiny.py: 8 = 2 x 4). Variables:
#   JF_CPU_DEVICES_PER_PROCESS  sets --config.mesh.cpu_devices to NUM_PROCESSES times this
#   JF_GPU_PER_PROCESS=1        process i uses local GPU i (one process per GPU)
#   JF_PORT                     the coordinator's port on 127.0.0.1 (default 12355)
# All processes print here; only process 0 writes metrics and logs. When a process fails the
# others are stopped, and the script exits with the failed process's status.
set -euo pipefail

num_processes="${1:?usage: launch/local.sh NUM_PROCESSES [jaxfrontier.main flags...]}"
shift
extra=()
if [[ -n "${JF_CPU_DEVICES_PER_PROCESS:-}" ]]; then
  extra+=("--config.mesh.cpu_devices=$((num_processes * JF_CPU_DEVICES_PER_PROCESS))")
fi

pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' INT TERM
for ((i = 0; i < num_processes; i++)); do
  gpu=()
  if [[ "${JF_GPU_PER_PROCESS:-0}" == 1 ]]; then gpu=("--config.distributed.local_device_ids=${i}"); fi
  python -m jaxfrontier.main "$@" "${extra[@]}" --config.distributed.mode=explicit \
    --config.distributed.coordinator_address="127.0.0.1:${JF_PORT:-12355}" \
    --config.distributed.num_processes="${num_processes}" --config.distributed.process_id="${i}" "${gpu[@]}" &
  pids+=("$!")
done

status=0
for ((i = 0; i < num_processes; i++)); do
  exited=0
  wait -n || exited=$?
  if (( exited != 0 && status == 0 )); then
    status=${exited}
    kill "${pids[@]}" 2>/dev/null || true
  fi
done
exit "${status}"
