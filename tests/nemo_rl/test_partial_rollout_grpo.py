"""The partial-rollout hook (bapo_nemo.nemo.partial_rollout) through NeMo-RL's real
`nemo_rl.algorithms.grpo` module (v0.7.0 or main): patched `run_multi_turn_rollout`, real
`calculate_rewards` with a Ray actor environment, real `BatchedDataDict`, `CheckpointManager` (finalised as
the installed grpo_train finalises it), loss-mask and baseline functions, and the real `validate`. The generation backend is the fake at the vLLM boundary of tests/support/nemo_rollout_pieces.py
(`ToyGenerationBackend`: no GPU here); the hook on plain structures is tested in
tests/unit/test_nemo_partial_rollout.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from bapo_nemo.nemo.checkpoint_hooks import CheckpointHooks
from bapo_nemo.nemo.partial_rollout import STATE_FILE, install_partial_rollouts
from bapo_nemo.nemo.segment_io import PartialRolloutSetupError
from bapo_nemo.nemo.worker_watch import StepCounter
from tests.support.nemo_rollout_pieces import (
    CHECKPOINTING,
    PAD,
    ToyGenerationBackend,
    datum,
    finalize_as_grpo_does,
    master_config,
)
from tests.support.toy_rollouts import ToyPolicy


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
    cfg = master_config()
    cfg["partial_rollouts"]["stale_segments"] = "exclude"
    original = grpo.run_multi_turn_rollout
    hook = install_partial_rollouts(cfg)
    try:
        assert grpo.run_multi_turn_rollout is not original
        checkpointer = CheckpointManager({"checkpoint_dir": str(tmp_path), **CHECKPOINTING})

        class TrainOnly:  # the Ray-worker policy is the boundary: only its train() call is observed
            def train(self, data, loss_fn, timer=None):
                return {}

        policy, train_calls = TrainOnly(), StepCounter(resumed_step=0)
        policy.train = train_calls.wrap(policy.train)  # the driver's one count of train calls
        hook.attach(train_calls, CheckpointHooks(checkpointer).install())
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
            finalize_as_grpo_does(checkpointer, path)
        assert hook.policy_version == 3 and masked_some
        saved = json.loads((tmp_path / "step_3" / STATE_FILE).read_text())
        assert saved["policy_version"] == 3 and saved["manager"]["group_size"] == 2
        assert saved["manager"]["active"] or saved["manager"]["pending"]  # prompts in flight at the save
    finally:
        hook.uninstall()
    assert grpo.run_multi_turn_rollout is original

    # a new run resumes the in-flight state from the latest checkpoint
    resumed = install_partial_rollouts(master_config(partial_rollouts__stale_segments="exclude"))
    try:
        resumed.attach(
            StepCounter(resumed_step=3), CheckpointHooks(CheckpointManager({"checkpoint_dir": str(tmp_path), **CHECKPOINTING}))
        )
        assert resumed.policy_version == 3
        assert resumed.manager.state_dict() == saved["manager"] | {
            "config": resumed.manager.state_dict()["config"]
        }
    finally:
        resumed.uninstall()


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

    cfg = master_config()
    hook = install_partial_rollouts(cfg)
    try:
        # validate() reads its config by attribute (MasterConfig); only these keys are touched. The grpo
        # section is the installed type: a dict on v0.7.0 (GRPOConfig is a TypedDict), a model on main.
        grpo_section = grpo.GRPOConfig(max_val_samples=3, val_batch_size=3, max_rollout_turns=1, val_period=1)
        master = SimpleNamespace(
            grpo=grpo_section,
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


def test_install_on_a_realmaster_config():
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


def test_installing_again_replaces_the_previous_wrappers():
    """A second driver run in one process installs again: its wrappers must wrap grpo's own functions,
    not the first installation's (two hooks on one batch broke the replay: 16 rows for 8 rollouts)."""
    from nemo_rl.algorithms import grpo

    originals = grpo.run_multi_turn_rollout, grpo.validate
    first = install_partial_rollouts(master_config())
    try:
        second = install_partial_rollouts(master_config())
        try:
            assert grpo.run_multi_turn_rollout.__wrapped__ is originals[0]
            assert grpo.validate.__wrapped__ is originals[1]
        finally:
            second.uninstall()
    finally:
        first.uninstall()
    assert (grpo.run_multi_turn_rollout, grpo.validate) == originals
