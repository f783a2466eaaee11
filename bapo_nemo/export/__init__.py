"""`bapo-nemo export`: checkpoints -> Hugging Face directories, each ending with a parity check.

- `checkpoint`: find and validate the checkpoint (embedded layout or NeMo-RL Megatron);
- `hf` (embedded -> HF), `megatron` (NeMo-RL Megatron -> HF through Megatron-Bridge, in the container),
  `fp8` (FP8 with NVIDIA ModelOpt), `model_card` (the README.md: prompt format, source, BAPO, parity);
- `parity`: held-out log-prob comparison; `registry`: MLflow model registry; `cli`: the sub-command.
"""
