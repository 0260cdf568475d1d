# The training step of launch/slurm.sbatch and launch/frontier.sbatch, restarted inside the allocation.
# Sourced by both (bash); defines jf_train and the helpers it uses. docs/checkpoints.md, "Restarts".
#
#   jf_train TASKS_PER_NODE SRUN_OPTION... COMMAND...    (the sbatch scripts: `jf_train 8 --cpus-per-task=7 ...
#                                                       python -m jaxfrontier.main ...`; returns its status)
#
# Runs `srun SRUN_OPTION... COMMAND...`. When the step fails in a way a restart can cure, it runs it
# again in the same allocation, where the trainer resumes from the newest checkpoint in WORKDIR:
#   a task killed by a signal (a process died: OOM killer, a crash, a node's failure) or exiting 4
#   (DistributedError: it lost a peer) or 5 (HangError: the watchdog found a hang,
#   jaxfrontier/run/control/watchdog.py), or srun reporting a node failure.
# Not restarted: 0 (done), 2 (a user error: the same command fails again), 3 (a NaN loss or loss spikes:
# the same data would do it again), 1 (a bug: a traceback), anything else.
# srun itself exits 143 whenever it ended the other tasks (--kill-on-bad-exit), so the failure is read
# from the first `srun: error: NODE: task N: ...` line it prints, which names the task that failed first.
#
# Variables:
#   JF_MAX_RESTARTS  restarts inside one allocation (default 3); after them, or when too few healthy nodes
#                    are left, a restartable failure requeues the job (at most JF_MAX_REQUEUES times per
#                    job id, default 1, counted in restarts.jsonl: time-limit requeues do not count);
#                    0: never restart.
#   JF_SPARE_NODES   nodes of the allocation kept as spares (default 0). Ask for the nodes the run needs
#                    plus the spares (`sbatch -N $((N + S))`, JF_SPARE_NODES=S): the step runs on
#                    SLURM_JOB_NUM_NODES - S nodes, and a restart excludes (srun --exclude) the node of a
#                    task killed by a signal and every node srun reports failed, so a spare takes its place.
#                    With 0 spares nothing is excluded: the step restarts on the same nodes.
# Each restart prints one line and appends a JSON line to ${WORKDIR}/restarts.jsonl: the failure, the
# nodes excluded, how long the failed attempt ran, the newest checkpoint and the last step logged (the
# steps the restart runs again) and the seconds of work lost (from the newer of the checkpoint's commit
# and the attempt's start to the failure).
# Globals: the trap of USR1 (the time limit) reads srun_pid and sets requeue, as before.

# The first task failure srun printed in file $1, as "NODE CODE" (CODE: the exit code, or "signal").
jf_first_failure() {
  local line node
  line="$(grep -m1 -E '^srun: error: [^ :]+: tasks? [0-9][0-9,-]*: ' "$1")" || return 1
  node="${line#srun: error: }"
  node="${node%%:*}"
  if [[ "${line}" =~ Exited\ with\ exit\ code\ ([0-9]+) ]]; then
    echo "${node} ${BASH_REMATCH[1]}"
  else
    echo "${node} signal"
  fi
}

# The nodes srun reported failed in file $1, one per line.
jf_failed_nodes() {
  grep -oE 'Node failure on [^ ,]+' "$1" | awk '{print $4}' | sort -u || true
}

# Whether a failure (jf_first_failure's CODE, and the file of srun's errors) is worth a restart.
jf_restartable() {
  case "$1" in
    4 | 5 | signal) return 0 ;;
  esac
  [[ -n "$(jf_failed_nodes "$2")" ]]
}

# The newest committed checkpoint step in WORKDIR and its commit time (epoch s): "STEP TIME" or "0 0".
jf_newest_checkpoint() {
  local dir="${WORKDIR}/checkpoints" step
  step="$(ls "${dir}" 2>/dev/null | grep -E '^[0-9]+$' | sort -n | tail -1 || true)"
  if [[ -z "${step}" ]]; then echo "0 0"; return; fi
  echo "${step} $(stat -c %Y "${dir}/${step}")"
}

# The last step in WORKDIR/metrics.jsonl (0 if none).
jf_last_logged_step() {
  tail -n 5 "${WORKDIR}/metrics.jsonl" 2>/dev/null | grep -oE '"step": *[0-9]+' | tail -1 | grep -oE '[0-9]+$' \
    || echo 0
}

# Appends one restart's record to WORKDIR/restarts.jsonl and prints its line.
jf_log_restart() {  # RESTART FAILURE CODE EXCLUDED STARTED FAILED_AT
  local n="$1" failure="$2" code="$3" excluded="$4" started="$5" failed_at="$6" ckpt ckpt_time last lost_from
  read -r ckpt ckpt_time < <(jf_newest_checkpoint)
  last="$(jf_last_logged_step)"
  lost_from=$(( ckpt_time > started ? ckpt_time : started ))
  echo "jaxfrontier: restart ${n}/${JF_MAX_RESTARTS} of job ${SLURM_JOB_ID} inside its allocation: ${failure}" \
    "after $(( failed_at - started )) s; resuming from checkpoint step ${ckpt} (last step logged ${last}," \
    "$(( last > ckpt ? last - ckpt : 0 )) step(s) and $(( failed_at - lost_from )) s of work lost);" \
    "excluded nodes: ${excluded:-none}" >&2
  mkdir -p "${WORKDIR}"
  local record  # one append per line
  record="$(printf '{"event": "restart", "time": "%s", "job": "%s", "restart": %d, "failure": "%s", "code": "%s", ' \
    "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "${SLURM_JOB_ID}" "${n}" "${failure//\"/}" "${code}")"
  record+="$(printf '"excluded": "%s", "attempt_s": %d, "checkpoint_step": %d, "last_step": %d, ' "${excluded}" \
    "$(( failed_at - started ))" "${ckpt}" "${last}")"
  record+="$(printf '"lost_steps": %d, "lost_s": %d}' "$(( last > ckpt ? last - ckpt : 0 ))" \
    "$(( failed_at - lost_from ))")"
  echo "${record}" >> "${WORKDIR}/restarts.jsonl"
}

jf_train() {
  local tasks_per_node="$1"
  shift
  local restarts=0 excluded="" needed=$(( ${SLURM_JOB_NUM_NODES:-1} - ${JF_SPARE_NODES:-0} )) errors
  local started failure node code exhausted=0 err_fd tee_pid
  JF_MAX_RESTARTS="${JF_MAX_RESTARTS:-3}"
  requeue=0
  trap 'echo "jaxfrontier: time limit near: checkpointing, then requeueing job ${SLURM_JOB_ID}"; requeue=1;
        kill -USR1 "${srun_pid}" 2>/dev/null || true' USR1
  if (( needed < 1 )); then
    echo "jaxfrontier: JF_SPARE_NODES=${JF_SPARE_NODES} leaves no node of ${SLURM_JOB_NUM_NODES} to train on" >&2
    return 2
  fi
  errors="$(mktemp)"
  while true; do
    if (( requeue )); then status=0; break; fi  # the time-limit signal came between attempts: requeue
    local place=()
    if (( ${JF_SPARE_NODES:-0} > 0 )); then
      place=(--nodes="${needed}" --ntasks="$(( needed * tasks_per_node ))")
      if [[ -n "${excluded}" ]]; then place+=(--exclude="${excluded}"); fi
    fi
    started="$(date +%s)"
    : > "${errors}"
    exec {err_fd}> >(tee -a "${errors}" >&2)  # srun's errors: shown, and read below
    tee_pid=$!
    srun "${place[@]}" "$@" 2>&"${err_fd}" &
    srun_pid=$!
    while true; do  # `wait` returns early when the trap runs; wait again until srun has exited
      status=0
      wait "${srun_pid}" || status=$?
      kill -0 "${srun_pid}" 2>/dev/null || break
    done
    exec {err_fd}>&-
    wait "${tee_pid}" 2>/dev/null || true
    if (( status == 0 || requeue )); then break; fi
    read -r node code < <(jf_first_failure "${errors}" || echo "none ${status}")
    failure="task on ${node}: $([[ "${code}" == signal ]] && echo 'killed by a signal' || echo "exit ${code}")"
    if [[ "${node}" == none && -n "$(jf_failed_nodes "${errors}")" ]]; then
      failure="node(s) failed: $(jf_failed_nodes "${errors}" | paste -sd, -)"
    fi
    if ! jf_restartable "${code}" "${errors}"; then
      echo "jaxfrontier: not restarting: ${failure} (restarted only after a lost process, node or a hang)" >&2
      [[ "${code}" =~ ^[0-9]+$ ]] && status="${code}"
      break
    fi
    if (( ${JF_SPARE_NODES:-0} > 0 )); then  # the node of a killed task, and nodes srun saw fail
      local bad
      bad="$( { [[ "${code}" == signal && "${node}" != none ]] && echo "${node}"; jf_failed_nodes "${errors}";
                tr ',' '\n' <<< "${excluded}"; } | grep -v '^$' | sort -u | paste -sd, -)"
      excluded="${bad}"
    fi
    local left=$(( ${SLURM_JOB_NUM_NODES:-1} - $(tr ',' '\n' <<< "${excluded}" | grep -c . || true) ))
    if (( restarts >= JF_MAX_RESTARTS || left < needed )); then
      echo "jaxfrontier: ${failure}; ${restarts} restart(s) used of JF_MAX_RESTARTS=${JF_MAX_RESTARTS}," \
        "${left} healthy node(s) for ${needed}: leaving this allocation" >&2
      exhausted=1
      break
    fi
    restarts=$(( restarts + 1 ))
    jf_log_restart "${restarts}" "${failure}" "${code}" "${excluded}" "${started}" "$(date +%s)"
  done
  rm -f "${errors}"
  if (( requeue && status == 0 )); then
    scontrol requeue "${SLURM_JOB_ID}"
  elif (( requeue )); then
    echo "jaxfrontier: not requeueing: the training step exited with status ${status} after the signal" >&2
  elif (( exhausted )); then
    local requeues
    requeues="$(grep -c "\"event\": \"requeue\", \"job\": \"${SLURM_JOB_ID}\"" "${WORKDIR}/restarts.jsonl" 2>/dev/null \
                || true)"
    if (( ${requeues:-0} < ${JF_MAX_REQUEUES:-1} )); then
      echo "jaxfrontier: requeueing job ${SLURM_JOB_ID} after failures (requeue $(( ${requeues:-0} + 1 )) of" \
        "JF_MAX_REQUEUES=${JF_MAX_REQUEUES:-1})" >&2
      mkdir -p "${WORKDIR}"
      printf '{"event": "requeue", "job": "%s", "time": "%s", "restarts": %d}\n' "${SLURM_JOB_ID}" \
        "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "${restarts}" >> "${WORKDIR}/restarts.jsonl"
      scontrol requeue "${SLURM_JOB_ID}"
    else
      echo "jaxfrontier: not requeueing job ${SLURM_JOB_ID}: JF_MAX_REQUEUES=${JF_MAX_REQUEUES:-1} spent" >&2
    fi
  fi
  return "${status}"
}
