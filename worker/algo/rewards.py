"""Reward functions: a registry of built-ins, plus ``package.module:function`` for user code.

Every reward has the signature ``fn(prompt: str, completion: str, answer: str | None) -> float``, where
``completion`` is the decoded completion text without special tokens and ``answer`` is the dataset's
reference answer (None when the dataset has none). Built-ins:

* ``repeat_digit``: the toy task. Share of completion characters equal to the prompt's digit (``"7="`` ->
  ``"7777"`` scores 1.0, ``"7a7b"`` 0.5); an empty completion scores 0.
* ``exact_match``: 1.0 when the stripped completion equals the stripped answer, else 0.0.
* ``format``: 1.0 when the completion is ``<think>...</think>`` followed by ``<answer>...</answer>`` and
  nothing else (whitespace aside), else 0.0 (the DeepSeek-R1 format reward).
* ``math_verify``: 1.0 when the completion's final math answer is equivalent to the reference, checked by
  the ``math-verify`` package (``pip install 'asyncgrpo[math]'``); 0.0 otherwise, and when math-verify times out
  (``worker.algo.math_scoring`` runs it in a helper process, away from this process's signals). It scores with
  the ``MathVerifier`` it is given (``resolve_reward``'s and ``score_completions``' ``verifier``: on a worker, the
  one its runtime owns); without one it raises ``RewardError``.

A reward model (an entry with ``model``, ``worker.model.reward_models``) is scored by the worker over a whole task
before the groups are; ``score_completions`` takes its values (``scored``) and checks them like a function's.
"""

from __future__ import annotations

import functools
import importlib
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from worker.algo.math_scoring import MathVerifier

RewardFn = Callable[[str, str, "str | None"], float]


class RewardError(ValueError):
    """A reward that cannot be resolved or that returned something other than a finite number."""


class RewardFailed(RewardError):
    """A reward function raised, or returned NaN or inf, on one completion: its group cannot be scored.

    ``reason`` is the group's rejection reason (``reward_error_<name>`` or ``reward_not_finite``); the generate
    job rejects that group only, and submits the rest of its task (invariant 9)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class ScoredReward:
    """A reward whose values come scored already, by name in ``score_completions``'s ``scored``: an [agent]
    environment's ``get_reward`` (TRL: named after the environment, weight 1)."""

    name: str
    weight: float = 1.0
    model: str | None = None
    prescored: bool = True


class RewardSpec(Protocol):
    """What ``score_completions`` needs of a reward config entry (``asyncgrpo.run.config.RewardConfig`` fits)."""

    name: str
    weight: float
    model: str | None  # a reward model's Hub id or folder; None for a function


def _toy_digit(prompt: str, answer: str | None) -> str:
    if answer:
        return answer.strip()[:1]
    # Without an answer column the digit is the prompt's first character ("7=" -> "7").
    return prompt.strip()[:1]


def repeat_digit(prompt: str, completion: str, answer: str | None) -> float:
    digit = _toy_digit(prompt, answer)
    if not completion or not digit:
        return 0.0
    return sum(1 for char in completion if char == digit) / len(completion)


def _require_answer(reward: str, answer: str | None) -> str:
    if answer is None:
        raise RewardError(f"reward {reward!r} needs a reference answer; set dataset.answer_column")
    return answer


def exact_match(prompt: str, completion: str, answer: str | None) -> float:
    return 1.0 if completion.strip() == _require_answer("exact_match", answer).strip() else 0.0


_FORMAT = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def format_reward(prompt: str, completion: str, answer: str | None) -> float:
    return 1.0 if _FORMAT.match(completion) else 0.0


NO_VERIFIER = (
    "reward 'math_verify' needs a MathVerifier (worker.algo.math_scoring): pass verifier= to resolve_reward or "
    "score_completions (a worker passes its runtime's, TaskContext.math_verifier)"
)


def math_verify_reward(prompt: str, completion: str, answer: str | None, verifier: MathVerifier | None = None) -> float:
    # In a helper process: math-verify's own timeouts use SIGALRM, which would cancel the preemption grace timer.
    reference = _require_answer("math_verify", answer)
    if verifier is None:
        raise RewardError(NO_VERIFIER)
    return verifier.score(reference, completion)


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "repeat_digit": repeat_digit,
    "exact_match": exact_match,
    "format": format_reward,
    "math_verify": math_verify_reward,
}


def resolve_reward(name: str, verifier: MathVerifier | None = None) -> RewardFn:
    """A built-in by name, or ``package.module:function`` imported from the worker's Python path.
    ``math_verify`` comes bound to ``verifier``, which it needs (``RewardError`` without one)."""
    if name == "math_verify":
        if verifier is None:
            raise RewardError(NO_VERIFIER)
        return functools.partial(math_verify_reward, verifier=verifier)
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if ":" not in name:
        raise RewardError(
            f"reward {name!r} is unknown; use a built-in ({', '.join(sorted(BUILTIN_REWARDS))}) or "
            "'package.module:function'"
        )
    module_name, _, function_name = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise RewardError(f"reward {name!r}: cannot import module {module_name!r}: {error}") from error
    function = getattr(module, function_name, None)
    if not callable(function):
        raise RewardError(f"reward {name!r}: module {module_name!r} has no function {function_name!r}")
    return function


def score_completions(
    reward_configs: Sequence[RewardSpec],
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str | None],
    scored: Mapping[str, Sequence[float]] | None = None,
    verifier: MathVerifier | None = None,
) -> tuple[list[float], dict[str, list[float]]]:
    """Weighted total reward of each completion, and each reward's raw values by name.

    ``prompts``, ``completions`` and ``answers`` are parallel (one entry per completion); ``scored`` holds, by
    name, the values of the reward models among ``reward_configs``, scored already; ``verifier`` scores
    ``math_verify`` (needed when it is among them). A reward that raises or
    returns something other than a finite number raises ``RewardFailed`` with the rejection reason.
    """
    if not (len(prompts) == len(completions) == len(answers)):
        raise ValueError(
            f"score_completions needs one prompt and answer per completion; got {len(prompts)} prompts, "
            f"{len(completions)} completions, {len(answers)} answers"
        )
    if not reward_configs:
        raise RewardError("no rewards configured; add at least one [[rewards]] entry")
    names = [config.name for config in reward_configs]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise RewardError(f"rewards {duplicates} are listed more than once; list each once with its total weight")
    totals = [0.0] * len(completions)
    per_reward: dict[str, list[float]] = {}
    for config in reward_configs:
        function = _function_of(config, scored, len(completions), verifier)
        values: list[float] = []
        for index, (prompt, completion, answer) in enumerate(zip(prompts, completions, answers, strict=True)):
            try:
                value = function(index, prompt, completion, answer)
            except Exception as error:
                raise RewardFailed(
                    f"reward {config.name!r} raised on completion {index}: {error!r}", f"reward_error_{config.name}"
                ) from error
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise RewardFailed(
                    f"reward {config.name!r} returned {value!r} for completion {index}; it must return a finite float",
                    "reward_not_finite" if isinstance(value, int | float) else f"reward_error_{config.name}",
                )
            values.append(float(value))
            totals[index] += config.weight * float(value)
        per_reward[config.name] = values
    return totals, per_reward


def _function_of(
    config: RewardSpec, scored: Mapping[str, Sequence[float]] | None, count: int, verifier: MathVerifier | None
) -> Callable[[int, str, str, str | None], object]:
    """The reward as a function of (index, prompt, completion, answer): a reward model's value is looked up."""
    if getattr(config, "model", None) is None and not getattr(config, "prescored", False):
        function = resolve_reward(config.name, verifier)
        return lambda _index, prompt, completion, answer: function(prompt, completion, answer)
    values = (scored or {}).get(config.name)
    if values is None or len(values) != count:
        raise RewardError(
            f"reward {config.name!r} has {'no' if values is None else len(values)} scores for {count} "
            "completions; the worker scores reward models and environments before the groups"
        )
    return lambda index, _prompt, _completion, _answer: values[index]
