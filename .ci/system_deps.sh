#!/usr/bin/env bash
# Debian packages the cluster tests use: Slurm daemons + client (tests/test_slurm_*.py), munge (Slurm's
# authentication) and shellcheck (tests/unit/test_shellcheck.py). Idempotent and quiet; a package that cannot
# be installed makes its tests skip with the reason, so this script never fails CI on its own.
set -uo pipefail

packages=(slurmctld slurmd slurm-client munge shellcheck)

missing=()
for pkg in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done
if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  echo "system_deps: apt-get not found; cannot install ${missing[*]} (their tests will skip)" >&2
  exit 0
fi

# apt needs root; use sudo without a password prompt when we are not root.
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    sudo_cmd=(sudo -n)
  else
    echo "system_deps: not root and no passwordless sudo; cannot install ${missing[*]} (their tests will skip)" >&2
    exit 0
  fi
fi

export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq >/dev/null 2>&1 || echo "system_deps: apt-get update failed" >&2
# Packages are installed one by one so a missing one does not block the others. Daemons are not started
# here (policy-rc.d would be overkill: there is no init system in CI containers); the tests start their
# own instances with their own configuration.
for pkg in "${missing[@]}"; do
  if ! "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "$pkg" >/dev/null 2>&1; then
    echo "system_deps: could not install $pkg (its tests will skip)" >&2
  fi
done
exit 0
