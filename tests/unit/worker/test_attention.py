"""Attention inside each sequence of a packed row (worker/model/attention.py) against attention written out:
softmax over each sequence's own causal (and, for sliding-window layers, windowed) keys, grouped KV heads."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from worker.model.attention import (
    SEGMENT_ATTENTION,
    attend_split,
    attend_varlen,
    runs_varlen,
    segment_attention,
    segments,
    use_segment_attention,
)
from worker.model.policy import Policy

HEADS, KV_HEADS, DIM = 4, 2, 8


class _Layer(torch.nn.Module):
    """What transformers' sdpa path reads from an attention module."""

    num_key_value_groups = HEADS // KV_HEADS
    is_causal = True


def _written_out(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: list[int], window: int | None):
    """(1, T, H, D): each sequence attends to itself only, causally (within ``window`` when given)."""
    key = key.repeat_interleave(HEADS // KV_HEADS, dim=1)
    value = value.repeat_interleave(HEADS // KV_HEADS, dim=1)
    pieces, start = [], 0
    for length in lengths:
        q, k, v = (t[:, :, start : start + length] for t in (query, key, value))
        scores = q @ k.transpose(-1, -2) / math.sqrt(DIM)
        index = torch.arange(length)
        allowed = index[:, None] >= index[None, :]
        if window is not None:
            allowed &= index[:, None] - index[None, :] < window
        scores = scores.masked_fill(~allowed, float("-inf"))
        pieces.append((scores.softmax(-1) @ v).transpose(1, 2))
        start += length
    return torch.cat(pieces, dim=1)


def test_segments_start_wherever_the_position_ids_restart() -> None:
    assert segments(torch.tensor([0, 1, 2, 0, 1, 0, 0, 1, 2, 3])) == [(0, 3), (3, 5), (5, 6), (6, 10)]
    assert segments(torch.tensor([0, 1, 2])) == [(0, 3)]


@pytest.mark.parametrize("window", [None, 3], ids=["full", "sliding-window"])
def test_each_sequence_attends_to_itself_only(window: int | None) -> None:
    lengths = [5, 1, 7, 5, 2]  # two of one length: attended in one stacked call
    total = sum(lengths)
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, HEADS, total, DIM, generator=generator)
    key = torch.randn(1, KV_HEADS, total, DIM, generator=generator)
    value = torch.randn(1, KV_HEADS, total, DIM, generator=generator)
    position_ids = torch.tensor([[p for length in lengths for p in range(length)]])
    got, _ = segment_attention(
        _Layer(), query, key, value, None, scaling=1 / math.sqrt(DIM), position_ids=position_ids, sliding_window=window
    )
    assert got.shape == (1, total, HEADS, DIM)
    torch.testing.assert_close(got, _written_out(query, key, value, lengths, window), rtol=0, atol=1e-5)


def test_a_padded_batch_goes_to_sdpa_with_its_mask() -> None:
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(2, HEADS, 4, DIM, generator=generator)
    key = torch.randn(2, KV_HEADS, 4, DIM, generator=generator)
    value = torch.randn(2, KV_HEADS, 4, DIM, generator=generator)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()[None, None].expand(2, 1, 4, 4)
    got, _ = segment_attention(_Layer(), query, key, value, causal, position_ids=torch.zeros(2, 4, dtype=torch.long))
    expected = torch.cat([_written_out(query[i : i + 1], key[i : i + 1], value[i : i + 1], [4], None) for i in (0, 1)])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_a_model_switched_to_it_still_decodes_against_a_cache_as_sdpa(tiny_model_dir: Path) -> None:
    """Generation (queries shorter than the keys) and padded prompts are sdpa's, unchanged."""
    policy = Policy.load(str(tiny_model_dir))
    prompts = torch.tensor([[3, 4, 5, 6], [0, 0, 7, 8]])
    attention = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])

    def greedy() -> torch.Tensor:
        scores = []
        # Padded prompts, and one prompt with no attention mask at all (each decoding step: one query, more keys).
        for mask in ({"attention_mask": attention, "input_ids": prompts}, {"input_ids": prompts[:1]}):
            out = policy.model.generate(
                **mask,
                do_sample=False,
                max_new_tokens=5,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=policy.pad_token_id,
            )
            scores.append(torch.stack(out.scores).flatten())
        return torch.cat(scores)

    expected = greedy()
    use_segment_attention(policy.model)
    assert policy.model.config._attn_implementation == SEGMENT_ATTENTION
    torch.testing.assert_close(greedy(), expected, rtol=0, atol=1e-5)


def test_a_packed_row_runs_the_varlen_kernel_only_on_cuda_in_half_precision() -> None:
    row = torch.zeros(1, HEADS, 4, DIM)
    assert not runs_varlen(row[0], None, 0.0)  # CPU: the split path
    assert not runs_varlen(row[0].double(), None, 0.0)
    if torch.cuda.is_available():
        half = row[0].to("cuda", torch.bfloat16)
        assert runs_varlen(half, None, 0.0)
        assert not runs_varlen(half, 4, 0.0)  # sliding window: the split path builds its mask
        assert not runs_varlen(half, None, 0.1)  # attention dropout: sdpa applies it
        assert not runs_varlen(half.float(), None, 0.0)  # float32: flash has no kernel


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the varlen kernel runs on CUDA only")
def test_the_varlen_kernel_equals_the_split_path_forward_and_backward() -> None:
    torch.manual_seed(0)
    lengths = [5, 1, 17, 5, 64, 3]
    total = sum(lengths)
    tensors = [
        torch.randn(heads, total, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for heads in (HEADS, KV_HEADS, KV_HEADS)
    ]
    scaling = DIM**-0.5
    varlen = attend_varlen(*tensors, lengths, scaling)
    (varlen.float() ** 2).sum().backward()
    varlen_grads = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    split = attend_split(_Layer(), *tensors, lengths, None, 0.0, scaling)
    (split.float() ** 2).sum().backward()
    assert varlen.shape == split.shape == (total, HEADS, DIM)
    torch.testing.assert_close(varlen.float(), split.float(), atol=2e-2, rtol=2e-2)
    for ours, theirs in zip(varlen_grads, [t.grad for t in tensors], strict=True):
        torch.testing.assert_close(ours.float(), theirs.float(), atol=5e-2, rtol=5e-2)
