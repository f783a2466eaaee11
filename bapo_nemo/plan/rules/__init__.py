"""Config rules of the planner: loading a NeMo-RL config, its schema, the cluster layout and the
checks that need no simulation (they also run in the NeMo-RL driver's pre-flight)."""
