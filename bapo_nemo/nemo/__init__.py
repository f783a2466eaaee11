"""The NeMo-RL adapter (v0.7.0 and main): BAPOLossFn (`loss.py`, imports nemo_rl), its nemo_rl-free logic
(`loss_math.py`, `groups.py`, `step_bounds.py`), partial rollouts (`partial_rollout.py`), the driver
(`driver.py`, `python -m bapo_nemo.train`), every layer it puts on NeMo-RL (`layers.py`), where NeMo-RL
releases differ (`installed.py`) and every place we touch NeMo-RL (`seams.py`, checked before a run
starts). See docs/nemo_rl.md."""
