#!/usr/bin/env bash
# Build step of the Dockerfile (runs inside nvcr.io/nvidia/nemo-rl:v0.7.0): make bapo-nemo importable in
# NeMo-RL's driver venv and in every Ray actor venv, without touching the container's torch.
#
# bapo_nemo itself comes from PYTHONPATH (set by the Dockerfile). Its runtime dependencies (pyproject
# `dependencies`, torch aside) are already in NeMo-RL's venvs; if one is missing from a venv it is
# installed into that venv with --no-deps, so nothing else in the venv moves. torch's version is
# compared before and after.
set -euo pipefail

BAPO_HOME=${BAPO_NEMO_HOME:-/opt/bapo-nemo}
DRIVER_VENV=${DRIVER_VENV:-/opt/nemo_rl_venv}
ACTOR_VENVS_DIR=${NEMO_RL_VENV_DIR:-/opt/ray_venvs}
STRICT=${BAPO_STRICT_IMPORT_CHECK:-0}
CLI_PATH=${BAPO_CLI_PATH:-/usr/local/bin/bapo-nemo}

# import name:pip requirement, mirroring pyproject.toml `dependencies`. Excluded on purpose: torch (the
# container's), and numba, which only fuses the bound search's pass over CPU tensors (GPU tensors take the
# PyTorch path) and whose numpy pin must not move the container's numpy.
DEPS=(
  "pydantic:pydantic>=2.6"
  "yaml:pyyaml>=6"
  "transformers:transformers>=4.45"
  "safetensors:safetensors>=0.4"
  "tokenizers:tokenizers>=0.19"
  "mlflow:mlflow>=2.14"
  "matplotlib:matplotlib>=3.7"
  "tqdm:tqdm>=4.66"
  "rich:rich>=13"
  "omegaconf:omegaconf>=2.3"
)

[[ -d "$BAPO_HOME/bapo_nemo" ]] || { echo "ERROR: $BAPO_HOME/bapo_nemo missing (COPY step of the Dockerfile)" >&2; exit 1; }
[[ -x "$DRIVER_VENV/bin/python" ]] || {
  echo "ERROR: $DRIVER_VENV/bin/python not found: is the base image nvcr.io/nvidia/nemo-rl:v0.7.0?" >&2
  exit 1
}

pythons=("$DRIVER_VENV/bin/python")
if [[ -d "$ACTOR_VENVS_DIR" ]]; then
  while IFS= read -r py; do pythons+=("$py"); done < <(find "$ACTOR_VENVS_DIR" -mindepth 3 -maxdepth 3 -path '*/bin/python' | sort)
fi
echo "bapo-nemo: checking ${#pythons[@]} venv(s): ${pythons[*]}"

install_no_deps() {
  local py=$1
  shift
  if command -v uv >/dev/null 2>&1; then
    uv pip install --python "$py" --no-deps "$@"
  else
    "$py" -m pip install --no-deps "$@"
  fi
}

# One Python process per venv and check (imports are slow): prints the torch version, then the
# requirements of the dependencies that do not import.
probe() {
  "$1" - "${DEPS[@]}" <<'EOF'
import importlib, sys
try:
    import torch
    print(torch.__version__)
except Exception:
    print("none")
for dep in sys.argv[1:]:
    module, requirement = dep.split(":", 1)
    try:
        importlib.import_module(module)
    except Exception:
        print(requirement)
EOF
}

failures=0
for py in "${pythons[@]}"; do
  mapfile -t probed < <(probe "$py")
  torch_before=${probed[0]:-none}
  missing=("${probed[@]:1}")
  torch_after=$torch_before
  if ((${#missing[@]})); then
    echo "bapo-nemo: $py lacks ${missing[*]}: installing with --no-deps"
    install_no_deps "$py" "${missing[@]}"
    torch_after=$("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)
  fi
  if [[ "$torch_before" != "$torch_after" ]]; then
    echo "ERROR: torch changed in $py ($torch_before -> $torch_after); refusing to build this image" >&2
    exit 1
  fi

  # Every venv runs the BAPO math; the driver also needs the CLI, tracking and planner modules. The loss
  # object is unpickled in the policy-worker venvs: check it imports there too (a warning: some actor
  # venvs never run it).
  modules="bapo_nemo.algorithm"
  if [[ "$py" == "$DRIVER_VENV/bin/python" ]]; then
    modules+=", bapo_nemo.cli, bapo_nemo.tracking.mlflow_tracker, bapo_nemo.plan.rules.checks, bapo_nemo.nemo.driver"
  fi
  rc=0
  out=$(PYTHONPATH="$BAPO_HOME" "$py" -c "
import $modules
try:
    import bapo_nemo.nemo.loss
except Exception as exc:
    print(f'{type(exc).__name__}: {exc}')
    raise SystemExit(3)
" 2>&1) || rc=$?
  if ((rc == 3)); then
    echo "WARNING: $py cannot import bapo_nemo.nemo.loss (fine for venvs that never run the loss): $out" >&2
    failures=$((failures + 1))
  elif ((rc != 0)); then
    echo "ERROR: $py cannot import $modules:" >&2
    echo "$out" >&2
    exit 1
  fi
  echo "bapo-nemo: $py ok (torch $torch_after)"
done

if ((failures && STRICT == 1)); then
  echo "ERROR: $failures venv(s) cannot import bapo_nemo.nemo.loss (BAPO_STRICT_IMPORT_CHECK=1)" >&2
  exit 1
fi

# `bapo-nemo` on PATH for every user of the image.
mkdir -p "$(dirname "$CLI_PATH")"
cat >"$CLI_PATH" <<EOF
#!/bin/sh
exec "$DRIVER_VENV/bin/python" -m bapo_nemo.cli "\$@"
EOF
chmod +x "$CLI_PATH"
echo "bapo-nemo: installed at $BAPO_HOME (PYTHONPATH), CLI at $CLI_PATH"
