"""Build the generation backend a generate worker uses: transformers or vLLM, chosen per worker.

The choice is ``settings.generation_backend`` (``ASYNCGRPO_GENERATION_BACKEND``) when set, else the run
config's ``sampling.backend``. Each backend module is imported only when chosen, so a transformers
environment never imports vLLM and a vLLM environment never needs the trainer's newer transformers.

vLLM engine settings that are not part of the run (GPU memory share, tensor parallelism, ...) come from
``settings.vllm_engine_args`` (``ASYNCGRPO_VLLM_ENGINE_ARGS``, a JSON object passed on to ``vllm.LLM``, e.g.
``{"gpu_memory_utilization": 0.85}``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from asyncgrpo.run.config import RunConfig
from worker.generate.backend import GenerationBackend

BACKENDS = ("transformers", "vllm")
VLLM_ENGINE_ARGS_ENV = "ASYNCGRPO_VLLM_ENGINE_ARGS"  # GenerateSettings.vllm_engine_args


class BackendSettings(Protocol):
    """What the factory reads of a worker's settings (``WorkerSettings`` has it; no import of that layer)."""

    @property
    def generation_backend(self) -> str | None: ...
    @property
    def device(self) -> str: ...
    @property
    def vllm_engine_args(self) -> dict[str, Any]: ...
    @property
    def cache(self) -> Path: ...


def chosen_backend(config: RunConfig, settings: BackendSettings) -> str:
    """The backend name this worker uses; an unknown name is an error naming where it came from."""
    if settings.generation_backend:
        name, source = settings.generation_backend, "ASYNCGRPO_GENERATION_BACKEND"
    else:
        name, source = config.sampling.backend, "sampling.backend in the run config"
    if name not in BACKENDS:
        raise ValueError(f"{source}={name!r} is not a generation backend; use one of {list(BACKENDS)}")
    return name


def vllm_engine_settings(config: RunConfig) -> dict[str, Any]:
    """The VLLMBackend arguments a run config implies (everything but the base path and engine extras)."""
    return {
        "dtype": config.model.dtype,
        # One slot per version the adapter cache holds: the staleness window plus the version being loaded.
        "max_loras": config.async_.max_staleness + 2,
        "max_lora_rank": config.lora.rank,  # rounded up to a rank vLLM supports by the backend
        "max_model_len": config.model.max_prompt_length + config.sampling.max_completion_length,
        "seed": config.seed,
    }


def build_generation_backend(config: RunConfig, settings: BackendSettings) -> GenerationBackend:
    """The generation backend for this worker and run, with the base model loaded."""
    from worker.model.tiny_model import resolve_base_model

    name = chosen_backend(config, settings)
    base = resolve_base_model(config.model.base, settings.cache)
    if name == "vllm":
        if settings.device not in ("auto", "cpu", "cuda", "cuda:0"):
            raise ValueError(
                f"ASYNCGRPO_DEVICE={settings.device!r}: the vLLM backend uses the first visible device; select "
                "a GPU with CUDA_VISIBLE_DEVICES and leave ASYNCGRPO_DEVICE at 'auto' or 'cuda'"
            )
        from worker.generate.vllm_backend import VLLMBackend

        return VLLMBackend(base, **vllm_engine_settings(config), engine_args=settings.vllm_engine_args)
    from worker.generate.transformers_backend import TransformersBackend

    return TransformersBackend(
        base, dtype=config.model.dtype, device=settings.device, attn_implementation=config.model.attn_implementation
    )
