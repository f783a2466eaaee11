#!/usr/bin/env bash
# Regenerates the two locks and commits nothing:
# - constraints/cpu-py311.txt: the exact versions of the CPU environment (Python 3.11, Linux x86_64) that the
#   README's commands and .ci/run install with (pip install -c constraints/cpu-py311.txt). Inputs:
#   pyproject.toml with every extra, and constraints/cpu-py311.in (torch's CPU build).
# - constraints/nemo-rl-py313.txt: the NeMo-RL tier's environment on NeMo-RL's Python (3.13), which
#   tests/suite.sh builds. Inputs: pyproject.toml's `test` and `nemo-cpu` extras and
#   constraints/nemo-rl-py313.in (PyPI's torch).
# Rerun it after changing a dependency or an extra in pyproject.toml and commit the files together;
# tests/unit/test_constraints.py fails while an extra names a package a lock does not pin.
#
#   bash constraints/refresh.sh              # keep the current pins, add/fix only what changed
#   bash constraints/refresh.sh --upgrade    # move every package to its newest allowed version
#
# Extra arguments go to `uv pip compile`. The torch CPU wheel is looked for in TORCH_FIND_LINKS (a
# directory or an HTML page of wheels, e.g. https://download.pytorch.org/whl/cpu/torch/), else in pip's
# find-links (PIP_FIND_LINKS or pip's config); every other package resolves against PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."

UV_VERSION=0.13.9   # the resolver is pinned too, so two refreshes of the same inputs agree

uv=$(command -v uv || true)
if [ -z "$uv" ] || [ "$("$uv" --version | cut -d' ' -f2)" != "$UV_VERSION" ]; then
  tool_dir=$(mktemp -d)
  trap 'rm -rf "$tool_dir"' EXIT
  python3 -m venv "$tool_dir/venv"
  "$tool_dir/venv/bin/pip" install -q "uv==$UV_VERSION"
  uv="$tool_dir/venv/bin/uv"
fi

find_links=()
for location in ${TORCH_FIND_LINKS:-${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}}; do
  find_links+=(--find-links "$location")
done

"$uv" pip compile pyproject.toml constraints/cpu-py311.in --all-extras \
  --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
  --no-config "${find_links[@]}" --quiet \
  --custom-compile-command "bash constraints/refresh.sh" \
  -o constraints/cpu-py311.txt "$@"
echo "wrote constraints/cpu-py311.txt ($(grep -c "^[a-z0-9]" constraints/cpu-py311.txt) pins)"

"$uv" pip compile pyproject.toml constraints/nemo-rl-py313.in --extra test --extra nemo-cpu \
  --python-version 3.13 --python-platform x86_64-manylinux_2_28 \
  --no-config --quiet \
  --custom-compile-command "bash constraints/refresh.sh" \
  -o constraints/nemo-rl-py313.txt "$@"
echo "wrote constraints/nemo-rl-py313.txt ($(grep -c "^[a-z0-9]" constraints/nemo-rl-py313.txt) pins)"
