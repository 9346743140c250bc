"""The generate side's own settings section (``ASYNCGRPO_GENERATION_BACKEND``, ``ASYNCGRPO_VLLM_ENGINE_ARGS``,
``ASYNCGRPO_PREFETCH_ADAPTERS``, ``ASYNCGRPO_PREFETCH_WAIT_S``).

It lives in this layer so that ``worker.generate`` reads its settings without importing ``worker.process``;
``worker.process.settings.WorkerSettings`` includes it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from asyncgrpo.protocol.settings import AsyncgrpoSettings


class GenerateSettings(AsyncgrpoSettings):
    """How a generate worker builds its backend, beyond what the run config says."""

    generation_backend: Literal["transformers", "vllm"] | None = None
    """Overrides the run config's `sampling.backend` on this generate worker: `transformers` or `vllm`."""

    vllm_engine_args: Annotated[dict[str, Any], NoDecode] = Field(default_factory=dict)
    """vLLM engine settings that are not part of the run, as a JSON object passed to `vllm.LLM`, e.g.
    `{"gpu_memory_utilization": 0.85}` (vllm backend only)."""

    prefetch_adapters: bool = True
    """Fetch and load each new adapter version as soon as the proxy publishes it (a background long poll), so
    tasks find it loaded; `false`: load it when a task first leases it."""

    prefetch_wait_s: float = Field(20.0, gt=0.0, le=30.0)
    """Longest wait (s) of one long poll for a new version; the proxy answers at once on a publish."""

    @field_validator("vllm_engine_args", mode="before")
    @classmethod
    def _json_object(cls, value: Any) -> Any:
        # Parsed here rather than by pydantic-settings so that a bad value gets a message, not a traceback.
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"not valid JSON ({error}); give a JSON object") from error
        if not isinstance(value, dict):
            raise ValueError("must be a JSON object of vllm.LLM arguments")
        return value
