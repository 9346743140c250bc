"""The model runtime shared by generators and the trainer: load a base model, wrap it with LoRA, and
prepare the wrapped model for training.

Plain LoRA only (no DoRA, no rsLoRA, no bias training), so vLLM can serve the very adapter the trainer
saves. The base weights stay frozen in the configured dtype; LoRA weights are float32.

The speed switches a TRL user expects live here too: the attention implementation the base model loads with
(``model.attn_implementation``), and gradient checkpointing and torch.compile of the decoder layers
(``optimizer.gradient_checkpointing``, ``optimizer.torch_compile``, applied by ``prepare_for_training``).
``decoder_layers`` finds the layers both act on, the unit FSDP2 shards too.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from asyncgrpo.run.config import LoraConfig, OptimizerConfig
from worker.model.tiny_model import resolve_base_model
from worker.model.tokenizer import load_tokenizer

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

# Names of the decoder layer list in transformers' causal LMs: `layers` (Llama, Qwen, Mistral, Gemma, ...),
# `h` (GPT-2, Falcon, Bloom, ...).
_LAYER_LIST_NAMES = ("layers", "h")


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
        tokenizer = load_tokenizer(path)
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


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a causal LM, bare or wrapped by PEFT, in order: the modules of the first
    ``torch.nn.ModuleList`` named ``layers`` (Llama, Qwen, Mistral, ...) or ``h`` (GPT-2, Falcon, ...) in module
    order. The unit ``prepare_for_training`` compiles and FSDP2 shards, one layer at a time.

    Raises ValueError naming the model's class when it has no such list."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and name.rpartition(".")[2] in _LAYER_LIST_NAMES:
            return list(module)
    inner = model.get_base_model() if isinstance(model, PeftModel) else model
    raise ValueError(
        f"{type(inner).__name__} has no decoder layer list (a torch.nn.ModuleList named "
        f"{' or '.join(repr(name) for name in _LAYER_LIST_NAMES)}); its layers cannot be compiled or sharded one by one"
    )


def _trace_checkpointed_side_effects() -> None:
    """Let torch.compile trace a checkpointed layer whose forward mutates Python state.

    A hub-kernel layer (the ``kernels`` package) sets and resets a context variable around each decoder layer's
    forward. Under checkpointing, dynamo refuses such a forward by default, since eager checkpointing would replay
    the mutation in the backward, and the whole layer then runs uncompiled. The replay is not needed (the state
    is set and reset within the call), so the process is told to skip it. Process-wide: the trainer's process
    prepares one model."""
    import torch._dynamo.config

    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):  # older torch lacks it
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def prepare_for_training(model: PeftModel, optimizer: OptimizerConfig) -> None:
    """Apply the run's ``optimizer.gradient_checkpointing`` and ``optimizer.torch_compile`` to the LoRA-wrapped
    model, in place; a no-op when both are off.

    The order is the one FSDP2 needs: checkpointing, then compiling each decoder layer (``layer.compile()``,
    which keeps module names, so adapter files and state dicts are unchanged), then sharding, by the caller,
    after this returns.

    Checkpointing is transformers' own, non-reentrant. transformers recomputes a layer only in a training
    forward (the module in train mode, gradients enabled): a caller that otherwise trains in eval mode must
    switch the model to train mode for its training forwards (without dropout both modes compute the same).
    """
    if optimizer.gradient_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:  # newer transformers, where gradient_checkpointing_enable is a deprecated alias
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # transformers may also hook the input embeddings so that their output requires grad. Only reentrant
        # checkpointing needs that (its recompute sees the inputs alone); non-reentrant checkpointing reaches the
        # LoRA weights without it (the tests compare gradients), and the first layer then skips the gradient of
        # its input. Older transformers may set no hook here, and their disable_input_require_grads fails then.
        base = model.get_base_model()
        if getattr(base, "_require_grads_hooks", None) or getattr(base, "_require_grads_hook", None) is not None:
            base.disable_input_require_grads()
    if optimizer.torch_compile:
        if optimizer.gradient_checkpointing:
            _trace_checkpointed_side_effects()
        for layer in decoder_layers(model):
            layer.compile()
    if optimizer.gradient_checkpointing or optimizer.torch_compile:
        log.info(
            "policy.prepared_for_training",
            gradient_checkpointing=optimizer.gradient_checkpointing,
            torch_compile=optimizer.torch_compile,
        )
