"""The vLLM generation backend: vLLM's offline engine (``vllm.LLM``) inside the generate worker's process.

How it maps the :class:`~worker.generate.backend.GenerationBackend` contract onto vLLM:

- **One LoRA slot per cached version.** The engine runs with ``max_loras`` GPU slots (and as many CPU slots);
  the factory sets it to ``max_staleness + 2``, the size of the worker's adapter cache, because a worker may
  be asked for any version in the staleness window while the next one loads. With one slot fewer, vLLM's
  own LRU would silently evict a version that still has work in flight. On top of that every adapter is
  *pinned* in vLLM and only leaves when :meth:`VLLMBackend.drop_adapter` removes it, and loading more
  adapters than there are slots is refused here: vLLM never chooses what to evict.
- **Versioned names and ids, never reused.** Version N is served as ``LoRARequest("vN", N + 1, path)``:
  vLLM needs an int id >= 1 and version 0 exists, hence ``id = version + 1``. vLLM's prefix cache is keyed
  by adapter, so two policies can never share cached KV blocks.
- **The G samples of a prompt are one request** (``SamplingParams(n=G)``), with prefix caching on, so the
  prompt is prefilled once per group.
- **Behaviour logprobs are processed logprobs**: the engine runs with ``logprobs_mode="processed_logprobs"``
  and each request asks for ``logprobs=0`` (the sampled token only), so each logprob is taken from the
  distribution the token was drawn from, after temperature and top-p -- the quantity the trainer's
  rescoring computes, so an unchanged policy gives an importance ratio of 1.
- **Stopping.** The engine uses ``generation_config="vllm"``: it ignores the model's
  ``generation_config.json`` (its default sampling settings and any extra stop ids), so a completion stops
  at the tokenizer's EOS (kept in the completion, with its logprob) or after ``max_completion_length`` tokens,
  exactly like the transformers backend.
- **Seeds.** vLLM seeds the n children of a request ``seed, seed + 1, ...``; prompt ``p`` of a call uses
  ``seed + p * G`` so that every sample of a call has its own seed, and the same seed gives the same samples.
  ``generate_from_ids`` (an agent conversation's next turns) sends one request per sequence, seeded ``seed + i``.
- **Adapters.** The folder is the plain PEFT folder the trainer published. Adapters vLLM cannot serve
  (DoRA, modules_to_save, LoRA bias, a rank above the engine's ``max_lora_rank``, ...) are refused with
  :class:`UnservableAdapter` before vLLM sees them.

vLLM is imported lazily, only inside this module and only when a backend is built, so the transformers
environment can import the worker package without it. By default the engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): a ``kill -9`` of the worker then leaves no engine process behind.
On a CPU build, ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache) defaults to 1 here; both can be overridden
from the environment.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

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
from worker.model.tokenizer import load_tokenizer

log = structlog.get_logger()

# Environment vLLM reads when the engine starts; set only where the user has not set them.
_ENGINE_ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine lives in the worker process
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on CPU builds (ignored on GPU builds)
}

# PEFT adapter_config.json fields that vLLM cannot serve, with the value it needs and what to change.
_UNSERVABLE_FIELDS: dict[str, tuple[Any, str]] = {
    "use_dora": (False, "train plain LoRA (use_dora=False)"),
    "lora_bias": (False, "train without LoRA bias (lora_bias=False)"),
    "layer_replication": (None, "train without layer_replication"),
    "trainable_token_indices": (None, "train without trainable_token_indices"),
    "alora_invocation_tokens": (None, "train plain LoRA, not Activated LoRA"),
    "use_bdlora": (None, "train plain LoRA, not block-diagonal LoRA"),
    "use_qalora": (False, "train plain LoRA, not QALoRA"),
}


class UnservableAdapter(ValueError):
    """A PEFT adapter folder this vLLM engine cannot serve; the message names the field and what to change."""


class AdapterSlotsFull(RuntimeError):
    """More adapters were loaded than the engine has LoRA slots; drop one first (vLLM would evict silently)."""


def adapter_lora_id(version: int) -> int:
    """vLLM's int id of an adapter version: LoRARequest needs an id >= 1, and version 0 exists."""
    if version < 0:
        raise ValueError(f"adapter version must be >= 0, got {version}")
    return version + 1


def round_up_lora_rank(rank: int, supported: Sequence[int]) -> int:
    """The smallest rank vLLM supports that holds ``rank`` (vLLM only accepts a fixed list of sizes)."""
    fitting = sorted(size for size in supported if size >= rank)
    if not fitting:
        raise ValueError(
            f"LoRA rank {rank} is above the largest rank vLLM supports ({max(supported)}); lower lora.rank"
        )
    return fitting[0]


def check_servable_adapter(path: Path, max_lora_rank: int, name: str = "adapter") -> dict[str, Any]:
    """Read ``path``'s adapter_config.json and raise :class:`UnservableAdapter` if vLLM cannot serve it.

    Returns the parsed config. Pure: needs neither vLLM nor torch.
    """
    path = Path(path)
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} is not a PEFT adapter folder: adapter_config.json is missing")
    if not (path / "adapter_model.safetensors").is_file():
        raise UnservableAdapter(
            f"{name} at {path} has no adapter_model.safetensors; vLLM serves only safetensors adapters"
        )
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise UnservableAdapter(f"{name}: {config_file} is not valid JSON: {error}") from error
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise UnservableAdapter(f"{name} is a {peft_type!r} adapter; vLLM serves only peft_type 'LORA'")
    if config.get("modules_to_save"):
        raise UnservableAdapter(
            f"{name} has modules_to_save={config['modules_to_save']}: vLLM cannot serve fully trained "
            "modules; train LoRA only (leave modules_to_save empty)"
        )
    if config.get("bias", "none") != "none":
        raise UnservableAdapter(f"{name} trains biases (bias={config['bias']!r}); vLLM needs bias='none'")
    for field_name, (wanted, remedy) in _UNSERVABLE_FIELDS.items():
        value = config.get(field_name, wanted)
        if value not in (wanted, None, False, [], {}):
            raise UnservableAdapter(f"{name} has {field_name}={value!r}, which vLLM cannot serve; {remedy}")
    ranks = [int(config.get("r", 0))] + [int(r) for r in (config.get("rank_pattern") or {}).values()]
    if min(ranks) < 1:
        raise UnservableAdapter(f"{name} has LoRA rank r={config.get('r')!r}; it must be >= 1")
    if max(ranks) > max_lora_rank:
        raise UnservableAdapter(
            f"{name} has LoRA rank {max(ranks)} above this engine's max_lora_rank={max_lora_rank}; start the "
            "generate worker with a run config whose lora.rank covers it (or lower the adapter's rank)"
        )
    return config


def model_max_positions(base: str) -> int | None:
    """The longest sequence ``base``'s config allows (max_position_embeddings), or None when it names none."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base)
    config = getattr(config, "text_config", None) or config  # multimodal configs nest the language model's
    limit = getattr(config, "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int | float) and limit > 0 else None


@dataclass(frozen=True)
class _LoadedAdapter:
    version: int
    lora_id: int
    path: str


class VLLMBackend:
    """A :class:`~worker.generate.backend.GenerationBackend` on vLLM's offline engine, in this process."""

    name = "vllm"  # what rollouts record as their sampler (RolloutExtra.sampler)
    # Not yet: a vLLM request keeps its LoRA to the end. The job keeps the version a task started on.
    follows_versions = False
    continues_partials = False

    def __init__(
        self,
        base: str,
        *,
        dtype: str = "float32",
        max_loras: int,
        max_lora_rank: int,
        max_model_len: int,
        seed: int = 0,
        enforce_eager: bool | None = None,
        engine_args: dict[str, Any] | None = None,
    ) -> None:
        """Start the engine for ``base`` (a local Hugging Face folder or hub id) with LoRA enabled.

        ``max_lora_rank`` is rounded up to a rank vLLM supports. ``enforce_eager=None`` means eager on CPU
        (compiling costs more than a CPU run gains) and CUDA graphs on GPU. ``engine_args`` are passed on
        to ``vllm.LLM`` last, so they override anything set here (e.g. ``gpu_memory_utilization``).
        """
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        for variable, value in _ENGINE_ENV_DEFAULTS.items():
            os.environ.setdefault(variable, value)
        # Lazy: the transformers environment never imports vLLM.
        from typing import get_args

        from vllm import LLM
        from vllm.config.lora import MaxLoRARanks
        from vllm.platforms import current_platform

        self.max_loras = max_loras
        self.max_lora_rank = round_up_lora_rank(max_lora_rank, get_args(MaxLoRARanks))
        model_limit = model_max_positions(base)
        if model_limit is not None and max_model_len > model_limit:
            # vLLM refuses a context longer than the model's positions; prompts that would not fit are
            # refused by generate() with the limit named.
            log.warning(
                "generation.vllm_context_clamped",
                asked=max_model_len,
                model_max_positions=model_limit,
                hint="model.max_prompt_length + sampling.max_completion_length exceeds the model's context",
            )
            max_model_len = model_limit
        self.max_model_len = max_model_len
        on_cpu = current_platform.is_cpu()
        arguments: dict[str, Any] = {
            "model": base,
            "dtype": dtype,
            "seed": seed,
            "enable_lora": True,
            "max_loras": max_loras,
            "max_cpu_loras": max_loras,
            "max_lora_rank": self.max_lora_rank,
            "max_model_len": max_model_len,
            "enable_prefix_caching": True,
            "logprobs_mode": "processed_logprobs",
            "generation_config": "vllm",
            "enforce_eager": on_cpu if enforce_eager is None else enforce_eager,
        }
        arguments.update(engine_args or {})
        started = time.perf_counter()
        self.llm = LLM(**arguments)
        self.engine_start_s = time.perf_counter() - started
        # The tokenizer as saved (worker.model.tokenizer), not the engine's AutoTokenizer pick: prompts and agent
        # turns are tokenized here and sent as token ids, so the two backends feed the same tokens.
        self._tokenizer = load_tokenizer(base)
        if self._tokenizer.eos_token_id is None:
            raise ValueError(f"the tokenizer of {base!r} has no EOS token; completions could never stop")
        self._adapters: dict[str, _LoadedAdapter] = {}
        self.last_adapter_load_s = 0.0
        log.info(
            "generation.vllm_ready",
            base=base,
            dtype=dtype,
            max_loras=max_loras,
            max_lora_rank=self.max_lora_rank,
            max_model_len=max_model_len,
            platform="cpu" if on_cpu else current_platform.device_name,
            s=round(self.engine_start_s, 2),
        )

    # -- the GenerationBackend protocol -----------------------------------------------------------------
    @property
    def eos_token_id(self) -> int:
        return int(self._tokenizer.eos_token_id)

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def tokenize(self, prompts: list[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        # Token ids go to the engine as TokensPrompt, so vLLM never tokenizes (nor adds a BOS) itself.
        return [list(ids) for ids in self._tokenizer(prompts, add_special_tokens=add_special_tokens)["input_ids"]]

    def loaded_adapters(self) -> list[str]:
        return sorted(self._adapters)

    def adapter_version(self, name: str) -> int:
        return self._adapter(name).version

    def load_adapter(self, name: str, version: int, path: Path) -> None:
        loaded = self._adapters.get(name)
        if loaded is not None:
            if loaded.version != version:
                raise ValueError(
                    f"adapter name {name!r} is loaded as version {loaded.version}, not {version}; "
                    "adapter names are never reused for another version"
                )
            return
        if len(self._adapters) >= self.max_loras:
            raise AdapterSlotsFull(
                f"cannot load {name!r}: all {self.max_loras} LoRA slots hold {self.loaded_adapters()}; drop one "
                "first (max_loras must be max_staleness + 2, the adapter cache's size)"
            )
        path = Path(path).resolve()
        check_servable_adapter(path, self.max_lora_rank, name)
        from vllm.lora.request import LoRARequest

        lora_id = adapter_lora_id(version)
        started = time.perf_counter()
        # Loaded now rather than on first use, so a broken adapter fails here and the switch time is known;
        # pinned so that vLLM's own LRU can never evict it behind our back.
        self.llm.llm_engine.add_lora(LoRARequest(name, lora_id, str(path)))
        self.llm.llm_engine.pin_lora(lora_id)
        self.last_adapter_load_s = time.perf_counter() - started
        self._adapters[name] = _LoadedAdapter(version=version, lora_id=lora_id, path=str(path))
        log.info("generation.adapter_loaded", adapter=name, version=version, s=round(self.last_adapter_load_s, 4))

    def drop_adapter(self, name: str) -> None:
        loaded = self._adapters.pop(name, None)
        if loaded is None:
            return
        self.llm.llm_engine.remove_lora(loaded.lora_id)
        log.info("generation.adapter_dropped", adapter=name)

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
        if follow is not None:
            raise ValueError("the vLLM backend does not follow new versions mid-generation (follows_versions = False)")
        if partials is not None or checkpoints is not None:
            raise ValueError(
                "the vLLM backend does not save or continue partial sequences (continues_partials = False)"
            )
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest

        lora_request = None
        if adapter is not None:
            loaded = self._adapter(adapter)
            lora_request = LoRARequest(adapter, loaded.lora_id, loaded.path)
        prompt_ids = sampled_prompt_ids(self, prompts, add_special_tokens)
        for index, ids in enumerate(prompt_ids):
            if len(ids) + max_completion_length > self.max_model_len:
                raise ValueError(
                    f"prompt {index} has {len(ids)} tokens; with max_completion_length={max_completion_length} it "
                    f"exceeds the engine's max_model_len={self.max_model_len} (model.max_prompt_length + "
                    "sampling.max_completion_length, at most the model's positions); shorten the prompt or lower "
                    "model.max_prompt_length so that such prompts are rejected before generation"
                )
        params = [
            SamplingParams(
                n=samples_per_prompt,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_completion_length,
                logprobs=0,  # the sampled token's own logprob only
                seed=_prompt_seed(seed, index, samples_per_prompt),
                skip_special_tokens=True,
            )
            for index in range(len(prompts))
        ]
        started = time.perf_counter()
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids],
            params,
            lora_request=lora_request,
            use_tqdm=False,
        )
        elapsed = time.perf_counter() - started
        completions = ([_completion(c) for c in output.outputs] for output in outputs)
        return generation_result(prompts, prompt_ids, completions, adapter, elapsed)

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
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest

        lora_request = None
        if adapter is not None:
            loaded = self._adapter(adapter)
            lora_request = LoRARequest(adapter, loaded.lora_id, loaded.path)
        for index, ids in enumerate(sequences):
            if len(ids) + max_completion_lengths[index] > self.max_model_len:
                raise ValueError(
                    f"a conversation of {len(ids)} tokens with {max_completion_lengths[index]} more exceeds the "
                    f"engine's max_model_len={self.max_model_len}; lower sampling.max_completion_length (the "
                    "conversation's budget) or model.max_prompt_length"
                )
        params = [
            SamplingParams(
                n=1,
                temperature=temperature,
                top_p=top_p,
                max_tokens=budget,
                logprobs=0,
                seed=(seed + index) % (2**63 - 1),
                skip_special_tokens=True,
            )
            for index, budget in enumerate(max_completion_lengths)
        ]
        # Token ids in, token ids out: the conversation so far is never re-tokenized.
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids in sequences],
            params,
            lora_request=lora_request,
            use_tqdm=False,
        )
        return [_completion(output.outputs[0]) for output in outputs]

    # -- helpers -----------------------------------------------------------------------------------------
    def _adapter(self, name: str) -> _LoadedAdapter:
        try:
            return self._adapters[name]
        except KeyError:
            raise UnknownAdapter(f"adapter {name!r} is not loaded; loaded: {self.loaded_adapters()}") from None


def _prompt_seed(seed: int, prompt_index: int, samples_per_prompt: int) -> int:
    # vLLM seeds the n children of a request seed, seed+1, ...; spacing prompts by G keeps every seed distinct.
    return (seed + prompt_index * samples_per_prompt) % (2**63 - 1)


def _completion(output: Any) -> Completion:
    """One vLLM CompletionOutput as a Completion; the logprob is the sampled token's processed logprob."""
    token_ids = [int(token) for token in output.token_ids]
    if output.logprobs is None or len(output.logprobs) != len(token_ids):
        raise RuntimeError(
            "vLLM returned no logprob for some sampled tokens; the engine must run with logprobs=0 requests"
        )
    logprobs = [float(position[token].logprob) for position, token in zip(output.logprobs, token_ids, strict=True)]
    finish: FinishReason = "length" if output.finish_reason == "length" else "stop"
    if output.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a completion with reason {output.finish_reason!r}; expected stop/length")
    return Completion(token_ids=token_ids, logprobs=logprobs, finish_reason=finish, text=output.text)
