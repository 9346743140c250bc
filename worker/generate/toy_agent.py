"""The toy agent task, the demo's counterpart for ``[agent]``: a digit hidden behind a ``reveal()`` tool.

Every prompt is the same text (``"?="``, dataset generator ``hidden_digit``); its answer column holds the digit,
which the environment takes at ``reset``. The model sees nothing of the digit until it calls ``reveal``, then
must repeat it. The reward is ``repeat_digit`` of the last model turn (the answer) at weight 0.75, plus the
environment's own ``get_reward`` (weight 1, TRL's contract): 0.25 once ``reveal`` was called. A random policy
rarely calls the tool and guesses a digit one time in ten; a trained one calls it, then repeats what it read.
Run on ``model.base = "tiny-agent"`` (``worker.model.tiny_model``); ``examples/agent.toml`` is the config.
"""

from __future__ import annotations

REVEAL_BONUS = 0.25
"""What ``get_reward`` gives a conversation that called ``reveal``: the step between chance and the answer."""


class HiddenDigit:
    """One conversation's environment: the digit, and whether the model has looked at it."""

    def __init__(self) -> None:
        self.digit = ""
        self.revealed = False

    def reset(self, answer: str | None = None, **_: object) -> None:
        """Hide the prompt's digit (its answer) for a new conversation; nothing is added to the prompt."""
        self.digit = (answer or "").strip()[:1]
        self.revealed = False

    def reveal(self) -> str:
        """Show the hidden digit.

        Returns:
            The digit this conversation must repeat.
        """
        self.revealed = True
        return self.digit

    def get_reward(self) -> float:
        return REVEAL_BONUS if self.revealed else 0.0
