"""bapo-nemo: BAPO adaptive clipping for NeMo-RL + Megatron-core, and a single-machine trainer.

Subpackages (data flows one way: runtimes use `algorithm` and `rollout`; `tracking`, `export` and
`plan` are leaves; only the CLI imports a runtime):

- `algorithm`: the BAPO math (config, bound search, loss). torch + pydantic only.
- `rollout`: partial-rollout segments and the replay buffer, framework-free and checkpointable.
- `embedded`: the single-process trainer (tiny model, tasks, generation, train loop).
- `nemo`: the NeMo-RL adapter, v0.7.0 and main (imports nemo_rl lazily; runs in the container).
- `tracking`, `export`, `plan`: MLflow and reports, HF export, config checks and memory planning.
- `config_errors` (a module below them all): pydantic errors as lines that name the key.
"""

__version__ = "0.1.0"
