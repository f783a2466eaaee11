"""bapo-nemo: BAPO adaptive clipping for NeMo-RL + Megatron-core, and a single-machine trainer.

Three floors; imports point down only (tests/unit/test_layering.py):

- bottom: `algorithm` (the BAPO math: config, bound search, loss; torch + pydantic only), `rollout`
  (partial-rollout segments and the replay buffer, framework-free and checkpointable), `tracking` (MLflow,
  its journal and the report);
- middle: `embedded` (the single-process trainer), `export` (HF export with its parity check), `plan`
  (`bapo-nemo check`: config rules, the memory and step-time models);
- top: `nemo` (the NeMo-RL adapter; imports nemo_rl lazily, runs in the container), above it only the CLI.

`config_errors`, a module below them all, turns pydantic errors into lines that name the key.
"""

__version__ = "0.1.0"
