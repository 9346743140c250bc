"""The transformers + PEFT generation backend (CPU, or CUDA when present).

One base model in memory; each adapter version is loaded into the same PeftModel under its own name and
selected per call with ``set_adapter``, so switching versions never reloads the base. Sampling is a plain
KV-cached loop rather than ``model.generate`` so that the logprob of each sampled token is exactly the one
the token was drawn from: ``log_softmax(logits / temperature)``, restricted to the top-p nucleus and
renormalised when ``top_p < 1``. Prompts are left-padded with position ids counted from each prompt's first
real token, so a padded row computes the same thing as the prompt alone.
"""

from __future__ import annotations

import inspect
import time
from pathlib import Path

import structlog
import torch
from peft import PeftModel
from transformers import DynamicCache

from worker.generate.backend import (
    Completion,
    FinishReason,
    GenerationResult,
    GenerationTimings,
    PromptResult,
    UnknownAdapter,
    check_sampling_arguments,
)
from worker.model.policy import Policy

log = structlog.get_logger()


class TransformersBackend:
    """A :class:`~worker.generate.backend.GenerationBackend` on transformers + PEFT."""

    def __init__(
        self,
        base: str,
        dtype: str = "float32",
        device: str | None = None,
        *,
        policy: Policy | None = None,
    ) -> None:
        # A caller that already holds the base model (tests, the in-process learner) passes it as `policy`.
        self.policy = policy if policy is not None else Policy.load(base, dtype=dtype, device=device)
        self._peft: PeftModel | None = None
        self._versions: dict[str, int] = {}

    @property
    def eos_token_id(self) -> int:
        return self.policy.eos_token_id

    def tokenize(self, prompts: list[str]) -> list[list[int]]:
        return self.policy.encode_prompts(prompts)

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
        if not (path / "adapter_config.json").is_file():
            raise FileNotFoundError(f"{path} is not a PEFT adapter folder: adapter_config.json is missing")
        started = time.perf_counter()
        if self._peft is None:
            self._peft = PeftModel.from_pretrained(self.policy.model, str(path), adapter_name=name)
        else:
            self._peft.load_adapter(str(path), adapter_name=name)
        self._peft.eval()
        self._versions[name] = version
        log.info("generation.adapter_loaded", adapter=name, version=version, s=time.perf_counter() - started)

    def drop_adapter(self, name: str) -> None:
        if name not in self._versions or self._peft is None:
            return
        if len(self._versions) == 1:
            # PEFT cannot delete the last adapter of a PeftModel; unwrap back to the bare base instead.
            self.policy.model = self._unwrap_base()
            self._peft = None
        else:
            if name in self._peft.active_adapters:
                other = next(n for n in self._versions if n != name)
                self._peft.set_adapter(other)
            self._peft.delete_adapter(name)
        del self._versions[name]
        log.info("generation.adapter_dropped", adapter=name)

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
        max_new_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> GenerationResult:
        check_sampling_arguments(samples_per_prompt, max_new_tokens, temperature, top_p)
        prompt_ids = self.tokenize(prompts)
        for index, ids in enumerate(prompt_ids):
            if not ids:
                raise ValueError(f"prompt {index} ({prompts[index]!r}) has no tokens; drop empty prompts")
        started = time.perf_counter()
        model = self._select(adapter)
        rows = [ids for ids in prompt_ids for _ in range(samples_per_prompt)]
        tokens, logprobs = sample_completions(
            model,
            rows,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            eos_token_id=self.policy.eos_token_id,
            pad_token_id=self.policy.pad_token_id,
            device=self.policy.device,
        )
        elapsed = time.perf_counter() - started
        results: list[PromptResult] = []
        for p_index, prompt in enumerate(prompts):
            completions = []
            for row in range(p_index * samples_per_prompt, (p_index + 1) * samples_per_prompt):
                ids = tokens[row]
                finish: FinishReason = "stop" if ids and ids[-1] == self.policy.eos_token_id else "length"
                text = self.policy.tokenizer.decode(ids, skip_special_tokens=True)
                completions.append(Completion(token_ids=ids, logprobs=logprobs[row], finish_reason=finish, text=text))
            results.append(PromptResult(prompt=prompt, prompt_token_ids=prompt_ids[p_index], completions=completions))
        timings = GenerationTimings(
            generate_s=elapsed,
            prompt_tokens=sum(len(ids) for ids in prompt_ids),
            completion_tokens=sum(len(ids) for ids in tokens),
        )
        return GenerationResult(results=results, adapter=adapter, timings=timings)

    def _select(self, adapter: str | None) -> torch.nn.Module:
        if adapter is None:
            return _BaseOnly(self._peft) if self._peft is not None else self.policy.model
        self.adapter_version(adapter)  # raises UnknownAdapter with the loaded names
        assert self._peft is not None
        if self._peft.active_adapter != adapter:
            self._peft.set_adapter(adapter)
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


def sample_completions(
    model: torch.nn.Module,
    prompt_rows: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    eos_token_id: int,
    pad_token_id: int,
    device: torch.device,
) -> tuple[list[list[int]], list[list[float]]]:
    """Sample one completion per row; returns token ids (EOS included) and their sampling logprobs.

    ``model`` is a causal LM (or PeftModel) in eval mode; call under ``torch.no_grad()``.
    """
    batch = len(prompt_rows)
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
        input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True, logits_to_keep=1,
        **cache,
    )
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    sampled: list[torch.Tensor] = []
    sampled_logprobs: list[torch.Tensor] = []
    for step in range(max_new_tokens):
        log_probs = torch.log_softmax(out.logits[:, -1, :].float() / temperature, dim=-1)
        if top_p < 1.0:
            log_probs = _nucleus(log_probs, top_p)
        next_tokens = torch.multinomial(log_probs.exp(), 1, generator=generator).squeeze(1)
        next_tokens = torch.where(finished, torch.full_like(next_tokens, pad_token_id), next_tokens)
        sampled.append(next_tokens)
        sampled_logprobs.append(log_probs.gather(1, next_tokens.unsqueeze(1)).squeeze(1))
        finished = finished | (next_tokens == eos_token_id)
        if step == max_new_tokens - 1 or bool(finished.all()):
            break
        attention = torch.cat([attention, torch.ones((batch, 1), dtype=attention.dtype, device=device)], dim=1)
        positions = positions[:, -1:] + 1
        out = model(
            input_ids=next_tokens.unsqueeze(1),
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **cache,
        )
    all_tokens = torch.stack(sampled, dim=1).tolist()
    all_logprobs = torch.stack(sampled_logprobs, dim=1).tolist()
    tokens: list[list[int]] = []
    logprobs: list[list[float]] = []
    for row_tokens, row_logprobs in zip(all_tokens, all_logprobs, strict=True):
        length = row_tokens.index(eos_token_id) + 1 if eos_token_id in row_tokens else len(row_tokens)
        tokens.append(row_tokens[:length])
        logprobs.append(row_logprobs[:length])
    return tokens, logprobs
