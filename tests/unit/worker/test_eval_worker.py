"""The worker's side of ``[eval]``, pure parts: the pass@k estimator, a chunk's summary."""

from __future__ import annotations

from math import comb

import pytest

from asyncgrpo.run.config import RunConfig
from worker.algo.math_scoring import MathVerifier
from worker.algo.rewards import RewardError
from worker.generate.backend import Completion, GenerationResult, PromptResult
from worker.generate.evals import pass_at_k, reported_ks, summarize


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    assert pass_at_k(1, 1, 1) == 1.0 and pass_at_k(1, 0, 1) == 0.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 4) == 1.0  # every draw of all 4 holds the correct one
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - comb(7, 2) / comb(10, 2))
    assert pass_at_k(5, 0, 5) == 0.0
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(2, 1, 3)
    assert reported_ks(1) == [1] and reported_ks(8) == [1, 8]


def _result(texts_per_prompt: list[list[str]]) -> GenerationResult:
    results = [
        PromptResult(
            prompt=f"{index}=",
            prompt_token_ids=[index],
            completions=[Completion([1] * len(text), [-0.1] * len(text), "length", text) for text in texts],
        )
        for index, texts in enumerate(texts_per_prompt)
    ]
    return GenerationResult(results=results, adapter="v0")


def test_summary_sums_rewards_pass_at_k_and_keeps_examples() -> None:
    config = RunConfig.model_validate(
        {"eval": {"every_versions": 1, "samples_per_prompt": 2, "temperature": 1.0, "examples": 1}}
    )
    prompts = [{"prompt": "3=", "answer": "3"}, {"prompt": "5=", "answer": "5"}]
    # prompt 3: one perfect completion of two; prompt 5: none (repeat_digit scores the share of the digit)
    summary = summarize(_result([["333", "312"], ["123", "000"]]), prompts, config, failed=1)
    assert summary.prompts == 2 and summary.prompts_failed == 1 and summary.completions == 4
    assert summary.reward_sum == pytest.approx(1.0 + 1 / 3 + 0.0 + 0.0)
    assert summary.reward_sums == {"repeat_digit": pytest.approx(summary.reward_sum)}
    assert summary.pass_at_k_sums == {"1": pytest.approx(0.5), "2": pytest.approx(1.0)}
    assert summary.completion_tokens == 12
    assert [(e.prompt, e.completion, e.answer) for e in summary.examples] == [("3=", "333", "3")]


@pytest.mark.processes
def test_summary_scores_math_verify_with_the_verifier_it_is_given() -> None:
    pytest.importorskip("math_verify")
    config = RunConfig.model_validate(
        {
            "dataset": {"answer_column": "answer"},
            "rewards": [{"name": "math_verify"}],
            "eval": {"every_versions": 1, "samples_per_prompt": 2, "temperature": 1.0},
        }
    )
    prompts = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "2+2=", "answer": "4"}]
    result = _result([[r"\boxed{3}", "5"], [r"$4$", r"\boxed{4}"]])
    with pytest.raises(RewardError, match="'math_verify' needs a MathVerifier"):
        summarize(result, prompts, config)
    verifier = MathVerifier()
    try:
        summary = summarize(result, prompts, config, verifier=verifier)
    finally:
        verifier.close()
    assert summary.prompts == 2 and summary.prompts_failed == 0
    assert summary.reward_sums == {"math_verify": pytest.approx(3.0)}
    assert summary.pass_at_k_sums == {"1": pytest.approx(1.5), "2": pytest.approx(2.0)}
