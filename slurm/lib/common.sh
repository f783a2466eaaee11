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
