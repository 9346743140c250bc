"""Exact attention inside each sequence of a packed row, without a dense mask: the padding-free trainer's
attention wherever flash-attention's varlen kernel is not in use.

transformers keeps the sequences of a packed row apart by building a (T, T) block-diagonal mask from the
position ids that restart at each sequence; sdpa and eager then compute all T^2 query-key pairs of the row,
most of them masked away (on a long-tailed length mix several times what padded rows compute, and slower
than padding). ``SEGMENT_ATTENTION`` runs causal attention on each sequence's own slice instead, sum of L_i^2
pairs, as flash-attention's varlen kernel does on GPUs. A batch with an attention mask (padded rows) goes to
transformers' sdpa unchanged. Registered under its name with transformers' attention and mask interfaces.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

SEGMENT_ATTENTION = "asyncgrpo_segments"


def segments(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each sequence in a row of position ids: a new one wherever an id is not the last + 1."""
    starts = [0, *(torch.diff(position_ids).ne(1).nonzero().flatten() + 1).tolist()]
    ends = [*starts[1:], int(position_ids.shape[0])]
    return list(zip(starts, ends, strict=True))


def segment_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query (B, H, T, D), key and value (B, H_kv, T, D) -> (B, T, H, D)."""
    position_ids = kwargs.pop("position_ids", None)
    # Padded rows, or decoding against a cache (keys beyond the queries): plain sdpa.
    if attention_mask is not None or position_ids is None or key.shape[2] != query.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    window = kwargs.pop("sliding_window", None)
    rows = []
    for row in range(query.shape[0]):
        lengths = [end - start for start, end in segments(position_ids[min(row, position_ids.shape[0] - 1)])]
        # One split per tensor (its backward is one concatenation, where a slice per sequence would write a
        # whole-row gradient each); sequences of one length attend in one call, stacked as a batch.
        parts = [tensor[row].split(lengths, dim=1) for tensor in (query, key, value)]
        by_length: dict[int, list[int]] = {}
        for number, length in enumerate(lengths):
            by_length.setdefault(length, []).append(number)
        pieces: list[torch.Tensor] = [query.new_empty(0)] * len(lengths)
        for length, members in by_length.items():
            stacked = [torch.stack([split[number] for number in members]) for split in parts]
            mask = None
            if window is not None and length > window:  # a sliding-window layer: causal and within the window
                index = torch.arange(length, device=query.device)
                distance = index[:, None] - index[None, :]
                mask = ((distance >= 0) & (distance < window))[None, None]
            out, _ = sdpa_attention_forward(module, *stacked, mask, dropout, scaling, is_causal=mask is None, **kwargs)
            for number, piece in zip(members, out.unbind(0), strict=True):  # (length, H, D) each
                pieces[number] = piece
        rows.append(torch.cat(pieces))
    return torch.stack(rows), None


def segment_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """No (T, T) mask for a row without padding and without a cache: ``segment_attention`` reads the sequences
    from the position ids. Otherwise sdpa's mask."""
    if attention_mask is None and q_length == kv_length and q_offset == 0 and kv_offset == 0:
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        **kwargs,
    )


def use_segment_attention(model: PreTrainedModel) -> None:
    """Make ``model`` attend with ``segment_attention`` (its weights are untouched)."""
    AttentionInterface.register(SEGMENT_ATTENTION, segment_attention)
    AttentionMaskInterface.register(SEGMENT_ATTENTION, segment_mask)
    model.set_attn_implementation(SEGMENT_ATTENTION)
