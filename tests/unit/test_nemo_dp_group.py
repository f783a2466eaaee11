"""The data-parallel reduction BAPOLossFn uses, on NeMo-RL's DTensor layout rebuilt by `groups.py`, with
real torch.distributed (gloo) processes (tests/support/dp_ranks.py; Megatron's own groups: the NeMo-RL
tier's tests/nemo_rl/test_dp_group.py)."""

from __future__ import annotations

import pytest

from bapo_nemo.nemo.groups import dtensor_dp_rank_lists
from tests.support.dp_ranks import check_four_ranks_reduce_over_data_parallel_only


def test_dtensor_rank_layout():
    # world 8, tp 2, cp 2: DP peers share r mod 4
    assert dtensor_dp_rank_lists(8, 2, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dtensor_dp_rank_lists(4, 1, 1) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        dtensor_dp_rank_lists(6, 4, 1)


def test_four_gloo_ranks_reduce_over_data_parallel_only(tmp_path):
    check_four_ranks_reduce_over_data_parallel_only(tmp_path, "dtensor")
