"""In-flight updates (``async.inflight_versions = "follow"``): a sequence moved onto newer versions between two
decode steps records the version and the logprob of each token (worker/generate: transformers_backend, inflight),
and the trainer checks each segment under its own version (worker/optimize: batch, rescore), on the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncgrpo.bucket.backends import open_bucket
from asyncgrpo.protocol.schemas import GroupRef
from asyncgrpo.run.config import RunConfig
from tests.support.fixtures_model import random_adapter
from worker.algo.rollout import Rollout
from worker.generate.adapter_cache import AdapterCache
from worker.generate.backend import Completion, VersionSource
from worker.generate.inflight import Follower, StagedVersion, VersionOffers
from worker.generate.transformers_backend import TransformersBackend
from worker.model.policy import Policy
from worker.optimize.batch import TrainSample
from worker.optimize.rescore import RecentAdapterWeights, plan_rescoring, rescore_planned
from worker.optimize.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["7=", "3=", "12="]  # of different lengths: rows are left-padded


class Schedule:
    """A ``VersionSource`` that offers the given version at the given call (one call between two decode steps)."""

    def __init__(self, offers: dict[int, tuple[str, int]]) -> None:
        self.offers = offers
        self.calls = 0

    def newer(self, version: int) -> tuple[str, int] | None:
        self.calls += 1
        found = self.offers.get(self.calls)
        return found if found is not None and found[1] > version else None


@pytest.fixture
def backend(tiny_model_dir: Path, tmp_path: Path) -> TransformersBackend:
    backend = TransformersBackend(str(tiny_model_dir))
    for version in (1, 2, 3):
        backend.load_adapter(f"v{version}", version, random_adapter(tiny_model_dir, tmp_path / f"v{version}", version))
    return backend


def _sample(backend: TransformersBackend, follow: VersionSource | None, **overrides: object) -> list[Completion]:
    options = {"samples_per_prompt": 6, "max_completion_length": 8, "temperature": 1.0, "top_p": 1.0, "seed": 5}
    options.update(overrides)
    result = backend.generate(PROMPTS, adapter="v1", **options, follow=follow)  # type: ignore[arg-type]
    return [c for r in result.results for c in r.completions]


def _own_logprobs(
    backend: TransformersBackend, prompt: list[int], tokens: list[int], versions: list[int] | None, temperature: float
) -> list[float]:
    """Each token's logprob under its version (None: all v1's), from a plain full forward of that version."""
    ids = torch.tensor([prompt + tokens])
    expected = []
    for position, (token, version) in enumerate(zip(tokens, versions or [1] * len(tokens), strict=True)):
        with torch.no_grad():
            logits = backend._select(f"v{version}")(input_ids=ids).logits[0].float() / temperature
        expected.append(torch.log_softmax(logits[len(prompt) + position - 1], dim=-1)[token].item())
    return expected


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_sequence_that_follows_new_versions_records_each_tokens_version_and_logprob(
    backend: TransformersBackend, temperature: float
) -> None:
    # v2 after the second token, v3 after the fourth.
    result = backend.generate(
        PROMPTS,
        adapter="v1",
        samples_per_prompt=6,
        max_completion_length=8,
        temperature=temperature,
        top_p=1.0,
        seed=5,
        follow=Schedule({2: ("v2", 2), 4: ("v3", 3)}),
    )
    spans = set()
    for prompt_result in result.results:
        for completion in prompt_result.completions:
            length = len(completion.token_ids)
            expected_versions = [1, 1, 2, 2, 3, 3, 3, 3][:length]
            if length > 2:
                assert completion.versions == expected_versions
                spans.add(len(set(expected_versions)))
            else:
                assert completion.versions is None  # ended before the first switch: all v1's
            own = _own_logprobs(
                backend, prompt_result.prompt_token_ids, completion.token_ids, completion.versions, temperature
            )
            torch.testing.assert_close(torch.tensor(completion.logprobs), torch.tensor(own), atol=2e-5, rtol=0)
    assert 3 in spans, "some sequence must span three versions"


def test_logprobs_after_a_switch_are_not_the_old_versions(backend: TransformersBackend) -> None:
    """The check above could pass if the switch changed nothing: the tokens after it differ from v1's own."""
    completions = _sample(backend, Schedule({1: ("v2", 2)}))
    followed = [c for c in completions if c.versions is not None]
    assert followed
    gaps = []
    for prompt_ids, completion in zip([p for p in PROMPTS for _ in range(6)], completions, strict=True):
        if completion.versions is None:
            continue
        ids = backend.tokenize([prompt_ids])[0]
        as_v1 = _own_logprobs(backend, ids, completion.token_ids, None, 1.0)
        gaps += [abs(a - b) for a, b in zip(as_v1[1:], completion.logprobs[1:], strict=True)]
    assert max(gaps) > 0.05


def test_a_source_that_never_offers_samples_exactly_as_keeping_the_version(backend: TransformersBackend) -> None:
    kept = _sample(backend, None)
    followed = _sample(backend, Schedule({}))
    assert [(c.token_ids, c.logprobs) for c in followed] == [(c.token_ids, c.logprobs) for c in kept]
    assert all(c.versions is None for c in kept + followed)


def test_the_follower_loads_the_prefetchers_offer_on_the_sampling_thread(tiny_model_dir: Path, tmp_path: Path) -> None:
    backend = TransformersBackend(str(tiny_model_dir))
    cache = AdapterCache(open_bucket(f"file://{tmp_path / 'bucket'}"), "r", tmp_path / "cache", 4, backend)
    first = cache.get(1, "sha-1", staged=random_adapter(tiny_model_dir, tmp_path / "staged-1", 1))
    backend.load_adapter("v1", 1, first)
    offers = VersionOffers()
    follower = Follower("r", cache, backend, offers)
    assert follower.newer(1) is None  # nothing newer yet

    staged = StagedVersion("r", 2, "sha-2", random_adapter(tiny_model_dir, tmp_path / "staged-2", 2))
    offers.offer(StagedVersion("other-run", 5, "sha", tmp_path / "nowhere"))  # another run's: never taken
    offers.offer(staged)
    offers.offer(StagedVersion("r", 1, "sha-1", tmp_path / "old"))  # older than the offer in place: ignored
    assert follower.newer(2) is None, "not newer than the version sampling now"
    assert follower.newer(1) == ("v2", 2)
    assert backend.loaded_adapters() == ["v1", "v2"] and cache.versions() == [1, 2]
    assert not staged.path.exists(), "moved into the cache, not copied"
    assert offers.withdraw(staged) is False, "taken: the prefetcher must not load it again"
    assert follower.newer(2) is None and follower.switches == 1

    # The completions of a generate call that takes the offer between two decode steps.
    third = StagedVersion("r", 3, "sha-3", random_adapter(tiny_model_dir, tmp_path / "staged-3", 3))
    offers.offer(third)
    result = backend.generate(
        ["7="], adapter="v2", samples_per_prompt=8, max_completion_length=6, temperature=1.0, seed=1, follow=follower
    )
    followed = [c.versions for c in result.results[0].completions if c.versions is not None]
    assert followed and all(versions[0] == 2 and set(versions[1:]) == {3} for versions in followed)
    assert offers.withdraw(third) is False


# ---- the optimize side: each segment under its own version ----


def _trainer_with_two_versions(model: Path) -> tuple[Trainer, list[torch.Tensor]]:
    """A trainer at "version 1" (its LoRA moved off the initial one) and version 0's LoRA values."""
    config = RunConfig.model_validate({"optimizer": {"max_grad_norm": 1e6}})
    trainer = Trainer.initial(Policy.load(str(model)), config)
    v0 = [parameter.detach().clone() for parameter in trainer.lora_parameters]
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in trainer.lora_parameters:
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 2.0)
    return trainer, v0


def _mixed_samples(trainer: Trainer, v0: list[torch.Tensor]) -> list[TrainSample]:
    """Sequences whose first tokens version 0 sampled and the rest version 1, with each token's own logprob."""
    vocab = trainer.policy.tokenizer.get_vocab()
    digits = [vocab[d] for d in "0123456789"]
    samples = []
    for index in range(4):
        completion = [digits[(index + k) % 10] for k in range(6)]
        versions = [0] * (2 + index % 2) + [1] * (4 - index % 2)
        samples.append(TrainSample([digits[index], vocab["="]], completion, [0.0] * 6, 1.0, token_versions=versions))
    under_v0 = trainer.rescore(samples, lora_values=v0)
    under_v1 = trainer.rescore(samples)
    for sample, old, new in zip(samples, under_v0, under_v1, strict=True):
        assert sample.token_versions is not None
        sample.behavior_logprobs = [o if v == 0 else n for o, n, v in zip(old, new, sample.token_versions, strict=True)]
    return samples


def test_rescoring_a_sequence_of_two_versions_checks_each_segment_under_its_own(tiny_model_dir: Path) -> None:
    trainer, v0 = _trainer_with_two_versions(tiny_model_dir)
    samples = _mixed_samples(trainer, v0)
    rollout = Rollout("r", "t", 0, "gen", [GroupRef(group_id="t.0", prompt_index=0)], [])
    recent = RecentAdapterWeights()
    recent.remember("r", 0, v0)

    # Never reused from the training forward (that is version 1's alone); each segment under its version.
    plan = plan_rescoring(
        trainer, [rollout], [0] * 4, base_version=1, first_update=range(4), fraction=1.0, seed=0, samples=samples
    )
    assert plan.reused == [] and plan.separate == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}
    sums = rescore_planned(trainer, None, "r", 1, [rollout], samples, plan, recent=recent)  # type: ignore[arg-type]
    for index, sample in enumerate(samples):
        assert sums[index][0] / sample.model_tokens == pytest.approx(1.0, abs=1e-5)
        assert sums[index][1] == pytest.approx(0.0, abs=1e-5)

    # The corrected path: each token's PPO denominator is its own version's logprob.
    for sample in samples:
        sample.corrected = True
    rescore_planned(trainer, None, "r", 1, [rollout], samples, plan, recent=recent)  # type: ignore[arg-type]
    for sample in samples:
        assert sample.old_logprobs == pytest.approx(sample.behavior_logprobs, abs=1e-5)

    # Segments claimed by the wrong versions drift: the check can fail.
    for sample in samples:
        sample.corrected, sample.old_logprobs = False, None
        assert sample.token_versions is not None
        sample.token_versions = [1 - v for v in sample.token_versions]
    swapped = rescore_planned(trainer, None, "r", 1, [rollout], samples, plan, recent=recent)  # type: ignore[arg-type]
    assert all(abs(swapped[i][1] / s.model_tokens) > 0.02 for i, s in enumerate(samples))  # the right ones: < 1e-5


def test_a_train_sample_knows_its_versions_oldest_first() -> None:
    sample = TrainSample([1], [2, 3, 4, 5], [0.0] * 4, 1.0, version=3, token_versions=[3, 5, 4, 5])
    assert sample.versions() == [3, 4, 5] and sample.oldest_version() == 3
    assert sample.segment(5).model_flags() == [False, True, False, True]
    tool = TrainSample([1], [2, 3], [0.0] * 2, 1.0, version=3, token_versions=[3, 4], completion_mask=[True, False])
    assert tool.versions() == [3], "a tool token's version is never checked: it has no behaviour logprob"
    assert TrainSample([1], [2], [0.0], 1.0, version=7).versions() == [7]
    with pytest.raises(ValueError, match="2 completion tokens but 1 token versions"):
        TrainSample([1], [2, 3], [0.0] * 2, 1.0, token_versions=[1])
