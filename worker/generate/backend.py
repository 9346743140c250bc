"""The generation backend interface used by the generate worker, and its result types.

A backend serves one base model and any number of LoRA adapters, each loaded under a versioned name
(``v42``, never reused) and switched between without reloading the base. ``generate`` samples
``samples_per_prompt`` completions per prompt and returns, for every sampled token, its logprob under the
*sampling* distribution: the model's next-token distribution after temperature (and top-p, renormalised over
the nucleus), as vLLM's processed logprobs. The trainer rescores with the same temperature, so with an
unchanged policy the importance ratio is 1.

A completion stops at the EOS token or after ``max_new_tokens`` tokens. **The EOS token is part of the
completion**: it is a sampled token with its own logprob, trained on like any other (that is how the policy
learns when to stop); ``finish_reason`` is ``"stop"`` then, ``"length"`` otherwise. ``text`` is the decoded
completion without special tokens. Padding never appears in a completion.

This module imports neither torch nor transformers, so any backend (transformers, vLLM) can implement it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length"]


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # one per token in token_ids: the behaviour logprob under the sampling distribution
    finish_reason: FinishReason
    text: str

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"a completion has {len(self.token_ids)} tokens but {len(self.logprobs)} logprobs; they must align"
            )


@dataclass
class PromptResult:
    prompt: str
    prompt_token_ids: list[int]
    completions: list[Completion]


@dataclass
class GenerationTimings:
    generate_s: float = 0.0  # wall time of sampling, prefill included
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.generate_s if self.generate_s > 0 else 0.0

    def to_dict(self) -> dict[str, float]:
        return {
            "generate_s": self.generate_s,
            "prompt_tokens": float(self.prompt_tokens),
            "completion_tokens": float(self.completion_tokens),
            "tokens_per_s": self.tokens_per_s,
        }


@dataclass
class GenerationResult:
    results: list[PromptResult]  # in prompt order
    adapter: str | None  # the adapter name that generated them (None: the bare base model)
    timings: GenerationTimings = field(default_factory=GenerationTimings)


def check_sampling_arguments(samples_per_prompt: int, max_new_tokens: int, temperature: float, top_p: float) -> None:
    """The argument checks every backend's ``generate`` makes before sampling. ``temperature`` 0 is greedy
    decoding (evaluation only: ``sampling.temperature`` is always > 0); its logprobs are those of the
    untempered distribution."""
    if samples_per_prompt < 1 or max_new_tokens < 1:
        raise ValueError(f"samples_per_prompt={samples_per_prompt} and max_new_tokens={max_new_tokens} must be >= 1")
    if not temperature >= 0.0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy) and top_p={top_p} in (0, 1]")


class UnknownAdapter(KeyError):
    """``generate`` named an adapter that was never loaded (or was dropped)."""


@runtime_checkable
class GenerationBackend(Protocol):
    """What a generate worker needs from a generation engine."""

    @property
    def eos_token_id(self) -> int: ...

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer the backend tokenizes with; chat templates are applied with it
        (``worker.generate.prompt_format``)."""
        ...

    def tokenize(self, prompts: list[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        """Prompt token ids exactly as ``generate`` would feed them to the model. ``add_special_tokens=False``
        for text that holds its special tokens already (a chat template's output)."""
        ...

    def load_adapter(self, name: str, version: int, path: Path) -> None:
        """Load the PEFT adapter folder ``path`` (adapter_config.json + adapter_model.safetensors) as ``name``.

        Loading a name that is already loaded is a no-op (names are never reused for another policy).
        """
        ...

    def drop_adapter(self, name: str) -> None:
        """Free an adapter; dropping an unknown name is a no-op."""
        ...

    def loaded_adapters(self) -> list[str]: ...

    def generate(
        self,
        prompts: list[str],
        *,
        adapter: str | None,
        samples_per_prompt: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
        add_special_tokens: bool = True,
    ) -> GenerationResult:
        """Sample ``samples_per_prompt`` completions of each prompt with ``adapter`` (None: base model).

        The prompts are tokenized as ``tokenize(prompts, add_special_tokens=add_special_tokens)`` does.

        The same seed, prompts, adapter and settings give the same completions on the same hardware.
        """
        ...
