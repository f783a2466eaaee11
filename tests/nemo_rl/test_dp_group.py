"""The data-parallel reduction BAPOLossFn uses, over Megatron's own groups: megatron-core's real
`initialize_model_parallel` on 4 gloo processes (TP 2, DP 2; it needs no GPU for groups), as NeMo-RL's
Megatron workers set it up (tests/support/dp_ranks.py says what is checked)."""

from __future__ import annotations

from tests.support.dp_ranks import check_four_ranks_reduce_over_data_parallel_only


def test_four_gloo_ranks_reduce_over_megatrons_data_parallel_group(tmp_path):
    check_four_ranks_reduce_over_data_parallel_only(tmp_path, "megatron")
