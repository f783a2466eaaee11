#!/usr/bin/env bash
# Helpers shared by the Slurm launch scripts (sourced, never run). Plain bash 4+, no dependencies.

# log MESSAGE...: timestamped line on stdout, prefixed with the job id and the attempt number.
log() {
  printf '[bapo %s job=%s attempt=%s] %s\n' "$(date '+%Y-%m-%dT%H:%M:%S')" \
    "${SLURM_JOB_ID:-none}" "${SLURM_RESTART_COUNT:-0}" "$*"
}

# die MESSAGE...: print a clear error on stderr (and in the job log) and exit 1.
die() {
  printf '[bapo %s job=%s] ERROR: %s\n' "$(date '+%Y-%m-%dT%H:%M:%S')" "${SLURM_JOB_ID:-none}" "$*" >&2
  exit 1
}

# redacted_env: the environment with the values of secrets (tokens, keys, passwords) replaced by ***,
# so logs can show what was set without leaking it.
redacted_env() {
  env | LC_ALL=C sort | sed -E 's/^([A-Za-z0-9_]*(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|CREDENTIAL)[A-Za-z0-9_]*)=.*/\1=***/I'
}

# duration_to_seconds VALUE: Slurm time strings (squeue %L / --time): [D-]HH:MM:SS, MM:SS, MM, D-HH,
# D-HH:MM. Prints nothing for UNLIMITED/NOT_SET/INVALID.
duration_to_seconds() {
  local value=$1 days=0 rest h=0 m=0 s=0
  case "$value" in
    UNLIMITED | NOT_SET | INVALID | "") return 0 ;;
  esac
  if [[ "$value" == *-* ]]; then
    days=${value%%-*}
    rest=${value#*-}
    IFS=: read -r h m s <<<"$rest"
  else
    local parts
    IFS=: read -r -a parts <<<"$value"
    case "${#parts[@]}" in
      3) h=${parts[0]} m=${parts[1]} s=${parts[2]} ;;
      2) m=${parts[0]} s=${parts[1]} ;;
      1) m=${parts[0]} ;;
      *) return 0 ;;
    esac
  fi
  echo $(((10#${days:-0} * 86400) + (10#${h:-0} * 3600) + (10#${m:-0} * 60) + 10#${s:-0}))
}

# seconds_to_ddhhmmss SECONDS: NeMo-RL's `checkpoint_must_save_by` format (DD:HH:MM:SS).
seconds_to_ddhhmmss() {
  local total=$1
  ((total < 0)) && total=0
  printf '%02d:%02d:%02d:%02d\n' $((total / 86400)) $((total % 86400 / 3600)) $((total % 3600 / 60)) $((total % 60))
}

# job_seconds_left: seconds until this job's time limit, or nothing when the job has no limit.
job_seconds_left() {
  local left
  left=$(squeue -h -j "$SLURM_JOB_ID" -o %L 2>/dev/null | head -n 1) || true
  duration_to_seconds "${left// /}"
}

# require_file PATH WHAT FIX: die with a message naming the file and the fix when PATH is not a file.
require_file() {
  [[ -f "$1" ]] || die "$2 not found: $1. $3"
}

# require_dir PATH WHAT FIX
require_dir() {
  [[ -d "$1" ]] || die "$2 not found: $1. $3"
}

# abs_path PATH [BASE]: PATH made absolute against BASE (default: current directory); no symlink games.
abs_path() {
  local path=$1 base=${2:-$PWD}
  if [[ "$path" == /* ]]; then echo "$path"; else echo "$base/$path"; fi
}

# newest_checkpoint DIR: name of the highest-numbered step_<N> directory in DIR (embedded and NeMo-RL
# checkpoints both use this layout), or nothing.
newest_checkpoint() {
  local dir=$1
  [[ -d "$dir" ]] || return 0
  find "$dir" -mindepth 1 -maxdepth 1 -type d -name 'step_*' -printf '%f\n' 2>/dev/null | sort -t_ -k2,2n | tail -n 1
}

# raise_open_file_limit: soft open-file limit up to 65535 (Ray's large-cluster advice; NeMo-RL's ray.sub
# does the same), never above the hard limit and never lowered.
raise_open_file_limit() {
  local want=65535 soft hard
  soft=$(ulimit -Sn)
  hard=$(ulimit -Hn)
  [[ "$soft" == unlimited ]] || ((soft >= want)) && return 0
  if [[ "$hard" != unlimited ]] && ((hard < want)); then
    log "WARNING: open-file hard limit is $hard (< $want): Ray may fail on large jobs; ask the admins to raise it"
    want=$hard
  fi
  ulimit -Sn "$want"
}

# ray_daemon_port_args: `ray start` flags pinning the per-node daemons' ports below the ephemeral range
# (32768-60999). Left to Ray they are picked at random there, and a port taken meanwhile as the source port
# of an outgoing connection fails the daemon with EADDRINUSE. Defaults sit in 30001-30011, clear of the
# ranges NeMo-RL uses (9900-9901 GCS, 10002-11000 Ray workers, 11001-15000 vLLM, 15001-20000 NeMo Gym,
# 20001+ vLLM rendezvous, 25000-28000 torch.distributed); one Ray node per machine, so head and workers
# share them.
ray_daemon_port_args() {
  printf '%s\n' \
    "--node-manager-port=${RAY_NODE_MANAGER_PORT:-30001}" \
    "--object-manager-port=${RAY_OBJECT_MANAGER_PORT:-30003}" \
    "--runtime-env-agent-port=${RAY_RUNTIME_ENV_AGENT_PORT:-30005}" \
    "--dashboard-agent-grpc-port=${RAY_DASHBOARD_AGENT_GRPC_PORT:-30007}" \
    "--dashboard-agent-listen-port=${RAY_DASHBOARD_AGENT_LISTEN_PORT:-30009}" \
    "--metrics-export-port=${RAY_METRICS_EXPORT_PORT:-30011}"
}

# require_megatron_checkpoint_dir: NeMo-RL converts the HF base model to Megatron once, into
# $NRL_MEGATRON_CHECKPOINT_DIR (else $HF_HOME/nemo_rl, else ~/.cache on each node: not shared, and the
# containers do not mount home). Every node must see the same directory, so it must be set and exist here.
require_megatron_checkpoint_dir() {
  [[ -n "${NRL_MEGATRON_CHECKPOINT_DIR:-}" ]] ||
    die "NRL_MEGATRON_CHECKPOINT_DIR is not set: slurm/bapo_32b.sbatch sets it to a directory of the run (shared by all nodes)"
  require_dir "$NRL_MEGATRON_CHECKPOINT_DIR" "NRL_MEGATRON_CHECKPOINT_DIR on $(hostname)" \
    "It must be on a filesystem shared by all nodes and mounted into the container."
  export NRL_MEGATRON_CHECKPOINT_DIR
}
