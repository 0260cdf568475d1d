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
#   JF_PORT                     the coordinator's port on 127.0.0.1 (default: a free port, so that
#                               several jobs can run side by side)
# All processes print here; only process 0 writes metrics and logs. When a process fails the
# others are stopped, and the script exits with the failed process's status. SIGTERM or SIGINT
# to this script is passed to every process as SIGTERM (they checkpoint and stop); the script
# waits for them and exits with their status.
set -euo pipefail

num_processes="${1:?usage: launch/local.sh NUM_PROCESSES [jaxfrontier.main flags...]}"
shift
extra=()
if [[ -n "${JF_CPU_DEVICES_PER_PROCESS:-}" ]]; then
  extra+=("--config.mesh.cpu_devices=$((num_processes * JF_CPU_DEVICES_PER_PROCESS))")
fi

if [[ -z "${JF_PORT:-}" ]]; then  # a port the kernel just handed out, released for the coordinator
  JF_PORT="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
fi

pids=()
stop() { kill -TERM "${pids[@]}" 2>/dev/null || true; }
trap stop INT TERM
for ((i = 0; i < num_processes; i++)); do
  gpu=()
  if [[ "${JF_GPU_PER_PROCESS:-0}" == 1 ]]; then gpu=("--config.distributed.local_device_ids=${i}"); fi
  python -m jaxfrontier.main "$@" "${extra[@]}" --config.distributed.mode=explicit \
    --config.distributed.coordinator_address="127.0.0.1:${JF_PORT}" \
    --config.distributed.num_processes="${num_processes}" --config.distributed.process_id="${i}" "${gpu[@]}" &
  pids+=("$!")
done

# Poll rather than `wait -n`: a trap interrupts `wait`, and bash < 5.1 cannot say which child exited.
status=0
running=("${pids[@]}")
while (( ${#running[@]} )); do
  still=()
  for pid in "${running[@]}"; do
    if kill -0 "${pid}" 2>/dev/null; then still+=("${pid}"); continue; fi
    exited=0
    wait "${pid}" || exited=$?
    if (( exited != 0 && status == 0 )); then
      status=${exited}
      stop
    fi
  done
  running=("${still[@]+"${still[@]}"}")
  if (( ${#running[@]} )); then sleep 0.2; fi
done
exit "${status}"
