"""Per-group poison inside a generate task (invariant 9): a reward that raises or returns NaN, and a prompt that
tokenizes to nothing, reject that group only; the rest is scored as usual. Real tiny model and backend."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from asyncgrpo.protocol.schemas import GroupRef
from asyncgrpo.run.config import RunConfig
from tests.support.poison_rewards import NAN_DIGIT, RAISE_DIGIT
from worker.generate.backend import fed_prompts
from worker.generate.job import _score, _split_bad_prompts
from worker.generate.transformers_backend import TransformersBackend
from worker.process.tasks import failure_reason

SAMPLES = 4


@pytest.fixture
def backend(tiny_model_dir: Path) -> TransformersBackend:
    return TransformersBackend(str(tiny_model_dir))


def config(reward: str) -> RunConfig:
    return RunConfig.model_validate(
        {"rewards": [{"name": "repeat_digit"}, {"name": reward}], "sampling": {"samples_per_prompt": SAMPLES}}
    )


@pytest.mark.parametrize(
    ("reward", "poison", "reason"),
    [
        ("tests.support.poison_rewards:nan_on_3", NAN_DIGIT, "reward_not_finite"),
        (
            "tests.support.poison_rewards:raise_on_5",
            RAISE_DIGIT,
            "reward_error_tests.support.poison_rewards:raise_on_5",
        ),
    ],
)
def test_a_reward_failing_on_one_group_rejects_that_group_only(
    backend: TransformersBackend, reward: str, poison: str, reason: str
) -> None:
    texts = ["7=", f"{poison}=", "1="]
    groups = [GroupRef(group_id=f"t.{i}", prompt_index=i) for i in range(3)]
    result = backend.generate(
        texts, adapter=None, samples_per_prompt=SAMPLES, max_completion_length=4, temperature=1.0, top_p=1.0, seed=1
    )
    kept, samples, tokens, rejected = _score(result, groups, texts, ["7", poison, "1"], config(reward))
    assert [g.group_id for g in kept] == ["t.0", "t.2"]
    assert [(r.group_id, r.reason) for r in rejected] == [("t.1", reason)]
    assert len(samples) == 2 * SAMPLES and tokens > 0
    # Samples point at the groups the rollout keeps, and every reward and advantage is finite.
    assert [s.group_index for s in samples] == [0] * SAMPLES + [1] * SAMPLES
    assert all(math.isfinite(s.reward) and math.isfinite(s.advantage) for s in samples)
    assert samples[SAMPLES].prompt_token_ids == result.results[2].prompt_token_ids


def test_a_prompt_that_tokenizes_to_nothing_is_rejected(backend: TransformersBackend) -> None:
    prompts = [{"prompt": "7="}, {"prompt": ""}]
    groups = [GroupRef(group_id=f"t.{i}", prompt_index=i) for i in range(2)]
    assert backend.tokenize([""]) == [[]], "the tiny tokenizer adds no special token"
    fed = fed_prompts(prompts, range(2), config("format").dataset, backend.tokenizer)
    accepted, rejected = _split_bad_prompts(groups, fed, backend, config("format"))
    assert [g.group_id for g in accepted] == ["t.0"]
    assert [(r.group_id, r.reason) for r in rejected] == [("t.1", "empty_prompt")]


def test_failure_reason_names_the_exception() -> None:
    assert failure_reason(ZeroDivisionError("x")) == "task_error_ZeroDivisionError"
