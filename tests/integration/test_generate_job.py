"""The generate job with real parts (tiny model, FileBucket, adapter cache) and a recording stand-in for the
proxy: the typed messages it sends (lease request, submission) match the rollout header it wrote, bad prompts
are rejected with their reason, and a redelivered task resubmits the same rollout without a new lease."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, open_bucket
from asyncgrpo.bucket.layout import write_version
from asyncgrpo.protocol.client import process_incarnation
from asyncgrpo.protocol.schemas import (
    GroupRef,
    LeaseGrant,
    LeaseRequest,
    ReleaseResult,
    RolloutSubmission,
    SubmitResult,
)
from asyncgrpo.run.config import RunConfig
from worker.algo.math_scoring import MathVerifier
from worker.algo.rewards import RewardError
from worker.algo.rollout import decode_rollout, read_rollout_header
from worker.generate.adapter_cache import AdapterCache
from worker.generate.inflight import VersionOffers
from worker.generate.job import GenerateResult, GenerateTask
from worker.generate.partial import Interrupted, LeftWindow, PartialStore, StopRequest
from worker.generate.task_context import TaskContext
from worker.generate.transformers_backend import TransformersBackend
from worker.model.policy import Policy
from worker.optimize.trainer import Trainer

RUN = "gen-job"
TASK = "gen-gen-job-0-00000001"
PROMPTS: list[dict[str, str | None]] = [
    {"prompt": "3=", "answer": "3"},
    {"prompt": "7=", "answer": "7"},
    {"prompt": "1" * 40 + "=", "answer": "1"},
]


@dataclass
class RecordingProxy:
    """Stands in for ProxyClient: grants leases on version 0 and admits every submission."""

    manifest_sha256: str
    version: int = 0
    leases: list[LeaseRequest] = field(default_factory=list)
    submissions: list[RolloutSubmission] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)

    def lease(self, request: LeaseRequest) -> LeaseGrant:
        self.leases.append(request)
        return LeaseGrant(
            lease_id="lease-1",
            version=self.version,
            adapter_prefix=bucket_keys.adapter_prefix(RUN, self.version),
            manifest_key=bucket_keys.manifest_key(RUN, self.version),
            manifest_sha256=self.manifest_sha256,
            ttl_s=60.0,
            expires_at=0.0,
        )

    def renew(self, lease_id: str) -> LeaseGrant:
        raise AssertionError(f"a 60 s lease ({lease_id}) needs no renewal in this test")

    def release(self, lease_id: str) -> ReleaseResult:
        self.releases.append(lease_id)
        return ReleaseResult(released=True)

    def submit_rollout(self, submission: RolloutSubmission) -> SubmitResult:
        status = "duplicate" if any(s.task_id == submission.task_id for s in self.submissions) else "admitted"
        self.submissions.append(submission)
        return SubmitResult(status=status)


def config(reward: str = "repeat_digit") -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {"max_prompt_length": 8},
            "dataset": {"answer_column": "answer"},
            "sampling": {"samples_per_prompt": 2, "max_completion_length": 4},
            "rewards": [{"name": reward}],
        }
    )


@pytest.fixture
def bucket_with_v0(tiny_model_dir: Path, tmp_path: Path, one_torch_thread: None) -> tuple[Bucket, str]:
    bucket = open_bucket(f"file://{tmp_path / 'bucket'}")
    trainer = Trainer.initial(Policy.load(str(tiny_model_dir)), config())
    _, manifest_sha = write_version(bucket, RUN, 0, trainer.version_files(0), {"step": 0, "base_version": -1})
    return bucket, manifest_sha


def job_context(
    run_config: RunConfig,
    bucket: Bucket,
    proxy: RecordingProxy,
    backend: TransformersBackend,
    cache_dir: Path,
    worker: str = "gen-1",
    **parts: Any,
) -> TaskContext:
    """A generate task's parts as a worker has them, with the recording proxy (``parts``: the optional ones)."""
    return TaskContext(
        run=RUN,
        config=run_config,
        prompts=PROMPTS,
        bucket=bucket,
        client=proxy,
        backend=backend,
        adapter_cache=AdapterCache(bucket, RUN, cache_dir, capacity=2),
        worker_id=worker,
        **parts,
    )


def test_generate_sends_typed_messages_that_match_its_rollout(
    bucket_with_v0: tuple[Bucket, str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    bucket, manifest_sha = bucket_with_v0
    proxy = RecordingProxy(manifest_sha256=manifest_sha)
    groups = [
        GroupRef(group_id=f"{TASK}.0", prompt_index=0),
        GroupRef(group_id=f"{TASK}.1", prompt_index=2),  # too long for max_prompt_length
        GroupRef(group_id=f"{TASK}.2", prompt_index=9),  # no such prompt
        GroupRef(group_id=f"{TASK}.3", prompt_index=1),
    ]

    def generate() -> GenerateResult:
        context = job_context(config(), bucket, proxy, TransformersBackend(str(tiny_model_dir)), tmp_path / "cache")
        return GenerateTask(context, TASK, groups).run()

    first = generate()
    assert first.status == "admitted" and not first.reused_rollout
    assert first.groups == 2 and first.samples == 4 and first.timings.task_s is not None
    assert proxy.leases == [LeaseRequest(worker_id="gen-1", task_id=TASK, incarnation=process_incarnation())]

    submitted = proxy.submissions[0]
    data = bucket.get(submitted.key)
    header = read_rollout_header(data)
    assert submitted.key == bucket_keys.rollout_key(RUN, TASK) and submitted.version == header.version == 0
    assert header.groups == [groups[0], groups[3]]
    assert submitted.group_ids == [group.group_id for group in header.groups]
    assert header.extra.rejected_groups == submitted.rejected_groups
    reasons = {rejected.group_id: rejected.reason for rejected in submitted.rejected_groups}
    assert "max_prompt_length=8" in reasons[f"{TASK}.1"] and "out of range" in reasons[f"{TASK}.2"]
    assert header.timings.generate_s is not None and header.timings.task_s is None
    rollout = decode_rollout(data)
    assert rollout.groups == header.groups and len(rollout.samples) == submitted.num_samples == 4

    again = generate()  # a redelivery: the rollout is in the bucket, so no lease and no sampling
    assert again.status == "duplicate" and again.reused_rollout and len(proxy.leases) == 1
    resubmitted = proxy.submissions[1]
    fields = ("task_id", "version", "key", "sha256", "group_ids", "num_samples", "rejected_groups")
    assert resubmitted.model_dump(include=set(fields)) == submitted.model_dump(include=set(fields))


@pytest.mark.processes
def test_math_verify_scores_with_the_verifier_of_the_tasks_context(
    bucket_with_v0: tuple[Bucket, str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    pytest.importorskip("math_verify")
    bucket, manifest_sha = bucket_with_v0
    backend = TransformersBackend(str(tiny_model_dir))
    groups = [GroupRef(group_id=f"{TASK}.0", prompt_index=0), GroupRef(group_id=f"{TASK}.1", prompt_index=1)]

    def generate(task: str, verifier: MathVerifier | None) -> GenerateResult:
        proxy = RecordingProxy(manifest_sha256=manifest_sha)
        context = job_context(config("math_verify"), bucket, proxy, backend, tmp_path / "cache", math_verifier=verifier)
        return GenerateTask(context, task, groups).run()

    with pytest.raises(RewardError, match="'math_verify' needs a MathVerifier"):
        generate(f"{TASK}-no-verifier", None)  # no hidden process-wide helper to fall back on
    verifier = MathVerifier()
    try:
        result = generate(TASK, verifier)
        assert result.status == "admitted" and result.groups == 2 and result.samples == 4
        assert verifier.pid is not None  # the context's helper scored them
    finally:
        verifier.close()


class StopAtCall(StopRequest):
    """A ``StopRequest`` whose stop is requested from its ``at``-th read on (one read per decode step)."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.reads = 0
        super().__init__()

    @property  # type: ignore[override]
    def requested(self) -> bool:
        self.reads += 1
        return self.reads >= self.at

    @requested.setter
    def requested(self, value: bool) -> None:
        """The worker's handler would set it; here the reads decide."""


def test_an_interrupted_task_saves_its_sequences_and_the_next_one_continues_them(
    tiny_model_dir: Path, tmp_path: Path, one_torch_thread: None
) -> None:
    """Stopped on v0 after a few decode steps (a SIGTERM), the task saves its sequences and goes back to its
    queue; another worker leases it on v1 and continues them: the rollout holds the saved tokens as they were
    (their version v0, older than the lease, is what the proxy checks), and the saved objects are deleted."""
    run_config = RunConfig.model_validate(
        {
            "dataset": {"answer_column": "answer"},
            "sampling": {"samples_per_prompt": 3, "max_completion_length": 16},
            "rewards": [{"name": "repeat_digit"}],
        }
    )
    bucket = open_bucket(f"file://{tmp_path / 'bucket'}")
    trainer = Trainer.initial(Policy.load(str(tiny_model_dir)), run_config)
    shas = [
        write_version(bucket, RUN, v, trainer.version_files(v), {"step": v, "base_version": v - 1})[1] for v in (0, 1)
    ]
    backend = TransformersBackend(str(tiny_model_dir))
    groups = [GroupRef(group_id=f"{TASK}.0", prompt_index=0), GroupRef(group_id=f"{TASK}.1", prompt_index=1)]

    def task(worker: str, version: int, proxy: RecordingProxy, stop: StopAtCall | None) -> GenerateTask:
        context = job_context(run_config, bucket, proxy, backend, tmp_path / f"cache-{worker}", worker, stop=stop)
        return GenerateTask(context, TASK, groups)

    first_proxy = RecordingProxy(manifest_sha256=shas[0])
    with pytest.raises(Interrupted):
        task("gen-1", 0, first_proxy, StopAtCall(at=4)).run()
    assert first_proxy.submissions == [] and first_proxy.releases == ["lease-1"], "the lease is let go at once"
    assert bucket.head(bucket_keys.rollout_key(RUN, TASK)) is None
    saved = {g.prompt_index: PartialStore(bucket, RUN).load(g.prompt_index) for g in groups}
    assert all(partial is not None and partial.task_id == TASK for partial in saved.values())
    saved_tokens = sum(len(s.token_ids) for p in saved.values() for s in p.sequences if s is not None)  # type: ignore[union-attr]
    assert saved_tokens > 0

    second_proxy = RecordingProxy(manifest_sha256=shas[1], version=1)
    result = task("gen-2", 1, second_proxy, None).run()
    assert result.status == "admitted" and result.tokens_resumed == saved_tokens
    (submitted,) = second_proxy.submissions
    header = read_rollout_header(bucket.get(submitted.key))
    assert (submitted.version, submitted.oldest_version) == (1, 0)
    assert (header.version, header.oldest_version, header.extra.resumed_tokens) == (1, 0, saved_tokens)
    rollout = decode_rollout(bucket.get(submitted.key))
    for sample in rollout.samples:
        begun = saved[header.groups[sample.group_index].prompt_index].sequences  # type: ignore[union-attr]
        sequence = begun[rollout.samples.index(sample) % 3]
        assert sequence is not None, "every sequence was begun before the stop"
        length = len(sequence.token_ids)
        assert sample.completion_token_ids[:length] == sequence.token_ids
        assert sample.behavior_logprobs[:length] == pytest.approx(sequence.logprobs, abs=1e-6)
        versions = sample.token_versions or [1] * len(sample.completion_token_ids)
        assert versions == [0] * length + [1] * (len(sample.completion_token_ids) - length)
    assert all(PartialStore(bucket, RUN).load(g.prompt_index) is None for g in groups), "deleted once written"

    # A saved group that does not fit (its prompt tokenized otherwise) is sampled afresh, and deleted with the
    # rollout: else every later task of the prompt would read it and discard it again.
    store = PartialStore(bucket, RUN)
    store.save(saved[0].model_copy(update={"prompt_token_ids": [1, 2, 3]}))  # type: ignore[union-attr]
    bucket.delete(bucket_keys.rollout_key(RUN, TASK))
    third_proxy = RecordingProxy(manifest_sha256=shas[1], version=1)
    result = task("gen-3", 1, third_proxy, None).run()
    assert (result.status, result.tokens_resumed, result.partials_discarded) == ("admitted", 0, 1)
    assert store.load(0) is None, "the discarded group is deleted once the rollout is written"


class PublishedAtRead(VersionOffers):
    """``VersionOffers`` whose prefetcher hears of ``version`` from its ``at``-th read on (one read per decode
    step of a task that watches the window)."""

    def __init__(self, version: int, at: int) -> None:
        super().__init__()
        self.version = version
        self.at = at
        self.reads = 0

    def published(self, run: str) -> int | None:
        self.reads += 1
        return self.version if self.reads >= self.at else None


@pytest.mark.parametrize(
    ("stale_tokens", "published", "partials", "stops"),
    [("drop", 2, True, True), ("drop", 2, False, True), ("drop", 1, True, False), ("mask", 2, True, False)],
    ids=["out-of-the-window", "out-of-the-window-no-partial-rollouts", "within-the-window", "masked"],
)
def test_a_task_whose_rollout_leaves_the_window_stops_and_goes_back_unsaved(
    tiny_model_dir: Path,
    tmp_path: Path,
    one_torch_thread: None,
    stale_tokens: str,
    published: int,
    partials: bool,
    stops: bool,
) -> None:
    """Leased on v0 with max_staleness 1, the task hears of ``published`` after a few decode steps. With
    ``stale_tokens = "drop"`` and v2 its rollout would be refused: it stops at once, saves nothing (those
    tokens could not be continued), lets its lease go and goes back to its queue, with partial rollouts off too.
    v1 is still in the window, and under "mask" old tokens are masked rather than refused: both tasks finish."""
    run_config = RunConfig.model_validate(
        {
            "dataset": {"answer_column": "answer"},
            "sampling": {"samples_per_prompt": 2, "max_completion_length": 16},
            "rewards": [{"name": "repeat_digit"}],
            "async": {"max_staleness": 1, "stale_tokens": stale_tokens, "partial_rollouts": partials},
        }
    )
    bucket = open_bucket(f"file://{tmp_path / 'bucket'}")
    trainer = Trainer.initial(Policy.load(str(tiny_model_dir)), run_config)
    _, sha = write_version(bucket, RUN, 0, trainer.version_files(0), {"step": 0, "base_version": -1})
    groups = [GroupRef(group_id=f"{TASK}.0", prompt_index=0)]
    offers = PublishedAtRead(published, at=3)
    proxy = RecordingProxy(manifest_sha256=sha)
    backend = TransformersBackend(str(tiny_model_dir))
    context = job_context(run_config, bucket, proxy, backend, tmp_path / "cache", version_offers=offers)
    task = GenerateTask(context, TASK, groups)
    if not stops:
        assert task.run().status == "admitted"
        assert len(proxy.submissions) == 1
        # under "drop" the window was watched at every decode step and held; under "mask" it is not watched
        assert (offers.reads >= 3) == (stale_tokens == "drop"), offers.reads
        return
    with pytest.raises(LeftWindow, match="v2 was published"):
        task.run()
    assert isinstance(LeftWindow("x"), Interrupted), "handed back to the queue like a stop"
    assert proxy.submissions == [] and proxy.releases == ["lease-1"], "the lease is let go at once"
    assert bucket.head(bucket_keys.rollout_key(RUN, TASK)) is None
    assert PartialStore(bucket, RUN).load(0) is None, "nothing saved: its tokens would be discarded"
