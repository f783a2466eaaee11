"""The planner's simulation: vLLM engines, sync/partial/async generation, step and run cost, the kept
results (sim_cache.py) and what `bapo-nemo check` prints about them. Imports plan/rules, never the CLI."""
