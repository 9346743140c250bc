"""Poison reward functions for the generate-side integrity tests, importable by worker processes
(``[[rewards]] name = "tests.support.poison_rewards:<function>"``; the workers run from the repository root).

Each one behaves like ``repeat_digit`` except on prompts of one digit: 3 gets NaN, 5 makes the reward raise,
and the digit in the environment variable ``POISON_CRASH_DIGIT`` kills the worker process.
"""

from __future__ import annotations

import os

from worker.algo.rewards import repeat_digit

NAN_DIGIT = "3"
RAISE_DIGIT = "5"
CRASH_DIGIT_ENV = "POISON_CRASH_DIGIT"


def nan_on_3(prompt: str, completion: str, answer: str | None) -> float:
    return float("nan") if prompt.startswith(NAN_DIGIT) else repeat_digit(prompt, completion, answer)


def raise_on_5(prompt: str, completion: str, answer: str | None) -> float:
    if prompt.startswith(RAISE_DIGIT):
        raise ZeroDivisionError(f"poison prompt {prompt!r}")
    return repeat_digit(prompt, completion, answer)


def crash_on_digit(prompt: str, completion: str, answer: str | None) -> float:
    digit = os.environ.get(CRASH_DIGIT_ENV, "")
    if digit and prompt.startswith(digit):
        os._exit(1)  # the worker process dies mid-task, as on a segfault or an OOM kill
    return repeat_digit(prompt, completion, answer)
