"""Partial rollouts (``async.partial_rollouts``): a task's sequences so far are saved between two decode steps
and a later task continues them from their token ids, each token keeping its logprob and version
(worker/generate: transformers_backend, partial), on the tiny model and a file bucket."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import open_bucket
from asyncgrpo.protocol.schemas import GroupRef
from asyncgrpo.run.config import RunConfig
from tests.support.fixtures_model import random_adapter
from worker.generate.backend import PartialSequence
from worker.generate.inflight import VersionOffers
from worker.generate.partial import (
    Interrupted,
    LeftWindow,
    PartialStore,
    Resumption,
    StaleWatch,
    StopRequest,
    StoredPartial,
    TaskCheckpoints,
    decode_partial,
    resume,
    unfit_reason,
)
from worker.generate.transformers_backend import TransformersBackend

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["7=", "3=", "12="]
SAMPLES = 4
MAX_LEN = 12


class StopAfter:
    """A ``Checkpoints`` that is due at the ``at``-th decode step, keeps what it is handed, and stops there."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.asked = 0
        self.saved: list[list[PartialSequence]] = []

    def due(self) -> bool:
        self.asked += 1
        return self.asked == self.at

    def save(self, sequences: list[PartialSequence]) -> None:
        self.saved.append(sequences)
        raise Interrupted("stop")


@pytest.fixture
def backend(tiny_model_dir: Path, tmp_path: Path) -> TransformersBackend:
    backend = TransformersBackend(str(tiny_model_dir))
    for version in (1, 2):
        backend.load_adapter(f"v{version}", version, random_adapter(tiny_model_dir, tmp_path / f"v{version}", version))
    return backend


def _generate(backend: TransformersBackend, adapter: str, **extra: object):
    return backend.generate(
        PROMPTS,
        adapter=adapter,
        samples_per_prompt=SAMPLES,
        max_completion_length=MAX_LEN,
        temperature=1.0,
        top_p=1.0,
        seed=11,
        **extra,  # type: ignore[arg-type]
    )


def _own_logprobs(
    backend: TransformersBackend, prompt: list[int], tokens: list[int], versions: list[int]
) -> list[float]:
    """Each token's logprob under its own version, from a plain full forward of that version."""
    ids = torch.tensor([prompt + tokens])
    expected = []
    for position, (token, version) in enumerate(zip(tokens, versions, strict=True)):
        with torch.no_grad():
            logits = backend._select(f"v{version}")(input_ids=ids).logits[0].float()
        expected.append(torch.log_softmax(logits[len(prompt) + position - 1], dim=-1)[token].item())
    return expected


def test_a_stopped_sampling_hands_over_every_sequence_so_far_as_sampled(backend: TransformersBackend) -> None:
    whole = _generate(backend, "v1")
    stop = StopAfter(at=3)  # after the third decode step: three tokens each, or fewer where EOS came first
    with pytest.raises(Interrupted):
        _generate(backend, "v1", checkpoints=stop)
    (saved,) = stop.saved
    completions = [c for r in whole.results for c in r.completions]
    assert len(saved) == len(PROMPTS) * SAMPLES
    for sequence, completion in zip(saved, completions, strict=True):
        # The same seed samples the same tokens: what was saved is the start of what the whole call samples.
        assert sequence.token_ids == completion.token_ids[: len(sequence.token_ids)]
        assert sequence.logprobs == pytest.approx(completion.logprobs[: len(sequence.token_ids)], abs=1e-6)
        assert sequence.versions == [1] * len(sequence.token_ids)
        assert 1 <= len(sequence.token_ids) <= 3
        ended = completion.token_ids == sequence.token_ids and completion.finish_reason == "stop"
        assert (sequence.finish_reason == "stop") == ended


def test_a_continued_sequence_keeps_its_tokens_and_samples_on_under_the_new_version(
    backend: TransformersBackend,
) -> None:
    stop = StopAfter(at=4)
    with pytest.raises(Interrupted):
        _generate(backend, "v1", checkpoints=stop)
    saved = stop.saved[0]
    partials = [saved[i * SAMPLES : (i + 1) * SAMPLES] for i in range(len(PROMPTS))]
    partials[2] = [None] * SAMPLES  # one prompt sampled afresh beside the continued ones
    result = _generate(backend, "v2", partials=partials)
    spanning = 0
    for prompt_index, prompt_result in enumerate(result.results):
        for sample, completion in enumerate(prompt_result.completions):
            begun = partials[prompt_index][sample]
            assert len(completion.token_ids) <= MAX_LEN
            if begun is None:
                assert completion.versions is None  # all v2's, the adapter of the call
                versions = [2] * len(completion.token_ids)
            else:
                assert completion.token_ids[: len(begun.token_ids)] == begun.token_ids
                assert completion.logprobs[: len(begun.logprobs)] == begun.logprobs
                assert completion.versions is not None
                versions = completion.versions
                assert versions[: len(begun.token_ids)] == [1] * len(begun.token_ids)
                assert set(versions[len(begun.token_ids) :]) <= {2}
                if begun.finish_reason is not None:
                    assert completion.token_ids == begun.token_ids
                    assert completion.finish_reason == begun.finish_reason
                elif len(completion.token_ids) > len(begun.token_ids):
                    spanning += 1
            own = _own_logprobs(backend, prompt_result.prompt_token_ids, completion.token_ids, versions)
            torch.testing.assert_close(torch.tensor(completion.logprobs), torch.tensor(own), atol=2e-5, rtol=0)
    assert spanning > 0, "some continued sequence must span both versions"


def test_budgets_leave_the_other_rows_samples_as_they_were(backend: TransformersBackend) -> None:
    sequences = [[5, 6, 7], [8, 9], [10]]
    one_budget = backend.generate_from_ids(
        sequences, adapter="v1", max_completion_lengths=[MAX_LEN] * 3, temperature=1.0, seed=3
    )
    budgets = [2, MAX_LEN, 5]
    own_budgets = backend.generate_from_ids(
        sequences, adapter="v1", max_completion_lengths=budgets, temperature=1.0, seed=3
    )
    for whole, cut, budget in zip(one_budget, own_budgets, budgets, strict=True):
        assert cut.token_ids == whole.token_ids[:budget]
        assert cut.logprobs == pytest.approx(whole.logprobs[:budget], abs=1e-6)


def _config(**async_: object) -> RunConfig:
    return RunConfig.model_validate(
        {
            "sampling": {"samples_per_prompt": 2, "max_completion_length": 6},
            "async": {"max_staleness": 1, **async_},
        }
    )


def _stored(versions: list[list[int] | None], prompt_ids: list[int] | None = None) -> StoredPartial:
    return StoredPartial.model_validate(
        {
            "format": 1,
            "run": "r",
            "prompt_index": 3,
            "prompt_token_ids": prompt_ids or [1, 2],
            "task_id": "t-1",
            "worker_id": "gen-1",
            "sequences": [
                None if v is None else {"token_ids": [4] * len(v), "logprobs": [-0.5] * len(v), "versions": v}
                for v in versions
            ],
        }
    )


def test_a_saved_group_is_continued_only_where_it_fits_the_task() -> None:
    config = _config()
    assert unfit_reason(_stored([[4, 5], None]), [1, 2], config, leased_version=5) is None
    assert "tokenizes differently" in (unfit_reason(_stored([[5], None]), [1, 9], config, 5) or "")
    assert "samples_per_prompt" in (unfit_reason(_stored([[5]]), [1, 2], config, 5) or "")
    assert "max_completion_length" in (unfit_reason(_stored([[5] * 7, None]), [1, 2], config, 5) or "")
    assert "newer than the leased" in (unfit_reason(_stored([[6], None]), [1, 2], config, 5) or "")
    assert "no sequence was begun" in (unfit_reason(_stored([None, None]), [1, 2], config, 5) or "")
    # A token older than the leased version's window would be dropped as stale at once (stale_tokens = "drop") ...
    assert "older than the window" in (unfit_reason(_stored([[3, 5], None]), [1, 2], config, 5) or "")
    # ... and is masked out of the loss with "mask", so the group is continued.
    assert unfit_reason(_stored([[3, 5], None]), [1, 2], _config(stale_tokens="mask"), 5) is None


def test_an_unreadable_saved_group_is_named_and_sampled_afresh(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a partial group"):
        decode_partial(b'{"format": 1}')
    with pytest.raises(ValueError, match="must align"):
        decode_partial(
            _stored([[4, 4], None]).model_dump_json().replace('"logprobs":[-0.5,-0.5]', '"logprobs":[-0.5]').encode()
        )
    bucket = open_bucket(f"file://{tmp_path}")
    bucket.put(bucket_keys.partial_key("r", 3), b"not json")
    store = PartialStore(bucket, "r")
    assert store.load(3) is None
    resumed = resume(store, [GroupRef(group_id="g", prompt_index=3)], [[1, 2]], _config(), 5)
    assert not resumed.any and resumed.partials == [[None, None]]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_checkpoints_save_at_the_default_interval_and_at_once_at_a_stop(tmp_path: Path) -> None:
    config = _config()
    every_s = config.async_.partial_save_every_s  # the default operators run
    assert every_s == 10.0
    bucket = open_bucket(f"file://{tmp_path}")
    store = PartialStore(bucket, "r")
    clock, signal = Clock(), StopRequest()
    groups = [GroupRef(group_id="g0", prompt_index=3), GroupRef(group_id="g1", prompt_index=8)]
    checkpoints = TaskCheckpoints(
        store,
        groups=groups,
        prompt_ids=[[1, 2], [1, 3]],
        samples_per_prompt=2,
        task_id="t-1",
        worker_id="gen-1",
        every_s=every_s,
        stop=signal,
        clock=clock,
    )
    clock.now = every_s - 0.01
    assert not checkpoints.due()
    clock.now = every_s
    assert checkpoints.due()
    rows = [
        PartialSequence([4, 5], [-0.1, -0.2], [5, 5]),
        PartialSequence([], [], []),
        PartialSequence([6], [-0.3], [5], "stop"),
        PartialSequence([7], [-0.4], [5]),
    ]
    checkpoints.save(rows)
    assert checkpoints.saves == 1 and not checkpoints.due()
    first = store.load(3)
    assert first is not None and first.sequences[1] is None and first.sequences[0] is not None
    second = store.load(8)
    assert second is not None and second.sequences[0] is not None and second.sequences[0].finish_reason == "stop"

    signal.requested = True  # SIGTERM: due at once, saved, then the task stops
    assert checkpoints.due()
    with pytest.raises(Interrupted):
        checkpoints.save(rows)
    assert checkpoints.saves == 2

    resumed = resume(store, groups, [[1, 2], [1, 3]], config, leased_version=5)
    assert resumed.by_group == {"g0": 2, "g1": 2}
    assert resumed.partials[0][0] == PartialSequence([4, 5], [-0.1, -0.2], [5, 5])
    store.clear([3, 8])
    assert store.load(3) is None and store.load(8) is None


def test_a_version_past_the_window_of_the_oldest_token_stops_the_task_unsaved(tmp_path: Path) -> None:
    """max_staleness 1, oldest token v4: v5 heard keeps the task going; v6 makes it due at once (long before the
    save interval) and its save stores nothing and raises ``LeftWindow``, a hand-back, even at a stop request."""
    offers = VersionOffers()
    watch = StaleWatch(lambda: offers.published("r"), oldest_version=4, max_staleness=1)
    store = PartialStore(open_bucket(f"file://{tmp_path}"), "r")
    stop = StopRequest()
    checkpoints = TaskCheckpoints(
        store,
        groups=[GroupRef(group_id="g0", prompt_index=3)],
        prompt_ids=[[1, 2]],
        samples_per_prompt=1,
        task_id="t-1",
        worker_id="gen-1",
        every_s=10.0,
        stop=stop,
        watch=watch,
        clock=Clock(),
    )
    assert watch.left() is None and not checkpoints.due(), "no version heard yet"
    offers.heard("r", 5)
    offers.heard("other-run", 9)
    assert watch.left() is None and not checkpoints.due(), "v5 - v4 <= max_staleness"
    offers.heard("r", 6)
    offers.heard("r", 3)  # an older answer never moves it back
    assert offers.published("r") == 6 and watch.left() == 6 and checkpoints.due()
    stop.requested = True
    with capture_logs() as events, pytest.raises(LeftWindow, match="v6 was published") as raised:
        checkpoints.save([PartialSequence([4, 5], [-0.1, -0.2], [4, 4])])
    assert isinstance(raised.value, Interrupted), "handed back like a stop"
    (stopped,) = [e for e in events if e["event"] == "generate.task_left_window"]
    assert (stopped["published"], stopped["oldest_version"], stopped["tokens"]) == (6, 4, 2), "the tokens lost"
    assert checkpoints.saves == 0 and store.load(3) is None


def test_the_oldest_token_of_a_task_counts_its_continued_sequences() -> None:
    old = PartialSequence([4, 5], [-0.1, -0.2], [3, 4])
    assert Resumption([[None, None]], {}, 0).oldest_version(7) == 7
    assert Resumption([[old, None], [None, None]], {"g0": 2}, 0).oldest_version(7) == 3
    newer_than_lease = PartialSequence([4], [-0.1], [9])  # never continued (unfit_reason), never lowers it
    assert Resumption([[newer_than_lease]], {"g0": 1}, 0).oldest_version(7) == 7
