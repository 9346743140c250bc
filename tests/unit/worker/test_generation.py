"""The transformers generation backend (worker/generate/transformers_backend.py) on the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from tests.support.fixtures_model import random_adapter
from worker.generate.backend import GenerationBackend, UnknownAdapter
from worker.generate.transformers_backend import TransformersBackend

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["7=", "3=", "12="]


@pytest.fixture
def backend(tiny_model_dir: Path) -> TransformersBackend:
    return TransformersBackend(str(tiny_model_dir))


def sample(backend: TransformersBackend, adapter: str | None, **overrides: object) -> list[tuple]:
    options = {"samples_per_prompt": 6, "max_completion_length": 8, "temperature": 1.0, "top_p": 1.0, "seed": 11}
    options.update(overrides)
    result = backend.generate(PROMPTS, adapter=adapter, **options)
    return [(c.token_ids, c.logprobs) for r in result.results for c in r.completions]


def test_implements_the_backend_protocol(backend: TransformersBackend) -> None:
    assert isinstance(backend, GenerationBackend)


def test_seeded_sampling_is_reproducible(backend: TransformersBackend) -> None:
    assert sample(backend, None) == sample(backend, None)
    assert sample(backend, None) != sample(backend, None, seed=12)


def test_completions_stop_at_eos_or_length(backend: TransformersBackend) -> None:
    eos = backend.eos_token_id
    result = backend.generate(
        PROMPTS, adapter=None, samples_per_prompt=16, max_completion_length=6, temperature=1.0, top_p=1.0, seed=0
    )
    assert [r.prompt for r in result.results] == PROMPTS
    reasons = set()
    for prompt_result in result.results:
        assert len(prompt_result.completions) == 16
        for completion in prompt_result.completions:
            reasons.add(completion.finish_reason)
            assert len(completion.token_ids) == len(completion.logprobs) >= 1
            assert eos not in completion.token_ids[:-1]  # nothing is sampled after EOS
            if completion.finish_reason == "stop":
                assert completion.token_ids[-1] == eos  # EOS is part of the completion
            else:
                assert len(completion.token_ids) == 6
            assert completion.text == backend.policy.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert reasons == {"stop", "length"}
    assert result.timings.completion_tokens == sum(len(c.token_ids) for r in result.results for c in r.completions)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_the_sampling_distribution(backend: TransformersBackend, temperature: float) -> None:
    """Each logprob equals log_softmax(logits / T) of a plain full forward over prompt + completion."""
    result = backend.generate(
        PROMPTS, adapter=None, samples_per_prompt=4, max_completion_length=8, temperature=temperature, top_p=1.0, seed=3
    )
    model = backend.policy.model
    for prompt_result in result.results:
        for completion in prompt_result.completions:
            ids = prompt_result.prompt_token_ids + completion.token_ids
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids])).logits[0].float() / temperature
            start = len(prompt_result.prompt_token_ids)
            log_probs = torch.log_softmax(logits[start - 1 : len(ids) - 1], dim=-1)
            expected = log_probs.gather(1, torch.tensor(completion.token_ids).unsqueeze(1)).squeeze(1)
            torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=2e-5, rtol=0)


def test_tiny_top_p_is_greedy_with_logprob_zero(backend: TransformersBackend) -> None:
    result = backend.generate(
        ["7="], adapter=None, samples_per_prompt=3, max_completion_length=4, temperature=1.0, top_p=1e-6, seed=0
    )
    completions = result.results[0].completions
    assert completions[0].token_ids == completions[1].token_ids == completions[2].token_ids
    assert all(lp == pytest.approx(0.0, abs=1e-6) for c in completions for lp in c.logprobs)
    ids = result.results[0].prompt_token_ids
    with torch.no_grad():
        first = backend.policy.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax().item()
    assert completions[0].token_ids[0] == first


def test_switching_adapters_without_reloading_the_base(tiny_model_dir: Path, tmp_path: Path) -> None:
    first = random_adapter(tiny_model_dir, tmp_path / "v1", seed=1)
    second = random_adapter(tiny_model_dir, tmp_path / "v2", seed=2)
    backend = TransformersBackend(str(tiny_model_dir))
    embedding = backend.policy.model.get_input_embeddings().weight
    base_only = sample(backend, None)

    backend.load_adapter("v1", 1, first)
    backend.load_adapter("v2", 2, second)
    backend.load_adapter("v1", 1, first)  # loading a loaded name again is a no-op
    assert backend.loaded_adapters() == ["v1", "v2"]
    with_first, with_second = sample(backend, "v1"), sample(backend, "v2")
    assert with_first != with_second != base_only
    assert sample(backend, "v1") == with_first  # back to v1 after v2: the same policy
    assert sample(backend, None) == base_only  # adapters switched off: the bare base model
    assert backend.policy.model.get_input_embeddings().weight is embedding  # the base was never reloaded

    # A backend that only ever saw v1 samples the same: no state leaks between adapters.
    fresh = TransformersBackend(str(tiny_model_dir))
    fresh.load_adapter("v1", 1, first)
    assert sample(fresh, "v1") == with_first

    backend.drop_adapter("v1")
    with pytest.raises(UnknownAdapter, match="'v1' is not loaded"):
        sample(backend, "v1")
    assert sample(backend, "v2") == with_second
    backend.drop_adapter("v2")
    backend.drop_adapter("v2")  # dropping an unknown name is a no-op
    assert backend.loaded_adapters() == []
    assert sample(backend, None) == base_only


def test_a_new_version_reuses_a_dropped_adapters_layers_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Eviction then load, as a generate worker's cache does each version: the new weights are copied into
    the dropped adapter's layers, and sample exactly as a backend that loaded them afresh."""
    folders = {v: random_adapter(tiny_model_dir, tmp_path / f"v{v}", seed=v) for v in (1, 2, 3, 4)}
    backend = TransformersBackend(str(tiny_model_dir))
    backend.load_adapter("v1", 1, folders[1])
    backend.load_adapter("v2", 2, folders[2])
    with_second = sample(backend, "v2")
    backend.drop_adapter("v1")
    with capture_logs() as events:
        backend.load_adapter("v3", 3, folders[3])
    assert [e["reused_slot"] for e in events if e["event"] == "generation.adapter_loaded"] == [True]
    backend.drop_adapter("v2")  # the active adapter's slot is freed while v3 is mapped to v1's old one
    backend.load_adapter("v4", 4, folders[4])
    assert backend.loaded_adapters() == ["v3", "v4"]
    for version in (3, 4):
        fresh = TransformersBackend(str(tiny_model_dir))
        fresh.load_adapter(f"v{version}", version, folders[version])
        assert sample(backend, f"v{version}") == sample(fresh, f"v{version}"), f"v{version} differs"
    assert sample(backend, "v4") != with_second, "v2's weights were overwritten, not kept"
    with pytest.raises(UnknownAdapter):
        sample(backend, "v2")


def test_bad_arguments_are_rejected(backend: TransformersBackend, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has no tokens"):
        backend.generate(
            [""], adapter=None, samples_per_prompt=2, max_completion_length=2, temperature=1.0, top_p=1.0, seed=0
        )
    with pytest.raises(ValueError, match="temperature"):
        backend.generate(
            ["1="], adapter=None, samples_per_prompt=2, max_completion_length=2, temperature=-0.5, top_p=1.0, seed=0
        )
    with pytest.raises(FileNotFoundError, match=r"adapter_config\.json is missing"):
        backend.load_adapter("v9", 9, tmp_path)


def test_temperature_zero_is_greedy(backend: TransformersBackend) -> None:
    """Evaluation's default: every sample of a prompt is the argmax path, whatever the seed."""
    results = [
        backend.generate(
            ["1=", "7="],
            adapter=None,
            samples_per_prompt=3,
            max_completion_length=5,
            temperature=0.0,
            top_p=1.0,
            seed=seed,
        )
        for seed in (0, 1)
    ]
    paths = [[c.token_ids for r in result.results for c in r.completions] for result in results]
    assert paths[0] == paths[1]
    for prompt_result in results[0].results:
        assert len({tuple(c.token_ids) for c in prompt_result.completions}) == 1
    assert all(lp <= 0.0 for c in results[0].results[0].completions for lp in c.logprobs)
