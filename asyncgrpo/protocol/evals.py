"""The messages of evaluation during training (``[eval]``): the eval task, its lease and its result.

The proxy sends one ``asyncgrpo.evaluate`` task per chunk of at most ``eval.max_prompts_per_task`` held-out
prompts of a due version. A generate worker leases that version (``POST /v1/evals/{task_id}/lease``), samples
and scores the chunk, and posts an ``EvalChunkSummary`` (``POST /v1/evals/{task_id}/result``): sums, not
means, so that the proxy merges the chunks of a version exactly (``merge_chunks``) into the flat metrics of
its ``EvalRecord`` (``asyncgrpo.protocol.records``). Nothing of an evaluation reaches a rollout or a step.
"""

from __future__ import annotations

import math

from pydantic import Field

from asyncgrpo.protocol.schemas import (
    MAX_INT,
    MAX_MAP_ENTRIES,
    Count,
    Id,
    Incarnation,
    LeaseGrant,
    Name,
    _Request,
    _Response,
)

MAX_EXAMPLES = 64
"""Example completions one chunk may carry (``eval.examples`` is at most this)."""
EXAMPLE_CHARS = 2000
"""An example's prompt and completion are cut to this many characters by the worker."""


class EvalTaskMessage(_Request):
    """Kwargs of ``asyncgrpo.evaluate``: evaluate ``version`` on the eval prompts ``prompt_start`` to
    ``prompt_start + prompt_count - 1``. Sent by the proxy (``proxy.coordinator.evals``) to the run's
    generate queue, validated by ``worker.process.tasks.eval_version``."""

    run: str
    task_id: Id
    version: Count
    prompt_start: Count
    prompt_count: int = Field(ge=1, le=MAX_INT)
    expires_at: float | None = None
    """Unix seconds after which the proxy re-sends the task (a copy run later is refused at its lease)."""


class EvalLeaseRequest(_Request):
    """``POST /v1/evals/{task_id}/lease``: the worker leases the task's version; renewed and released like a
    generate task's lease (``/v1/leases/{lease_id}``)."""

    worker_id: Id
    incarnation: Incarnation | None = None
    """Binds the task to this process: a new incarnation of ``worker_id`` has it sent again at once."""


class EvalLeaseGrant(LeaseGrant):
    """A lease on the task's version (not the current one), with the task's eval prompts."""

    prompt_start: int
    prompt_count: int


class EvalExample(_Request):
    """One example completion kept in the eval record."""

    prompt: str = Field(max_length=EXAMPLE_CHARS)
    completion: str = Field(max_length=EXAMPLE_CHARS)
    answer: str | None = Field(None, max_length=EXAMPLE_CHARS)
    reward: float


class EvalChunkSummary(_Request):
    """What one eval task measured, as sums over its prompts and completions (merged by the proxy)."""

    prompts: Count
    """Prompts scored (prompts too long, empty or whose reward failed are in ``prompts_failed``)."""
    prompts_failed: Count = 0
    completions: Count
    reward_sum: float
    reward_square_sum: float
    reward_sums: dict[Name, float] = Field(default_factory=dict, max_length=MAX_MAP_ENTRIES)
    """Per reward name: the sum of its unweighted scores over every completion."""
    pass_at_k_sums: dict[Name, float] = Field(default_factory=dict, max_length=8)
    """Per k (as text, ``"1"``, ``"8"``): the sum over prompts of each prompt's unbiased pass@k estimate."""
    completion_tokens: Count = 0
    examples: list[EvalExample] = Field(default_factory=list, max_length=MAX_EXAMPLES)


class EvalResultRequest(_Request):
    """``POST /v1/evals/{task_id}/result``: the chunk's summary; the proxy records it and releases ``lease_id``."""

    worker_id: Id
    lease_id: Id
    """The sender's lease of the task (``POST /v1/evals/{task_id}/lease``); a result is bound to it."""
    summary: EvalChunkSummary


class EvalResultAnswer(_Response):
    version: int
    chunks_left: int
    """Chunks of the version still to come; at 0 the proxy writes the version's eval record."""


def merge_chunks(chunks: list[EvalChunkSummary], examples: int) -> tuple[dict[str, float], list[EvalExample], int]:
    """The flat metrics of a version (TRL-style names: ``reward``, ``reward_std``, ``rewards/<name>/mean``,
    ``pass@<k>``, ``completions/mean_length``, ``prompts_failed``), its first ``examples`` examples, and the
    number of prompts scored."""
    prompts = sum(chunk.prompts for chunk in chunks)
    completions = sum(chunk.completions for chunk in chunks)
    metrics: dict[str, float] = {"prompts_failed": float(sum(chunk.prompts_failed for chunk in chunks))}
    if completions:
        mean = sum(chunk.reward_sum for chunk in chunks) / completions
        square = sum(chunk.reward_square_sum for chunk in chunks) / completions
        metrics["reward"] = mean
        metrics["reward_std"] = math.sqrt(max(square - mean * mean, 0.0))
        names = sorted({name for chunk in chunks for name in chunk.reward_sums})
        for name in names:
            metrics[f"rewards/{name}/mean"] = sum(chunk.reward_sums.get(name, 0.0) for chunk in chunks) / completions
        metrics["completions/mean_length"] = sum(chunk.completion_tokens for chunk in chunks) / completions
    if prompts:
        ks = sorted({k for chunk in chunks for k in chunk.pass_at_k_sums}, key=int)
        for k in ks:
            metrics[f"pass@{k}"] = sum(chunk.pass_at_k_sums.get(k, 0.0) for chunk in chunks) / prompts
    kept = [example for chunk in chunks for example in chunk.examples][:examples]
    return metrics, kept, prompts


__all__ = [
    "EvalChunkSummary",
    "EvalExample",
    "EvalLeaseGrant",
    "EvalLeaseRequest",
    "EvalResultAnswer",
    "EvalResultRequest",
    "EvalTaskMessage",
    "merge_chunks",
]
