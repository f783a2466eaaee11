"""tests/support/nemo_rehearsal.py's reading of a rehearsal's record: which log-probs the driver searched
each optimizer step's bounds with."""

from __future__ import annotations

import torch

from tests.support.nemo_rehearsal import searched_logprobs


def _batch(rows: list[list[int]], fill: float) -> dict:
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    return {"input_ids": ids, "input_lengths": torch.tensor([len(r) for r in rows]),
            "prev_logprobs": torch.full((len(rows), width), fill)}


def test_two_steps_holding_the_same_rows_each_take_their_own_pass():
    """One rollout batch of 8 rows trained as 2 optimizer steps whose 4 rows are alike (one prompt drawn
    twice, its responses alike): the first step searched with grpo's prev_logprobs, the second with the
    extra pass made right before its train(), at weights the first step changed. A record once matched
    by content alone gave the first step the second one's pass."""
    rows = [[5, 14, 4, 17, 20, 6, 2], [5, 14, 4, 17, 20, 21, 6, 2], [5, 14, 4, 17, 6, 2], [5, 14, 4, 17, 20, 6, 2]]
    first, second = _batch(rows, -1.0), _batch(rows, -1.0)
    prev_pass = (_batch(rows + rows, 0.0), {"logprobs": torch.full((8, 8), -1.0)})
    extra_pass = (_batch(rows, 0.0), {"logprobs": torch.full((4, 8), -2.0)})

    searched = searched_logprobs([first, second], [prev_pass, extra_pass], calls_before_train=[1, 2])

    assert torch.equal(searched[0], first["prev_logprobs"])
    assert torch.equal(searched[1], torch.full((4, 8), -2.0))


def test_a_pass_over_other_rows_right_before_a_step_is_not_its_own():
    rows, other = [[3, 4, 5]], [[3, 4, 6]]
    step = _batch(rows, -1.0)
    searched = searched_logprobs([step], [(_batch(other, 0.0), {"logprobs": torch.full((1, 3), -2.0)})],
                                 calls_before_train=[1])
    assert torch.equal(searched[0], step["prev_logprobs"])
