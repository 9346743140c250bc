"""Partial rollouts: an interrupted generate task's unfinished sequences, saved to the bucket and continued by
the next task of the same prompt instead of being sampled again (``async.partial_rollouts``).

While a task samples, its sequences so far go to ``runs/<run>/partials/p<prompt>.json``, one object per prompt
group: every ``async.partial_save_every_s`` seconds, and at once when the worker is told to stop (SIGTERM:
the task then goes back to its queue, ``Interrupted``). Each sequence keeps its tokens, each token's behaviour
logprob and the version that sampled it. A task that samples a prompt with a saved group continues its open
sequences from their token ids (and takes the ended ones as they are), so a SIGTERM loses nothing and a
``kill -9`` only what was sampled since the last save. The object is deleted once the task's rollout is
written: the rollout holds those sequences now.

The key is the prompt's, not the task's: a task the proxy gave up on (its worker died) has its prompts
dispatched again in a new task, which finds the saved group all the same.

A saved group is continued only when it fits the task: the same prompt tokens, ``samples_per_prompt``
sequences, none longer than ``sampling.max_completion_length``, none newer than the leased version, and with
``async.stale_tokens = "drop"`` no token older than the window of the leased version (it would be dropped as
stale at once). Otherwise, or when the object is unreadable, it is discarded (logged, counted) and the group
sampled afresh. Continued tokens keep their own versions, so the rollout's staleness is its oldest token's
(``RolloutHeader.oldest_version``), as for a sequence that followed new versions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, BucketError, ObjectNotFound
from asyncgrpo.protocol.schemas import GroupRef
from asyncgrpo.run.config import RunConfig
from worker.generate.backend import PartialSequence

log = structlog.get_logger()

PARTIAL_FORMAT = 1


class Interrupted(BaseException):
    """A task's sampling stopped because its worker was told to stop, after its sequences were saved: the task
    goes back to its queue (a BaseException, like the preemption it answers, so no ``except Exception`` keeps
    the task going)."""


class LeftWindow(Interrupted):
    """A task's sampling stopped because a version newer than its oldest token by more than ``max_staleness`` was
    published (``async.stale_tokens = "drop"``): the proxy would refuse its rollout as stale, so the task goes
    back to its queue at once and is sampled again under the new version, rather than finished and dropped."""


class StopRequest:
    """A stop asked of the running task: the worker's SIGTERM handler (``worker.process.preemption``) sets
    ``requested``, a task that samples reads it at every decode step. Plain state, so that neither side calls
    into the other's layer."""

    def __init__(self) -> None:
        self.requested = False  # a stop came while the task ran: save and hand the task back
        self.cooperative = False  # the running task stops by itself at a request

    @contextmanager
    def cooperating(self) -> Iterator[None]:
        """For the block, the task stops by itself at a request (at its next decode step), so the worker lets
        it instead of interrupting it at once."""
        self.cooperative = True
        try:
            yield
        finally:
            self.cooperative = False


class _StoredSequence(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token_ids: list[int] = Field(min_length=1)
    logprobs: list[float]
    versions: list[int]
    finish_reason: Literal["stop", "length"] | None = None


class StoredPartial(BaseModel):
    """The JSON object of one prompt group's partial sequences."""

    model_config = ConfigDict(extra="forbid")

    format: Literal[1]
    run: str
    prompt_index: int = Field(ge=0)
    prompt_token_ids: list[int]
    task_id: str
    worker_id: str
    sequences: list[_StoredSequence | None]
    """One per sample of the group; None: not begun."""


def encode_partial(partial: StoredPartial) -> bytes:
    return partial.model_dump_json().encode()


def decode_partial(data: bytes) -> StoredPartial:
    """The stored object; raises ValueError (naming what is wrong) for one that is not a partial group."""
    try:
        partial = StoredPartial.model_validate_json(data)
    except ValidationError as error:
        raise ValueError(f"not a partial group object: {error}") from error
    for sequence in partial.sequences:
        if sequence is not None and not len(sequence.token_ids) == len(sequence.logprobs) == len(sequence.versions):
            raise ValueError("a partial sequence's token ids, logprobs and versions must align")
    return partial


def _as_sequence(stored: _StoredSequence | None) -> PartialSequence | None:
    if stored is None:
        return None
    return PartialSequence(stored.token_ids, stored.logprobs, stored.versions, stored.finish_reason)


def unfit_reason(
    partial: StoredPartial, prompt_token_ids: list[int], config: RunConfig, leased_version: int
) -> str | None:
    """Why a saved group cannot be continued by a task that leased ``leased_version`` (None: it can)."""
    sampling, window = config.sampling, config.async_
    if partial.prompt_token_ids != prompt_token_ids:
        return "its prompt tokenizes differently now"
    if len(partial.sequences) != sampling.samples_per_prompt:
        return f"it has {len(partial.sequences)} sequences, not samples_per_prompt={sampling.samples_per_prompt}"
    begun = [sequence for sequence in partial.sequences if sequence is not None]
    if any(len(sequence.token_ids) > sampling.max_completion_length for sequence in begun):
        return f"a sequence is longer than max_completion_length={sampling.max_completion_length}"
    versions = [version for sequence in begun for version in sequence.versions]
    if not versions:
        return "no sequence was begun"
    if max(versions) > leased_version:
        return f"a token was sampled by v{max(versions)}, newer than the leased v{leased_version}"
    oldest_allowed = leased_version - window.max_staleness
    if window.stale_tokens == "drop" and min(versions) < oldest_allowed:
        return f"its oldest token (v{min(versions)}) is older than the window of v{leased_version}"
    return None


class PartialStore:
    """The saved groups of one run's prompts in the bucket: load, save, clear."""

    def __init__(self, bucket: Bucket, run: str) -> None:
        self.bucket = bucket
        self.run = run

    def saved(self) -> set[str]:
        """The keys of the saved groups: one listing, so that a task of prompts with none pays no read per group."""
        try:
            return set(self.bucket.list(bucket_keys.partials_prefix(self.run)))
        except BucketError as error:
            log.warning("generate.partials_unlisted", run=self.run, error=str(error))
            return set()

    def load(self, prompt_index: int) -> StoredPartial | None:
        """The saved group of a prompt; None when there is none, or it cannot be read (logged)."""
        key = bucket_keys.partial_key(self.run, prompt_index)
        try:
            return decode_partial(self.bucket.get(key))
        except ObjectNotFound:
            return None
        except (ValueError, BucketError) as error:
            log.warning("generate.partial_unreadable", key=key, error=str(error))
            return None

    def save(self, partial: StoredPartial) -> None:
        self.bucket.put(bucket_keys.partial_key(self.run, partial.prompt_index), encode_partial(partial))

    def clear(self, prompt_indices: Sequence[int]) -> None:
        """Delete the saved groups of these prompts (best effort: a leftover is discarded or continued later)."""
        keys = [bucket_keys.partial_key(self.run, index) for index in prompt_indices]
        try:
            self.bucket.delete_keys(keys)
        except BucketError as error:
            log.warning("generate.partial_not_deleted", keys=keys, error=str(error))


class Resumption:
    """What a task continues: per kept group, its saved sequences (None: sampled afresh), and the counts."""

    def __init__(self, partials: list[list[PartialSequence | None]], by_group: dict[str, int], discarded: int) -> None:
        self.partials = partials
        self.by_group = by_group  # group id -> its completion tokens continued, not sampled again
        self.discarded = discarded  # saved groups that did not fit and were sampled afresh

    @property
    def tokens(self) -> int:
        return sum(self.by_group.values())

    @property
    def any(self) -> bool:
        return bool(self.by_group)

    def oldest_version(self, leased_version: int) -> int:
        """The oldest token of a task that continues these sequences and samples the rest under ``leased_version``."""
        versions = (min(s.versions) for group in self.partials for s in group if s is not None and s.versions)
        return min(leased_version, min(versions, default=leased_version))


def resume(
    store: PartialStore,
    groups: list[GroupRef],
    prompt_ids: list[list[int]],
    config: RunConfig,
    leased_version: int,
) -> Resumption:
    """The saved sequences a task of ``groups`` (with these prompt tokens) continues under ``leased_version``."""
    samples = config.sampling.samples_per_prompt
    partials: list[list[PartialSequence | None]] = []
    by_group: dict[str, int] = {}
    discarded = 0
    seen: set[int] = set()
    saved = store.saved()
    for group, ids in zip(groups, prompt_ids, strict=True):
        listed = bucket_keys.partial_key(store.run, group.prompt_index) in saved
        stored = store.load(group.prompt_index) if listed and group.prompt_index not in seen else None
        seen.add(group.prompt_index)  # a prompt twice in one task: one group continues its sequences
        reason = unfit_reason(stored, ids, config, leased_version) if stored is not None else None
        if stored is None or reason is not None:
            if reason is not None:
                discarded += 1
                log.info("generate.partial_discarded", prompt_index=group.prompt_index, reason=reason)
            partials.append([None] * samples)
            continue
        sequences = [_as_sequence(sequence) for sequence in stored.sequences]
        by_group[group.group_id] = sum(len(sequence.token_ids) for sequence in sequences if sequence is not None)
        partials.append(sequences)
    return Resumption(partials, by_group, discarded)


class StaleWatch:
    """Whether a task's rollout already left the window: ``published()`` (the newest version the worker heard of)
    is more than ``max_staleness`` ahead of the task's oldest token. Asked at every decode step: cheap."""

    def __init__(self, published: Callable[[], int | None], oldest_version: int, max_staleness: int) -> None:
        self.published = published
        self.oldest_version = oldest_version
        self.max_staleness = max_staleness

    def left(self) -> int | None:
        """The published version the task's rollout is too old for (None: it is still in the window)."""
        newest = self.published()
        if newest is None or newest - self.oldest_version <= self.max_staleness:
            return None
        return newest


class TaskCheckpoints:
    """A task's ``Checkpoints`` (``worker.generate.backend``): every ``every_s`` seconds, and at a stop request,
    each group's sequences so far are saved; after a save at a stop request, ``Interrupted`` is raised. With a
    ``watch`` (``stale_tokens = "drop"``), a task whose rollout left the window saves nothing (its tokens could
    not be continued) and raises ``LeftWindow``."""

    def __init__(
        self,
        store: PartialStore,
        *,
        groups: list[GroupRef],
        prompt_ids: list[list[int]],
        samples_per_prompt: int,
        task_id: str,
        worker_id: str,
        every_s: float,
        stop: StopRequest | None = None,
        watch: StaleWatch | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.groups = groups
        self.prompt_ids = prompt_ids
        self.samples_per_prompt = samples_per_prompt
        self.task_id = task_id
        self.worker_id = worker_id
        self.every_s = every_s
        self.stop = stop
        self.watch = watch
        self.clock = clock
        self.last = clock()
        self.saves = 0

    def due(self) -> bool:
        if self.stop is not None and self.stop.requested:
            return True
        return self.clock() - self.last >= self.every_s or (self.watch is not None and self.watch.left() is not None)

    def save(self, sequences: list[PartialSequence]) -> None:
        watch = self.watch
        newer = watch.left() if watch is not None else None
        if watch is not None and newer is not None:  # before a stop request's save too: these tokens are lost
            log.warning(
                "generate.task_left_window",
                task_id=self.task_id,
                oldest_version=watch.oldest_version,
                published=newer,
                tokens=sum(len(row.token_ids) for row in sequences),  # thrown away, sampled again
            )
            raise LeftWindow(
                f"task {self.task_id} stopped: v{newer} was published, more than max_staleness="
                f"{watch.max_staleness} ahead of its oldest token (v{watch.oldest_version})"
            )
        expected = len(self.groups) * self.samples_per_prompt
        if len(sequences) != expected:
            raise ValueError(f"{len(sequences)} sequences saved for {len(self.groups)} groups; expected {expected}")
        for position, (group, ids) in enumerate(zip(self.groups, self.prompt_ids, strict=True)):
            rows = sequences[position * self.samples_per_prompt : (position + 1) * self.samples_per_prompt]
            stored = [
                _StoredSequence(
                    token_ids=row.token_ids,
                    logprobs=row.logprobs,
                    versions=row.versions,
                    finish_reason=row.finish_reason,
                )
                if row.token_ids
                else None
                for row in rows
            ]
            self.store.save(
                StoredPartial(
                    format=PARTIAL_FORMAT,
                    run=self.store.run,
                    prompt_index=group.prompt_index,
                    prompt_token_ids=ids,
                    task_id=self.task_id,
                    worker_id=self.worker_id,
                    sequences=stored,
                )
            )
        self.saves += 1
        self.last = self.clock()
        if self.stop is not None and self.stop.requested:
            log.warning("generate.partial_saved_on_stop", task_id=self.task_id, groups=len(self.groups))
            raise Interrupted(f"task {self.task_id} stopped on request after saving its partial sequences")
