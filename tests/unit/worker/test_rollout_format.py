"""The rollout object format (worker/algo/rollout.py): agent samples' completion masks round trip, and a
rollout without them is the same bytes as before the mask existed; likewise per-token versions."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load as load_tensors
from safetensors.numpy import save as save_tensors

from asyncgrpo.protocol.schemas import GroupRef
from worker.algo.rollout import (
    Rollout,
    RolloutFormatError,
    RolloutSample,
    decode_rollout,
    encode_rollout,
    oldest_token_version,
    read_rollout_header,
)

MODEL, TOOL = True, False


def _rollout(masks: list[list[bool] | None]) -> Rollout:
    """One group of samples, completion i of length 5 + i, with ``masks[i]``."""
    samples = [
        RolloutSample(
            group_index=0,
            prompt_token_ids=[1, 2, 3],
            completion_token_ids=list(range(10, 15 + i)),
            behavior_logprobs=[-0.25 * (j + 1) for j in range(5 + i)],
            reward=float(i),
            advantage=0.5 - i,
            finish_reason="stop",
            rewards_by_name={"exact_match": float(i)},
            completion_mask=mask,
        )
        for i, mask in enumerate(masks)
    ]
    return Rollout("run", "task-7", 3, "gen-1", [GroupRef(group_id="task-7.0", prompt_index=4)], samples)


def test_a_rollout_without_masks_is_the_bytes_of_the_format_before_masks() -> None:
    rollout = _rollout([None, None])
    samples = rollout.samples
    # The format as it was before completion_mask, written out by hand.
    header = json.dumps(rollout.header().model_dump(mode="json"), sort_keys=True)
    before = save_tensors(
        {
            "prompt_ids": np.array([1, 2, 3, 1, 2, 3], dtype=np.int64),
            "prompt_offsets": np.array([0, 3, 6], dtype=np.int64),
            "completion_ids": np.array([*range(10, 15), *range(10, 16)], dtype=np.int64),
            "completion_offsets": np.array([0, 5, 11], dtype=np.int64),
            "behavior_logprobs": np.array([x for s in samples for x in s.behavior_logprobs], dtype=np.float32),
            "rewards": np.array([0.0, 1.0], dtype=np.float32),
            "advantages": np.array([0.5, -0.5], dtype=np.float32),
            "sample_group": np.array([0, 0], dtype=np.int64),
            "reward/exact_match": np.array([0.0, 1.0], dtype=np.float32),
        },
        metadata={"asyncgrpo": header},
    )
    data = encode_rollout(rollout)
    assert data == before
    assert "completion_mask" not in load_tensors(data)
    assert all(sample.completion_mask is None for sample in decode_rollout(data).samples)


def test_masks_round_trip_and_an_all_model_mask_reads_as_none() -> None:
    conversation = [MODEL, MODEL, TOOL, TOOL, TOOL, MODEL]
    rollout = _rollout([None, conversation, [MODEL] * 7])
    data = encode_rollout(rollout)
    # Aligned with completion_ids: a maskless sample of an agent rollout is written all 1.
    assert load_tensors(data)["completion_mask"].tolist() == [1] * 5 + [1, 1, 0, 0, 0, 1] + [1] * 7
    decoded = decode_rollout(data)
    assert [s.completion_mask for s in decoded.samples] == [None, conversation, None]
    assert [s.model_tokens for s in decoded.samples] == [5, 3, 7]
    for before, after in zip(rollout.samples, decoded.samples, strict=True):
        assert after.completion_token_ids == before.completion_token_ids
        assert after.behavior_logprobs == pytest.approx(before.behavior_logprobs)
    assert encode_rollout(decoded) == encode_rollout(_rollout([None, conversation, None]))


def test_a_mask_that_does_not_fit_its_completion_is_refused_naming_the_task() -> None:
    with pytest.raises(RolloutFormatError, match=r"task-7: .* 5 tokens but a mask of 4"):
        encode_rollout(_rollout([[MODEL, TOOL, MODEL, MODEL]]))
    # A stored mask tensor of the wrong length (or not 0/1) does not decode either.
    data = encode_rollout(_rollout([[MODEL, TOOL, MODEL, MODEL, MODEL]]))
    tensors = load_tensors(data)
    metadata = {"asyncgrpo": json.dumps(_rollout([None]).header().model_dump(mode="json"), sort_keys=True)}
    for bad in (np.array([1, 0, 1, 1], dtype=np.uint8), np.array([1, 0, 2, 1, 1], dtype=np.uint8)):
        with pytest.raises(RolloutFormatError, match=r"task-7: completion_mask"):
            decode_rollout(save_tensors({**tensors, "completion_mask": bad}, metadata=metadata))


def _with_versions(versions: list[list[int] | None]) -> Rollout:
    """``_rollout`` (version 3) with ``versions[i]`` as sample i's token versions."""
    rollout = _rollout([None] * len(versions))
    for sample, token_versions in zip(rollout.samples, versions, strict=True):
        sample.token_versions = token_versions
    return rollout


def test_token_versions_round_trip_and_a_one_version_rollout_is_the_bytes_before_them() -> None:
    followed = [3, 3, 4, 4, 5, 5]
    rollout = _with_versions([None, followed, [3] * 7])
    data = encode_rollout(rollout)
    # Aligned with completion_ids: a sample that never switched is written as the rollout's version throughout.
    assert load_tensors(data)["completion_versions"].tolist() == [3] * 5 + followed + [3] * 7
    decoded = decode_rollout(data)
    assert [s.token_versions for s in decoded.samples] == [None, followed, None]
    assert oldest_token_version(decoded) == 3
    # Every token the rollout's version (or none recorded): the same bytes as a rollout of the format before.
    assert encode_rollout(_with_versions([None, None, [3] * 7])) == encode_rollout(_rollout([None, None, None]))
    assert "completion_versions" not in load_tensors(encode_rollout(_with_versions([None, None])))


def test_a_token_older_than_the_rollouts_version_is_refused_on_write_and_read() -> None:
    """The proxy admits and claims by the header's version: a token older than it would slip past the window."""
    with pytest.raises(RolloutFormatError, match=r"task-7: a token was sampled by version 2, older than .* 3"):
        encode_rollout(_with_versions([[3, 2, 3, 3, 3]]))
    with pytest.raises(RolloutFormatError, match=r"task-7: a completion has 5 tokens but 4 versions"):
        encode_rollout(_with_versions([[3, 3, 3, 3]]))
    tensors = load_tensors(encode_rollout(_with_versions([[3, 3, 4, 4, 4]])))
    metadata = {"asyncgrpo": json.dumps(_rollout([None]).header().model_dump(mode="json"), sort_keys=True)}
    for bad, match in (
        (np.array([3, 3, 2, 4, 4], dtype=np.int64), "older than version 3"),
        (np.array([3, 3, 4], dtype=np.int64), "completion_versions must hold one version per completion token"),
    ):
        with pytest.raises(RolloutFormatError, match=match):
            decode_rollout(save_tensors({**tensors, "completion_versions": bad}, metadata=metadata))
    # In memory, where no format stands guard, the trainer's check still sees the oldest token.
    in_memory = _with_versions([[3, 1, 3, 3, 3]])
    assert oldest_token_version(in_memory) == 1


def test_tokens_continued_from_a_partial_sequence_may_be_older_than_the_leased_version() -> None:
    """A sequence an interrupted task began (``async.partial_rollouts``) keeps its tokens' own versions: older
    than the version the continuing task leased, which the header records as ``oldest_version``."""
    continued = _with_versions([[1, 1, 3, 3, 3]])
    with pytest.raises(RolloutFormatError, match="only tokens continued from a partial sequence"):
        encode_rollout(continued)  # not marked as continued: a bug the window check would miss
    continued.extra = continued.extra.model_copy(update={"resumed_tokens": 2})
    data = encode_rollout(continued)
    header = read_rollout_header(data)
    assert (header.version, header.oldest_version, header.extra.resumed_tokens) == (3, 1, 2)
    decoded = decode_rollout(data)
    assert decoded.samples[0].token_versions == [1, 1, 3, 3, 3]
    assert oldest_token_version(decoded) == 1 and decoded.oldest_version() == 1
    # A header that says older tokens without saying they were continued is refused on read.
    tensors = load_tensors(data)
    forged = header.model_copy(update={"extra": header.extra.model_copy(update={"resumed_tokens": None})})
    metadata = {"asyncgrpo": json.dumps(forged.model_dump(mode="json"), sort_keys=True)}
    with pytest.raises(RolloutFormatError, match="no token was continued from a partial sequence"):
        decode_rollout(save_tensors(tensors, metadata=metadata))
    # And no token older than the header's oldest_version.
    older = {**tensors, "completion_versions": np.array([0, 1, 3, 3, 3], dtype=np.int64)}
    with pytest.raises(RolloutFormatError, match="older than version 1"):
        decode_rollout(save_tensors(older, metadata={"asyncgrpo": json.dumps(header.model_dump(mode="json"))}))
    # A rollout of no continued tokens writes neither field.
    plain = read_rollout_header(encode_rollout(_with_versions([[3, 3, 4, 4, 4]])))
    assert plain.oldest_version is None and plain.extra.resumed_tokens is None
