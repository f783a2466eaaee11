"""The NeMo-RL v0.7.0 adapter: BAPOLossFn (`loss.py`, imports nemo_rl), its nemo_rl-free logic
(`loss_math.py`, `options.py`, `groups.py`, `step_bounds.py`), partial rollouts (`partial_rollout.py`)
and the driver (`driver.py`, `python -m bapo_nemo.train`). See docs/nemo_rl.md."""
