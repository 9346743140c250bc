"""The policy's attention implementation (worker/model/policy.py), on the tiny model, on CPU."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from worker.model.policy import Policy

IDS = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11], [1, 1, 5, 5, 7, 3, 4, 9, 10]])
MASK = torch.tensor([[1] * 9, [0, 0] + [1] * 7])  # the second row left-padded, as prompts are


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
