#!/usr/bin/env bash
# Ray worker, run as one task per non-head node inside the container. Blocks for the life of the job: if
# Ray dies on this node the task exits, the worker step ends, and the batch script's watchdog fails the
# whole job at once instead of leaving the driver hanging on a lost node.
#
# Environment (set by bapo_32b.sbatch): BAPO_REPO BAPO_CODE_DIR ATTEMPT_DIR HEAD_IP RAY_PORT RAY_MIN_WORKER_PORT
# RAY_MAX_WORKER_PORT GPUS_PER_NODE RAY_JOIN_TIMEOUT NRL_MEGATRON_CHECKPOINT_DIR [RAY_*_PORT: see common.sh]
set -uo pipefail
# shellcheck source=slurm/lib/common.sh
source "$BAPO_REPO/slurm/lib/common.sh"

trap 'ray stop --force >/dev/null 2>&1 || true' EXIT
# bapo_nemo from the mounted checkout (or the image's copy), ahead of the image's PYTHONPATH; Ray hands
# this environment to every actor venv.
export PYTHONPATH="${BAPO_CODE_DIR:-$BAPO_REPO}${PYTHONPATH:+:$PYTHONPATH}"

deadline=$((SECONDS + RAY_JOIN_TIMEOUT))
until [[ -e "$ATTEMPT_DIR/RAY_HEAD_READY" ]]; do
  [[ -e "$ATTEMPT_DIR/ENDED" ]] && die "the job ended before the Ray head came up"
  ((SECONDS > deadline)) && die "no Ray head after ${RAY_JOIN_TIMEOUT}s ($ATTEMPT_DIR/RAY_HEAD_READY missing): is $ATTEMPT_DIR on a filesystem shared by all nodes?"
  sleep 5
done

log "Ray worker on $(hostname) joining $HEAD_IP:$RAY_PORT"
raise_open_file_limit
require_megatron_checkpoint_dir
mapfile -t port_args < <(ray_daemon_port_args)
ray stop --force >/dev/null 2>&1 || true
ray start \
  --address="$HEAD_IP:$RAY_PORT" \
  --disable-usage-stats \
  --min-worker-port="$RAY_MIN_WORKER_PORT" \
  --max-worker-port="$RAY_MAX_WORKER_PORT" \
  --num-gpus="$GPUS_PER_NODE" \
  "${port_args[@]}" \
  --block
rc=$?
die "Ray worker on $(hostname) exited with code $rc"
