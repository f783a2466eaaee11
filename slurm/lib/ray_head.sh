#!/usr/bin/env bash
# Ray head + training driver, run as one Slurm step inside the container on the first node.
# Starts the Ray head, waits until every node of the job has joined, then runs the driver (through
# run_driver.sh, which relays stop requests) and exits with the driver's exit code.
#
# Environment (set by bapo_32b.sbatch): BAPO_REPO BAPO_CODE_DIR ATTEMPT_DIR HEAD_IP RAY_PORT RAY_CLIENT_PORT
# RAY_DASHBOARD_PORT RAY_MIN_WORKER_PORT RAY_MAX_WORKER_PORT GPUS_PER_NODE NUM_NODES RAY_JOIN_TIMEOUT
# STOP_FILE DRIVER_STOP_SIGNAL DRIVER_COMMAND_FILE NRL_MEGATRON_CHECKPOINT_DIR [RAY_*_PORT: see common.sh]
set -uo pipefail
# shellcheck source=slurm/lib/common.sh
source "$BAPO_REPO/slurm/lib/common.sh"

trap 'ray stop --force >/dev/null 2>&1 || true' EXIT
# bapo_nemo from the mounted checkout (or the image's copy), ahead of the image's PYTHONPATH; Ray hands
# this environment to every actor venv.
export PYTHONPATH="${BAPO_CODE_DIR:-$BAPO_REPO}${PYTHONPATH:+:$PYTHONPATH}"

log "Ray head on $(hostname) ($HEAD_IP:$RAY_PORT), waiting for $NUM_NODES node(s)"
raise_open_file_limit
require_megatron_checkpoint_dir
mapfile -t port_args < <(ray_daemon_port_args)
ray stop --force >/dev/null 2>&1 || true
ray start --head \
  --disable-usage-stats \
  --node-ip-address="$HEAD_IP" \
  --port="$RAY_PORT" \
  --ray-client-server-port="$RAY_CLIENT_PORT" \
  --dashboard-host="$HEAD_IP" \
  --dashboard-port="$RAY_DASHBOARD_PORT" \
  --min-worker-port="$RAY_MIN_WORKER_PORT" \
  --max-worker-port="$RAY_MAX_WORKER_PORT" \
  --num-gpus="$GPUS_PER_NODE" \
  "${port_args[@]}" \
  --resources='{"slurm_managed_ray_cluster": 1}' ||
  die "ray start --head failed on $(hostname); see the lines above"
touch "$ATTEMPT_DIR/RAY_HEAD_READY"

# Count the nodes that joined; a node that never joins fails the job instead of hanging it.
deadline=$((SECONDS + RAY_JOIN_TIMEOUT))
while true; do
  alive=$(python - <<'EOF' 2>/dev/null || echo 0
import ray
ray.init(address="auto", log_to_driver=False, logging_level="ERROR")
print(sum(1 for node in ray.nodes() if node["Alive"]))
EOF
)
  alive=${alive##*$'\n'}
  [[ "$alive" =~ ^[0-9]+$ ]] || alive=0
  log "Ray nodes alive: $alive/$NUM_NODES"
  [[ "$alive" -ge "$NUM_NODES" ]] && break
  ((SECONDS > deadline)) && die "only $alive/$NUM_NODES nodes joined the Ray cluster in ${RAY_JOIN_TIMEOUT}s; see ray-worker-*.log in $ATTEMPT_DIR"
  sleep 10
done

export RAY_ADDRESS="$HEAD_IP:$RAY_PORT"
log "all nodes joined; starting the driver (log: $ATTEMPT_DIR/driver.log)"
rc=0
bash "$BAPO_REPO/slurm/lib/run_driver.sh" "$STOP_FILE" "$DRIVER_STOP_SIGNAL" -- bash "$DRIVER_COMMAND_FILE" \
  >>"$ATTEMPT_DIR/driver.log" 2>&1 || rc=$?
log "driver exited with code $rc"
exit "$rc"
