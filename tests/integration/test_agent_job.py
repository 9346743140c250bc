"""The generate and eval jobs of an [agent] run with real parts (the tiny agent model, a real tool process,
FileBucket, the adapter cache) and recording stand-ins for the proxy: the rollout holds each conversation with its
mask and its own prompt, the header holds turns and tool calls, each environment's reward is a reward named after
it, a group whose environment fails to start is rejected with the reason while the task goes on, a tool process
that dies takes only the groups it held with it, and an evaluation runs the same conversations. ``run create``'s
checks of tools, templates and environment names."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, open_bucket
from asyncgrpo.bucket.layout import write_version
from asyncgrpo.protocol.evals import EvalLeaseGrant, EvalResultAnswer, EvalResultRequest
from asyncgrpo.protocol.schemas import GroupRef
from asyncgrpo.run.config import ConfigError, RunConfig
from asyncgrpo.run.creation import create_run
from tests.integration.test_generate_job import RecordingProxy
from worker.algo.rollout import decode_rollout
from worker.generate.adapter_cache import AdapterCache
from worker.generate.agent import AgentRun, AgentSetupError, check_agent_of, tool_process_count
from worker.generate.evals import EvalTask
from worker.generate.job import GenerateResult, GenerateTask
from worker.generate.task_context import TaskContext
from worker.generate.tool_process import ToolSetupError
from worker.generate.transformers_backend import TransformersBackend
from worker.model.policy import Policy
from worker.model.tiny_model import ensure_tiny_model
from worker.optimize.batch import build_train_samples
from worker.optimize.trainer import Trainer

pytestmark = pytest.mark.processes  # a child process per test (see tests/conftest.py)

RUN = "gen-job"  # RecordingProxy's run
TASK = "gen-agent-0-00000001"
PROMPTS = [
    {"prompt": "?=", "answer": "4", "environment": "digit"},
    {"prompt": "explode", "answer": "2", "environment": "count"},  # Counter.reset raises on this prompt
    {"prompt": "?=", "answer": "9", "environment": "digit"},
    {"prompt": "?=", "answer": "3", "environment": "count"},
]


def agent_config() -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {"base": "tiny-agent"},
            "dataset": {"path": "unused.jsonl", "chat_template": True, "environment_column": "environment"},
            "rewards": [{"name": "repeat_digit", "weight": 0.75}],
            "agent": {
                "environment": {
                    "digit": "worker.generate.toy_agent:HiddenDigit",
                    "count": "tests.support.agent_tools:Counter",
                },
                "tool_timeout_s": 10,
            },
            "sampling": {"samples_per_prompt": 4, "max_completion_length": 24},
        }
    )


@pytest.fixture
def agent_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(cache_dir=tmp_path_factory.getbasetemp() / "asyncgrpo-cache", agent=True)


@pytest.fixture
def bucket_with_v0(agent_dir: Path, tmp_path: Path, one_torch_thread: None) -> tuple[Bucket, str]:
    bucket = open_bucket(f"file://{tmp_path / 'bucket'}")
    trainer = Trainer.initial(Policy.load(str(agent_dir)), agent_config())
    _, manifest_sha = write_version(bucket, RUN, 0, trainer.version_files(0), {"step": 0, "base_version": -1})
    return bucket, manifest_sha


@pytest.fixture
def backend(agent_dir: Path) -> TransformersBackend:
    return TransformersBackend(str(agent_dir))


@pytest.fixture
def agent(backend: TransformersBackend) -> Iterator[AgentRun]:
    config = agent_config().agent
    assert config is not None
    run = AgentRun.start(config, backend.tokenizer)
    yield run
    run.close()


def run_agent_task(
    bucket_with_v0: tuple[Bucket, str],
    backend: TransformersBackend,
    agent: AgentRun,
    config: RunConfig,
    prompts: list[dict[str, str]],
    cache: Path,
) -> tuple[GenerateResult, RecordingProxy]:
    """One generate task over every prompt, against a recording proxy that leases version 0."""
    bucket, manifest_sha = bucket_with_v0
    proxy = RecordingProxy(manifest_sha256=manifest_sha)
    context = TaskContext(
        run=RUN,
        config=config,
        prompts=prompts,
        bucket=bucket,
        client=proxy,
        backend=backend,
        adapter_cache=AdapterCache(bucket, RUN, cache, capacity=2),
        worker_id="gen-1",
        agent=agent,
    )
    result = GenerateTask(
        context, TASK, [GroupRef(group_id=f"{TASK}.{i}", prompt_index=i) for i in range(len(prompts))]
    ).run()
    return result, proxy


def test_an_agent_task_writes_conversations_with_masks_stats_and_environment_rewards(
    bucket_with_v0: tuple[Bucket, str], backend: TransformersBackend, agent: AgentRun, tmp_path: Path
) -> None:
    bucket = bucket_with_v0[0]
    result, proxy = run_agent_task(bucket_with_v0, backend, agent, agent_config(), PROMPTS, tmp_path / "cache")
    assert result.status == "admitted"
    submitted = proxy.submissions[0]
    assert [rejected.group_id for rejected in submitted.rejected_groups] == [f"{TASK}.1"]
    assert submitted.rejected_groups[0].reason == "environment_error"  # Counter.reset raised

    rollout = decode_rollout(bucket.get(submitted.key))
    assert [group.prompt_index for group in rollout.groups] == [0, 2, 3]
    stats = rollout.extra.agent
    assert stats is not None and len(stats.turns) == len(rollout.samples) == 12
    tokenizer = backend.tokenizer
    for index, sample in enumerate(rollout.samples):
        # A conversation without a tool answer is all the model's: its mask reads back unset.
        mask = sample.completion_mask or [True] * len(sample.completion_token_ids)
        assert len(mask) == len(sample.completion_token_ids) and mask[0]
        tool_tokens = [t for t, model in zip(sample.completion_token_ids, mask, strict=True) if not model]
        # Answers were appended only after calls, and each turn but the last is followed by one.
        assert bool(tool_tokens) == (stats.turns[index] > 1)
        assert stats.tool_calls[index] >= stats.turns[index] - 1
        assert all(lp == 0.0 for lp, model in zip(sample.behavior_logprobs, mask, strict=True) if not model)
        prompt = tokenizer.decode(sample.prompt_token_ids, skip_special_tokens=False)
        environment = PROMPTS[rollout.groups[sample.group_index].prompt_index]["environment"]
        # The Counter's reset text goes into its conversation's prompt; HiddenDigit adds nothing.
        assert prompt.startswith("<user>") and prompt.endswith("<assistant>")
        assert (len(sample.prompt_token_ids) > 4) == (environment == "count")
        assert set(sample.rewards_by_name) == {"repeat_digit", "HiddenDigit", "Counter"}
        owned = "HiddenDigit" if environment == "digit" else "Counter"
        other = "Counter" if owned == "HiddenDigit" else "HiddenDigit"
        assert sample.rewards_by_name[other] == 0.0
        if owned == "HiddenDigit":
            assert sample.rewards_by_name[owned] == (0.25 if stats.tool_calls[index] else 0.0)
        assert sample.reward == pytest.approx(
            0.75 * sample.rewards_by_name["repeat_digit"] + sample.rewards_by_name[owned], abs=1e-6
        )
    # The task's tokens are the model's, as the trainer counts them.
    train_samples, _ = build_train_samples([rollout], agent_config().loss)
    assert result.tokens == sum(s.model_tokens for s in train_samples) > 0


CRASH_PROMPTS = [
    {"prompt": "?=", "answer": "4", "environment": "count"},
    {"prompt": "?=", "answer": "2", "environment": "count"},
    {"prompt": "?=", "answer": "9", "environment": "digit"},
    {"prompt": "crash", "answer": "3", "environment": "count"},  # Counter.reset kills its tool process
]
LOST_BY_PROCESSES = {
    # One process a group (the default): the crash takes only its own group.
    None: {3: "environment_error"},
    # Two: group 1 lives in group 3's process (i mod 2), started before the crash, and is lost with it.
    2: {1: "environment_lost", 3: "environment_error"},
    # One process for the task (what every [agent] worker held before): every group started before is lost.
    1: {0: "environment_lost", 1: "environment_lost", 2: "environment_lost", 3: "environment_error"},
}


@pytest.mark.parametrize("processes", list(LOST_BY_PROCESSES), ids=["one-per-group", "two", "one"])
def test_a_dead_tool_process_costs_only_the_groups_it_held(
    bucket_with_v0: tuple[Bucket, str], backend: TransformersBackend, tmp_path: Path, processes: int | None
) -> None:
    base = agent_config()
    assert base.agent is not None
    config = base.model_copy(update={"agent": base.agent.model_copy(update={"tool_processes": processes})})
    assert config.agent is not None
    count = tool_process_count(config.agent, len(CRASH_PROMPTS))
    assert count == (processes or len(CRASH_PROMPTS))
    agent = AgentRun.start(config.agent, backend.tokenizer, count)
    try:
        result, proxy = run_agent_task(bucket_with_v0, backend, agent, config, CRASH_PROMPTS, tmp_path / "cache")
    finally:
        agent.close()
    lost = LOST_BY_PROCESSES[processes]
    assert result.status == "admitted" and len(proxy.submissions) == 1  # the task itself is never lost
    rejected = {item.group_id: item.reason for item in proxy.submissions[0].rejected_groups}
    assert rejected == {f"{TASK}.{group}": reason for group, reason in lost.items()}
    if len(lost) < len(CRASH_PROMPTS):
        rollout = decode_rollout(bucket_with_v0[0].get(proxy.submissions[0].key))
        kept = [group for group in range(len(CRASH_PROMPTS)) if group not in lost]
        assert [group.prompt_index for group in rollout.groups] == kept
        assert len(rollout.samples) == 4 * len(kept)


def test_run_create_refuses_a_prompt_naming_an_unknown_environment_and_stores_nothing(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt": "?=", "answer": "1", "env": "digit"}\n{"prompt": "?=", "answer": "2", "env": "dice"}\n'
    )
    config = tmp_path / "agent.toml"
    config.write_text(
        '[model]\nbase = "tiny-agent"\n\n[dataset]\npath = "prompts.jsonl"\nchat_template = true\n'
        'environment_column = "env"\n\n[[rewards]]\nname = "repeat_digit"\n\n'
        '[agent.environment]\ndigit = "worker.generate.toy_agent:HiddenDigit"\n'
    )
    bucket = open_bucket(f"file://{tmp_path / 'bucket'}")
    with pytest.raises(ConfigError, match=r"prompt 1 names environment 'dice'.*\(digit\)"):
        create_run(config, "agent-env", bucket)
    assert list(bucket.list("")) == []


@dataclass
class RecordingEvalProxy:
    """Stands in for ProxyClient on an eval task: leases version 0 over all the eval prompts."""

    manifest_sha256: str
    prompts: int
    results: list[EvalResultRequest] = field(default_factory=list)

    def eval_lease(self, task_id: str, worker_id: str) -> EvalLeaseGrant:
        return EvalLeaseGrant(
            lease_id="lease-eval",
            version=0,
            adapter_prefix=bucket_keys.adapter_prefix(RUN, 0),
            manifest_key=bucket_keys.manifest_key(RUN, 0),
            manifest_sha256=self.manifest_sha256,
            ttl_s=60.0,
            expires_at=0.0,
            prompt_start=0,
            prompt_count=self.prompts,
        )

    def renew(self, lease_id: str) -> None:
        raise AssertionError("a 60 s lease needs no renewal here")

    def release(self, lease_id: str) -> None:
        return None

    def eval_result(self, task_id: str, request: EvalResultRequest) -> EvalResultAnswer:
        self.results.append(request)
        return EvalResultAnswer(version=0, chunks_left=0)


def test_evaluation_runs_the_same_conversations_and_scores_the_environment_reward(
    bucket_with_v0: tuple[Bucket, str], backend: TransformersBackend, agent: AgentRun, tmp_path: Path
) -> None:
    bucket, manifest_sha = bucket_with_v0
    config = agent_config().model_copy(
        update={
            "eval": agent_config().eval.model_copy(
                update={"every_versions": 1, "samples_per_prompt": 4, "temperature": 1.0, "max_completion_length": 24}
            )
        }
    )
    proxy = RecordingEvalProxy(manifest_sha256=manifest_sha, prompts=len(PROMPTS))
    context = TaskContext(
        run=RUN,
        config=config,
        eval_prompts=PROMPTS,
        bucket=bucket,
        client=proxy,
        backend=backend,
        adapter_cache=AdapterCache(bucket, RUN, tmp_path / "cache", capacity=2),
        worker_id="gen-1",
        agent=agent,
    )
    result = EvalTask(context, "eval-0").run()
    assert result.status == "recorded"
    summary = proxy.results[0].summary
    # Counter.reset raises on "explode": that prompt fails, the other three are conversations, 4 each.
    assert (summary.prompts, summary.prompts_failed, summary.completions) == (3, 1, 12)
    assert set(summary.reward_sums) == {"repeat_digit", "HiddenDigit", "Counter"}
    assert summary.reward_sums["HiddenDigit"] in {0.25 * n for n in range(9)}  # 0.25 per digit conversation that called
    assert summary.reward_sum == pytest.approx(
        0.75 * summary.reward_sums["repeat_digit"] + summary.reward_sums["HiddenDigit"] + summary.reward_sums["Counter"]
    )


def test_run_create_checks_the_tools_and_the_chat_template_naming_the_field(tmp_path: Path) -> None:
    def config(base: str, tools: str) -> Path:
        path = tmp_path / f"{base}.toml"
        path.write_text(
            f'[model]\nbase = "{base}"\n\n[dataset]\ngenerator = "hidden_digit"\nchat_template = true\n\n'
            f'[[rewards]]\nname = "repeat_digit"\n\n[agent]\ntools = [{tools}]\n'
        )
        return path

    with pytest.raises(ToolSetupError, match=r"agent\.tools\.1: .*type hint"):
        check_agent_of(config("tiny-agent", '"tests.support.agent_tools:add", "tests.support.agent_tools:untyped"'))
    with pytest.raises(AgentSetupError, match="drops the tool call"):  # the plain tiny model's ChatML template
        check_agent_of(config("tiny", '"tests.support.agent_tools:add"'))
    check_agent_of(config("tiny-agent", '"tests.support.agent_tools:add"'))
