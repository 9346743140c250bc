"""Exact attention inside each sequence of a packed row, without a dense mask: the padding-free trainer's
attention wherever flash-attention's varlen kernel is not in use.

transformers keeps the sequences of a packed row apart by building a (T, T) block-diagonal mask from the
position ids that restart at each sequence; sdpa and eager then compute all T^2 query-key pairs of the row,
most of them masked away (on a long-tailed length mix several times what padded rows compute, and slower
than padding). ``SEGMENT_ATTENTION`` runs causal attention on each sequence's own slice instead, sum of L_i^2
pairs, as flash-attention's varlen kernel does on GPUs. A batch with an attention mask (padded rows) goes to
transformers' sdpa unchanged. Registered under its name with transformers' attention and mask interfaces.

On a CUDA device in half precision the whole row goes to PyTorch's own varlen kernel
(``torch.nn.attention.varlen``, flash-attention inside torch) in one call: splitting a row of a hundred
lengths into a hundred small sdpa calls per layer is launch-bound on a GPU (on an H200, padding-free ran at
half padded's tokens/s that way). Elsewhere (CPU, float32) the split runs, one sdpa call per distinct length.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

SEGMENT_ATTENTION = "asyncgrpo_segments"

try:  # PyTorch's flash-attention varlen entry (torch >= 2.9); CUDA and half precision only
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - older torch: the split path everywhere
    varlen_attn = None
# Its keywords moved between releases: causality as `is_causal` (2.9-2.11) or `window_size` (later), and
# grouped KV heads only later (`enable_gqa`); earlier ones get the KV heads repeated.
_VARLEN_KEYWORDS = frozenset(inspect.signature(varlen_attn).parameters) if varlen_attn is not None else frozenset()


def runs_varlen(query: torch.Tensor, window: int | None, dropout: float) -> bool:
    """Whether a packed row attends through ``varlen_attn``: CUDA, half precision, no dropout, no window."""
    return (
        varlen_attn is not None
        and query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and window is None
        and dropout == 0.0
    )


def attend_varlen(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: list[int], scaling: float | None
) -> torch.Tensor:
    """One packed row's causal attention per sequence in one kernel: (H, T, D) each -> (T, H, D)."""
    assert varlen_attn is not None
    bounds = torch.tensor([0, *lengths], device=query.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    longest = max(lengths)
    options: dict[str, Any] = {"scale": scaling}
    options.update({"window_size": (-1, 0)} if "window_size" in _VARLEN_KEYWORDS else {"is_causal": True})
    grouped = key.shape[0] != query.shape[0]
    if grouped and "enable_gqa" in _VARLEN_KEYWORDS:
        options["enable_gqa"] = True
    elif grouped:
        key = key.repeat_interleave(query.shape[0] // key.shape[0], dim=0)
        value = value.repeat_interleave(query.shape[0] // value.shape[0], dim=0)
    return varlen_attn(
        query.transpose(0, 1).contiguous(),
        key.transpose(0, 1).contiguous(),
        value.transpose(0, 1).contiguous(),
        bounds,
        bounds,
        longest,
        longest,
        **options,
    )


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
        if runs_varlen(query, window, dropout):
            rows.append(attend_varlen(query[row], key[row], value[row], lengths, scaling))
            continue
        rows.append(attend_split(module, query[row], key[row], value[row], lengths, window, dropout, scaling, **kwargs))
    return torch.stack(rows), None


def attend_split(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: list[int],
    window: int | None,
    dropout: float,
    scaling: float | None,
    **kwargs: Any,
) -> torch.Tensor:
    """One packed row's attention per sequence through sdpa: (H, T, D) each -> (T, H, D)."""
    # One split per tensor (its backward is one concatenation, where a slice per sequence would write a
    # whole-row gradient each); sequences of one length attend in one call, stacked as a batch.
    parts = [tensor.split(lengths, dim=1) for tensor in (query, key, value)]
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
    return torch.cat(pieces)


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
