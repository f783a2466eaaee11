"""`bapo-nemo export`: checkpoints -> Hugging Face directories, each ending with a parity check.

- `checkpoint`: find and validate the checkpoint (embedded layout or NeMo-RL Megatron).
- `hf`: embedded -> HF (atomic write; the tokenizer's chat template builds the training prompt);
  `model_card`: the README.md (prompt format, source, BAPO settings, parity; no local path);
  `fp8`: FP8 with NVIDIA ModelOpt;
  `megatron`: NeMo-RL Megatron -> HF through Megatron-Bridge (inside the NeMo-RL container).
- `parity`: held-out log-prob comparison, and the training-time reference file for Megatron exports.
- `registry`: MLflow model registry; `cli`: the sub-command.
"""
