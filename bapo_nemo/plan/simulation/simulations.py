"""The simulations `bapo-nemo check` runs, each kept between runs by plan/simulation/sim_cache.py (a hit returns what
the plain function would). The plain functions stay in their modules for the tests and the benchmarks."""

from __future__ import annotations

from bapo_nemo.plan.simulation import async_generation, generation, search_stats
from bapo_nemo.plan.simulation.sim_cache import persistent

simulate_async = persistent(async_generation.simulate_async)
simulate_partial = persistent(generation.simulate_partial)
simulate_without_partial = persistent(generation.simulate_without_partial)
simulate_validation = persistent(generation.simulate_validation)
response_moments = persistent(generation.response_moments)
search_statistics = persistent(search_stats.simulate)
length_moments = persistent(search_stats.length_moments)


def expected_response_tokens(shape: generation.RolloutShape, lengths: search_stats.LengthModel) -> float:
    """generation.expected_response_tokens, from the kept moments."""
    return response_moments(shape, lengths)[0] - shape.prompt_tokens
