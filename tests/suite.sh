#!/usr/bin/env bash
# The whole test suite, as the README's test command runs it (after installing this checkout with
# constraints/cpu-py311.txt into the active environment), tier by tier (tests/README.md):
#
#   1. tests/unit, tests/cli and tests/slurm on this Python (3.11 or newer);
#   2. tests/nemo_rl on NeMo-RL's own Python, 3.13, in .venv-nemo-rl (installed here, pinned by
#      constraints/nemo-rl-py313.txt: torch, megatron-core 0.19.2 and the `nemo-cpu` extra), once per NeMo-RL
#      source tree in NEMO_RL_SRCS (colon-separated; .ci/run sets v0.7.0's and main's from ../shared/upstream).
#
# Without a tree (NEMO_RL_SRCS and NEMO_RL_SRC unset) the NeMo-RL tests skip, each with its reason. Without
# Python 3.13 (PYTHON313, `python3.13` on PATH, or pyenv's 3.13.0; NeMo-RL itself requires it) the command
# says so in one line, with how to get it, and runs tier 1 only.
# Arguments go to every pytest (e.g. `-x`, `-k name`). Exit status: non-zero if any part failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

trees=${NEMO_RL_SRCS:-${NEMO_RL_SRC:-}}
IFS=: read -r -a tree_list <<< "$trees"

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

python_tiers=(tests/unit tests/cli tests/slurm)
if [ -z "$trees" ]; then
  exec pytest "${python_tiers[@]}" "$@"
fi
python313=$(find_python313)
if [ -z "$python313" ]; then
  echo "Python 3.13 (NeMo-RL's own) not found: the NeMo-RL tier (tests/nemo_rl) is skipped; install it (pyenv install 3.13) or set PYTHON313 to run it against every tree"
  exec env -u NEMO_RL_SRC pytest "${python_tiers[@]}" "$@"
fi

# NeMo-RL's environment is built while the rest of the suite runs.
venv=.venv-nemo-rl
(
  rm -rf "$venv" && "$python313" -m venv "$venv" \
    && "$venv/bin/pip" install -q -c constraints/nemo-rl-py313.txt torch==2.13.0 -e '.[test,nemo-cpu]'
) > "$venv.log" 2>&1 &
build=$!

declare -A status seconds
start=$SECONDS
part="${python_tiers[*]}, $(python -V 2>&1)"
env -u NEMO_RL_SRC pytest "${python_tiers[@]}" "$@"
status["$part"]=$?
seconds["$part"]=$((SECONDS - start))

if ! wait "$build"; then
  echo "could not build $venv with $python313 (its log: $venv.log):" >&2
  tail -n 20 "$venv.log" >&2
  exit 1
fi
echo "== $venv ready $((SECONDS - start)) s after the suite started"
for tree in "${tree_list[@]}"; do
  echo "== NeMo-RL tier on $("$venv/bin/python" -V 2>&1) against $tree"
  part="tests/nemo_rl, $tree"
  tier_start=$SECONDS
  NEMO_RL_SRC=$tree "$venv/bin/pytest" tests/nemo_rl "$@"
  status["$part"]=$?
  seconds["$part"]=$((SECONDS - tier_start))
done

echo "== suite: $((SECONDS - start)) s"
failed=0
for part in "${!status[@]}"; do
  code=${status[$part]}
  # pytest exit 5: nothing collected (e.g. a -k that matches only one part)
  if [ "$code" -ne 0 ] && [ "$code" -ne 5 ]; then failed=1; echo "FAILED (exit $code): $part (${seconds[$part]} s)"; else echo "ok: $part (${seconds[$part]} s)"; fi
done
exit $failed
