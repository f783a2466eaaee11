"""The generation ledger (bapo_nemo/rollout/ledger.py): durable lines, a torn last line, and what each
resume counts as generated again, with the sums computed by hand from the lines each test writes."""

from __future__ import annotations

import json

from bapo_nemo.rollout import PartialRolloutConfig, PartialRolloutManager, PromptItem
from bapo_nemo.rollout.ledger import LEDGER_FILE, GenerationLedger, iteration_counts
from bapo_nemo.rollout.types import GenerationChunk


def ledger(tmp_path) -> GenerationLedger:
    return GenerationLedger(tmp_path / "ckpt" / LEDGER_FILE)


def generate(ledger: GenerationLedger, steps: range, tokens: int = 10, segments: int = 2) -> None:
    """One segment iteration per step; step s generates `tokens * s` tokens, so each step is told apart."""
    for step in steps:
        ledger.record(step, step - 1, tokens * step, segments, 1)


def test_each_record_is_a_whole_line_on_disk(tmp_path):
    led = ledger(tmp_path)
    assert led.entries() == [] and led.resume(0) is None  # a first start: nothing to count, nothing written
    assert not led.path.exists()
    led.record(1, 0, 40, 4, 1)
    led.record(1, 0, 12, 3, 3)
    text = led.path.read_text()
    assert text.endswith("\n") and len(text.splitlines()) == 2
    assert json.loads(text.splitlines()[0]) == {
        "kind": "generation", "step": 1, "policy_version": 0, "tokens": 40, "segments": 4, "finished": 1
    }
    # another process (the next attempt) reads what this one wrote
    assert [e["tokens"] for e in GenerationLedger(led.path).entries()] == [40, 12]


def test_a_torn_last_line_is_tolerated_and_cut_before_the_next_append(tmp_path, capsys):
    led = ledger(tmp_path)
    generate(led, range(1, 4))  # 10 + 20 + 30 tokens
    whole = led.path.read_bytes()
    torn = b'{"kind":"generation","step":4,"policy_ver'  # the writer was killed mid-write
    led.path.write_bytes(whole + torn)
    next_attempt = GenerationLedger(led.path)
    assert [e["step"] for e in next_attempt.entries()] == [1, 2, 3]
    regenerated = next_attempt.resume(2)
    assert (regenerated.tokens, regenerated.segments, regenerated.iterations) == (30, 2, 1)
    assert capsys.readouterr().err == ""  # tolerated: no error line
    lines = next_attempt.path.read_bytes().split(b"\n")
    assert lines[:3] == whole.split(b"\n")[:3] and torn not in next_attempt.path.read_bytes()
    assert json.loads(lines[3])["kind"] == "resume" and lines[4] == b""

    # a whole record that lost only its newline is kept, and ended before the next line
    led2 = GenerationLedger(tmp_path / "other" / LEDGER_FILE)
    led2.record(5, 4, 7, 1, 0)
    led2.path.write_bytes(led2.path.read_bytes().rstrip(b"\n"))
    again = GenerationLedger(led2.path)
    again.record(5, 4, 8, 1, 1)
    assert [e["tokens"] for e in again.entries()] == [7, 8]


def test_two_faults_in_a_row_count_each_line_once(tmp_path):
    led = ledger(tmp_path)
    # attempt 1: checkpoints at steps 2 and 4, killed while generating for step 6
    generate(led, range(1, 7))  # step s: 10*s tokens, 2 segments
    second = GenerationLedger(led.path).resume(4)
    assert (second.from_step, second.tokens, second.segments) == (4, 50 + 60, 4)
    # attempt 2 resumes from step_4, generates for steps 5 and 6 (two iterations for step 6), is killed
    led = GenerationLedger(led.path)
    generate(led, range(5, 7), tokens=3)  # 15, 18
    led.record(6, 5, 4, 1, 1)
    third = GenerationLedger(led.path).resume(4)
    # attempt 1's steps 5-6 were counted at the first resume; only attempt 2's lines now
    assert (third.tokens, third.segments, third.iterations) == (15 + 18 + 4, 2 + 2 + 1, 3)
    kinds = [e["kind"] for e in GenerationLedger(led.path).entries()]
    assert kinds == ["generation"] * 6 + ["resume"] + ["generation"] * 3 + ["resume"]  # nothing lost
    assert third.line() == (
        "resumed from step_4: 37 tokens in 5 segments that an earlier attempt generated after step_4 are "
        "generated again (partial rollouts)"
    )
    assert third.metrics() == {
        "partial_rollouts/regenerated_tokens": 37.0,
        "partial_rollouts/regenerated_segments": 5.0,
        "partial_rollouts/resumed_from_step": 4.0,
    }


def test_a_skipped_newest_checkpoint_counts_what_it_held(tmp_path):
    led = ledger(tmp_path)
    # attempt 1: checkpoints at 3 and 6, killed generating for step 7
    generate(led, range(1, 8))
    first = GenerationLedger(led.path).resume(6)
    assert first.tokens == 70  # step 7 only: steps <= 6 are held by step_6
    # attempt 2 generates for step 7 and is killed; step_6 turns out damaged and is skipped: K = 3 < 7
    led = GenerationLedger(led.path)
    generate(led, range(7, 8), tokens=1)  # 7 tokens
    second = GenerationLedger(led.path).resume(3)
    # attempt 1's steps 4-6 (held by step_6 until now) and attempt 2's step 7; attempt 1's step 7 counted once
    assert (second.tokens, second.iterations) == (40 + 50 + 60 + 7, 4)


def test_no_checkpoint_after_a_fault_counts_everything_generated(tmp_path):
    led = ledger(tmp_path)
    generate(led, range(1, 3))  # killed before the first checkpoint
    regenerated = GenerationLedger(led.path).resume(0)
    assert (regenerated.from_step, regenerated.tokens) == (0, 30)
    assert regenerated.line().startswith("started from no checkpoint: 30 tokens in 4 segments")
    assert GenerationLedger(led.path).resume(0) is None  # counted already: a clean start from here


def test_a_bad_line_gets_one_error_line_and_is_not_counted(tmp_path, capsys):
    led = ledger(tmp_path)
    generate(led, range(1, 3))
    lines = led.path.read_text().splitlines()
    led.path.write_text("\n".join([lines[0], '{"kind":"generation","step":2,"tokens":-5}', lines[1]]) + "\n")
    regenerated = GenerationLedger(led.path).resume(0)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: {led.path} line 2: generation record's policy_version must be an int >= 0, got None; the line"
        + " is not counted as generated tokens: fix or delete it"
    ]
    assert regenerated.tokens == 30  # the two good lines
    assert len(led.path.read_text().splitlines()) == 4  # the bad line stays, the resume is appended


def test_iteration_counts_match_what_the_manager_generated():
    """Against the real manager: tokens, segments and finished responses per iteration, counted
    independently from the chunks a scripted generator returns."""
    manager = PartialRolloutManager(
        PartialRolloutConfig(token_budget=3, max_resumptions=4, max_in_flight_groups=2), group_size=2
    )
    manager.add_prompts([PromptItem(str(i), [1, i + 2], {}) for i in range(3)])
    # iteration 1 starts two groups (4 responses); iteration 3 starts the third after one group left
    script = iter([[3, 1, 3, 2], [1, 3], [2, 3, 1]])  # tokens per scheduled response; < 3 = it ended
    seen = []

    def generate_fn(contexts, max_new):
        lengths = next(script)
        assert len(lengths) == len(contexts)
        chunks = [GenerationChunk([7] * n, [-0.5] * n, finished=n < max_new) for n in lengths]
        seen.append(chunks)
        return chunks

    started = []
    for version in range(3):
        before = manager.stats(version)
        manager.run_iteration(generate_fn, version, max_groups=0)
        counts = iteration_counts(before, manager.stats(version), group_size=2)
        chunks = seen[-1]
        assert counts == {
            "tokens": sum(len(c.token_ids) for c in chunks),
            "segments": len(chunks),
            "finished": sum(c.finished for c in chunks),
        }
        started.append(manager.num_pending)
        manager.take_completed(version)  # the step's hand-out, between two steps' iterations
    assert started == [1, 1, 0]
