"""Prompt datasets: built-in generators (pure Python, seeded) and loading a user's prompt file.

A prompt record is a dict with at least ``prompt`` (str) and ``answer`` (str or None); the record index in
the run's ``prompts.jsonl`` is the prompt's identity for the whole run.
"""

from __future__ import annotations

import random
from collections.abc import Callable

PromptRecord = dict[str, str | None]


def repeat_digit_prompts(num_prompts: int, seed: int) -> list[PromptRecord]:
    """The toy task: the prompt is one digit and '=' (``"7="``); the answer is that digit.

    The reward ``repeat_digit`` scores the share of completion characters equal to the digit, so a random
    policy over a ~13-token vocabulary scores about 1/13, and a policy that learnt the task scores 1.
    """
    rng = random.Random(seed)
    records: list[PromptRecord] = []
    for _ in range(num_prompts):
        digit = str(rng.randrange(10))
        records.append({"prompt": f"{digit}=", "answer": digit})
    return records


PROMPT_GENERATORS: dict[str, Callable[[int, int], list[PromptRecord]]] = {
    "repeat_digit": repeat_digit_prompts,
}


def generate_prompts(name: str, num_prompts: int, seed: int) -> list[PromptRecord]:
    try:
        generator = PROMPT_GENERATORS[name]
    except KeyError:
        known = ", ".join(sorted(PROMPT_GENERATORS))
        raise ValueError(f"dataset.generator={name!r} is unknown; use one of: {known}") from None
    return generator(num_prompts, seed)
