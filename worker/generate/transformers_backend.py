"""The transformers + PEFT generation backend (CPU, or CUDA when present).

One base model in memory; each adapter version is loaded into the same PeftModel and selected per call with
``set_adapter``, so switching versions never reloads the base. A version whose LoRA shape matches a
dropped one is copied into the dropped one's layers (a slot) rather than given new layers. Sampling is a plain
KV-cached loop rather than ``model.generate`` so that the logprob of each sampled token is exactly the one
the token was drawn from: ``log_softmax(logits / temperature)``, restricted to the top-p nucleus and
renormalised when ``top_p < 1``. Prompts are left-padded with position ids counted from each prompt's first
real token, so a padded row computes the same thing as the prompt alone.

In-flight updates (``generate(follow=...)``): between two decode steps the loop asks for a newer version; on
one, it selects that adapter and computes the KV cache again from every sequence's tokens so far under it (one
prefill), so each later token's logprob is exactly the new version's given the tokens before it, the
distribution the trainer rescores under that version. A cache kept from the old version would give logprobs
of no version at all. With LoRA the switch is a ``set_adapter``; the prefill is the whole cost.

Partial sequences (``generate(partials=..., checkpoints=...)``): a sequence an earlier task began is one more
row whose prompt is its prompt and its tokens so far, sampled on within what is left of its budget; every
row's tokens so far go to the checkpoints between two decode steps when they are due.
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import structlog
import torch
from peft import PeftModel, set_peft_model_state_dict
from safetensors.torch import load_file as load_safetensors
from transformers import DynamicCache

from worker.generate.backend import (
    Checkpoints,
    Completion,
    FinishReason,
    GenerationResult,
    PartialSequence,
    UnknownAdapter,
    VersionSource,
    check_continuations,
    check_sampling_arguments,
    generation_result,
    sampled_prompt_ids,
)
from worker.model.policy import Policy

log = structlog.get_logger()

MAX_FREE_SLOTS = 2
"""Dropped adapters kept as slots. A new version of the same LoRA shape is copied into one instead of
getting new LoRA layers (PEFT's ``load_adapter``), which costs several times more per version."""


class TransformersBackend:
    """A :class:`~worker.generate.backend.GenerationBackend` on transformers + PEFT."""

    name = "transformers"  # what rollouts record as their sampler (RolloutExtra.sampler)
    follows_versions = True
    continues_partials = True

    def __init__(
        self,
        base: str,
        dtype: str = "float32",
        device: str | None = None,
        *,
        policy: Policy | None = None,
        attn_implementation: str | None = None,
    ) -> None:
        # A caller that already holds the base model (tests, the in-process learner) passes it as `policy`.
        self.policy = (
            policy
            if policy is not None
            else Policy.load(base, dtype=dtype, device=device, attn_implementation=attn_implementation)
        )
        self._peft: PeftModel | None = None
        self._versions: dict[str, int] = {}
        # Adapter name -> the PEFT adapter (slot) holding its weights. A dropped adapter's slot is kept for
        # the next version of the same shape (see MAX_FREE_SLOTS), so slot names are internal only.
        self._slot_of: dict[str, str] = {}
        self._slot_config: dict[str, dict[str, Any]] = {}
        self._slot_tensors: dict[str, dict[str, torch.Tensor]] = {}
        self._free_slots: list[str] = []

    @property
    def eos_token_id(self) -> int:
        return self.policy.eos_token_id

    @property
    def tokenizer(self) -> Any:
        return self.policy.tokenizer

    def tokenize(self, prompts: list[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        return self.policy.encode_prompts(prompts, add_special_tokens=add_special_tokens)

    def loaded_adapters(self) -> list[str]:
        return sorted(self._versions)

    def adapter_version(self, name: str) -> int:
        try:
            return self._versions[name]
        except KeyError:
            raise UnknownAdapter(f"adapter {name!r} is not loaded; loaded: {self.loaded_adapters()}") from None

    def load_adapter(self, name: str, version: int, path: Path) -> None:
        if name in self._versions:
            return
        path = Path(path)
        config_path = path / "adapter_config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{path} is not a PEFT adapter folder: adapter_config.json is missing")
        started = time.perf_counter()
        config = json.loads(config_path.read_text())
        slot = self._take_free_slot(config)
        if slot is not None:
            self._fill_slot(slot, path)
        elif self._peft is None:
            self._peft = PeftModel.from_pretrained(self.policy.model, str(path), adapter_name=name)
            slot = name
        else:
            self._peft.load_adapter(str(path), adapter_name=name)
            slot = name
        assert self._peft is not None
        self._peft.eval()
        self._slot_of[name] = slot
        self._slot_config[slot] = config
        self._versions[name] = version
        log.info(
            "generation.adapter_loaded",
            adapter=name,
            version=version,
            s=time.perf_counter() - started,
            reused_slot=slot != name,
        )

    def drop_adapter(self, name: str) -> None:
        if name not in self._versions or self._peft is None:
            return
        slot = self._slot_of.pop(name)
        del self._versions[name]
        if len(self._free_slots) < MAX_FREE_SLOTS:
            self._free_slots.append(slot)  # its LoRA layers stay; the next version's weights are copied in
        else:
            self._delete_slot(slot)
        log.info("generation.adapter_dropped", adapter=name)

    def _take_free_slot(self, config: dict[str, Any]) -> str | None:
        """A dropped adapter's slot whose LoRA shape (its adapter_config) is the new one's, if any."""
        for slot in self._free_slots:
            if self._slot_config.get(slot) == config:
                self._free_slots.remove(slot)
                return slot
        return None

    def _fill_slot(self, slot: str, path: Path) -> None:
        """Copy a version's weights into an existing adapter of the same shape: exact values, no new layers."""
        assert self._peft is not None
        weights = path / "adapter_model.safetensors"
        if not weights.is_file():
            raise FileNotFoundError(f"{path} is not a PEFT adapter folder: adapter_model.safetensors is missing")
        state = load_safetensors(str(weights), device=str(self.policy.device))
        targets = self._slot_parameters(slot)
        if state.keys() == targets.keys() and all(state[k].shape == targets[k].shape for k in state):
            with torch.no_grad():
                for key, value in state.items():
                    targets[key].copy_(value)
            return
        # Other key names (another PEFT tuner): PEFT's own loader, checked.
        result = set_peft_model_state_dict(self._peft, state, adapter_name=slot)
        missing = [key for key in result.missing_keys if "lora_" in key and f".{slot}." in key]
        if result.unexpected_keys or missing:
            # Not the shape its config promised: never generate from a half-overwritten slot.
            self._delete_slot(slot)
            raise ValueError(
                f"{weights} does not fit the adapter layers of its adapter_config.json (unexpected "
                f"{sorted(result.unexpected_keys)[:3]}, missing {missing[:3]}); the version files are inconsistent"
            )

    def _slot_parameters(self, slot: str) -> dict[str, torch.Tensor]:
        """The slot's tensors under the names PEFT saves them with (the adapter name left out); found once
        per slot, since walking the whole model's state dict per version would cost more than the copy."""
        assert self._peft is not None
        tensors = self._slot_tensors.get(slot)
        if tensors is None:
            marker = f".{slot}."
            tensors = {
                name.replace(marker, "."): tensor
                for name, tensor in self._peft.state_dict(keep_vars=True).items()
                if marker in name
            }
            self._slot_tensors[slot] = tensors
        return tensors

    def _delete_slot(self, slot: str) -> None:
        assert self._peft is not None
        self._slot_config.pop(slot, None)
        self._slot_tensors.pop(slot, None)
        others = [s for s in [*self._slot_of.values(), *self._free_slots] if s != slot]
        if not others:
            # PEFT cannot delete the last adapter of a PeftModel; unwrap back to the bare base instead.
            self.policy.model = self._unwrap_base()
            self._peft = None
            self._free_slots.clear()
            self._slot_tensors.clear()
            return
        if slot in self._peft.active_adapters:
            self._peft.set_adapter(others[0])
        self._peft.delete_adapter(slot)

    def _unwrap_base(self) -> torch.nn.Module:
        assert self._peft is not None
        base = self._peft.unload()  # removes the LoRA layers, leaving the base weights untouched
        base.eval()
        return base

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        *,
        adapter: str | None,
        samples_per_prompt: int,
        max_completion_length: int,
        temperature: float,
        top_p: float = 1.0,
        seed: int = 0,
        add_special_tokens: bool = True,
        follow: VersionSource | None = None,
        partials: list[list[PartialSequence | None]] | None = None,
        checkpoints: Checkpoints | None = None,
    ) -> GenerationResult:
        check_sampling_arguments(samples_per_prompt, max_completion_length, temperature, top_p)
        prompt_ids = sampled_prompt_ids(self, prompts, add_special_tokens)
        started = time.perf_counter()
        model = self._select(adapter)
        start_version = self.adapter_version(adapter) if adapter is not None else -1
        rows = [ids for ids in prompt_ids for _ in range(samples_per_prompt)]
        begun = _begun_rows(partials, len(prompts), samples_per_prompt, max_completion_length)
        # Only the rows still open are sampled: a fresh one from its prompt, a begun one from its tokens so far.
        live = [row for row, partial in enumerate(begun) if partial is None or partial.finish_reason is None]
        saver = _RowSaver(checkpoints, begun, live, start_version) if checkpoints is not None else None
        tokens: list[list[int]] = []
        logprobs: list[list[float]] = []
        step_versions: list[int] = []
        if live:
            tokens, logprobs, step_versions = self._sample(
                model,
                [rows[row] + (begun[row].token_ids if begun[row] else []) for row in live],  # type: ignore[union-attr]
                max_completion_length=max_completion_length,
                temperature=temperature,
                top_p=top_p,
                seed=seed,
                version=start_version,
                follow=self._follower(follow, adapter),
                budgets=[_budget(begun[row], max_completion_length) for row in live],
                checkpoint=saver,
            )
        elapsed = time.perf_counter() - started
        sampled = dict(zip(live, zip(tokens, logprobs, strict=True), strict=True))
        completions = []
        for row, partial in enumerate(begun):
            ids, row_logprobs = sampled.get(row, ([], []))
            versions = _row_versions(step_versions, len(ids), start_version)
            if partial is None:
                completions.append(self._completion(ids, row_logprobs, versions))
                continue
            new_versions = versions if versions is not None else [start_version] * len(ids)
            completions.append(
                self._completion(
                    partial.token_ids + ids,
                    partial.logprobs + row_logprobs,
                    partial.versions + new_versions,
                    ended=partial.finish_reason,
                )
            )
        # Row r is sample r % samples_per_prompt of prompt r // samples_per_prompt.
        per_prompt = (completions[row : row + samples_per_prompt] for row in range(0, len(rows), samples_per_prompt))
        return generation_result(prompts, prompt_ids, per_prompt, adapter, elapsed)

    @torch.no_grad()
    def generate_from_ids(
        self,
        sequences: list[list[int]],
        *,
        adapter: str | None,
        max_completion_lengths: list[int],
        temperature: float,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> list[Completion]:
        check_continuations(sequences, max_completion_lengths, temperature, top_p)
        model = self._select(adapter)
        tokens, logprobs, _ = self._sample(
            model,
            sequences,
            max_completion_length=max(max_completion_lengths),
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            budgets=max_completion_lengths,
        )
        return [self._completion(ids, row_logprobs) for ids, row_logprobs in zip(tokens, logprobs, strict=True)]

    def _completion(
        self,
        ids: list[int],
        logprobs: list[float],
        versions: list[int] | None = None,
        *,
        ended: FinishReason | None = None,
    ) -> Completion:
        """Sampled ids as a completion: "stop" when it ends with EOS (or ``ended``, as an earlier task saw it end),
        its text without special tokens."""
        finish: FinishReason = ended or ("stop" if ids and ids[-1] == self.policy.eos_token_id else "length")
        text = self.policy.tokenizer.decode(ids, skip_special_tokens=True)
        return Completion(token_ids=ids, logprobs=logprobs, finish_reason=finish, text=text, versions=versions)

    def _follower(self, follow: VersionSource | None, adapter: str | None) -> Follow | None:
        """``follow`` as the sampling loop asks it: the newer version's selected model and number."""
        if follow is None:
            return None
        if adapter is None:
            raise ValueError("generate(follow=...) needs an adapter to start from: the bare base model has no version")

        def newer(version: int) -> tuple[torch.nn.Module, int] | None:
            found = follow.newer(version)
            if found is None or found[1] <= version:
                return None
            name, number = found
            return self._select(name), number

        return newer

    def _sample(
        self, model: torch.nn.Module, sequences: list[list[int]], **options: Any
    ) -> tuple[list[list[int]], list[list[float]], list[int]]:
        """``sample_completions`` with this policy's end, padding and device."""
        policy = self.policy
        return sample_completions(
            model,
            sequences,
            eos_token_id=policy.eos_token_id,
            pad_token_id=policy.pad_token_id,
            device=policy.device,
            **options,
        )

    def _select(self, adapter: str | None) -> torch.nn.Module:
        if adapter is None:
            return _BaseOnly(self._peft) if self._peft is not None else self.policy.model
        self.adapter_version(adapter)  # raises UnknownAdapter with the loaded names
        assert self._peft is not None
        slot = self._slot_of[adapter]
        if self._peft.active_adapter != slot:
            self._peft.set_adapter(slot)
        return self._peft


class _BaseOnly(torch.nn.Module):
    """Calls a PeftModel with its adapters disabled (the bare base model), without unloading them."""

    def __init__(self, peft: PeftModel) -> None:
        super().__init__()
        self.peft = peft

    def forward(self, **kwargs: object) -> object:
        with self.peft.disable_adapter():
            return self.peft(**kwargs)

    def get_base_model(self) -> torch.nn.Module:
        return self.peft.get_base_model()


def _cache_argument(model: torch.nn.Module) -> str:
    """The forward keyword of the KV cache: transformers 5 renamed `past_key_values` to `cache`."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(type(inner).forward).parameters else "past_key_values"


def _nucleus(log_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p; renormalise over it."""
    sorted_lp, order = torch.sort(log_probs, dim=-1, descending=True)
    mass_before = sorted_lp.exp().cumsum(dim=-1) - sorted_lp.exp()
    drop_sorted = mass_before >= top_p  # the most likely token always stays (its mass_before is 0)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return torch.log_softmax(log_probs.masked_fill(drop, float("-inf")), dim=-1)


Follow = Callable[[int], tuple[torch.nn.Module, int] | None]
"""Between two decode steps, given the version sampling now: a newer version's model and number, or None."""


def _row_versions(step_versions: list[int], length: int, start: int) -> list[int] | None:
    """A row's per-token versions (the first ``length`` steps'); None when its every token is ``start``'s."""
    versions = step_versions[:length]
    return versions if any(version != start for version in versions) else None


def _begun_rows(
    partials: list[list[PartialSequence | None]] | None, prompts: int, samples_per_prompt: int, budget: int
) -> list[PartialSequence | None]:
    """``generate``'s partials, one per row (None: sampled afresh), checked against the call's shape."""
    if partials is None:
        return [None] * (prompts * samples_per_prompt)
    if len(partials) != prompts or any(len(per_prompt) != samples_per_prompt for per_prompt in partials):
        raise ValueError(f"partials must hold {samples_per_prompt} entries (or None) for each of the {prompts} prompts")
    rows = [partial for per_prompt in partials for partial in per_prompt]
    for row, partial in enumerate(rows):
        if partial is None:
            continue
        if len(partial.token_ids) > budget:
            raise ValueError(f"a partial sequence has {len(partial.token_ids)} tokens > max_completion_length={budget}")
        if partial.finish_reason is None and len(partial.token_ids) == budget:
            rows[row] = replace(partial, finish_reason="length")  # saved at its last token, before it was marked
    return rows


def _budget(partial: PartialSequence | None, max_completion_length: int) -> int:
    """The tokens a row may still sample (>= 1: a begun row at the full length has ended, and is not sampled)."""
    return max_completion_length - (len(partial.token_ids) if partial is not None else 0)


class _RowSaver:
    """The sampling loop's side of ``Checkpoints``: the open rows' new tokens, put back among every row's tokens
    so far (a begun row's earlier tokens first) before they are saved."""

    def __init__(
        self, checkpoints: Checkpoints, begun: list[PartialSequence | None], live: list[int], start_version: int
    ) -> None:
        self.checkpoints = checkpoints
        self.begun = begun
        self.live = live
        self.start_version = start_version

    def due(self) -> bool:
        return self.checkpoints.due()

    def save(
        self,
        tokens: list[list[int]],
        logprobs: list[list[float]],
        versions: list[int],
        finishes: list[FinishReason | None],
    ) -> None:
        """The open rows' tokens so far (trimmed), the version of each decode step, and how each row ended."""
        by_row = dict(zip(self.live, zip(tokens, logprobs, finishes, strict=True), strict=True))
        sequences: list[PartialSequence] = []
        for row, partial in enumerate(self.begun):
            before = partial or PartialSequence([], [], [])
            if row not in by_row:
                sequences.append(before)  # it ended before this task
                continue
            ids, row_logprobs, finish = by_row[row]
            sequences.append(
                PartialSequence(
                    before.token_ids + ids,
                    before.logprobs + row_logprobs,
                    before.versions + versions[: len(ids)],
                    finish,
                )
            )
        self.checkpoints.save(sequences)


def sample_completions(
    model: torch.nn.Module,
    prompt_rows: list[list[int]],
    *,
    max_completion_length: int,
    temperature: float,
    top_p: float,
    seed: int,
    eos_token_id: int,
    pad_token_id: int,
    device: torch.device,
    version: int = -1,
    follow: Follow | None = None,
    budgets: list[int] | None = None,
    checkpoint: _RowSaver | None = None,
) -> tuple[list[list[int]], list[list[float]], list[int]]:
    """Sample one completion per row; returns token ids (EOS included), their sampling logprobs, and the version
    that sampled each decode step (``version`` until the first switch).

    ``model`` is a causal LM (or PeftModel) in eval mode; call under ``torch.no_grad()``. ``follow`` is asked
    between two decode steps; on a newer version every row's cache is computed again under it (see the module
    docstring). ``budgets``: per row, at most that many tokens (each >= 1, ``max_completion_length`` the
    largest); a row's draws go on past its budget as padding, so the other rows sample what they would alone.
    ``checkpoint`` is handed every row's tokens so far between two decode steps when it is due."""
    batch = len(prompt_rows)
    budgets = budgets if budgets is not None else [max_completion_length] * batch
    if len(budgets) != batch or min(budgets) < 1 or max(budgets) > max_completion_length:
        raise ValueError(f"budgets must hold one value in [1, {max_completion_length}] per row, got {budgets}")
    budget = torch.tensor(budgets, device=device)
    width = max(len(ids) for ids in prompt_rows)
    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    for row, ids in enumerate(prompt_rows):
        input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention[row, width - len(ids) :] = 1
    input_ids, attention = input_ids.to(device), attention.to(device)
    positions = (attention.cumsum(dim=-1) - 1).clamp(min=0)
    generator = torch.Generator(device=device).manual_seed(seed)

    cache = {_cache_argument(model): DynamicCache()}  # filled in place by every forward
    # logits_to_keep=1: only the last position is sampled from; the prompt's (B, P, V) logits are never built.
    out = model(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **cache,
    )
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    sampled: list[torch.Tensor] = []
    sampled_logprobs: list[torch.Tensor] = []
    step_versions: list[int] = []
    for step in range(max_completion_length):
        step_versions.append(version)
        # temperature 0 (evaluation): greedy, the most likely token, with its untempered logprob
        log_probs = torch.log_softmax(out.logits[:, -1, :].float() / (temperature or 1.0), dim=-1)
        if top_p < 1.0:
            log_probs = _nucleus(log_probs, top_p)
        if temperature == 0.0:
            next_tokens = log_probs.argmax(dim=-1)
        else:
            next_tokens = torch.multinomial(log_probs.exp(), 1, generator=generator).squeeze(1)
        next_tokens = torch.where(finished, torch.full_like(next_tokens, pad_token_id), next_tokens)
        sampled.append(next_tokens)
        sampled_logprobs.append(log_probs.gather(1, next_tokens.unsqueeze(1)).squeeze(1))
        finished = finished | (next_tokens == eos_token_id) | (budget <= step + 1)
        if step == max_completion_length - 1 or bool(finished.all()):
            break
        if checkpoint is not None and checkpoint.due():
            so_far, so_far_logprobs = _trimmed(sampled, sampled_logprobs, budgets, eos_token_id)
            finishes = [_finish(ids, cap, eos_token_id) for ids, cap in zip(so_far, budgets, strict=True)]
            checkpoint.save(so_far, so_far_logprobs, step_versions, finishes)
        attention = torch.cat([attention, torch.ones((batch, 1), dtype=attention.dtype, device=device)], dim=1)
        switch = follow(version) if follow is not None else None
        if switch is not None:
            # A newer version: every row's tokens so far prefilled again under it, in a fresh cache.
            model, version = switch
            cache = {_cache_argument(model): DynamicCache()}
            full_positions = (attention.cumsum(dim=-1) - 1).clamp(min=0)
            out = model(
                input_ids=torch.cat([input_ids, torch.stack(sampled, dim=1)], dim=1),
                attention_mask=attention,
                position_ids=full_positions,
                use_cache=True,
                logits_to_keep=1,
                **cache,
            )
            positions = full_positions[:, -1:]
            continue
        positions = positions[:, -1:] + 1
        out = model(
            input_ids=next_tokens.unsqueeze(1),
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **cache,
        )
    tokens, logprobs = _trimmed(sampled, sampled_logprobs, budgets, eos_token_id)
    return tokens, logprobs, step_versions


def _trimmed(
    sampled: list[torch.Tensor], sampled_logprobs: list[torch.Tensor], budgets: list[int], eos_token_id: int
) -> tuple[list[list[int]], list[list[float]]]:
    """Each row's tokens and logprobs so far, up to its EOS (included) or its budget, without the padding after."""
    all_tokens = torch.stack(sampled, dim=1).tolist()
    all_logprobs = torch.stack(sampled_logprobs, dim=1).tolist()
    tokens: list[list[int]] = []
    logprobs: list[list[float]] = []
    for row_tokens, row_logprobs, cap in zip(all_tokens, all_logprobs, budgets, strict=True):
        row_tokens = row_tokens[:cap]
        length = row_tokens.index(eos_token_id) + 1 if eos_token_id in row_tokens else len(row_tokens)
        tokens.append(row_tokens[:length])
        logprobs.append(row_logprobs[:length])
    return tokens, logprobs


def _finish(ids: list[int], budget: int, eos_token_id: int) -> FinishReason | None:
    """How a row so far has ended: at its EOS, at its budget, or not yet (None)."""
    if ids and ids[-1] == eos_token_id:
        return "stop"
    return "length" if len(ids) >= budget else None
