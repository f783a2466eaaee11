"""The NeMo-RL v0.7.0 partial-rollout hook (bapo_nemo.nemo.partial_rollout).

CPU tests drive the hook on plain dicts/tensors shaped exactly like v0.7.0's structures at the boundary
(tests/support/nemo_rollout_pieces.py; the glue below it is tested in tests/unit/test_nemo_segment_io.py, the hook
inside the real `nemo_rl.algorithms.grpo` module in tests/nemo_rl/test_partial_rollout_grpo.py). The
generation backend is a fake at the vLLM boundary (no GPU here): `ToyGenerationBackend` answers
`generate(data, greedy)` like vLLM's sync path, sampling from the seeded ToyPolicy with the backend's
`max_new_tokens` as vLLM's `max_tokens`, and `truncated` = finish_reason "length".
"""

from __future__ import annotations

import math

import pytest

from bapo_nemo.nemo.partial_rollout import STATE_FILE, PartialRolloutHook, install_partial_rollouts
from bapo_nemo.nemo.segment_io import PartialRolloutSetupError, check_prompt_blocks
from bapo_nemo.rollout import PartialRolloutConfig
from bapo_nemo.rollout.config import check_partial_rollout_config
from tests.support.nemo_rollout_pieces import (
    EOS,
    PadOnlyTokenizer,
    ToyGenerationBackend,
    collate,
    datum,
    grpo_loss_masks,
    master_config,
    prompt_batches,
    repeat_interleave,
    standin_single_turn_rollout,
)
from tests.support.toy_rollouts import ToyPolicy


def test_config_checks_name_every_problem():
    cfg = master_config(grpo__max_rollout_turns=3, loss_fn__use_importance_sampling_correction=False)
    cfg["grpo"]["async_grpo"] = {"enabled": True}
    cfg["policy"]["generation"]["vllm_cfg"] = {"async_engine": True}
    problems = check_partial_rollout_config(cfg, PartialRolloutConfig(token_budget=4, max_in_flight_groups=1))
    text = "\n".join(problems)
    for needle in (
        "grpo.max_rollout_turns=3",
        "grpo.async_grpo.enabled",
        "async engine",
        "loss_fn.use_importance_sampling_correction",
        "max_in_flight_groups=1 < grpo.num_prompts_per_step=2",
    ):
        assert needle in text
    assert check_partial_rollout_config(master_config(), PartialRolloutConfig(token_budget=4)) == []
    downweight = PartialRolloutConfig(token_budget=4, stale_segments="downweight")
    assert "downweight" in check_partial_rollout_config(master_config(), downweight)[0]
    with pytest.raises(PartialRolloutSetupError, match="grpo.max_rollout_turns=3"):
        install_partial_rollouts(master_config(grpo__max_rollout_turns=3), patch_grpo=False)


def test_install_sets_the_budget_and_uninstall_restores():
    cfg = master_config()
    hook = install_partial_rollouts(cfg, patch_grpo=False)
    assert cfg["policy"]["generation"]["max_new_tokens"] == 4  # vLLM max_tokens per segment
    assert hook.response_cap == 12 and hook.group_size == 2  # old max_new_tokens caps whole responses
    hook.uninstall()
    assert cfg["policy"]["generation"]["max_new_tokens"] == 12


def _run_steps(hook, backend, loader, steps, reward=lambda log: float(len(log[-1]["token_ids"]) % 2)):
    """grpo_train's loop around the rollout: repeat_interleave(G), rollout, train (version + 1)."""
    out = []
    for batch in loader:
        if len(out) == steps:
            break
        backend.policy.bind(hook.policy_version)
        final, metrics = hook.training_rollout(
            standin_single_turn_rollout,
            backend,
            repeat_interleave(batch, 2),
            PadOnlyTokenizer(),
            reward,
            max_seq_len=64,
            greedy=False,
        )
        out.append((final, metrics))
        hook.policy_version += 1  # what the attached policy.train does after each step
    return out


def test_hook_returns_grpo_shaped_batches_of_complete_groups():
    cfg = master_config()
    hook = install_partial_rollouts(cfg, patch_grpo=False)
    backend = ToyGenerationBackend(ToyPolicy(seed=5, vocab_size=4, eos_logit_bias=-1.5), max_new_tokens=4)
    loader = hook.wrap_dataloader(prompt_batches(5))
    results = _run_steps(hook, backend, loader, steps=4)
    # prefill (1 batch) + 4 steps of 2 prompts: 10 queued, 8 handed out, 2 groups still in the pool
    m = hook.manager
    assert hook.batches_seen == 5 and m.num_pending + m.num_in_flight + m.num_completed == 2
    seen_versions = set()
    for step, (final, metrics) in enumerate(results):
        logs = final["message_log"]
        assert len(logs) == 4  # P*G rows; G-row blocks of one prompt each
        assert check_prompt_blocks({"message_log": [log[:-1] for log in logs]}, 2) == 2
        assert final["idx"][0] == final["idx"][1] and final["idx"][2] == final["idx"][3]
        for i, log in enumerate(logs):
            msg = log[-1]
            assert msg["role"] == "assistant" and len(msg["token_ids"]) <= 12
            n = len(msg["token_ids"])
            assert final["truncated"][i].item() == (n == 0 or msg["token_ids"][-1].item() != EOS)
        assert metrics["rollout/policy_version"] == step
        assert metrics["rollout/returned_groups"] == 2
        seen_versions.add(metrics["rollout/staleness_max"])
    # with a 4-token budget and 12-token responses some groups span several policy versions
    assert max(seen_versions) >= 1
    # each response is segments the backend produced from prompt + tokens so far, with their log-probs
    for final, _ in results:
        for log in final["message_log"]:
            prompt = [t for m in log[:-1] for t in m["token_ids"].tolist()]
            tokens, logprobs = log[-1]["token_ids"].tolist(), log[-1]["generation_logprobs"].tolist()
            assert logprobs == pytest.approx(
                _logprobs_from_segments(backend.policy, prompt, tokens), abs=1e-6
            )


class _TwoEngines:
    """v0.7.0 VllmGeneration's `sharding_annotations` for two engines (its data_parallel axis)."""

    def get_axis_size(self, name: str) -> int:
        return {"data_parallel": 2}[name]


def test_hook_deals_long_contexts_across_the_engines():
    """The backend gives each engine a contiguous half of a call's rows: the hook orders the rows so the
    longest contexts (resumed responses) are split between the halves, and every response still gets
    its own segments back."""
    hook = install_partial_rollouts(master_config(), patch_grpo=False)
    backend = ToyGenerationBackend(ToyPolicy(seed=5, vocab_size=4, eos_logit_bias=-1.5), max_new_tokens=4)
    backend.sharding_annotations = _TwoEngines()
    results = _run_steps(hook, backend, hook.wrap_dataloader(prompt_batches(5)), steps=4)
    resumed_calls = 0
    for contexts in backend.calls:
        lengths = [len(c) for c in contexts]
        half = -(-len(lengths) // 2)
        first, second = lengths[:half], lengths[half:]
        assert first == sorted(first, reverse=True) and second == sorted(second, reverse=True)
        if second:
            assert first[0] == max(lengths) and second[0] == sorted(lengths)[-2]
            assert abs(sum(first) - sum(second)) <= max(lengths)
        resumed_calls += sum(n > 2 for n in lengths) >= 2
    assert resumed_calls  # some calls held several resumed responses
    for final, _ in results:
        for log in final["message_log"]:
            prompt = [t for m in log[:-1] for t in m["token_ids"].tolist()]
            tokens, logprobs = log[-1]["token_ids"].tolist(), log[-1]["generation_logprobs"].tolist()
            assert logprobs == pytest.approx(
                _logprobs_from_segments(backend.policy, prompt, tokens), abs=1e-6
            )


def _logprobs_from_segments(policy: ToyPolicy, prompt: list[int], tokens: list[int]) -> list[float]:
    """Rebuild a response from the generator's log: the segment at position k must have been generated
    from context prompt + tokens[:k] (possibly cut at the length cap)."""
    out, pos = [], 0
    while pos < len(tokens):
        ctx = tuple(prompt + tokens[:pos])
        seg = next(
            (t, lp)
            for _, c, t, lp, _ in policy.log
            if c == ctx and t and t[: len(tokens) - pos] == tokens[pos : pos + len(t)]
        )
        take = min(len(seg[0]), len(tokens) - pos)
        out += seg[1][:take]
        pos += take
    return out


def test_hook_exclude_masks_tokens_of_older_policies():
    cfg = master_config()
    cfg["partial_rollouts"]["stale_segments"] = "exclude"
    hook = install_partial_rollouts(cfg, patch_grpo=False)
    backend = ToyGenerationBackend(ToyPolicy(seed=8, vocab_size=4, eos_logit_bias=-2.0), max_new_tokens=4)
    results = _run_steps(hook, backend, hook.wrap_dataloader(prompt_batches(5)), steps=4)
    masked_some = False
    for step, (final, metrics) in enumerate(results):
        for log in final["message_log"]:
            mask = grpo_loss_masks(log)
            generated = [m for m in log if m["role"] == "assistant"]
            total = sum(len(m["token_ids"]) for m in generated)
            trainable = sum(mask)
            # trainable tokens are exactly those sampled at this step's policy version (the last part):
            # at most 4 per segment iteration run in this step
            assert trainable == len(generated[-1]["token_ids"]) <= 4 * metrics["rollout/segment_iterations"]
            masked_some |= trainable < total
    assert masked_some


def test_hook_state_survives_a_restart_mid_flight(tmp_path):
    def run(restart_after: int | None):
        cfg = master_config()
        hook = install_partial_rollouts(cfg, patch_grpo=False)
        backend = ToyGenerationBackend(
            ToyPolicy(seed=21, vocab_size=4, eos_logit_bias=-3.0), max_new_tokens=4
        )
        batches = prompt_batches(6)
        if restart_after is None:
            return _run_steps(hook, backend, hook.wrap_dataloader(batches), 5)
        first = _run_steps(hook, backend, hook.wrap_dataloader(batches), restart_after)
        assert hook.manager.num_in_flight > 0
        hook.save(tmp_path)
        fresh = install_partial_rollouts(master_config(), patch_grpo=False)
        fresh.load(tmp_path)
        assert fresh.policy_version == restart_after and fresh.prefilled
        # the dataloader resumes after the prefill batch and the steps already taken
        rest = fresh.wrap_dataloader(batches[1 + restart_after :])
        return first + _run_steps(fresh, backend, rest, 5 - restart_after)

    def tokens(results):
        return [[log[-1]["token_ids"].tolist() for log in f["message_log"]] for f, _ in results]

    assert tokens(run(2)) == tokens(run(None))
    # an incompatible run is refused with the field named
    other = master_config()
    other["partial_rollouts"]["token_budget"] = 3
    hook = install_partial_rollouts(other, patch_grpo=False)
    with pytest.raises(ValueError, match=rf"{STATE_FILE}: .*config\.token_budget"):
        hook.load(tmp_path)


def test_prefill_shortens_only_the_first_epoch():
    hook = install_partial_rollouts(master_config(), patch_grpo=False)  # prefill_batches defaults to 1
    loader = hook.wrap_dataloader(prompt_batches(4))
    assert len(loader) == 4
    first_epoch = []
    for batch in loader:
        first_epoch.append(batch["idx"])
        assert len(loader) == 3  # grpo_train's last-step test sees the shortened epoch
    assert first_epoch == [[2, 3], [4, 5], [6, 7]] and hook.manager.num_pending == 2  # prompts 0, 1 pooled
    assert len(loader) == 4 and [b["idx"] for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert hook.manager.num_pending == 2  # no second prefill


def test_unwrapped_dataloader_is_warned_about():
    hook = install_partial_rollouts(master_config(), patch_grpo=False)
    backend = ToyGenerationBackend(ToyPolicy(seed=1, vocab_size=4), max_new_tokens=4)
    with pytest.warns(UserWarning, match="hook.wrap_dataloader"):
        _run_steps(hook, backend, prompt_batches(1), steps=1)


def test_validation_is_generated_to_completion():
    hook = PartialRolloutHook(
        PartialRolloutConfig(token_budget=3), group_size=2, prompts_per_step=2, response_cap=10
    )
    backend = ToyGenerationBackend(ToyPolicy(seed=2, vocab_size=4, eos_logit_bias=-3.0), max_new_tokens=3)
    batch = collate([datum(0, [5, 1]), datum(1, [5, 2]), datum(2, [5, 3])])
    final, _ = hook.validation_rollout(
        standin_single_turn_rollout,
        backend,
        batch,
        PadOnlyTokenizer(),
        lambda log: 0.0,
        max_seq_len=64,
        greedy=True,
    )
    lengths = [len(log[-1]["token_ids"]) for log in final["message_log"]]
    # each answer ends at EOS or at the 10-token cap, never at the 3-token segment budget
    for log, n in zip(final["message_log"], lengths):
        assert log[-1]["token_ids"][-1].item() == EOS or n == 10
    assert max(lengths) > 3 and len(backend.calls) >= math.ceil(max(lengths) / 3)
