"""The NeMo-RL v0.7.0 partial-rollout hook (bapo_nemo.nemo.partial_rollout).

CPU tests drive the hook on plain dicts/tensors shaped exactly like v0.7.0's structures at the boundary
(tests/nemo_rollout_pieces.py; the glue below it is tested in tests/test_nemo_segment_io.py). Tests marked
`nemo_rl` run the hook through the real `nemo_rl.algorithms.grpo` module (patched
`run_multi_turn_rollout`, real `calculate_rewards` with a Ray actor environment, real `BatchedDataDict`,
`CheckpointManager`, loss-mask and baseline functions) inside nvcr.io/nvidia/nemo-rl:v0.7.0. In both, the
generation backend is a fake at the vLLM boundary (no GPU here): `ToyGenerationBackend` answers
`generate(data, greedy)` like vLLM's sync path, sampling from the seeded ToyPolicy with the backend's
`max_new_tokens` as vLLM's `max_tokens`, and `truncated` = finish_reason "length".
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_rollout_generators import ToyPolicy

from bapo_nemo.nemo.partial_rollout import STATE_FILE, PartialRolloutHook, install_partial_rollouts
from bapo_nemo.nemo.segment_io import PartialRolloutSetupError, check_prompt_blocks
from bapo_nemo.rollout import PartialRolloutConfig
from bapo_nemo.rollout.config import check_partial_rollout_config
from tests.nemo_rollout_pieces import (
    EOS,
    PAD,
    PadOnlyTokenizer,
    ToyGenerationBackend,
    collate,
    datum,
    grpo_loss_masks,
    repeat_interleave,
    standin_single_turn_rollout,
)


def _master_config(**over) -> dict:
    cfg = {
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2, "max_rollout_turns": 1},
        "policy": {"max_total_sequence_length": 64, "generation": {"backend": "vllm", "max_new_tokens": 12}},
        "loss_fn": {"use_importance_sampling_correction": True},
        "env": {},
        "partial_rollouts": {"token_budget": 4, "max_resumptions": 5},
    }
    for path, value in over.items():
        section, key = path.split("__")
        cfg[section][key] = value
    return cfg


def test_config_checks_name_every_problem():
    cfg = _master_config(grpo__max_rollout_turns=3, loss_fn__use_importance_sampling_correction=False)
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
    assert check_partial_rollout_config(_master_config(), PartialRolloutConfig(token_budget=4)) == []
    downweight = PartialRolloutConfig(token_budget=4, stale_segments="downweight")
    assert "downweight" in check_partial_rollout_config(_master_config(), downweight)[0]
    with pytest.raises(PartialRolloutSetupError, match="grpo.max_rollout_turns=3"):
        install_partial_rollouts(_master_config(grpo__max_rollout_turns=3), patch_grpo=False)


def test_install_sets_the_budget_and_uninstall_restores():
    cfg = _master_config()
    hook = install_partial_rollouts(cfg, patch_grpo=False)
    assert cfg["policy"]["generation"]["max_new_tokens"] == 4  # vLLM max_tokens per segment
    assert hook.response_cap == 12 and hook.group_size == 2  # old max_new_tokens caps whole responses
    hook.uninstall()
    assert cfg["policy"]["generation"]["max_new_tokens"] == 12


def _batches(n: int, first: int = 0) -> list[dict]:
    """n dataloader batches of 2 prompts each (rl_collate_fn columns), prompt i = [5, i + 1]."""
    return [collate([datum(i, [5, i + 1]), datum(i + 1, [5, i + 2])]) for i in range(first, first + 2 * n, 2)]


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
    cfg = _master_config()
    hook = install_partial_rollouts(cfg, patch_grpo=False)
    backend = ToyGenerationBackend(ToyPolicy(seed=5, vocab_size=4, eos_logit_bias=-1.5), max_new_tokens=4)
    loader = hook.wrap_dataloader(_batches(5))
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
    hook = install_partial_rollouts(_master_config(), patch_grpo=False)
    backend = ToyGenerationBackend(ToyPolicy(seed=5, vocab_size=4, eos_logit_bias=-1.5), max_new_tokens=4)
    backend.sharding_annotations = _TwoEngines()
    results = _run_steps(hook, backend, hook.wrap_dataloader(_batches(5)), steps=4)
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
    cfg = _master_config()
    cfg["partial_rollouts"]["stale_segments"] = "exclude"
    hook = install_partial_rollouts(cfg, patch_grpo=False)
    backend = ToyGenerationBackend(ToyPolicy(seed=8, vocab_size=4, eos_logit_bias=-2.0), max_new_tokens=4)
    results = _run_steps(hook, backend, hook.wrap_dataloader(_batches(5)), steps=4)
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
        cfg = _master_config()
        hook = install_partial_rollouts(cfg, patch_grpo=False)
        backend = ToyGenerationBackend(
            ToyPolicy(seed=21, vocab_size=4, eos_logit_bias=-3.0), max_new_tokens=4
        )
        batches = _batches(6)
        if restart_after is None:
            return _run_steps(hook, backend, hook.wrap_dataloader(batches), 5)
        first = _run_steps(hook, backend, hook.wrap_dataloader(batches), restart_after)
        assert hook.manager.num_in_flight > 0
        hook.save(tmp_path)
        fresh = install_partial_rollouts(_master_config(), patch_grpo=False)
        fresh.load(tmp_path)
        assert fresh.policy_version == restart_after and fresh.prefilled
        # the dataloader resumes after the prefill batch and the steps already taken
        rest = fresh.wrap_dataloader(batches[1 + restart_after :])
        return first + _run_steps(fresh, backend, rest, 5 - restart_after)

    def tokens(results):
        return [[log[-1]["token_ids"].tolist() for log in f["message_log"]] for f, _ in results]

    assert tokens(run(2)) == tokens(run(None))
    # an incompatible run is refused with the field named
    other = _master_config()
    other["partial_rollouts"]["token_budget"] = 3
    hook = install_partial_rollouts(other, patch_grpo=False)
    with pytest.raises(ValueError, match=rf"{STATE_FILE}: .*config\.token_budget"):
        hook.load(tmp_path)


def test_prefill_shortens_only_the_first_epoch():
    hook = install_partial_rollouts(_master_config(), patch_grpo=False)  # prefill_batches defaults to 1
    loader = hook.wrap_dataloader(_batches(4))
    assert len(loader) == 4
    first_epoch = []
    for batch in loader:
        first_epoch.append(batch["idx"])
        assert len(loader) == 3  # grpo_train's last-step test sees the shortened epoch
    assert first_epoch == [[2, 3], [4, 5], [6, 7]] and hook.manager.num_pending == 2  # prompts 0, 1 pooled
    assert len(loader) == 4 and [b["idx"] for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert hook.manager.num_pending == 2  # no second prefill


def test_unwrapped_dataloader_is_warned_about():
    hook = install_partial_rollouts(_master_config(), patch_grpo=False)
    backend = ToyGenerationBackend(ToyPolicy(seed=1, vocab_size=4), max_new_tokens=4)
    with pytest.warns(UserWarning, match="hook.wrap_dataloader"):
        _run_steps(hook, backend, _batches(1), steps=1)


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


# ---- the real v0.7.0 grpo module (container) --------------------------------------------------------
@pytest.fixture
def ray_cluster():
    import ray

    ray.init(num_cpus=1, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    yield ray
    ray.shutdown()


def _word_tokenizer():
    """A real HF fast tokenizer over words "t0".."t98" plus pad (id 99) and "ok", built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(99)} | {"<pad>": PAD, "ok": 100, "<unk>": 101}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")


@pytest.mark.nemo_rl
def test_real_grpo_rollout_path_with_checkpoints(ray_cluster, tmp_path):
    from nemo_rl.algorithms import grpo
    from nemo_rl.algorithms.utils import calculate_baseline_and_std_per_prompt
    from nemo_rl.data.collate_fn import rl_collate_fn
    from nemo_rl.data.llm_message_utils import batched_message_log_to_flat_message
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.environments.interfaces import EnvironmentInterface, EnvironmentReturn
    from nemo_rl.utils.checkpoint import CheckpointManager

    @ray_cluster.remote
    class EvenLengthEnv(EnvironmentInterface):
        """Reward 1 if the joined assistant text has an even number of words."""

        def step(self, message_log_batch, metadata):
            texts = [
                "".join(m["content"] for m in log if m["role"] == "assistant") for log in message_log_batch
            ]
            n = len(texts)
            return EnvironmentReturn(
                observations=[{"role": "environment", "content": "ok"}] * n,
                metadata=metadata,
                next_stop_strings=[None] * n,
                rewards=torch.tensor([float(len(t.split()) % 2 == 0) for t in texts]),
                terminateds=torch.ones(n, dtype=torch.bool),
                answers=[None] * n,
            )

        def global_post_process_and_metrics(self, batch):
            return batch, {}

    tokenizer = _word_tokenizer()
    env = {"math": EvenLengthEnv.remote()}
    cfg = _master_config()
    cfg["partial_rollouts"]["stale_segments"] = "exclude"
    original = grpo.run_multi_turn_rollout
    hook = install_partial_rollouts(cfg)
    try:
        assert grpo.run_multi_turn_rollout is not original
        checkpointer = CheckpointManager(
            {
                "checkpoint_dir": str(tmp_path),
                "metric_name": None,
                "higher_is_better": False,
                "keep_top_k": 3,
                "save_optimizer": False,
            }
        )

        class TrainOnly:  # the Ray-worker policy is the boundary: only its train() call is observed
            def train(self, data, loss_fn, timer=None):
                return {}

        policy = TrainOnly()
        hook.attach(policy, checkpointer)
        backend = ToyGenerationBackend(
            ToyPolicy(seed=4, vocab_size=6, eos_logit_bias=-2.0), max_new_tokens=4, wrap=BatchedDataDict
        )
        # the real collate function; one extra batch is prefilled so responses carry over between steps
        raw_batches = [
            rl_collate_fn([datum(2 * k, [5, 2 * k + 1]), datum(2 * k + 1, [5, 2 * k + 2])]) for k in range(5)
        ]
        masked_some = False
        for step, raw in enumerate(hook.wrap_dataloader(raw_batches)):
            if step == 3:
                break
            batch = raw.repeat_interleave(2)
            flat, _ = batched_message_log_to_flat_message(
                batch["message_log"], pad_value_dict={"token_ids": PAD}
            )
            input_ids = flat["token_ids"]  # grpo_train groups its baseline/std by these
            backend.policy.bind(hook.policy_version)
            final, metrics = grpo.run_multi_turn_rollout(
                policy_generation=backend,
                input_batch=batch,
                tokenizer=tokenizer,
                task_to_env=env,
                max_seq_len=64,
                max_rollout_turns=1,
                greedy=False,
            )
            assert final.size == 4 and "total_reward" in final and "truncated" in final
            assert metrics["rollout/returned_groups"] == 2
            # the baseline grpo_train computes from the step's original prompts equals the one from the
            # returned prompts: the groups sit in the same G-row blocks
            prompts = grpo.extract_initial_prompt_messages(final["message_log"], final["length"])
            prompt_flat, _ = batched_message_log_to_flat_message(prompts, pad_value_dict={"token_ids": PAD})
            ones = torch.ones_like(final["total_reward"])
            b1, s1 = calculate_baseline_and_std_per_prompt(input_ids, final["total_reward"], ones)
            b2, s2 = calculate_baseline_and_std_per_prompt(
                prompt_flat["token_ids"], final["total_reward"], ones
            )
            assert torch.allclose(b1, b2) and torch.allclose(s1, s2)
            # the real loss-mask function trains only this version's tokens
            grpo.add_grpo_token_loss_masks_and_generation_logprobs(final["message_log"])
            for log in final["message_log"]:
                trainable = sum(int(m["token_loss_mask"].sum()) for m in log)
                fresh = [m for m in log if m["role"] == "assistant"][-1]
                assert trainable == len(fresh["token_ids"]) <= 4 * metrics["rollout/segment_iterations"]
                masked_some |= trainable < sum(len(m["token_ids"]) for m in log if m["role"] == "assistant")
            policy.train(None, None)
            path = checkpointer.init_tmp_checkpoint(step + 1, {"step": step + 1}, None)
            checkpointer.finalize_checkpoint(path)
        assert hook.policy_version == 3 and masked_some
        saved = json.loads((tmp_path / "step_3" / STATE_FILE).read_text())
        assert saved["policy_version"] == 3 and saved["manager"]["group_size"] == 2
        assert saved["manager"]["active"] or saved["manager"]["pending"]  # prompts in flight at the save
    finally:
        hook.uninstall()
    assert grpo.run_multi_turn_rollout is original

    # a new run resumes the in-flight state from the latest checkpoint
    resumed = install_partial_rollouts(_master_config(partial_rollouts__stale_segments="exclude"))
    try:
        resumed.attach(
            TrainOnly(),
            CheckpointManager(
                {
                    "checkpoint_dir": str(tmp_path),
                    "metric_name": None,
                    "higher_is_better": False,
                    "keep_top_k": 3,
                    "save_optimizer": False,
                }
            ),
        )
        assert resumed.policy_version == 3
        assert resumed.manager.state_dict() == saved["manager"] | {
            "config": resumed.manager.state_dict()["config"]
        }
    finally:
        resumed.uninstall()


@pytest.mark.nemo_rl
def test_real_validate_generates_answers_to_completion(ray_cluster):
    from types import SimpleNamespace

    from nemo_rl.algorithms import grpo
    from nemo_rl.data.collate_fn import rl_collate_fn
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.environments.interfaces import EnvironmentInterface, EnvironmentReturn

    @ray_cluster.remote
    class ZeroEnv(EnvironmentInterface):
        def step(self, message_log_batch, metadata):
            n = len(message_log_batch)
            return EnvironmentReturn(
                observations=[{"role": "environment", "content": "ok"}] * n,
                metadata=metadata,
                next_stop_strings=[None] * n,
                rewards=torch.zeros(n),
                terminateds=torch.ones(n, dtype=torch.bool),
                answers=[None] * n,
            )

        def global_post_process_and_metrics(self, batch):
            return batch, {}

    cfg = _master_config()
    hook = install_partial_rollouts(cfg)
    try:
        # validate() reads its config by attribute (MasterConfig); only these keys are touched
        master = SimpleNamespace(
            grpo={"max_val_samples": 3, "val_batch_size": 3, "max_rollout_turns": 1, "val_period": 1},
            env={},
            policy={"generation": cfg["policy"]["generation"], "max_total_sequence_length": 64},
            logger={"num_val_samples_to_print": 0},
        )
        backend = ToyGenerationBackend(
            ToyPolicy(seed=6, vocab_size=6, eos_logit_bias=-3.0), max_new_tokens=4, wrap=BatchedDataDict
        )
        val_batch = rl_collate_fn([datum(i, [5, i + 1]) for i in range(3)])
        metrics, _ = grpo.validate(
            backend, [val_batch], _word_tokenizer(), {"math": ZeroEnv.remote()}, 0, master
        )
        # every answer ran past the 4-token segment budget, in several generate calls of one policy
        assert metrics["avg_length"] > 4 and len(backend.calls) > 1
        assert {len(c) for c in backend.calls[1:]} <= {1, 2, 3}  # only unfinished answers are continued
        assert not hook._in_validation
    finally:
        hook.uninstall()


@pytest.mark.nemo_rl
def test_install_on_a_real_master_config():
    """The driver passes v0.7.0's pydantic MasterConfig (dict sections, a pydantic loss_fn, extra keys)."""
    from pathlib import Path

    import nemo_rl
    from nemo_rl.algorithms.grpo import MasterConfig
    from nemo_rl.utils.config import load_config, register_omegaconf_resolvers
    from omegaconf import OmegaConf

    example = Path(nemo_rl.__file__).resolve().parents[1] / "examples" / "configs" / "grpo_math_1B.yaml"
    if not example.exists():
        pytest.skip(f"NeMo-RL's example configs are not next to the package ({example})")
    register_omegaconf_resolvers()
    raw = OmegaConf.to_container(load_config(str(example)), resolve=True)
    raw["partial_rollouts"] = {"token_budget": 128, "stale_segments": "exclude", "prefill_batches": 2}
    master = MasterConfig(**raw)
    hook = install_partial_rollouts(master, patch_grpo=False)
    # grpo_math_1B: max_new_tokens 512 = max_total_sequence_length, 16 generations per prompt
    assert master.policy["generation"]["max_new_tokens"] == 128
    assert (hook.response_cap, hook.max_seq_len, hook.group_size, hook.prefill_batches) == (512, 512, 16, 2)
    hook.uninstall()
    assert master.policy["generation"]["max_new_tokens"] == 512
    raw["partial_rollouts"] = {"token_budget": 128}  # keep without importance-sampling correction
    with pytest.raises(PartialRolloutSetupError, match="loss_fn.use_importance_sampling_correction"):
        install_partial_rollouts(MasterConfig(**raw), patch_grpo=False)


@pytest.mark.nemo_rl
def test_installing_again_replaces_the_previous_wrappers():
    """A second driver run in one process installs again: its wrappers must wrap grpo's own functions,
    not the first installation's (two hooks on one batch broke the replay: 16 rows for 8 rollouts)."""
    from nemo_rl.algorithms import grpo

    originals = grpo.run_multi_turn_rollout, grpo.validate
    first = install_partial_rollouts(_master_config())
    try:
        second = install_partial_rollouts(_master_config())
        try:
            assert grpo.run_multi_turn_rollout.__wrapped__ is originals[0]
            assert grpo.validate.__wrapped__ is originals[1]
        finally:
            second.uninstall()
    finally:
        first.uninstall()
    assert (grpo.run_multi_turn_rollout, grpo.validate) == originals
