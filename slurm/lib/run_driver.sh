#!/usr/bin/env bash
# Runs the training driver inside a Slurm step and relays stop requests to it; exits with its exit code.
#
#   run_driver.sh STOP_FILE STOP_SIGNAL -- COMMAND [ARGS...]
#
# STOP_FILE is written by the batch script (on a shared filesystem) when the time limit nears. The step's
# processes cannot be signalled selectively from outside (a signal to a step reaches every process in it,
# Ray's daemons included), so this wrapper watches the file and sends STOP_SIGNAL to the driver process
# only. STOP_SIGNAL "none" sends nothing (the driver stops on its own, e.g. NeMo-RL's
# `checkpoint_must_save_by`).
#
# SIGTERM (scancel, `scontrol requeue`, preemption) is delivered by Slurm to every process of the step,
# the driver included, so the wrapper only keeps waiting for the driver to checkpoint and exit.
set -uo pipefail

if [[ $# -lt 4 || "$3" != "--" ]]; then
  echo "usage: run_driver.sh STOP_FILE STOP_SIGNAL -- COMMAND [ARGS...]" >&2
  exit 2
fi
stop_file=$1
stop_signal=$2
shift 3

"$@" &
driver_pid=$!

# Stay alive on SIGTERM/SIGINT until the driver has exited, so its exit code is reported. The driver got
# the SIGTERM too: no stop signal is relayed after it (a stop file seen later is only logged).
relayed=0  # 1: the stop request was handled; 2: SIGTERM came first
trap '[[ $relayed -eq 1 ]] || relayed=2; echo "[run_driver] got SIGTERM; waiting for the driver (pid $driver_pid) to checkpoint and exit"' TERM
trap 'kill -INT "$driver_pid" 2>/dev/null || true' INT
# A signal sent to the whole step (e.g. `scancel --signal=USR1 JOB.STEP`) reaches the driver directly.
trap 'echo "[run_driver] got SIGUSR1 (the driver receives it too)"' USR1

while kill -0 "$driver_pid" 2>/dev/null; do
  if [[ $relayed -ne 1 && -e "$stop_file" ]]; then
    if [[ $relayed -eq 2 ]]; then
      echo "[run_driver] stop requested after SIGTERM: nothing sent, the driver is stopping already"
    elif [[ "$stop_signal" != "none" ]]; then
      echo "[run_driver] stop requested: sending SIG$stop_signal to the driver (pid $driver_pid)"
      kill -s "$stop_signal" "$driver_pid" 2>/dev/null || true
    else
      echo "[run_driver] stop requested: the driver is expected to stop on its own"
    fi
    relayed=1
  fi
  sleep 1 &
  wait $! 2>/dev/null || true
done

rc=0
wait "$driver_pid" || rc=$?
echo "[run_driver] driver exited with code $rc"
exit "$rc"
