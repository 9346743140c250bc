"""A trainer's state <-> bytes: the files of one version, written by ``Trainer.version_files`` and read by
``Trainer.load_version_files`` (``worker.optimize.trainer``).

The adapter in plain PEFT format, the rest as safetensors + JSON (no pickle).

Files of one version (names from ``asyncgrpo.bucket.layout``):

* ``adapter_model.safetensors`` + ``adapter_config.json``: exactly what ``PeftModel.save_pretrained`` writes
  (so ``PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` load it), with ``target_modules`` sorted and
  ``base_model_name_or_path`` set to the run's ``model.base`` so the bytes do not depend on the machine.
* ``trainer_state.safetensors``: AdamW moments and step counts as ``optimizer/<param name>/<state key>``,
  and the trainer's private RNG states as ``rng/cpu`` and ``rng/cuda``.
* ``trainer_state.json``: format, version, optimizer updates taken, the parameter names in optimizer order,
  the optimizer's param groups, and free ``extra`` metadata.

Loading these into a trainer built with the same config continues bit-identically (same device, same seed).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from asyncgrpo.bucket.layout import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    TRAINER_STATE_JSON_NAME,
    TRAINER_STATE_TENSORS_NAME,
)

TRAINER_STATE_FORMAT = 1
VERSION_FILE_NAMES = (
    ADAPTER_WEIGHTS_NAME,
    ADAPTER_CONFIG_NAME,
    TRAINER_STATE_TENSORS_NAME,
    TRAINER_STATE_JSON_NAME,
)
_OPTIMIZER_PREFIX = "optimizer/"
_RNG_CPU = "rng/cpu"
_RNG_CUDA = "rng/cuda"


class TrainerStateError(ValueError):
    """Version files that cannot be loaded into this trainer; the message says what does not match."""


@dataclass
class TrainerState:
    version: int
    updates: int  # optimizer updates taken since version 0
    optimizer_state: dict[str, Any]  # in torch.optim.Optimizer.state_dict() form
    rng_cpu: torch.Tensor
    rng_cuda: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# --- the adapter -----------------------------------------------------------------------------------------


def adapter_files(
    model: PeftModel, base: str, adapter_name: str = "default", config_bytes: bytes | None = None
) -> dict[str, bytes]:
    """The adapter as the two files of a PEFT adapter folder.

    ``config_bytes``: this adapter's config file from an earlier call (it never changes for a trainer); the
    weights are then serialised in memory, the bytes PEFT's ``save_pretrained`` writes, without its temporary
    folder and model card (most of its time on a small adapter).
    """
    if config_bytes is not None:
        state = get_peft_model_state_dict(model, adapter_name=adapter_name)
        weights = save_tensors({name: tensor.contiguous() for name, tensor in state.items()}, metadata={"format": "pt"})
        return {ADAPTER_WEIGHTS_NAME: weights, ADAPTER_CONFIG_NAME: config_bytes}
    with tempfile.TemporaryDirectory(prefix="asyncgrpo-adapter-") as tmp:
        model.save_pretrained(tmp, selected_adapters=[adapter_name])
        # save_pretrained writes a non-default adapter into a sub-folder named after it.
        folder = Path(tmp) if adapter_name == "default" else Path(tmp) / adapter_name
        weights = (folder / ADAPTER_WEIGHTS_NAME).read_bytes()
        config = json.loads((folder / ADAPTER_CONFIG_NAME).read_text())
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    config["base_model_name_or_path"] = base
    config_bytes = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    return {ADAPTER_WEIGHTS_NAME: weights, ADAPTER_CONFIG_NAME: config_bytes}


def write_adapter_folder(files: dict[str, bytes], folder: Path) -> Path:
    """Write the two adapter files into ``folder`` (for PeftModel.from_pretrained or a generator)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in (ADAPTER_WEIGHTS_NAME, ADAPTER_CONFIG_NAME):
        if name not in files:
            raise TrainerStateError(f"adapter file {name} is missing; got {sorted(files)}")
        (folder / name).write_bytes(files[name])
    return folder


def check_adapter_config(config_bytes: bytes, model: PeftModel, adapter_name: str = "default") -> None:
    """Raise TrainerStateError when a saved adapter's LoRA shape differs from the model's."""
    try:
        saved = json.loads(config_bytes)
    except ValueError as error:
        raise TrainerStateError(f"{ADAPTER_CONFIG_NAME} is not valid JSON: {error}") from error
    ours = model.peft_config[adapter_name]
    targets = ours.target_modules if isinstance(ours.target_modules, str) else sorted(ours.target_modules)
    expected = {
        "r": ours.r,
        "lora_alpha": ours.lora_alpha,
        "target_modules": targets,
        "use_dora": bool(ours.use_dora),
        "use_rslora": bool(ours.use_rslora),
    }
    for key, value in expected.items():
        found = saved.get(key)
        if isinstance(found, list):
            found = sorted(found)
        if found != value:
            raise TrainerStateError(
                f"the saved adapter has {key}={found!r} but this trainer has {key}={value!r}; "
                "load it with the run's own [lora] config"
            )


def load_adapter_weights(model: PeftModel, weights: bytes, adapter_name: str = "default") -> None:
    """Copy saved adapter weights into the model's adapter (exact values, no re-init)."""
    try:
        state = load_tensors(weights)
    except SafetensorError as error:
        raise TrainerStateError(f"{ADAPTER_WEIGHTS_NAME} is not a safetensors file: {error}") from error
    result = set_peft_model_state_dict(model, state, adapter_name=adapter_name)
    if result.unexpected_keys:
        raise TrainerStateError(
            f"{ADAPTER_WEIGHTS_NAME} holds tensors this model has no place for: {sorted(result.unexpected_keys)[:5]}"
        )
    missing = [key for key in result.missing_keys if "lora_" in key and f".{adapter_name}." in key]
    if missing:
        raise TrainerStateError(f"{ADAPTER_WEIGHTS_NAME} lacks LoRA tensors: {missing[:5]}")


# --- optimizer state and RNG -----------------------------------------------------------------------------


def encode_trainer_state(
    optimizer: torch.optim.Optimizer,
    param_names: list[str],
    state: TrainerState,
) -> tuple[bytes, bytes]:
    """(trainer_state.safetensors bytes, trainer_state.json bytes). ``state.optimizer_state`` is ignored:
    the live optimizer is read instead."""
    saved = optimizer.state_dict()
    indices = [index for group in saved["param_groups"] for index in group["params"]]
    if len(indices) != len(param_names):
        raise TrainerStateError(f"optimizer holds {len(indices)} parameters but {len(param_names)} names were given")
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, name in zip(indices, param_names, strict=True):
        for key, value in saved["state"].get(index, {}).items():
            if isinstance(value, torch.Tensor):
                tensors[f"{_OPTIMIZER_PREFIX}{name}/{key}"] = value.detach().to("cpu").contiguous()
            else:
                scalars.setdefault(name, {})[key] = value
    tensors[_RNG_CPU] = state.rng_cpu.to("cpu").contiguous()
    if state.rng_cuda is not None:
        tensors[_RNG_CUDA] = state.rng_cuda.to("cpu").contiguous()
    groups = [
        {key: (list(value) if isinstance(value, tuple) else value) for key, value in group.items()}
        for group in saved["param_groups"]
    ]
    meta = {
        "format": TRAINER_STATE_FORMAT,
        "version": state.version,
        "updates": state.updates,
        "param_names": param_names,
        "param_groups": groups,
        "state_scalars": scalars,
        "extra": state.extra,
    }
    return save_tensors(tensors), (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode()


def decode_trainer_state(tensor_bytes: bytes, json_bytes: bytes, param_names: list[str]) -> TrainerState:
    """Parse the two trainer-state files for a trainer whose trainable parameters are ``param_names``."""
    try:
        meta = json.loads(json_bytes)
    except ValueError as error:
        raise TrainerStateError(f"{TRAINER_STATE_JSON_NAME} is not valid JSON: {error}") from error
    if meta.get("format") != TRAINER_STATE_FORMAT:
        raise TrainerStateError(
            f"{TRAINER_STATE_JSON_NAME} has format {meta.get('format')!r}; this worker reads format "
            f"{TRAINER_STATE_FORMAT}: upgrade the worker"
        )
    if meta["param_names"] != param_names:
        raise TrainerStateError(
            f"the saved trainer state is for {len(meta['param_names'])} LoRA parameters that differ from this "
            f"trainer's {len(param_names)}; the run's model or [lora] config does not match"
        )
    try:
        tensors = load_tensors(tensor_bytes)
    except SafetensorError as error:
        raise TrainerStateError(f"{TRAINER_STATE_TENSORS_NAME} is not a safetensors file: {error}") from error
    per_param: dict[int, dict[str, Any]] = {}
    for index, name in enumerate(param_names):
        entry: dict[str, Any] = dict(meta["state_scalars"].get(name, {}))
        prefix = f"{_OPTIMIZER_PREFIX}{name}/"
        for key, value in tensors.items():
            if key.startswith(prefix):
                entry[key[len(prefix) :]] = value
        if entry:
            per_param[index] = entry
    groups = [
        {key: (tuple(value) if key == "betas" else value) for key, value in group.items()}
        for group in meta["param_groups"]
    ]
    if _RNG_CPU not in tensors:
        raise TrainerStateError(f"{TRAINER_STATE_TENSORS_NAME} has no {_RNG_CPU} tensor")
    return TrainerState(
        version=int(meta["version"]),
        updates=int(meta["updates"]),
        optimizer_state={"state": per_param, "param_groups": groups},
        rng_cpu=tensors[_RNG_CPU],
        rng_cuda=tensors.get(_RNG_CUDA),
        extra=meta.get("extra", {}),
    )
