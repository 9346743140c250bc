"""The generation backend interface used by the generate worker, and its result types.

A backend serves one base model and any number of LoRA adapters, each loaded under a versioned name
(``v42``, never reused) and switched between without reloading the base. ``generate`` samples
``samples_per_prompt`` completions per prompt and returns, for every sampled token, its logprob under the
*sampling* distribution: the model's next-token distribution after temperature (and top-p, renormalised over
the nucleus), as vLLM's processed logprobs. The trainer rescores with the same temperature, so with an
unchanged policy the importance ratio is 1.

A completion stops at the EOS token or after ``max_completion_length`` tokens. **The EOS token is part of the
completion**: it is a sampled token with its own logprob, trained on like any other (that is how the policy
learns when to stop); ``finish_reason`` is ``"stop"`` then, ``"length"`` otherwise. ``text`` is the decoded
completion without special tokens. Padding never appears in a completion.

This module imports neither torch nor transformers, so any backend (transformers, vLLM) can implement it.

The exact text a worker feeds the model for a stored prompt record, and how to tokenize it.

Without a chat template the text is the record's ``prompt``, tokenized with the tokenizer's own special
tokens (a BOS where the model uses one), as before chats existed. With one (``dataset.chat_template = true``,
or a ``dataset.messages_column``) it is ``tokenizer.apply_chat_template(messages, add_generation_prompt=True,
tokenize=False)``: the chat (or the prompt as one user message), after ``dataset.system_prompt`` when the chat
has no system message of its own. A template writes its special tokens into the text itself (Llama's starts
with its BOS), so templated text is tokenized *without* adding special tokens again, which would double the
BOS; ``FedPrompts.add_special_tokens`` says which.

This text is what the length check (``model.max_prompt_length``) counts, what rewards receive as their
``prompt`` argument, and what the rollout header records (``RolloutExtra.prompts``). The tokenizer is the
generation backend's (``GenerationBackend.tokenizer``), so the worker templates exactly as it tokenizes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from asyncgrpo.protocol.schemas import GroupRef
from asyncgrpo.run.config import DatasetConfig

Message = dict[str, str]


class ChatTemplateMissing(ValueError):
    """The run asks for a chat template and the model's tokenizer has none."""


def chat_messages(record: Mapping[str, Any], dataset: DatasetConfig) -> list[Message]:
    """The chat a record stands for: its stored ``messages``, or its prompt as one user message; with
    ``dataset.system_prompt`` in front unless the chat starts with a system message of its own."""
    messages: list[Message] = list(record.get("messages") or [{"role": "user", "content": record["prompt"]}])
    if dataset.system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": dataset.system_prompt})
    return messages


def fed_prompt_text(
    record: Mapping[str, Any], dataset: DatasetConfig, tokenizer: Any, tools: list[dict] | None = None
) -> str:
    """The text fed to the model for one stored prompt record (see the module docstring); ``tools``: the JSON
    schemas an [agent] run shows the model through the template (``worker.generate.agent``)."""
    if not dataset.chat_templated:
        return record["prompt"]
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
        raise ChatTemplateMissing(
            f"the run sets dataset.chat_template = true or dataset.messages_column, but the tokenizer of {name!r} "
            "has no chat template; use an instruct model (model.base), or set dataset.chat_template = false "
            "and leave dataset.messages_column unset"
        )
    text = tokenizer.apply_chat_template(
        chat_messages(record, dataset), tools=tools or None, add_generation_prompt=True, tokenize=False
    )
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template returned a {type(text).__name__}, not the text")
    return text


@dataclass(frozen=True)
class FedPrompts:
    """The fed texts of one task's prompts, by prompt index."""

    texts: dict[int, str]
    add_special_tokens: bool  # False for templated text: the template wrote its special tokens already

    def of(self, groups: Sequence[GroupRef]) -> list[str]:
        """The texts of ``groups``, in their order."""
        return [self.texts[group.prompt_index] for group in groups]


def fed_prompts(
    prompts: Sequence[Mapping[str, Any]],
    indices: Iterable[int],
    dataset: DatasetConfig,
    tokenizer: Any,
    tools_of: Callable[[Mapping[str, Any]], list[dict]] | None = None,
) -> FedPrompts:
    """The fed text of each prompt index in ``indices`` that exists in ``prompts`` (others are left out: the
    job rejects them as out of range); ``tools_of``: an [agent] run's tool schemas for a record. Raises
    ChatTemplateMissing naming the config field."""
    in_range = [index for index in indices if 0 <= index < len(prompts)]
    texts = {
        index: fed_prompt_text(prompts[index], dataset, tokenizer, tools_of(prompts[index]) if tools_of else None)
        for index in in_range
    }
    return FedPrompts(texts=texts, add_special_tokens=not dataset.chat_templated)


FinishReason = Literal["stop", "length"]


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # one per token in token_ids: the behaviour logprob under the sampling distribution
    finish_reason: FinishReason
    text: str
    # Per token, the adapter version that sampled it, where the call followed newer versions and switched at
    # least once (``follow``); None: every token was sampled by the adapter the call named.
    versions: list[int] | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"a completion has {len(self.token_ids)} tokens but {len(self.logprobs)} logprobs; they must align"
            )
        if self.versions is not None and len(self.versions) != len(self.token_ids):
            raise ValueError(
                f"a completion has {len(self.token_ids)} tokens but {len(self.versions)} versions; they must align"
            )


@dataclass(frozen=True)
class PartialSequence:
    """A completion so far, as a task saves it and a later task continues it (``async.partial_rollouts``):
    its tokens, each token's behaviour logprob and the version that sampled it. ``finish_reason`` set: it has
    ended and is taken as it is; None: the later task samples on from its last token."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason | None = None

    def __post_init__(self) -> None:
        if not len(self.token_ids) == len(self.logprobs) == len(self.versions):
            raise ValueError(
                f"a partial sequence has {len(self.token_ids)} tokens, {len(self.logprobs)} logprobs and "
                f"{len(self.versions)} versions; they must align"
            )


@runtime_checkable
class Checkpoints(Protocol):
    """Where a backend that continues partial sequences (``continues_partials``) hands its sequences so far,
    between two decode steps (``worker.generate.partial``)."""

    def due(self) -> bool:
        """Whether to save now (cheap: asked at every decode step)."""
        ...

    def save(self, sequences: list[PartialSequence]) -> None:
        """Every sequence so far, row by row (``samples_per_prompt`` rows per prompt, in prompt order). It may
        raise to stop the sampling (a stop was requested), after it has stored them."""
        ...


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


def check_sampling_arguments(
    samples_per_prompt: int, max_completion_length: int, temperature: float, top_p: float
) -> None:
    """The argument checks every backend's ``generate`` makes before sampling. ``temperature`` 0 is greedy
    decoding (evaluation only: ``sampling.temperature`` is always > 0); its logprobs are those of the
    untempered distribution."""
    if samples_per_prompt < 1 or max_completion_length < 1:
        raise ValueError(
            f"samples_per_prompt={samples_per_prompt} and max_completion_length={max_completion_length} must be >= 1"
        )
    if not temperature >= 0.0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy) and top_p={top_p} in (0, 1]")


def check_continuations(
    sequences: list[list[int]], max_completion_lengths: list[int], temperature: float, top_p: float
) -> None:
    """The argument checks every backend's ``generate_from_ids`` makes: one budget (>= 1) per non-empty sequence."""
    if len(max_completion_lengths) != len(sequences) or not sequences:
        raise ValueError(
            f"{len(sequences)} sequences need as many max_completion_lengths, got {len(max_completion_lengths)}"
        )
    check_sampling_arguments(1, min(max_completion_lengths), temperature, top_p)
    if any(not ids for ids in sequences):
        raise ValueError("a sequence to continue has no tokens")


def sampled_prompt_ids(backend: GenerationBackend, prompts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """The prompts' token ids as every backend's ``generate`` feeds them; an empty one is refused (nothing to
    condition on: the job drops such prompts before they get here)."""
    prompt_ids = backend.tokenize(prompts, add_special_tokens=add_special_tokens)
    for index, ids in enumerate(prompt_ids):
        if not ids:
            raise ValueError(f"prompt {index} ({prompts[index]!r}) has no tokens; drop empty prompts")
    return prompt_ids


def generation_result(
    prompts: list[str],
    prompt_ids: list[list[int]],
    completions: Iterable[list[Completion]],
    adapter: str | None,
    generate_s: float,
) -> GenerationResult:
    """Every backend's ``generate`` result: each prompt's completions (in prompt order), and the token counts."""
    results = [
        PromptResult(prompt=prompt, prompt_token_ids=ids, completions=sampled)
        for prompt, ids, sampled in zip(prompts, prompt_ids, completions, strict=True)
    ]
    timings = GenerationTimings(
        generate_s=generate_s,
        prompt_tokens=sum(len(ids) for ids in prompt_ids),
        completion_tokens=sum(len(c.token_ids) for r in results for c in r.completions),
    )
    return GenerationResult(results=results, adapter=adapter, timings=timings)


class UnknownAdapter(KeyError):
    """``generate`` named an adapter that was never loaded (or was dropped)."""


@runtime_checkable
class VersionSource(Protocol):
    """Where a backend that follows new versions looks between two decode steps (``async.inflight_versions =
    "follow"``; ``worker.generate.inflight``)."""

    def newer(self, version: int) -> tuple[str, int] | None:
        """A version newer than ``version``, loaded into the backend: its adapter name and number; None when
        there is none yet. Called on the sampling thread, with the backend lock held."""
        ...


@runtime_checkable
class GenerationBackend(Protocol):
    """What a generate worker needs from a generation engine."""

    name: str
    """The engine ('transformers', 'vllm'), recorded in each rollout: whether its logprobs are the trainer's
    own numerics (``loss.vllm_importance_sampling_correction``)."""

    follows_versions: bool
    """Whether ``generate`` takes a ``follow`` (moves its sequences onto newer versions mid-generation)."""

    continues_partials: bool
    """Whether ``generate`` takes ``partials`` and ``checkpoints`` (saves its sequences mid-generation and
    continues saved ones)."""

    @property
    def eos_token_id(self) -> int: ...

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer the backend tokenizes with; chat templates are applied with it
        (``worker.generate.backend``)."""
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
        max_completion_length: int,
        temperature: float,
        top_p: float,
        seed: int,
        add_special_tokens: bool = True,
        follow: VersionSource | None = None,
        partials: list[list[PartialSequence | None]] | None = None,
        checkpoints: Checkpoints | None = None,
    ) -> GenerationResult:
        """Sample ``samples_per_prompt`` completions of each prompt with ``adapter`` (None: base model).

        The prompts are tokenized as ``tokenize(prompts, add_special_tokens=add_special_tokens)`` does.

        ``follow``: between two decode steps, ask it for a newer version and continue every unfinished sequence
        under that one; each token's logprob is then exactly its version's (given the tokens before it), and
        ``Completion.versions`` says which version sampled each token. A backend that cannot follow says so
        with ``follows_versions = False`` and refuses a ``follow``.

        ``partials``: per prompt, ``samples_per_prompt`` entries; a ``PartialSequence`` is that completion begun
        by an earlier task, continued from its last token (or taken as it is, when it has ended) within
        ``max_completion_length`` in all, its tokens, logprobs and versions kept; None samples it afresh.
        ``checkpoints``: asked between two decode steps, and handed every sequence so far when ``due()``. A
        backend that cannot says so with ``continues_partials = False`` and refuses both.

        The same seed, prompts, adapter and settings give the same completions on the same hardware.
        """
        ...

    def generate_from_ids(
        self,
        sequences: list[list[int]],
        *,
        adapter: str | None,
        max_completion_lengths: list[int],
        temperature: float,
        top_p: float,
        seed: int,
    ) -> list[Completion]:
        """One completion of each token sequence, continued exactly from its ids (no re-tokenizing): the next
        turn of a conversation (``worker.generate.agent``). ``max_completion_lengths[i]`` (>= 1) bounds sequence i's;
        one cut short is ``"length"``. Logprobs and determinism as ``generate``."""
        ...
