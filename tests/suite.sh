#!/usr/bin/env bash
# The whole test suite, as the README's test command runs it (after installing this checkout with
# constraints/cpu-py311.txt into the active environment), tier by tier (tests/README.md):
#
#   1. tests/unit, tests/cli and tests/slurm on this Python (3.11 or newer);
#   2. tests/nemo_rl on NeMo-RL's own Python, 3.13, once per NeMo-RL source tree in NEMO_RL_SRCS
#      (colon-separated; .ci/run sets v0.7.0's and main's from ../shared/upstream), each in its own
#      environment .venv-nemo-rl/<tree's folder name> with NeMo-RL's torch (2.11.0) and the CPU build of the
#      vLLM that tree pins (tests/support/nemo_rl_venv.sh, from constraints/nemo-rl-vllm-<X>-py313.txt).
#
# Each part has its own pytest workers and its own log, printed whole when it ends. The package's tiers run
# first while the trees' environments build; then the trees' tiers run at the same time, one pytest worker
# each (each part waits on subprocesses, servers and schedulers for much of its time: one tree after the
# other left the cores idle). All three at once slowed the rehearsals past their hang guards and filled the
# memory. The rehearsals take turns across the trees where memory asks for it (tests/support/nemo_rehearsal.py).
#
# Without a tree (NEMO_RL_SRCS and NEMO_RL_SRC unset) the NeMo-RL tests skip, each with its reason. Without
# Python 3.13 (PYTHON313, `python3.13` on PATH, or pyenv's 3.13.0; NeMo-RL itself requires it) the command
# says so in one line, with how to get it, and runs tier 1 only.
# Arguments go to every pytest (e.g. `-x`, `-k name`). Exit status: non-zero if any part failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

trees=${NEMO_RL_SRCS:-${NEMO_RL_SRC:-}}
IFS=: read -r -a tree_list <<< "$trees"
python_tiers=(tests/unit tests/cli tests/slurm)
# pytest workers per NeMo-RL tier: each holds NeMo-RL, torch and megatron-core (~1 GB) and starts a Ray
# cluster of ~1 GB actors for its e2e tests and rehearsals; two per tree, with both trees and the package's
# tiers at once, filled a 24 GB machine to Ray's memory monitor (95%), which killed rehearsal workers.
TIER_WORKERS=${TIER_WORKERS:-1}
# Each part's pytest gets Ctrl-C (its summary of what ran) after PART_LIMIT_S seconds and is killed a minute
# later: a hung part (a Ray worker that took its pytest worker down left xdist waiting forever) ends the
# suite with the others' results instead of running into CI's own limit with nothing printed.
PART_LIMIT_S=${PART_LIMIT_S:-2700}
limited() { timeout -s INT -k 60 "$PART_LIMIT_S" "$@"; }

find_python313() {
  local candidate
  for candidate in "${PYTHON313:-}" "$(command -v python3.13 || true)" \
                   "$(pyenv prefix 3.13.0 2>/dev/null)/bin/python3.13"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] \
       && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 13))' 2>/dev/null; then
      echo "$candidate"
      return
    fi
  done
}

if [ -z "$trees" ]; then
  exec pytest "${python_tiers[@]}" "$@"
fi
python313=$(find_python313)
if [ -z "$python313" ]; then
  echo "Python 3.13 (NeMo-RL's own) not found: the NeMo-RL tier (tests/nemo_rl) is skipped; install it (pyenv install 3.13) or set PYTHON313 to run it against every tree"
  exec env -u NEMO_RL_SRC pytest "${python_tiers[@]}" "$@"
fi

venvs=.venv-nemo-rl
logs=$venvs/logs
rm -rf "$logs" && mkdir -p "$logs"
venv_of() { echo "$venvs/$(basename "$1")"; }

# part NAME COMMAND...: runs COMMAND in the background into $logs/NAME.log; its exit status and seconds
# land in $logs/NAME.status when it ends.
parts=()
part_pids=()
part() {
  local name=$1
  shift
  parts+=("$name")
  (
    started=$SECONDS
    "$@" > "$logs/$name.log" 2>&1
    echo "$? $((SECONDS - started))" > "$logs/$name.status"
  ) &
  part_pids+=($!)
}

# tier TREE READY_FILE PREVIOUS_READY: builds the tree's environment (after the previous tree's, whose
# packages then come from uv's cache), then runs tests/nemo_rl in it.
tier() {
  local tree=$1 ready=$2 previous=$3 venv
  venv=$(venv_of "$tree")
  shift 3
  while [ -n "$previous" ] && [ ! -e "$previous" ]; do sleep 1; done
  bash tests/support/nemo_rl_venv.sh "$tree" "$venv" "$python313"
  local built=$?
  touch "$ready"
  [ "$built" -eq 0 ] || { echo "could not build $venv for $tree with $python313"; return 1; }
  # The tier's tests wait for the package's tiers: all at once, their processes slowed the rehearsals
  # past their hang guards on 2 cores (the environments' builds, mostly downloads, go ahead).
  while [ ! -e "$logs/python_tiers.done" ]; do sleep 2; done
  echo "== NeMo-RL tier on $("$venv/bin/python" -V 2>&1) against $tree"
  # Bytecode, cached: uv installs none, the tree is read-only, and with PYTHONDONTWRITEBYTECODE (set on our
  # machines) every Ray actor compiled torch, megatron-core and vLLM again (megatron-core's import: 24 s
  # uncached, 8 s cached). The cache lives in the environment, outside the checkout and the tree.
  limited env -u PYTHONDONTWRITEBYTECODE NEMO_RL_SRC="$tree" PYTHONPYCACHEPREFIX="$PWD/$venv/pycache" \
    "$venv/bin/pytest" tests/nemo_rl -n "$TIER_WORKERS" "$@"
}

start=$SECONDS
python_tiers_then_mark() {
  limited env -u NEMO_RL_SRC pytest "${python_tiers[@]}" "$@"
  local code=$?
  touch "$logs/python_tiers.done"
  return $code
}
part unit+cli+slurm python_tiers_then_mark "$@"
previous=""
for tree in "${tree_list[@]}"; do
  name=nemo_rl-$(basename "$tree")
  part "$name" tier "$tree" "$logs/$name.ready" "$previous" "$@"
  previous=$logs/$name.ready
done
# A line per part every PROGRESS_S seconds (its log's newest line), so a long or stuck run shows where it is;
# on SIGTERM (a CI limit) the parts' logs come out before the suite ends.
progress() {
  while sleep "${PROGRESS_S:-300}" > /dev/null 2>&1; do  # (not holding the suite's output open once killed)
    for name in "${parts[@]}"; do
      [ -e "$logs/$name.status" ] && continue
      echo "== $((SECONDS - start)) s, $name: $(tail -c 2000 "$logs/$name.log" 2>/dev/null | tr '\r' '\n' | grep -v '^\s*$' | tail -n 1 | cut -c1-160)"
    done
  done
}
progress &
ticker=$!
stopped() {
  kill "$ticker" 2>/dev/null
  echo "== suite stopped by a signal after $((SECONDS - start)) s; the newest lines of each part's log:"
  for name in "${parts[@]}"; do echo "== $name"; tail -n 40 "$logs/$name.log"; done
  exit 143
}
trap stopped TERM INT
wait "${part_pids[@]}"
kill "$ticker" 2>/dev/null

failed=0
summary=()
for name in "${parts[@]}"; do
  echo "== $name: its log ($logs/$name.log)"
  cat "$logs/$name.log"
  read -r code seconds < "$logs/$name.status" || { code=1; seconds="?"; }
  # pytest exit 5: nothing collected (e.g. a -k that matches only one part)
  if [ "$code" -eq 124 ] || [ "$code" -eq 137 ]; then
    failed=1
    summary+=("FAILED: $name stopped at its limit of $PART_LIMIT_S s (PART_LIMIT_S): a hang, or far slower than CI allows")
  elif [ "$code" -ne 0 ] && [ "$code" -ne 5 ]; then
    failed=1
    summary+=("FAILED (exit $code): $name ($seconds s)")
  else
    summary+=("ok: $name ($seconds s)")
  fi
done
echo "== suite: $((SECONDS - start)) s"
printf '%s\n' "${summary[@]}"
exit $failed
