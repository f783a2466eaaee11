#!/usr/bin/env bash
# Turn the bapo-nemo image into a squashfs file that enroot/pyxis run (srun --container-image=FILE).
#
#   bash containers/make_squashfs.sh --build                  # docker build . then import from the local daemon
#   bash containers/make_squashfs.sh --build --nemo-rl-image nvcr.io/nvidia/nemo-rl:v0.8.0   # on another NeMo-RL
#   bash containers/make_squashfs.sh --tag bapo-nemo:v1       # import an image already in the local daemon
#   bash containers/make_squashfs.sh --registry 'nvcr.io#myorg/bapo-nemo:v1'   # import from a registry
#
# Options:
#   --build              docker build the Dockerfile at the repository root first (tag: --tag)
#   --nemo-rl-image REF  with --build: the NeMo-RL image to build on (default nvcr.io/nvidia/nemo-rl:v0.7.0;
#                        tested: v0.7.0 and NeMo-RL main of 2026-08-22, see docs/nemo_rl.md; the driver
#                        refuses to start on a NeMo-RL where one of its hooks cannot be placed)
#   --tag TAG            local image tag (default: bapo-nemo:<git short commit>, or bapo-nemo:latest)
#   --registry REF       import REF with `enroot import docker://REF` instead of the local daemon
#                        (enroot's syntax: [USER@][REGISTRY#]IMAGE[:TAG]; credentials in
#                        ~/.config/enroot/.credentials)
#   --output FILE        squashfs to write (default: containers/bapo-nemo.sqsh, what the sbatch uses)
#   --force              replace an existing FILE (it is kept as FILE.previous until the import succeeds)
#
# Run it on a machine with enroot (a login or compute node of the cluster) and, for --build or a local
# tag, docker. The squashfs must sit on a filesystem the compute nodes see.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=0
force=0
registry=""
nemo_rl_image="nvcr.io/nvidia/nemo-rl:v0.7.0"
nemo_rl_image_given=0
output="$repo/containers/bapo-nemo.sqsh"
tag=""

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }
die() { echo "ERROR: $*" >&2; exit 1; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) build=1 ;;
    --force) force=1 ;;
    --tag) [[ $# -ge 2 ]] || die "--tag needs a value"; tag=$2; shift ;;
    --registry) [[ $# -ge 2 ]] || die "--registry needs a value"; registry=$2; shift ;;
    --nemo-rl-image) [[ $# -ge 2 ]] || die "--nemo-rl-image needs a value"; nemo_rl_image=$2; nemo_rl_image_given=1; shift ;;
    --output) [[ $# -ge 2 ]] || die "--output needs a value"; output=$2; shift ;;
    -h | --help) usage; exit 0 ;;
    *) usage >&2; die "unknown option: $1" ;;
  esac
  shift
done

if [[ -z "$tag" ]]; then
  commit=$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || true)
  tag="bapo-nemo:${commit:-latest}"
fi
[[ -n "$registry" && $build -eq 1 ]] && die "--build and --registry exclude each other (build, push, then --registry)"
[[ $nemo_rl_image_given -eq 1 && $build -eq 0 ]] && die "--nemo-rl-image only applies with --build (it is the image built on)"

command -v enroot >/dev/null || die "enroot not found: run this on a cluster node with enroot (https://github.com/NVIDIA/enroot)"
if [[ -z "$registry" ]]; then
  command -v docker >/dev/null || die "docker not found: use --registry REF to import from a registry instead"
fi
output_dir=$(dirname "$output")
[[ -d "$output_dir" && -w "$output_dir" ]] || die "output directory $output_dir does not exist or is not writable"

previous=""
if [[ -e "$output" ]]; then
  [[ $force -eq 1 ]] || die "$output exists; pass --force to replace it"
  previous="$output.previous"
  mv -f "$output" "$previous"
fi
restore_previous() {
  if [[ -n "$previous" && -e "$previous" && ! -e "$output" ]]; then
    mv -f "$previous" "$output"
    echo "import failed: restored the previous $output" >&2
  fi
}
trap restore_previous EXIT

if [[ $build -eq 1 ]]; then
  echo "building $tag from $repo/Dockerfile on $nemo_rl_image (needs docker login nvcr.io for NVIDIA's images)"
  docker build --build-arg "BASE_IMAGE=$nemo_rl_image" -t "$tag" -f "$repo/Dockerfile" "$repo"
fi

if [[ -n "$registry" ]]; then
  source_uri="docker://$registry"
else
  docker image inspect "$tag" >/dev/null 2>&1 || die "image $tag is not in the local docker daemon: pass --build, or --tag an existing image"
  source_uri="dockerd://$tag"
fi
echo "enroot import -o $output $source_uri"
enroot import -o "$output" "$source_uri"

[[ -s "$output" ]] || die "enroot produced no $output"
if [[ -n "$previous" ]]; then rm -f "$previous"; fi
echo "wrote $output ($(du -h "$output" | cut -f1)); submit with CONTAINER_IMAGE=$output (the sbatch default)"
