"""The model runtime shared by generators and the trainer: load a base model, wrap it with LoRA.

Plain LoRA only (no DoRA, no rsLoRA, no bias training), so vLLM can serve the very adapter the trainer
saves. The base weights stay frozen in the configured dtype; LoRA weights are float32.

The base model loads with the run's attention implementation (``model.attn_implementation``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from asyncgrpo.run.config import LoraConfig
from worker.model.tiny_model import resolve_base_model

log = structlog.get_logger()

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# The adapter name the trainer's single LoRA lives under inside its PeftModel.
TRAIN_ADAPTER = "default"

# The flash-attention implementations: the module each needs importable, and the package that provides it.
_FLASH_ATTENTION = {
    "flash_attention_2": ("flash_attn", "flash-attn"),
    "flash_attention_3": ("flash_attn_interface", "flash-attention 3 (its hopper/ build)"),
}


def resolve_device(device: str | None = None) -> torch.device:
    """'auto' or None -> cuda when available, else cpu; anything else is passed to torch.device."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but CUDA is not available; use 'cpu' or 'auto'")
    return resolved


def check_attn_implementation(name: str | None, device: torch.device) -> None:
    """Refuse a flash-attention ``model.attn_implementation`` this process cannot run (its package missing, or
    no GPU), with a message naming the config field rather than transformers' own."""
    if name not in _FLASH_ATTENTION:
        return
    module, package = _FLASH_ATTENTION[name]
    if importlib.util.find_spec(module) is None:
        raise ValueError(
            f"model.attn_implementation = {name!r} needs the {package} package (module {module!r}), which is not "
            "installed in this environment; install it, or set model.attn_implementation to 'sdpa' or leave it "
            "unset"
        )
    if device.type != "cuda":
        raise ValueError(
            f"model.attn_implementation = {name!r} runs on a CUDA GPU only, and this process uses {device}; set "
            "model.attn_implementation to 'sdpa' or leave it unset"
        )


def resolve_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"model dtype {name!r} is unknown; use one of {sorted(_DTYPES)}") from None


@dataclass
class Policy:
    """A frozen base model and its tokenizer on one device."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    base: str

    @property
    def eos_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def pad_token_id(self) -> int:
        # A tokenizer without a pad token pads with EOS; padding is always masked, so its id does not matter.
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    @classmethod
    def load(
        cls,
        base: str,
        dtype: str = "float32",
        device: str | None = None,
        cache_dir: Path | None = None,
        *,
        attn_implementation: str | None = None,
    ) -> Policy:
        """Load ``base`` (hub id, local folder, or 'tiny', built in ``cache_dir``) with frozen weights, in eval
        mode, with ``attn_implementation`` (``model.attn_implementation``; None: transformers' default)."""
        path = resolve_base_model(base, cache_dir)
        torch_device = resolve_device(device)
        check_attn_implementation(attn_implementation, torch_device)
        tokenizer = AutoTokenizer.from_pretrained(path)
        if tokenizer.eos_token_id is None:
            raise ValueError(f"the tokenizer of {base!r} has no EOS token; completions could never stop")
        chosen = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype), **chosen)
        model.to(torch_device)
        model.eval()
        model.requires_grad_(False)
        attention = getattr(model.config, "_attn_implementation", None)
        log.info("policy.loaded", base=base, path=path, dtype=dtype, device=str(torch_device), attention=attention)
        return cls(model=model, tokenizer=tokenizer, device=torch_device, base=base)

    def encode_prompts(self, prompts: list[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each prompt, as the model sees them: with the tokenizer's own special tokens, unless
        the text already holds them (a chat template's output, see ``worker.generate.backend``)."""
        return [list(ids) for ids in self.tokenizer(prompts, add_special_tokens=add_special_tokens)["input_ids"]]


def peft_lora_config(lora: LoraConfig) -> PeftLoraConfig:
    """The PEFT config for a run's ``[lora]`` section: plain LoRA on the causal LM."""
    target = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=target,
        bias="none",
        use_dora=False,
        use_rslora=False,
        task_type="CAUSAL_LM",
    )


def wrap_with_lora(policy: Policy, lora: LoraConfig, seed: int) -> PeftModel:
    """Wrap the policy's base model with a freshly initialised LoRA; the same seed gives the same init."""
    with torch.random.fork_rng(devices=[policy.device] if policy.device.type == "cuda" else []):
        torch.manual_seed(seed)
        model = get_peft_model(policy.model, peft_lora_config(lora), adapter_name=TRAIN_ADAPTER)
    # LoRA weights train in float32 whatever the base dtype.
    for name, parameter in model.named_parameters():
        if parameter.requires_grad and parameter.dtype != torch.float32:
            raise TypeError(f"LoRA parameter {name} is {parameter.dtype}; expected float32")
    return model


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every trainable parameter, in a fixed order (the module order)."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]
