"""The rollout object: one generate task's samples, as one safetensors file with a JSON header.

Ragged sequences are stored flat with offsets (``prompt_ids`` + ``prompt_offsets``, ``completion_ids`` +
``completion_offsets``), so one file holds any number of groups without padding. ``behavior_logprobs`` is
aligned with ``completion_ids``: the logprob of each sampled token under the sampling distribution
(temperature applied) of the version named in the header. Per-sample arrays (``rewards``, ``advantages``,
``sample_group``, ``reward/<name>``) have one entry per completion, groups in header order, G per group.

An agent rollout's completion is the whole conversation after the prompt: the model's turns and the tools'
or environment's answers, one token sequence. ``completion_mask`` (uint8, aligned with ``completion_ids``,
same offsets) is 1 at the model's tokens and 0 at the others, whose behaviour logprob is meaningless (the
generator writes 0.0). It is written only when some sample has a mask, so a rollout without one is the same
bytes as before the field existed; absent, every completion token is the model's. A sample's mask decodes to
None when it is all 1 (one form for "every token is the model's").

Per-token versions (``async.inflight_versions = "follow"``, ``async.partial_rollouts``): ``completion_versions``
(int64, aligned with ``completion_ids``) is the adapter version that sampled each completion token;
``behavior_logprobs`` is then each token's logprob under its own version. The header's ``version`` is the one
the task leased. No token is older than it, except the tokens a sequence continued from a partial one an
earlier task saved (``extra.resumed_tokens``), which may be as old as the header's ``oldest_version``: an
older token is an error to write or read. Written only when some token's version differs, so a rollout of one
version is the same bytes as before the field existed; a sample's versions decode to None when they are all
the header's.

The header is ``asyncgrpo.protocol.records.RolloutHeader``. Only numpy, safetensors and pydantic: no torch
needed to read or write one, and no pickle anywhere.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from pydantic import ValidationError
from safetensors.numpy import load as load_tensors
from safetensors.numpy import save as save_tensors

from asyncgrpo.protocol.records import ROLLOUT_FORMAT, GenerateTimings, RolloutExtra, RolloutHeader
from asyncgrpo.protocol.schemas import GroupRef

_HEADER_FIELD = "asyncgrpo"


class RolloutFormatError(ValueError):
    """A rollout object that cannot be read as this format."""


@dataclass
class RolloutSample:
    group_index: int
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    behavior_logprobs: list[float]
    reward: float
    advantage: float
    finish_reason: str
    rewards_by_name: dict[str, float] = field(default_factory=dict)
    # Per completion token, whether the model sampled it (False: a tool's or environment's answer, which
    # never trains or counts); None: every completion token is the model's.
    completion_mask: list[bool] | None = None
    # Per completion token, the version that sampled it (never older than the rollout's version, except tokens
    # continued from a partial sequence); None: every token is the rollout's version.
    token_versions: list[int] | None = None

    @property
    def model_tokens(self) -> int:
        """Completion tokens the model sampled: what counts as its completion length."""
        if self.completion_mask is None:
            return len(self.completion_token_ids)
        return sum(self.completion_mask)


@dataclass
class Rollout:
    """One generate task's samples in memory: what the generate job writes and the optimize job reads."""

    run: str
    task_id: str
    version: int
    worker_id: str
    groups: list[GroupRef]  # in sample order
    samples: list[RolloutSample]
    timings: GenerateTimings = field(default_factory=GenerateTimings)
    extra: RolloutExtra = field(default_factory=RolloutExtra)

    def newest_version(self) -> int | None:
        """The newest token's version where some token is newer than the rollout's version; else None."""
        newest = max((max(s.token_versions) for s in self.samples if s.token_versions), default=self.version)
        return newest if newest > self.version else None

    def oldest_version(self) -> int | None:
        """The oldest token's version where a sequence continues an older partial one; else None."""
        oldest = min((min(s.token_versions) for s in self.samples if s.token_versions), default=self.version)
        return oldest if oldest < self.version else None

    def header(self) -> RolloutHeader:
        return RolloutHeader(
            format=ROLLOUT_FORMAT,
            run=self.run,
            task_id=self.task_id,
            version=self.version,
            newest_version=self.newest_version(),
            oldest_version=self.oldest_version(),
            worker_id=self.worker_id,
            groups=self.groups,
            finish_reasons=[sample.finish_reason for sample in self.samples],
            reward_names=sorted({name for s in self.samples for name in s.rewards_by_name}),
            rewards=[sample.reward for sample in self.samples],
            timings=self.timings,
            extra=self.extra,
        )


def oldest_token_version(rollout: Rollout) -> int:
    """The version of the rollout's oldest token (its staleness is this one's): the header's version, unless a
    sequence continues an older partial one (``extra.resumed_tokens``)."""
    recorded = [min(s.token_versions) for s in rollout.samples if s.token_versions]
    return min([rollout.version, *recorded])


def newest_token_version(rollout: Rollout) -> int:
    """The version of the rollout's newest token (its version, unless a sequence followed newer versions)."""
    return rollout.newest_version() or rollout.version


def _flatten(sequences: Sequence[Sequence[float]], dtype: type) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.array([len(seq) for seq in sequences], dtype=np.int64)
    offsets = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(lengths)])
    flat = np.array([value for seq in sequences for value in seq], dtype=dtype)
    return flat, offsets


def _split(flat: np.ndarray, offsets: np.ndarray) -> list[list]:
    return [flat[offsets[i] : offsets[i + 1]].tolist() for i in range(len(offsets) - 1)]


def encode_rollout(rollout: Rollout) -> bytes:
    samples = rollout.samples
    # Only tokens continued from a partial sequence may be older than the leased version.
    floor = 0 if rollout.extra.resumed_tokens else rollout.version
    for sample in samples:
        if len(sample.completion_token_ids) != len(sample.behavior_logprobs):
            raise RolloutFormatError(
                f"rollout {rollout.task_id}: a completion has {len(sample.completion_token_ids)} tokens but "
                f"{len(sample.behavior_logprobs)} logprobs"
            )
        if sample.completion_mask is not None and len(sample.completion_mask) != len(sample.completion_token_ids):
            raise RolloutFormatError(
                f"rollout {rollout.task_id}: a completion has {len(sample.completion_token_ids)} tokens but a "
                f"mask of {len(sample.completion_mask)}"
            )
        _check_versions(rollout.task_id, floor, len(sample.completion_token_ids), sample.token_versions)
    prompt_ids, prompt_offsets = _flatten([s.prompt_token_ids for s in samples], np.int64)
    completion_ids, completion_offsets = _flatten([s.completion_token_ids for s in samples], np.int64)
    logprobs, _ = _flatten([s.behavior_logprobs for s in samples], np.float32)
    tensors = {
        "prompt_ids": prompt_ids,
        "prompt_offsets": prompt_offsets,
        "completion_ids": completion_ids,
        "completion_offsets": completion_offsets,
        "behavior_logprobs": logprobs,
        "rewards": np.array([s.reward for s in samples], dtype=np.float32),
        "advantages": np.array([s.advantage for s in samples], dtype=np.float32),
        "sample_group": np.array([s.group_index for s in samples], dtype=np.int64),
    }
    if any(s.completion_mask is not None for s in samples):  # absent otherwise: the bytes of a maskless rollout
        masks = [s.completion_mask or [True] * len(s.completion_token_ids) for s in samples]
        tensors["completion_mask"] = _flatten(masks, np.uint8)[0]
    if any(v != rollout.version for s in samples for v in s.token_versions or ()):  # else one version's bytes
        versions = [s.token_versions or [rollout.version] * len(s.completion_token_ids) for s in samples]
        tensors["completion_versions"] = _flatten(versions, np.int64)[0]
    header = rollout.header()
    for name in header.reward_names:
        tensors[f"reward/{name}"] = np.array([s.rewards_by_name.get(name, 0.0) for s in samples], dtype=np.float32)
    metadata = json.dumps(header.model_dump(mode="json"), sort_keys=True)
    return save_tensors(tensors, metadata={_HEADER_FIELD: metadata})


def _check_versions(task_id: str, floor: int, tokens: int, versions: Sequence[int] | None) -> None:
    """A sample's token versions align with its tokens and none is older than ``floor``: the rollout's version,
    or its oldest version where sequences continue partial ones (``extra.resumed_tokens``)."""
    if versions is None:
        return
    if len(versions) != tokens:
        raise RolloutFormatError(f"rollout {task_id}: a completion has {tokens} tokens but {len(versions)} versions")
    if versions and min(versions) < floor:
        raise RolloutFormatError(
            f"rollout {task_id}: a token was sampled by version {min(versions)}, older than version {floor}; only "
            "tokens continued from a partial sequence (extra.resumed_tokens) may be older than the leased version, "
            "and none older than the header's oldest_version"
        )


def read_rollout_header(data: bytes) -> RolloutHeader:
    """The JSON header alone, without decoding the tensors (safetensors: u64 length, then JSON)."""
    if len(data) < 8:
        raise RolloutFormatError("rollout object is shorter than a safetensors header")
    (length,) = struct.unpack("<Q", data[:8])
    try:
        raw = json.loads(data[8 : 8 + length])
        text = raw["__metadata__"][_HEADER_FIELD]
    except (ValueError, KeyError, TypeError) as error:
        raise RolloutFormatError(f"rollout object has no asyncgrpo header: {error}") from error
    try:
        header = RolloutHeader.model_validate_json(text)
    except ValidationError as error:
        raise RolloutFormatError(f"rollout header does not match RolloutHeader: {error}") from error
    if header.format != ROLLOUT_FORMAT:
        raise RolloutFormatError(
            f"rollout format {header.format!r} is not {ROLLOUT_FORMAT}; upgrade the worker that reads it"
        )
    return header


def _decode_masks(task_id: str, tensors: dict[str, np.ndarray], count: int) -> list[list[bool] | None]:
    """Each sample's completion mask: None where the tensor is absent or the sample's mask is all 1."""
    flat = tensors.get("completion_mask")
    if flat is None:
        return [None] * count
    if flat.shape != tensors["completion_ids"].shape or not np.isin(flat, (0, 1)).all():
        raise RolloutFormatError(
            f"rollout {task_id}: completion_mask must hold one 0 or 1 per completion token "
            f"({flat.shape[0] if flat.ndim else 0} values for {tensors['completion_ids'].shape[0]} tokens)"
        )
    masks = _split(flat.astype(bool), tensors["completion_offsets"])
    return [None if all(mask) else mask for mask in masks]


def _decode_versions(header: RolloutHeader, tensors: dict[str, np.ndarray], count: int) -> list[list[int] | None]:
    """Each sample's token versions: None where the tensor is absent or every token is the header's version."""
    flat = tensors.get("completion_versions")
    if flat is None:
        return [None] * count
    if flat.shape != tensors["completion_ids"].shape:
        raise RolloutFormatError(
            f"rollout {header.task_id}: completion_versions must hold one version per completion token "
            f"({flat.shape[0] if flat.ndim else 0} values for {tensors['completion_ids'].shape[0]} tokens)"
        )
    per_sample = _split(flat, tensors["completion_offsets"])
    if header.oldest_version is not None and not header.extra.resumed_tokens:
        raise RolloutFormatError(
            f"rollout {header.task_id}: oldest_version v{header.oldest_version} is older than its version, but no "
            "token was continued from a partial sequence (extra.resumed_tokens)"
        )
    floor = header.oldest_version if header.oldest_version is not None else header.version
    for versions in per_sample:
        _check_versions(header.task_id, floor, len(versions), versions)
    return [None if all(v == header.version for v in versions) else versions for versions in per_sample]


def decode_rollout(data: bytes) -> Rollout:
    header = read_rollout_header(data)
    tensors = load_tensors(data)
    prompts = _split(tensors["prompt_ids"], tensors["prompt_offsets"])
    completions = _split(tensors["completion_ids"], tensors["completion_offsets"])
    logprobs = _split(tensors["behavior_logprobs"], tensors["completion_offsets"])
    rewards = tensors["rewards"].tolist()
    advantages = tensors["advantages"].tolist()
    groups_of = tensors["sample_group"].tolist()
    by_name = {name: tensors[f"reward/{name}"].tolist() for name in header.reward_names}
    masks = _decode_masks(header.task_id, tensors, len(completions))
    versions = _decode_versions(header, tensors, len(completions))
    samples = [
        RolloutSample(
            group_index=groups_of[i],
            prompt_token_ids=prompts[i],
            completion_token_ids=completions[i],
            behavior_logprobs=logprobs[i],
            reward=rewards[i],
            advantage=advantages[i],
            finish_reason=header.finish_reasons[i],
            rewards_by_name={name: values[i] for name, values in by_name.items()},
            completion_mask=masks[i],
            token_versions=versions[i],
        )
        for i in range(len(completions))
    ]
    return Rollout(
        run=header.run,
        task_id=header.task_id,
        version=header.version,
        worker_id=header.worker_id,
        groups=header.groups,
        samples=samples,
        timings=header.timings,
        extra=header.extra,
    )
