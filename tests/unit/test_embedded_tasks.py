"""Bundled arithmetic tasks: exact answers, heavy-tailed lengths, JSONL loading with bad-row accounting."""

from __future__ import annotations

import json
import warnings

import pytest

from bapo_nemo.embedded.config.run_config import TaskConfig
from bapo_nemo.embedded.data.tasks import (
    Task,
    TaskFileError,
    TaskGenerator,
    TaskStream,
    extract_answer,
    load_jsonl_tasks,
    looping_solution,
    reward,
    solve,
)


def test_solution_is_the_left_to_right_chain():
    # 7+5=12, 12-3=9
    assert solve([7, 5, 3], ["+", "-"]) == ("7+5=12;12-3=9;#9", 9)


def test_generated_answers_are_exact_and_lengths_heavy_tailed():
    tasks = TaskGenerator(seed=3, min_ops=1, max_ops=12, tail_alpha=1.5).sample(3000)
    for t in tasks[:200]:
        # Independent check: evaluate the question left to right from its characters.
        tokens, value, op = t.question.rstrip("?"), None, "+"
        num = ""
        for ch in tokens + "+":
            if ch.isdigit():
                num += ch
                continue
            value = int(num) if value is None else (value + int(num) if op == "+" else value - int(num))
            op, num = ch, ""
        assert str(value) == t.answer == extract_answer(t.solution)
    ops = [t.meta["num_ops"] for t in tasks]
    share_1 = ops.count(1) / len(ops)
    share_12 = ops.count(12) / len(ops)
    # P(n) ~ n^-1.5 on 1..12: P(1) = 1 / sum(n^-1.5) = 1/2.0 (sum_{1..12} n^-1.5 ~ 2.0); P(12) = 12^-1.5 / 2.0 ~ 0.012
    assert 0.45 < share_1 < 0.55
    assert 0.006 < share_12 < 0.02
    assert max(len(t.solution) for t in tasks) > 5 * sorted(len(t.solution) for t in tasks)[len(tasks) // 2]


def test_looping_demonstration_repeats_one_step_to_the_length_limit_without_an_answer():
    import random

    chain = "7+5=12;12-3=9;9+4=13;#13"
    looped = looping_solution(chain, 40, random.Random(0))
    assert len(looped) == 40 and "#" not in looped
    steps = looped.split(";")
    # a prefix of the true chain, then its last step over and over (the final piece may be cut short)
    k = next(i for i in range(1, len(steps)) if steps[i] == steps[i - 1])
    assert steps[:k] == chain.split(";")[:k]
    assert all(s == steps[k] for s in steps[k:-1]) and steps[k].startswith(steps[-1])


def test_loop_rate_marks_that_share_of_demonstrations_cut_off_and_leaves_the_rest_unchanged():
    plain = TaskGenerator(seed=5, max_ops=6).sample(2000)
    looping = TaskGenerator(seed=5, max_ops=6, loop_rate=0.3, loop_length=80).sample(2000)
    cut = [t for t in looping if t.meta.get("cut_off")]
    assert 0.26 < len(cut) / len(looping) < 0.34
    assert all(len(t.solution) == 80 and extract_answer(t.solution) is None for t in cut)
    # the others are ordinary demonstrations (same questions for the first one; the loop draw shifts
    # the random stream afterwards)
    assert looping[0].question == plain[0].question
    assert all(extract_answer(t.solution) == t.answer for t in looping if not t.meta.get("cut_off"))


def test_generator_state_round_trip_reproduces_the_stream():
    g = TaskGenerator(seed=1)
    g.sample(5)
    state = g.state()
    expected = [t.question for t in g.sample(10)]
    h = TaskGenerator(seed=99)
    h.set_state(json.loads(json.dumps(state)))  # as it travels through a checkpoint
    assert [t.question for t in h.sample(10)] == expected


def test_reward_checks_the_final_answer_exactly():
    task = Task("p", "7+5-3?", "9")
    assert reward("7+5=12;12-3=9;#9", task) == 1.0
    assert reward("7+5=12;12-3=9;#19", task) == 0.0
    assert reward("7+5=12;12-3=9", task) == 0.0  # no final answer


def test_stream_never_serves_held_out_questions():
    held = {t.question for t in TaskGenerator(seed=5, max_ops=1).sample(50)}
    stream = TaskStream(0, TaskConfig(max_ops=1), held)
    served = stream.next(500)
    assert not {t.question for t in served} & held


def _write(path, rows):
    path.write_text("\n".join(rows) + "\n")


def test_jsonl_malformed_rows_are_skipped_and_counted(tmp_path):
    path = tmp_path / "tasks.jsonl"
    good = [json.dumps({"question": f"{i}+1?", "answer": str(i + 1)}) for i in range(1, 10)] * 2  # 18 good
    rows = good[:5] + ["{not json"] + good[5:] + [json.dumps({"question": "1+1?"})]  # 2 bad of 20
    _write(path, rows)
    with pytest.warns(UserWarning) as record:
        tasks = load_jsonl_tasks(path, max_bad_fraction=0.2)
    assert len(tasks) == 18
    msg = str(record[0].message)
    assert str(path) in msg and "skipped 2 malformed row(s) of 20" in msg
    assert "line 6: not JSON" in msg and "line 20: missing 'answer'" in msg


def test_jsonl_too_many_bad_rows_is_an_error(tmp_path):
    path = tmp_path / "tasks.jsonl"
    _write(
        path,
        [
            json.dumps({"question": "1+1?", "answer": "2"}),
            json.dumps({"question": "1+1=!", "answer": 2}),
            "[]",
        ],
    )
    with pytest.raises(
        TaskFileError, match=r"skipped 2 malformed row\(s\) of 3.*task.max_bad_fraction=0.1"
    ) as exc:
        load_jsonl_tasks(path, max_bad_fraction=0.1)
    assert "characters outside the vocabulary: '!'" in str(exc.value)


def test_jsonl_clean_file_gives_no_warning(tmp_path):
    path = tmp_path / "tasks.jsonl"
    _write(path, [json.dumps({"question": "2+2?", "answer": 4, "solution": "2+2=4;#4", "id": "a"})])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (task,) = load_jsonl_tasks(path)
    assert (task.prompt_id, task.answer, task.solution) == ("a", "4", "2+2=4;#4")


def test_warmup_batch_ends_demonstrations_with_eos_except_the_cut_off_ones():
    from bapo_nemo.embedded.loop.warmup import sft_batch
    from bapo_nemo.embedded.model.tokenizer import load_tokenizer

    tok = load_tokenizer()
    ended = Task("a", "7+5?", "12", "7+5=12;#12")
    cut = Task("b", "7+5?", "12", "7+5=12;7+5=12;7+5=1", {"cut_off": True})
    ids, attention, target = sft_batch(tok, [ended, cut])
    lengths = attention.sum(-1).tolist()
    assert ids[0, lengths[0] - 1] == tok.eos_token_id
    assert ids[1, lengths[1] - 1] == tok.convert_tokens_to_ids("1") and tok.eos_token_id not in ids[1].tolist()[: lengths[1]]
    # the targets cover exactly the response tokens: solution (+ EOS when it ends)
    assert target[0].sum() == len("7+5=12;#12") + 1 and target[1].sum() == len("7+5=12;7+5=12;7+5=1")
