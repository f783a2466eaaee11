# syntax=docker/dockerfile:1
# bapo-nemo on NVIDIA NeMo-RL (Python 3.13, torch, Megatron-core, vLLM, Ray): v0.7.0 by default, or the
# NeMo-RL image given as BASE_IMAGE (tested: v0.7.0 and NeMo-RL main of 2026-08-22; docs/nemo_rl.md).
#
#   docker build -t bapo-nemo:latest .                  # needs `docker login nvcr.io` for the base image
#   docker build --build-arg BASE_IMAGE=nvcr.io/nvidia/nemo-rl:<tag> -t bapo-nemo:<tag> .
#   bash containers/make_squashfs.sh --build [--nemo-rl-image REF]   # build + squashfs for enroot/pyxis
#
# bapo-nemo is pure Python. It is layered over the container through PYTHONPATH rather than installed
# with pip: NeMo-RL runs the driver in /opt/nemo_rl_venv and each Ray actor in its own venv under
# /opt/ray_venvs (NEMO_RL_VENV_DIR), and `init_ray()` hands the driver's environment, PYTHONPATH
# included, to every actor. So one copy reaches all venvs, and pip never gets a chance to replace the
# container's torch. The build step below checks that, and installs (with --no-deps) only a light
# dependency a venv lacks.
ARG BASE_IMAGE=nvcr.io/nvidia/nemo-rl:v0.7.0
FROM ${BASE_IMAGE}

ARG BAPO_HOME=/opt/bapo-nemo
# 1: fail the build when a Ray actor venv cannot import bapo_nemo.nemo.loss (the BAPO loss is unpickled
# there). 0: report it and go on (some actor venvs only import cleanly on a GPU node).
ARG BAPO_STRICT_IMPORT_CHECK=0

COPY pyproject.toml README.md ${BAPO_HOME}/
COPY bapo_nemo ${BAPO_HOME}/bapo_nemo
COPY configs ${BAPO_HOME}/configs
COPY slurm ${BAPO_HOME}/slurm
COPY containers/install_into_venvs.sh ${BAPO_HOME}/containers/install_into_venvs.sh

ENV BAPO_NEMO_HOME=${BAPO_HOME}
ENV PYTHONPATH=${BAPO_HOME}${PYTHONPATH:+:${PYTHONPATH}}

RUN BAPO_STRICT_IMPORT_CHECK=${BAPO_STRICT_IMPORT_CHECK} bash ${BAPO_HOME}/containers/install_into_venvs.sh

WORKDIR ${BAPO_HOME}
