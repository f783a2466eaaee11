"""Which math verifier the shipped configs use (`env.math.math_verify_impl`), checked with NeMo-RL v0.7.0's
own graders: its HFVerifyWorker rule (math-verify, gold wrapped in \\boxed{}) and its DAPO verifier
(`dapo_math_verifier.compute_score`, which only reads a final "Answer: ..." line). One `env.math` grades
both the training set (DAPOMath17K, whose prompts ask for "Answer: $Answer") and the AIME validation sets
(NeMo-RL's cot.txt prompt, which asks for \\boxed{}), so the verifier must grade both forms."""

from __future__ import annotations

from tests.support.nemo_rl_source import run_with_nemo_rl

# (response, ground truth, correct?) -- DAPO-style final lines, then the boxed form, then wrong answers.
CASES = [
    ("So the total is 12 + 22 = 34.\n\nAnswer: 34", "34", True),
    ("The remainder is 3 mod 7, and the count is 201.\n\nAnswer: $201$", "201", True),
    ("After checking cases 1, 2 and 3, the answer is 45.\nAnswer: 45\n", "45", True),
    ("Answer: 1,024", "1024", True),
    ("Answer: \\frac{1}{2}", "\\frac{1}{2}", True),
    ("Answer: 34.", "34", True),
    ("Thus the final answer is \\boxed{34}.", "34", True),
    ("Step 1: 17. Step 2: 3.\nAnswer: 17", "3", False),
    ("I first thought 34 but that is wrong.\nAnswer: 35", "34", False),
    ("Answer: 35\nHmm, actually 34.", "34", False),
]


def grade():
    return run_with_nemo_rl(
        """
        from math_verify.metric import math_metric
        from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig
        from nemo_rl.environments.dapo_math_verifier import compute_score
        """,
        f"""
        # v0.7.0 HFVerifyWorker.__init__ / verify(math_verify_impl="hf_math_verify")
        hf = math_metric(gold_extraction_target=(LatexExtractionConfig(),),
                         pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()))
        out = []
        for response, gt, _ in {CASES!r}:
            score, _ = hf(["\\\\boxed{{" + gt + "}}"], [response])
            out.append([float(score), float(compute_score(response, gt)["score"])])
        print(json.dumps(out))
        """,
    )


def test_hf_math_verify_grades_dapo_answers_and_boxed_answers():
    scores = grade()
    for (response, gt, correct), (hf, dapo) in zip(CASES, scores):
        assert hf == float(correct), (response, gt, hf)
        if dapo == 1.0:  # whatever DAPO's verifier accepts, hf_math_verify accepts too
            assert hf == 1.0, response
    # DAPO's verifier gives 0 to a correct boxed answer: it would zero AIME validation under cot.txt.
    boxed = [i for i, (r, _, _) in enumerate(CASES) if "\\boxed" in r]
    assert boxed and all(scores[i][1] == 0.0 for i in boxed)
