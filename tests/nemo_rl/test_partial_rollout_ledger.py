"""What a fault makes partial rollouts generate again, counted by the hook's ledger
(bapo_nemo/rollout/ledger.py, `<checkpoint_dir>/partial_rollouts_ledger.jsonl`) across attempts of one run,
on NeMo-RL's real `CheckpointManager` (v0.7.0 or main, finalised as the installed grpo_train finalises it)
with our real `CheckpointHooks`. Each attempt is the hook grpo_train drives (rollout, `policy.train`,
checkpoint); an attempt dies by being dropped mid-step, as a SIGKILLed driver leaves its files. The rollout
upstream runs after generation is the one-turn CPU stand-in and the generation backend the fake at the vLLM
boundary of tests/support/nemo_rollout_pieces.py (no GPU, no Ray here); the backend counts what it generated, so
the expected counts come from it, not from the hook.
"""

from __future__ import annotations

import json

from bapo_nemo.nemo.checkpoint_hooks import CheckpointHooks
from bapo_nemo.nemo.partial_rollout import install_partial_rollouts
from bapo_nemo.nemo.worker_watch import StepCounter
from bapo_nemo.rollout.ledger import LEDGER_FILE
from tests.support.nemo_rollout_pieces import (
    CHECKPOINTING,
    PadOnlyTokenizer,
    ToyGenerationBackend,
    finalize_as_grpo_does,
    master_config,
    prompt_batches,
    repeat_interleave,
    standin_single_turn_rollout,
)
from tests.support.toy_rollouts import ToyPolicy

REGENERATED = "partial_rollouts/regenerated_tokens"


class CountingBackend(ToyGenerationBackend):
    """The fake vLLM backend, keeping (tokens generated, rows) of every generate call."""

    def __init__(self):
        super().__init__(ToyPolicy(seed=11, vocab_size=5, eos_logit_bias=-2.5), max_new_tokens=4)
        self.generated: list[tuple[int, int]] = []

    def generate(self, data, greedy: bool = False):
        out = super().generate(data, greedy)
        self.generated.append((int(out["generation_lengths"].sum()), len(out["generation_lengths"])))
        return out


class TrainOnly:  # the Ray-worker policy is the boundary: only its train() call is observed
    def train(self, data, loss_fn, timer=None):
        return {}


class Attempt:
    """One driver process: the hook installed before setup, attached to a new CheckpointManager over the
    run's checkpoint directory, and the dataloader resumed after the steps the checkpoint holds."""

    def __init__(self, root, batches, backend: CountingBackend):
        from nemo_rl.utils.checkpoint import CheckpointManager

        self.hook = install_partial_rollouts(master_config(), patch_grpo=False)
        self.checkpointer = CheckpointManager({"checkpoint_dir": str(root), **CHECKPOINTING})
        self.policy = TrainOnly()
        trains = StepCounter(resumed_step=0)  # the driver's one count of finished train calls
        self.policy.train = trains.wrap(self.policy.train)
        self.hook.attach(trains, CheckpointHooks(self.checkpointer).install())
        done = self.hook.policy_version  # steps the checkpoint holds: grpo_train's dataloader state
        start = 0 if done == 0 else 1 + done  # the first attempt's wrapper prefills one batch
        self.batches = iter(self.hook.wrap_dataloader(batches[start:]))
        self.backend = backend
        self.metrics: list[dict] = []

    def rollout(self) -> None:
        """grpo_train's rollout of the next step."""
        self.backend.policy.bind(self.hook.policy_version)
        _, metrics = self.hook.training_rollout(
            standin_single_turn_rollout, self.backend, repeat_interleave(next(self.batches), 2),
            PadOnlyTokenizer(), lambda log: 0.0, max_seq_len=64,
        )
        self.metrics.append(metrics)

    def train_and_checkpoint(self, save: bool) -> None:
        self.policy.train(None, None)
        if save:
            step = self.hook.policy_version
            finalize_as_grpo_does(self.checkpointer, self.checkpointer.init_tmp_checkpoint(step, {}, None))

    def step(self, save: bool = False) -> None:
        self.rollout()
        self.train_and_checkpoint(save)


def _generated_since(backend: CountingBackend, mark: int) -> tuple[int, int]:
    calls = backend.generated[mark:]
    return sum(t for t, _ in calls), sum(r for _, r in calls)


def test_a_resume_counts_what_the_dead_attempt_generated_after_its_checkpoint(tmp_path, capsys):
    batches = prompt_batches(12)
    backend = CountingBackend()

    # attempt 1: steps 1-3 (checkpoint step_2), then killed during step 4's generation, after its rollout
    first = Attempt(tmp_path, batches, backend)
    first.step()
    first.step(save=True)
    after_step_2 = len(backend.generated)
    first.step()
    first.rollout()
    lost_tokens, lost_segments = _generated_since(backend, after_step_2)
    assert lost_tokens > 0 and first.hook.manager.num_in_flight > 0  # responses were cut mid-flight
    del first  # SIGKILL: nothing flushed, nothing uninstalled

    capsys.readouterr()
    second = Attempt(tmp_path, batches, backend)
    assert second.hook.policy_version == 2  # restored from step_2
    assert capsys.readouterr().out.splitlines() == [
        f"resumed from step_2: {lost_tokens} tokens in {lost_segments} segments that an earlier attempt generated"
        + " after step_2 are generated again (partial rollouts)"
    ]
    # logged with the first step of the resumed attempt (grpo_train logs rollout metrics as train/...)
    second_started = len(backend.generated)
    second.step()
    assert second.metrics[0][REGENERATED] == lost_tokens
    assert second.metrics[0]["partial_rollouts/regenerated_segments"] == lost_segments
    assert second.metrics[0]["partial_rollouts/resumed_from_step"] == 2
    # a second fault in a row: killed during step 4's generation, before any new checkpoint
    second.rollout()
    assert REGENERATED not in second.metrics[1]
    again_tokens, again_segments = _generated_since(backend, second_started)
    del second

    third = Attempt(tmp_path, batches, backend)
    assert third.hook.policy_version == 2
    third.step()
    # only the second attempt's generation: the first attempt's was counted at the first resume
    assert third.metrics[0][REGENERATED] == again_tokens
    assert third.metrics[0]["partial_rollouts/regenerated_segments"] == again_segments
    records = [json.loads(line) for line in (tmp_path / LEDGER_FILE).read_text().splitlines()]
    assert [r["from_step"] for r in records if r["kind"] == "resume"] == [2, 2]  # every line kept
    generated = [r for r in records if r["kind"] == "generation"]
    assert sum(r["tokens"] for r in generated) == sum(t for t, _ in backend.generated)
    assert [r["step"] for r in generated][:1] == [1] and max(r["step"] for r in generated) == 4
