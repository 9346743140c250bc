"""Reward registry and built-in rewards (worker/algo/rewards.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from asyncgrpo.run.config import RewardConfig
from worker.algo.math_scoring import MathVerifier
from worker.algo.rewards import (
    BUILTIN_REWARDS,
    RewardError,
    RewardFailed,
    exact_match,
    format_reward,
    math_verify_reward,
    repeat_digit,
    resolve_reward,
    score_completions,
)


def length_reward(prompt: str, completion: str, answer: str | None) -> float:
    """A user reward, resolved by 'tests.unit.worker.test_rewards:length_reward'."""
    return float(len(completion))


def nan_reward(prompt: str, completion: str, answer: str | None) -> float:
    return math.nan


@pytest.mark.parametrize(
    ("completion", "expected"),
    [("7777", 1.0), ("7a7b", 0.5), ("1234", 0.0), ("", 0.0), ("77=", 2 / 3)],
)
def test_repeat_digit(completion: str, expected: float) -> None:
    assert repeat_digit("7=", completion, "7") == pytest.approx(expected)


def test_repeat_digit_takes_the_digit_from_the_prompt_without_an_answer() -> None:
    assert repeat_digit("3=", "33", None) == 1.0
    assert repeat_digit("3=", "77", None) == 0.0


def test_exact_match() -> None:
    assert exact_match("q", " 42\n", "42") == 1.0
    assert exact_match("q", "42.0", "42") == 0.0
    with pytest.raises(RewardError, match="answer_column"):
        exact_match("q", "42", None)


def test_format_reward() -> None:
    assert format_reward("q", "<think>because</think>\n<answer>4</answer>", None) == 1.0
    assert format_reward("q", "<think>a\nb</think><answer>4</answer>  ", None) == 1.0
    assert format_reward("q", "<answer>4</answer>", None) == 0.0
    assert format_reward("q", "<think>x</think><answer>4</answer> trailing", None) == 0.0


@pytest.mark.processes
def test_math_verify_reward() -> None:
    pytest.importorskip("math_verify")
    verifier = MathVerifier()
    try:
        assert math_verify_reward("q", r"so the result is $\frac{1}{2}$", "0.5", verifier) == 1.0
        assert math_verify_reward("q", r"The answer is \boxed{42}", "42", verifier) == 1.0
        assert math_verify_reward("q", r"The answer is \boxed{41}", "42", verifier) == 0.0
        # Resolved by name (as score_completions does), it is bound to the verifier it was given.
        bound = resolve_reward("math_verify", verifier)
        assert bound("q", r"\boxed{7}", "7") == 1.0 and bound("q", r"\boxed{8}", "7") == 0.0
        totals, per_reward = score_completions(
            [_Spec("math_verify", 2.0)], ["q", "q"], [r"\boxed{3}", "4"], ["3", "3"], verifier=verifier
        )
        assert per_reward == {"math_verify": [1.0, 0.0]} and totals == [2.0, 0.0]
    finally:
        verifier.close()
    assert verifier.pid is None


def test_math_verify_without_a_verifier_names_what_to_pass() -> None:
    """No hidden process-wide helper: whoever scores math_verify hands it the verifier it owns."""
    for call in (
        lambda: resolve_reward("math_verify"),
        lambda: math_verify_reward("q", r"\boxed{1}", "1"),
        lambda: score_completions([_Spec("math_verify")], ["q"], [r"\boxed{1}"], ["1"]),
    ):
        with pytest.raises(RewardError, match=r"'math_verify' needs a MathVerifier.*pass verifier=") as error:
            call()
        assert not isinstance(error.value, RewardFailed)  # a set-up mistake, not a group's failure


def test_resolve_builtin_and_user_code() -> None:
    assert resolve_reward("repeat_digit") is repeat_digit
    user = resolve_reward("tests.unit.worker.test_rewards:length_reward")
    assert user("p", "abc", None) == 3.0


def test_unknown_reward_names_the_builtins() -> None:
    with pytest.raises(RewardError) as error:
        resolve_reward("reapeat_digit")
    for name in BUILTIN_REWARDS:
        assert name in str(error.value)
    with pytest.raises(RewardError, match="cannot import module"):
        resolve_reward("no_such_module_xyz:fn")
    with pytest.raises(RewardError, match="has no function 'missing'"):
        resolve_reward("tests.unit.worker.test_rewards:missing")


def test_score_completions_weights_and_per_reward_values() -> None:
    configs = [
        RewardConfig(name="repeat_digit", weight=2.0),
        RewardConfig(name="tests.unit.worker.test_rewards:length_reward", weight=-0.5),
    ]
    totals, per_reward = score_completions(configs, ["7=", "7="], ["77", "1"], ["7", "7"])
    assert per_reward == {"repeat_digit": [1.0, 0.0], "tests.unit.worker.test_rewards:length_reward": [2.0, 1.0]}
    assert totals == pytest.approx([2.0 * 1.0 - 0.5 * 2.0, 2.0 * 0.0 - 0.5 * 1.0])


@dataclass
class _Spec:
    name: str
    weight: float = 1.0


def test_score_completions_rejects_bad_rewards_and_input() -> None:
    with pytest.raises(RewardError, match="returned nan for completion 0"):
        score_completions([_Spec("tests.unit.worker.test_rewards:nan_reward")], ["p"], ["c"], [None])
    with pytest.raises(RewardError, match="more than once"):
        score_completions([_Spec("format"), _Spec("format")], ["p"], ["c"], [None])
    with pytest.raises(ValueError, match="one prompt and answer per completion"):
        score_completions([_Spec("format")], ["p"], ["c", "d"], [None])


def test_run_create_knows_the_workers_builtin_rewards() -> None:
    """`run create` (asyncgrpo.run, which never imports worker code) checks names against the same built-ins."""
    from asyncgrpo.run.config import BUILTIN_REWARD_NAMES, REWARDS_NEEDING_ANSWER

    assert set(BUILTIN_REWARD_NAMES) == set(BUILTIN_REWARDS)
    for name, function in BUILTIN_REWARDS.items():
        if name in REWARDS_NEEDING_ANSWER:
            with pytest.raises(RewardError, match="needs a reference answer"):
                function("1=", "1", None)
        else:
            assert math.isfinite(function("1=", "1", None))
