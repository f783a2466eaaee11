"""bapo-nemo: BAPO adaptive clipping for NeMo-RL + Megatron-core, and a single-machine trainer.

Imports point down only (tests/unit/test_layering.py):
- bottom: `algorithm` (BAPO's math), `rollout` (partial rollouts, replay), `tracking` (MLflow, report);
- middle: `embedded` (the one-machine trainer), `export` (HF export), `plan` (`bapo-nemo check`);
- top: `nemo` (the NeMo-RL adapter, nemo_rl imported lazily); the entry points `cli.py`, `train.py` above.
`config_errors` (pydantic errors as lines naming the key) sits below them all.
"""

__version__ = "0.1.0"
