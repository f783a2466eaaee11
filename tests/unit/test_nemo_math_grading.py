"""Which math verifier the shipped configs use (`env.math.math_verify_impl`), checked with NeMo-RL v0.7.0's
own graders: its HFVerifyWorker rule (math-verify, gold wrapped in \\boxed{}) and its DAPO verifier
(`dapo_math_verifier.compute_score`, which only reads a final "Answer: ..." line). One `env.math` grades
both the training set (DAPOMath17K, whose prompts ask for "Answer: $Answer") and the AIME validation sets
(NeMo-RL's cot.txt prompt, which asks for \\boxed{}), so the verifier must grade both forms."""

from __future__ import annotations

from pathlib import Path

from bapo_nemo.plan.rules.config_io import load_nemo_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_shipped_configs_grade_with_hf_math_verify():
    for name in ("bapo_7b.yaml", "bapo_32b.yaml", "bapo_32b_64k.yaml"):
        config = load_nemo_config(CONFIGS / name)
        assert config["env"]["math"]["math_verify_impl"] == "hf_math_verify", name
        assert config["data"]["train"]["dataset_name"] == "DAPOMath17K"
