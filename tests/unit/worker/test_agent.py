"""Agent conversations (``worker.generate.agent``): the tiny agent model and a real tool process.

The masks must be exact: every token after a conversation's prompt is the model's (sampled, with its logprob)
or the template's rendering of a tool answer (masked out), and the trainer's logprobs of the model's tokens
equal the generator's. Tool faults end as error observations and counted failures, never as a lost task.
A scripted backend (a test double of ``generate_from_ids`` over the real tokenizer) drives the loop's
branches that a random model reaches only by chance.
"""

from __future__ import annotations

import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncgrpo.run.agent_config import AgentConfig
from asyncgrpo.run.config import RunConfig
from asyncgrpo.run.datasets import hidden_digit_prompts
from tests.support.toy_conversations import check_toy_conversation
from worker.generate.agent import (
    AgentRun,
    AgentSetupError,
    check_chat_template,
    converse,
    parse_tool_calls,
    tool_answer_ids,
)
from worker.generate.backend import Completion, VersionSource, chat_messages
from worker.generate.transformers_backend import TransformersBackend
from worker.model.policy import Policy
from worker.model.tiny_model import ensure_tiny_model
from worker.model.tokenizer import load_tokenizer
from worker.optimize.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOY_ENVIRONMENT = "worker.generate.toy_agent:HiddenDigit"
TOOLS = "tests.support.agent_tools"


@pytest.fixture(scope="module")
def agent_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(cache_dir=tmp_path_factory.getbasetemp() / "asyncgrpo-cache", agent=True)


@pytest.fixture(scope="module")
def toy_run() -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {"base": "tiny-agent"},
            "dataset": {"generator": "hidden_digit", "chat_template": True},
            "rewards": [{"name": "repeat_digit", "weight": 0.75}],
            "agent": {"environment": TOY_ENVIRONMENT, "max_tool_calling_iterations": 2, "tool_timeout_s": 10},
            "sampling": {"max_completion_length": 16},
        }
    )


@pytest.fixture(scope="module")
def toy_agent(agent_model_dir: Path, toy_run: RunConfig) -> Iterator[AgentRun]:
    assert toy_run.agent is not None
    agent = AgentRun.start(toy_run.agent, load_tokenizer(agent_model_dir))
    yield agent
    agent.close()


# ---- the template's side ----


def test_the_toy_template_renders_tools_and_the_plain_tiny_one_is_refused(
    agent_model_dir: Path, tiny_model_dir: Path
) -> None:
    check_chat_template(load_tokenizer(agent_model_dir), "hermes")
    with pytest.raises(AgentSetupError, match="drops the tool call"):
        check_chat_template(load_tokenizer(tiny_model_dir), "hermes")
    with pytest.raises(AgentSetupError, match="no response template"):
        check_chat_template(load_tokenizer(agent_model_dir), "tokenizer")


def test_a_tool_answer_is_the_template_text_after_the_turn_s_eos(agent_model_dir: Path) -> None:
    tokenizer = load_tokenizer(agent_model_dir)
    ids = tool_answer_ids(tokenizer, [{"role": "tool", "name": "reveal", "content": "7"}], tokenizer.eos_token_id)
    assert tokenizer.convert_ids_to_tokens(ids) == ["<tool>", "7", "<assistant>"]


def test_hermes_calls_are_read_in_order_and_a_broken_one_is_an_error(agent_model_dir: Path) -> None:
    tokenizer = load_tokenizer(agent_model_dir)
    calls = [
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
        '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}\n</tool_call>',
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
    ]
    tokenizer.add_tokens(calls)
    ids = tokenizer("7" + "".join(calls) + "9", add_special_tokens=False).input_ids
    parsed = parse_tool_calls(tokenizer, ids, "hermes")
    assert parsed[0] == {"name": "add", "arguments": {"a": 1, "b": 2}}
    assert parsed[1] == {"name": "add", "arguments": {"a": 3, "b": 4}}  # arguments as a JSON string
    assert "not JSON" in parsed[2]["error"]
    assert "name" in parsed[3]["error"]
    assert parse_tool_calls(tokenizer, tokenizer("123", add_special_tokens=False).input_ids, "hermes") == []


# ---- real conversations: exact masks, ratio 1 ----


def _toy_conversations(agent_dir: Path, agent: AgentRun, config: RunConfig, policy: Policy) -> list[Any]:
    backend = TransformersBackend(str(agent_dir), policy=policy)
    records = hidden_digit_prompts(8, seed=1)
    groups, scores, _ = converse(
        backend,
        agent,
        records,
        [chat_messages(record, config.dataset) for record in records],
        adapter=None,
        samples_per_prompt=8,
        max_completion_length=config.sampling.max_completion_length,
        temperature=1.0,
        top_p=1.0,
        seed=5,
        task_id="task-masks",
    )
    assert all(group.failure is None for group in groups)
    assert set(scores) == {"HiddenDigit"}
    return [
        (record, group, scores["HiddenDigit"][i]) for i, (record, group) in enumerate(zip(records, groups, strict=True))
    ]


def test_conversations_mask_exactly_the_tool_answers_and_rescore_to_ratio_one(
    agent_model_dir: Path, toy_agent: AgentRun, toy_run: RunConfig
) -> None:
    policy = Policy.load(str(agent_model_dir))
    tokenizer = policy.tokenizer
    conversations = _toy_conversations(agent_model_dir, toy_agent, toy_run, policy)
    called = 0
    samples = []
    for record, group, rewards in conversations:
        for completion, reward in zip(group.completions, rewards, strict=True):
            samples.append(check_toy_conversation(tokenizer, record["answer"], completion, reward, 2))
            called += completion.tool_calls > 0
    assert called >= 4, f"only {called} of 64 random conversations called reveal(); the check needs some"
    # The trainer scores every token of the conversation; the model's tokens score what the generator sampled.
    trainer = Trainer.initial(policy, toy_run)
    for sample, rescored in zip(samples, trainer.rescore(samples), strict=True):
        for model, generated, scored in zip(sample.completion_mask, sample.behavior_logprobs, rescored, strict=True):
            if model:
                assert scored == pytest.approx(generated, abs=2e-5)


# ---- the loop's branches, with a scripted model over the real tokenizer ----


class ScriptedBackend:
    """Every conversation's turn k is ``turns[k]`` (text of added tokens), EOS-ended unless ``cut``."""

    name = "scripted"

    def __init__(self, tokenizer: Any, turns: list[str], cut: set[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.turns = turns
        self.cut = cut or set()
        self.calls = 0
        self.seen: list[list[int]] = []
        self.adapters: list[str | None] = []  # the adapter of each turn

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    def tokenize(self, prompts: list[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        return [self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids for text in prompts]

    def generate_from_ids(self, sequences: list[list[int]], **options: Any) -> list[Completion]:
        turn = self.calls
        self.calls += 1
        self.seen.extend(sequences)
        self.adapters.append(options["adapter"])
        ids = self.tokenize([self.turns[turn]], add_special_tokens=False)[0]
        cut = turn in self.cut
        ids = ids if cut else [*ids, self.eos_token_id]
        ids = ids[: min(options["max_completion_lengths"])]
        finish = "length" if cut or ids[-1] != self.eos_token_id else "stop"
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return [Completion(list(ids), [-0.5] * len(ids), finish, text) for _ in sequences]


def _call(name: str, arguments: str = "{}") -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


@pytest.fixture
def scripted_tokenizer(agent_model_dir: Path) -> Any:
    tokenizer = load_tokenizer(agent_model_dir)
    tokenizer.add_tokens(
        [
            _call("add", '{"a": 2, "b": 3}'),
            _call("fail", '{"reason": "no"}'),
            _call("hang", '{"seconds": 60}'),
            _call("exit_hard", '{"code": 3}'),
            _call("segfault"),
            _call("as_dict", '{"key": "k"}'),
            _call("nope"),
            "<tool_call>{broken</tool_call>",
        ]
    )
    # Every printable character, so that the error observations read back as the model would see them.
    tokenizer.add_tokens([char for char in string.printable if char.strip()] + [" "])
    return tokenizer


def _run(
    tokenizer: Any,
    turns: list[str],
    *,
    budget: int = 200,
    cut: set[int] | None = None,
    follow: VersionSource | None = None,
    **agent: Any,
) -> Any:
    config = AgentConfig.model_validate(
        {
            "tools": [f"{TOOLS}:{name}" for name in ("add", "fail", "hang", "exit_hard", "segfault", "as_dict")],
            "tool_timeout_s": 2,
            **agent,
        }
    )
    run = AgentRun.start(config, tokenizer)
    backend = ScriptedBackend(tokenizer, turns, cut)
    try:
        groups, scores, _ = converse(
            backend,
            run,
            [{"prompt": "?=", "answer": "1"}],
            [[{"role": "user", "content": "?="}]],
            adapter="v4" if follow is not None else None,
            samples_per_prompt=2,
            max_completion_length=budget,
            temperature=1.0,
            top_p=1.0,
            seed=0,
            task_id="scripted",
            version=4,
            follow=follow,
        )
    finally:
        run.close()
    assert scores == {}
    return groups[0], backend


class NewerAfter:
    """A ``VersionSource``: ``v5`` from the ``at``-th question on (asked before every turn but the first)."""

    def __init__(self, at: int) -> None:
        self.at, self.asked = at, 0

    def newer(self, version: int) -> tuple[str, int] | None:
        self.asked += 1
        return ("v5", 5) if self.asked >= self.at and version < 5 else None


@pytest.mark.processes
def test_a_conversation_follows_new_versions_between_turns_only(scripted_tokenizer: Any) -> None:
    add = _call("add", '{"a": 2, "b": 3}')
    group, backend = _run(scripted_tokenizer, [add, add, "7"], follow=NewerAfter(at=2))
    assert backend.adapters == ["v4", "v4", "v5"], "asked between turns, never before the first"
    for completion in group.completions:
        # Turn 1 (call + EOS) and its answer, turn 2 and its answer: v4's; the last turn ("7" + EOS): v5's.
        assert completion.mask == [True, True, False, False, False, True, True, False, False, False, True, True]
        assert completion.versions == [4] * 10 + [5] * 2
    kept, _ = _run(scripted_tokenizer, [add, "7"], follow=NewerAfter(at=99))
    assert all(completion.versions is None for completion in kept.completions), "no switch: no versions"


@pytest.mark.processes
def test_each_tool_fault_is_an_observation_and_a_counted_failure(scripted_tokenizer: Any) -> None:
    faults = [
        _call("fail", '{"reason": "no"}'),
        _call("hang", '{"seconds": 60}'),
        _call("exit_hard", '{"code": 3}'),
        _call("segfault"),
        _call("as_dict", '{"key": "k"}'),
        _call("nope"),
        "<tool_call>{broken</tool_call>",
    ]
    group, backend = _run(scripted_tokenizer, [*faults, _call("add", '{"a": 2, "b": 3}'), "7"], budget=4000)
    assert group.failure is None
    for completion in group.completions:
        assert completion.tool_calls == 8
        assert completion.tool_failures == 7  # every fault, and add() after them answers
        assert completion.turns == 9
        assert completion.finish_reason == "stop"
        assert completion.text == "7"
    # The model read an error after each fault, then 5 from add(): the conversation went on each time.
    last_context = scripted_tokenizer.decode(backend.seen[-1], skip_special_tokens=False)
    for reason in (
        "raised ValueError: no",
        "timed out after 2 s",
        "exit code 3",
        "SIGSEGV",
        "returned a dict",
        "unknown tool 'nope'",
        "not JSON",
    ):
        assert reason in last_context, reason
    assert last_context.endswith("<tool>5<assistant>")


@pytest.mark.processes
def test_max_tool_calling_iterations_ends_the_conversation_at_the_next_call(scripted_tokenizer: Any) -> None:
    add = _call("add", '{"a": 2, "b": 3}')
    group, backend = _run(scripted_tokenizer, [add, add, add, "7"], max_tool_calling_iterations=1)
    completion = group.completions[0]
    assert (completion.tool_calls, completion.turns, completion.finish_reason) == (1, 2, "stop")
    assert backend.calls == 2


@pytest.mark.processes
def test_a_cut_turn_and_a_tool_answer_past_the_budget_end_the_conversation_truncated(scripted_tokenizer: Any) -> None:
    add = _call("add", '{"a": 2, "b": 3}')
    group, _ = _run(scripted_tokenizer, [add, "777"], cut={1})
    assert [c.finish_reason for c in group.completions] == ["length", "length"]
    assert group.completions[0].mask == [True, True, False, False, False, True, True, True]
    # Budget 4: the call and its EOS (2) + the answer (3) leaves no room for a reply: ended, answer not appended.
    group, backend = _run(scripted_tokenizer, [add, "7"], budget=4)
    completion = group.completions[0]
    assert (completion.finish_reason, completion.tool_calls, len(completion.token_ids)) == ("length", 1, 2)
    assert backend.calls == 1


@pytest.mark.processes
def test_a_crash_that_loses_the_environment_fails_its_group_not_the_task(scripted_tokenizer: Any) -> None:
    config = AgentConfig.model_validate(
        {"tools": [f"{TOOLS}:exit_hard"], "environment": f"{TOOLS}:Counter", "tool_timeout_s": 5}
    )
    run = AgentRun.start(config, scripted_tokenizer)
    backend = ScriptedBackend(scripted_tokenizer, [_call("exit_hard", '{"code": 3}'), "7"])
    try:
        groups, scores, _ = converse(
            backend,
            run,
            [{"prompt": "?=", "answer": "1"}, {"prompt": "?=", "answer": "2"}],
            [[{"role": "user", "content": "?="}]] * 2,
            adapter=None,
            samples_per_prompt=2,
            max_completion_length=4000,
            temperature=1.0,
            top_p=1.0,
            seed=0,
            task_id="lost",
        )
    finally:
        run.close()
    # Every conversation's Counter lived in the process the first call killed: no group can be scored.
    assert [group.failure for group in groups] == ["environment_lost", "environment_lost"]
    assert scores == {"Counter": [[0.0, 0.0], [0.0, 0.0]]}
    assert groups[0].completions[0].tool_failures == 1


class FailingSecondTurn(ScriptedBackend):
    def generate_from_ids(self, sequences: list[list[int]], **options: Any) -> list[Completion]:
        if self.calls == 1:
            raise RuntimeError("the engine died")
        return super().generate_from_ids(sequences, **options)


@pytest.mark.processes
def test_a_task_that_fails_mid_conversation_can_run_again_on_the_same_worker(scripted_tokenizer: Any) -> None:
    config = AgentConfig.model_validate({"environment": f"{TOOLS}:Counter", "tools": [f"{TOOLS}:add"]})
    run = AgentRun.start(config, scripted_tokenizer)
    add = _call("add", '{"a": 2, "b": 3}')
    options = {
        "adapter": None, "samples_per_prompt": 2, "max_completion_length": 4000, "temperature": 1.0, "top_p": 1.0,
        "seed": 0, "task_id": "again",
    }  # fmt: skip
    prompts = ([{"prompt": "?=", "answer": "1"}], [[{"role": "user", "content": "?="}]])
    try:
        with pytest.raises(RuntimeError, match="the engine died"):
            converse(FailingSecondTurn(scripted_tokenizer, [add, "7"]), run, *prompts, **options)
        # The redelivered task starts the same conversation names: the failed attempt ended them.
        groups, _, _ = converse(ScriptedBackend(scripted_tokenizer, [add, "7"]), run, *prompts, **options)
    finally:
        run.close()
    assert groups[0].failure is None and groups[0].completions[0].tool_calls == 1
