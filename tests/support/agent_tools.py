"""Agent tools and environments for the tool-process tests, importable by its child process
(``tests.support.agent_tools:<name>``; the child gets the test process's ``sys.path``).

Well-behaved ones (``add``, ``Counter``, ``make_notebook``), and one for each fault the child must survive or
report: raising, returning non-text, hanging, exiting, crashing, and setups that cannot be used.
"""

from __future__ import annotations

import os
import signal
import sys
import time

NOT_CALLABLE = 3


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return str(a + b)


def fail(reason: str) -> str:
    """Raise ValueError.

    Args:
        reason: The message of the error.
    """
    raise ValueError(reason)


def as_dict(key: str) -> dict:
    """Return a dict, which is not a tool result.

    Args:
        key: The dict's one key.
    """
    return {key: 1}


def hang(seconds: float) -> str:
    """Sleep, longer than any test's timeout.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "woke up"


def exit_hard(code: int) -> str:
    """End the process at once, with no cleanup.

    Args:
        code: The exit code.
    """
    os._exit(code)


def segfault() -> str:
    """Crash the process with SIGSEGV."""
    os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(10)
    return "not reached"


def sys_exit() -> str:
    """Raise SystemExit(1)."""
    sys.exit(1)


def untyped(x):  # no type hints, on purpose
    """Has no type hints.

    Args:
        x: Anything.
    """
    return str(x)


def undocumented(x: int) -> str:
    return str(x)


class Counter:
    """A count to bring to the answer with increments; the reward is 1.0 when it gets there.

    ``reset`` raises for the prompt ``"explode"`` and kills its tool process for ``"crash"``; ``get_reward``
    returns text for the answer ``"not a number"``.
    """

    created = 0  # instances constructed in this process: pooling reuses them

    def __init__(self) -> None:
        Counter.created += 1
        self.serial = Counter.created
        self.resets = 0
        self.count = 0
        self.target: str | None = None

    def reset(self, prompt: str, answer: str | None = None) -> str:
        if prompt == "explode":
            raise RuntimeError("cannot reset")
        if prompt == "crash":
            os._exit(3)
        self.resets += 1
        self.count = 0
        self.target = answer
        return f"The count is 0; bring it to {answer}."

    def increment(self, by: int) -> str:
        """Add to the count.

        Args:
            by: How much to add.
        """
        self.count += by
        return str(self.count)

    def whoami(self) -> str:
        """Which instance this is, and how many times it was reset."""
        return f"instance {self.serial}, reset {self.resets} times"

    def get_reward(self) -> float:
        if self.target == "not a number":
            return "high"  # type: ignore[return-value]
        return 1.0 if str(self.count) == self.target else 0.0

    def _hidden(self) -> str:
        return "not a tool"


class _Notebook:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def reset(self) -> None:
        self.lines = []

    def write(self, text: str) -> str:
        """Write a line in the notebook.

        Args:
            text: The line.
        """
        self.lines.append(text)
        return "ok"

    def read(self) -> str:
        """Read the notebook."""
        return "\n".join(self.lines)


def make_notebook() -> _Notebook:
    """A factory that is not a class: an environment without a reward."""
    return _Notebook()


class NoReset:
    def step(self, x: int) -> str:
        """Do nothing.

        Args:
            x: Ignored.
        """
        return ""
