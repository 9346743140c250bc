"""The policy's speed switches (worker/model/policy.py): the attention implementation, gradient checkpointing,
torch.compile of the decoder layers, and the decoder layer list they act on; on the tiny model, on CPU."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from torch._dynamo.utils import counters

from asyncgrpo.run.config import LoraConfig, OptimizerConfig, RunConfig
from tests.support.train_samples import synthetic_samples
from worker.model.policy import Policy, decoder_layers, prepare_for_training, wrap_with_lora
from worker.model.tiny_model import TINY_LAYERS
from worker.optimize.trainer import Trainer

IDS = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11], [1, 1, 5, 5, 7, 3, 4, 9, 10]])
MASK = torch.tensor([[1] * 9, [0, 0] + [1] * 7])  # the second row left-padded, as prompts are


def _lora_model(base: Path, **optimizer: Any) -> PeftModel:
    """The tiny model with a LoRA whose B is not zero (a fresh LoRA's B is, which would hide most gradients),
    prepared with the given optimizer switches."""
    model = wrap_with_lora(Policy.load(str(base)), LoraConfig(), seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    prepare_for_training(model, OptimizerConfig(**optimizer))
    return model


def _lora_gradients(model: PeftModel) -> dict[str, torch.Tensor]:
    model.train()
    logits = model(input_ids=IDS, attention_mask=MASK).logits
    (logits.log_softmax(-1)[..., 0] * MASK).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def _checkpointing(model: PeftModel) -> bool:
    base = model.get_base_model()
    # transformers 5 renamed the flag (the old name warns); older versions have only the old one.
    name = (
        "is_activation_checkpointing"
        if hasattr(type(base), "is_activation_checkpointing")
        else "is_gradient_checkpointing"
    )
    return bool(getattr(base, name))


def _count_calls(module: torch.nn.Module) -> list[int]:
    # A pre-hook: non-reentrant checkpointing stops its recompute once the last saved tensor is rebuilt, before a
    # module's forward hooks would run.
    calls = [0]
    module.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_gradient_checkpointing_recomputes_and_gives_the_same_lora_gradients(tiny_model_dir: Path) -> None:
    plain = _lora_model(tiny_model_dir)
    checkpointed = _lora_model(tiny_model_dir, gradient_checkpointing=True)
    assert not _checkpointing(plain) and _checkpointing(checkpointed)
    plain_calls = _count_calls(decoder_layers(plain)[0].mlp)
    recomputed_calls = _count_calls(decoder_layers(checkpointed)[0].mlp)

    expected = _lora_gradients(plain)
    got = _lora_gradients(checkpointed)

    assert plain_calls == [1] and recomputed_calls == [2]  # the backward ran the layer again
    assert expected.keys() == got.keys() and len(got) > 0
    for name, gradient in got.items():
        assert gradient.abs().sum() > 0, f"{name} got no gradient"
        torch.testing.assert_close(gradient, expected[name], rtol=0, atol=1e-6, msg=name)


def test_prepare_for_training_with_both_switches_off_changes_nothing(tiny_model_dir: Path) -> None:
    model = _lora_model(tiny_model_dir)
    assert not _checkpointing(model)
    assert all(layer._compiled_call_impl is None for layer in decoder_layers(model))
    assert not getattr(model.get_base_model(), "_require_grads_hooks", None)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS, attention_mask=MASK).logits


def test_eager_attention_gives_the_logits_of_sdpa(tiny_model_dir: Path) -> None:
    sdpa = Policy.load(str(tiny_model_dir), attn_implementation="sdpa").model
    eager = Policy.load(str(tiny_model_dir), attn_implementation="eager").model
    assert (sdpa.config._attn_implementation, eager.config._attn_implementation) == ("sdpa", "eager")
    real = MASK.bool()  # padded positions attend to nothing; what they output is never used
    torch.testing.assert_close(_logits(eager)[real], _logits(sdpa)[real], rtol=0, atol=1e-5)


def _flash_attention_installed(installed: bool) -> Callable[..., Any]:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        if name in ("flash_attn", "flash_attn_interface"):
            return real_find_spec("json") if installed else None  # any spec: only its presence is read
        return real_find_spec(name, *args)

    return find_spec


@pytest.mark.parametrize(
    ("implementation", "package"), [("flash_attention_2", "flash-attn"), ("flash_attention_3", "flash-attention 3")]
)
def test_flash_attention_without_its_package_is_refused_naming_the_field(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, implementation: str, package: str
) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", _flash_attention_installed(False))
    with pytest.raises(ValueError, match=rf"model\.attn_implementation = '{implementation}' needs the {package}"):
        Policy.load(str(tiny_model_dir), attn_implementation=implementation)


def test_flash_attention_on_a_cpu_is_refused_naming_the_field(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", _flash_attention_installed(True))
    with pytest.raises(ValueError, match=r"model\.attn_implementation = 'flash_attention_2' runs on a CUDA GPU only"):
        Policy.load(str(tiny_model_dir), device="cpu", attn_implementation="flash_attention_2")


def test_decoder_layers_are_the_tiny_models_layers_bare_or_wrapped(tiny_model_dir: Path) -> None:
    policy = Policy.load(str(tiny_model_dir))
    bare = decoder_layers(policy.model)
    assert len(bare) == TINY_LAYERS
    assert all(layer is expected for layer, expected in zip(bare, policy.model.model.layers, strict=True))
    wrapped = wrap_with_lora(policy, LoraConfig(), seed=0)
    assert all(layer is expected for layer, expected in zip(decoder_layers(wrapped), bare, strict=True))


def test_a_model_without_a_layer_list_is_refused_naming_its_class() -> None:
    with pytest.raises(ValueError, match=r"Sequential has no decoder layer list"):
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ModuleList([torch.nn.Linear(2, 2)])))


def _or_skip_without_a_compiler(run: Callable[[], Any]) -> Any:
    """``run()``; a test skips, with the reason, when inductor cannot build kernels on this machine (no working
    C++ compiler), and fails on any other error."""
    try:
        return run()
    except Exception as error:
        text = f"{type(error).__name__}: {error}"
        if not any(cause in text for cause in ("InvalidCxxCompiler", "CppCompileError", "C++ compile")):
            raise
        pytest.skip(f"torch.compile cannot build kernels here: {text.splitlines()[0][:300]}")


@pytest.mark.slow
def test_torch_compile_compiles_each_layer_and_keeps_logits_and_gradients(tiny_model_dir: Path) -> None:
    """The trainer's order, checkpointing then compile, on CPU: the same logits and LoRA gradients."""
    plain = _lora_model(tiny_model_dir)
    compiled = _lora_model(tiny_model_dir, gradient_checkpointing=True, torch_compile=True)
    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(compiled))
    assert [name for name, _ in compiled.named_parameters()] == [name for name, _ in plain.named_parameters()]

    counters.clear()
    got = _or_skip_without_a_compiler(lambda: _lora_gradients(compiled))
    # A graph break inside a checkpointed layer would run that layer uncompiled: still correct, no faster.
    assert not counters["graph_break"], list(counters["graph_break"])
    expected = _lora_gradients(plain)
    for name, gradient in got.items():
        torch.testing.assert_close(gradient, expected[name], rtol=0, atol=1e-5, msg=name)
    real = MASK.bool()
    torch.testing.assert_close(_logits(compiled)[real], _logits(plain)[real], rtol=0, atol=1e-5)


def test_the_trainer_recomputes_layers_in_its_step_with_gradient_checkpointing(tiny_model_dir: Path) -> None:
    """The switch reaches the trainer's own step (transformers checkpoints only a module in train mode), and
    the step's update is the one without it."""
    trainers, calls = [], []
    for checkpointing in (False, True):
        config = RunConfig.model_validate({"optimizer": {"gradient_checkpointing": checkpointing}})
        trainer = Trainer.initial(Policy.load(str(tiny_model_dir)), config)
        trainers.append(trainer)
        calls.append(_count_calls(decoder_layers(trainer.model)[0].mlp))
    samples = synthetic_samples(trainers[0], 8, seed=1)
    for counted in calls:
        counted[0] = 0  # the rescoring that made the samples' behaviour logprobs
    plain, checkpointed = (trainer.step(samples) for trainer in trainers)
    assert calls[1][0] == 2 * calls[0][0] > 0  # every micro-batch's layer ran again in the backward
    assert checkpointed.loss == pytest.approx(plain.loss, abs=1e-6)
    for a, b in zip(trainers[0].lora_parameters, trainers[1].lora_parameters, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
