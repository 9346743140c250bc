"""Agent rollouts: each completion is a whole conversation in which the model calls tools or acts in an
environment before it answers (``[agent]``, TRL's ``tools`` / ``environment_factory`` contract).

One conversation is one token sequence after its prompt, with a mask:

* the model's turns are sampled by the backend from the conversation's token ids
  (``GenerationBackend.generate_from_ids``), never from re-tokenized text, so the trainer scores exactly the
  tokens the generator sampled; they are masked in (True) and carry their sampling logprobs;
* after a turn that calls tools, the calls run in the worker's tool process (``worker.generate.tool_process``)
  and the chat template's rendering of the tool messages (its tool-response wrapping and the next generation
  prompt) is appended as tokens masked out (False, logprob 0.0): they are context, never trained on.

A turn without a tool call ends the conversation (``"stop"``), as does reaching
``agent.max_tool_calling_iterations``. ``sampling.max_completion_length`` is the conversation's budget of
tokens, model and tool tokens alike (TRL's ``max_completion_length``); a turn cut short by it, or by
``agent.max_turn_tokens``, or tool answers that would not leave room for one more model token, end it
truncated (``"length"``), so ``loss.mask_truncated_completions`` treats it as TRL does.

Tool faults stay local: a call that cannot be parsed, names no tool, raises, returns no text, hangs past
``agent.tool_timeout_s`` or kills the tool process is an error observation the model reads, and a counted
failure; the task goes on. A worker of a run with environments holds several tool processes
(``agent.tool_processes``, by default one per group of a task), and group i of a task keeps its conversations in
process i mod n: a process killed by a timeout or a crash takes only those groups' environment instances with it,
so only those groups are rejected (``environment_lost``), and the rest of the task is submitted.

The environment's ``reset`` text is appended to the last user message of the conversation's prompt; its
``get_reward`` (when it has one) is read once the conversation ends.

The tool-call formats (``agent.tool_call_format``): ``hermes``, ``<tool_call>{"name": ..., "arguments": ...}
</tool_call>`` anywhere in the turn, as Qwen2.5/Qwen3/Hermes chat templates write them; ``tokenizer``, the
tokenizer's own response template (transformers' ``parse_response``).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from asyncgrpo.protocol.records import AgentStats
from asyncgrpo.run.agent_config import AgentConfig
from worker.algo.rewards import ScoredReward
from worker.generate.backend import (
    Completion,
    GenerationBackend,
    GenerationResult,
    Message,
    PromptResult,
    VersionSource,
)
from worker.generate.tool_process import LOST, EnvironmentFailed, ToolAnswer, ToolProcess

log = structlog.get_logger()

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

ToolCall = dict[str, Any]  # {"name": str, "arguments": object} or {"error": str} for one that did not parse


class AgentSetupError(ValueError):
    """An [agent] run this worker cannot serve (its chat template or tool-call format); names the field."""


# ---- the chat template's side: tools in the prompt, tool answers as tokens ----


def check_chat_template(tokenizer: Any, tool_call_format: str) -> None:
    """Refuse a tokenizer whose chat template cannot render a whole tool-calling exchange (user, assistant
    with a tool call, tool answer: each part must show in the text), or that lacks the response template
    ``agent.tool_call_format = "tokenizer"`` reads."""
    name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    if not getattr(tokenizer, "chat_template", None):
        raise AgentSetupError(
            f"[agent] needs a chat template, and the tokenizer of {name!r} has none; use an instruct model"
        )
    marks = {"name": "probe_tool_x7", "key": "probe_arg_k3", "value": "probe_val_v9", "answer": "probe_answer_a5"}
    call = {"type": "function", "function": {"name": marks["name"], "arguments": {marks["key"]: marks["value"]}}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": marks["name"], "content": marks["answer"]},
    ]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as error:  # a template raises anything jinja can
        raise AgentSetupError(
            f"the chat template of {name!r} cannot render a tool call and its answer ({error}); [agent] needs a "
            "model whose template supports tools"
        ) from error
    missing = [part for part, mark in marks.items() if mark not in text]
    if missing:
        raise AgentSetupError(
            f"the chat template of {name!r} drops the tool call's {', '.join(missing)}; [agent] needs a model whose "
            "template renders tool calls and tool answers"
        )
    if tool_call_format == "tokenizer" and getattr(tokenizer, "response_template", None) is None:
        raise AgentSetupError(
            f"agent.tool_call_format = 'tokenizer', but the tokenizer of {name!r} has no response template; use "
            "'hermes'"
        )


def prompt_text(tokenizer: Any, messages: list[Message], schemas: list[dict], reset_text: str | None) -> str:
    """The conversation's prompt: the chat (the reset text appended to its last user message, as TRL does)
    through the chat template, with the tools' schemas and the generation prompt."""
    if reset_text:
        last = max(i for i, message in enumerate(messages) if message["role"] == "user")
        messages = [*messages[:last], {**messages[last], "content": messages[last]["content"] + reset_text}]
    text = tokenizer.apply_chat_template(messages, tools=schemas or None, add_generation_prompt=True, tokenize=False)
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template returned a {type(text).__name__}, not the text")
    return text


def tool_answer_ids(tokenizer: Any, tool_messages: list[Message], eos_token_id: int) -> list[int]:
    """The tokens the template puts after a model turn that ended with EOS and called tools: the tool
    messages' wrapping and the next generation prompt. Rendered after a stand-in exchange, then cut where the
    stand-in assistant turn's EOS ends (a template writes more after it, e.g. Qwen's newline, that the model
    never sampled)."""
    call = {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}
    before = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    prefix = tokenizer.apply_chat_template(before, tokenize=True, return_dict=False)
    full = tokenizer.apply_chat_template(
        before + tool_messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ends = [i for i, token in enumerate(prefix) if token == eos_token_id]
    if ends:
        prefix = prefix[: ends[-1] + 1]
    if list(full[: len(prefix)]) != list(prefix):
        raise AgentSetupError(
            "the chat template renders a tool answer that changes the turn before it; it cannot be used"
        )
    return list(full[len(prefix) :])


def parse_tool_calls(tokenizer: Any, turn_ids: list[int], tool_call_format: str) -> list[ToolCall]:
    """The tool calls of one model turn, in order; one that does not parse is ``{"error": why}``."""
    if tool_call_format == "tokenizer":
        parsed = tokenizer.parse_response(turn_ids)
        return [_normalise(call.get("function", call)) for call in parsed.get("tool_calls") or []]
    text = tokenizer.decode(turn_ids, skip_special_tokens=False)
    calls: list[ToolCall] = []
    for body in _HERMES_CALL.findall(text):
        try:
            calls.append(_normalise(json.loads(body)))
        except ValueError as error:
            calls.append({"error": f"the tool call is not JSON ({error})"})
    return calls


def _normalise(call: object) -> ToolCall:
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return {"error": 'a tool call must be an object with a "name" and "arguments"'}
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some templates and parsers carry the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return {"name": call["name"], "error": "the tool call's arguments are not JSON"}
    return {"name": call["name"], "arguments": arguments}


# ---- conversations ----


@dataclass
class AgentPrompt:
    """One group's prompt: its chat, reference answer and environment (None: the unnamed one, or none)."""

    messages: list[Message]
    prompt: str
    answer: str | None
    environment: str | None


@dataclass
class Conversation:
    key: str  # the tool process's name for it
    tools: ToolProcess  # the process its environment instance (if any) lives in: its group's
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    finish_reason: str = "stop"
    last_turn: list[int] = field(default_factory=list)
    done: bool = False
    versions: list[int] = field(default_factory=list)  # per token: the version of the turn it belongs to


@dataclass
class AgentCompletion(Completion):
    """A conversation as a completion: ``token_ids`` after its own prompt (``prompt_token_ids``), ``mask``
    True at the model's tokens; ``text`` is its last model turn (what rewards score)."""

    prompt_token_ids: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    environment_reward: float | None = None


@dataclass
class AgentGroup:
    """One prompt's G conversations; ``failure`` (the reason: ``environment_error``, or ``environment_lost`` when
    the tool process died with its instances) when its environment could not start or score one of them: the
    group is rejected, the task goes on."""

    completions: list[AgentCompletion]
    failure: str | None = None


def tool_process_count(config: AgentConfig, groups_per_task: int) -> int:
    """How many tool processes a generate worker holds: ``agent.tool_processes``, by default one per group of a
    task; one where there is no environment (standalone tools hold no state a dead process could lose)."""
    if not config.environments:
        return 1
    return config.tool_processes or groups_per_task


@dataclass
class AgentRun:
    """What a generate worker holds for an [agent] run: its config, its tool processes (a task's group i talks
    to ``processes[i % len(processes)]``) and the tools' schemas per environment."""

    config: AgentConfig
    processes: list[ToolProcess]
    schemas: dict[str | None, list[dict]]

    @classmethod
    def start(cls, config: AgentConfig, tokenizer: Any, processes: int = 1) -> AgentRun:
        """Check the template, start the first tool process and read the schemas (raises ToolSetupError or
        AgentSetupError naming the field); the other ``processes - 1`` start their children at first use."""
        if processes < 1:
            raise ValueError(f"an agent run needs at least one tool process, not {processes}")
        check_chat_template(tokenizer, config.tool_call_format)
        first = ToolProcess(config.tools, config.environments or None, config.tool_timeout_s)
        try:
            schemas = first.describe()
        except BaseException:
            first.close()
            raise
        pool = [first, *(first.sibling() for _ in range(processes - 1))]
        return cls(config=config, processes=pool, schemas=schemas)

    def tools_for(self, group: int) -> ToolProcess:
        """The tool process that holds the conversations of a task's group ``group``."""
        return self.processes[group % len(self.processes)]

    def has_reward(self, environment: str | None) -> bool:
        return self.processes[0].has_reward(environment)

    def schemas_for(self, environment: str | None) -> list[dict]:
        return self.schemas.get(environment, self.schemas.get(None, []))

    def close(self) -> None:
        for process in self.processes:
            process.close()


def run_conversations(
    backend: GenerationBackend,
    agent: AgentRun,
    prompts: Sequence[AgentPrompt],
    *,
    adapter: str | None,
    samples_per_prompt: int,
    max_completion_length: int,
    temperature: float,
    top_p: float,
    seed: int,
    task_id: str,
    version: int = 0,
    follow: VersionSource | None = None,
) -> tuple[list[AgentGroup], float]:
    """``samples_per_prompt`` conversations of each prompt, all advanced together turn by turn; returns the
    groups (in prompt order) and the seconds spent outside sampling (tools, environments, templating).

    ``adapter`` is version ``version``; with ``follow``, every turn after the first is sampled by the newest
    version it offers (a turn is never split between versions), and each token records its turn's version."""
    tokenizer = backend.tokenizer
    tools_s = 0.0
    failures: dict[int, str] = {}
    conversations: list[tuple[int, Conversation]] = []
    try:
        started = time.perf_counter()
        for group, prompt in enumerate(prompts):
            tools = agent.tools_for(group)
            for sample in range(samples_per_prompt):
                key = f"{task_id}/{group}/{sample}"
                try:
                    reset = tools.start(key, prompt.environment, prompt.prompt, prompt.answer)
                except EnvironmentFailed as error:
                    failures[group] = _failure_reason(key, error)
                    tools.end(key)
                    break  # the group is rejected: its other conversations need not start (nor fail again)
                text = prompt_text(tokenizer, prompt.messages, agent.schemas_for(prompt.environment), reset)
                ids = backend.tokenize([text], add_special_tokens=False)[0]
                conversations.append((group, Conversation(key=key, tools=tools, prompt_ids=ids)))
        tools_s += time.perf_counter() - started
        live = [c for g, c in conversations if g not in failures]
        turn = 0
        start_version = version
        while live:
            newer = follow.newer(version) if follow is not None and turn > 0 else None
            if newer is not None:
                adapter, version = newer
            budgets = [max_completion_length - len(c.tokens) for c in live]
            caps = [min(b, agent.config.max_turn_tokens or b) for b in budgets]
            turns = backend.generate_from_ids(
                [c.prompt_ids + c.tokens for c in live],
                adapter=adapter,
                max_completion_lengths=caps,
                temperature=temperature,
                top_p=top_p,
                seed=(seed + 7919 * turn) % (2**31 - 1),
            )
            turn += 1
            started = time.perf_counter()
            for conversation, completion in zip(live, turns, strict=True):
                _take_turn(
                    conversation, completion, agent, tokenizer, backend.eos_token_id, max_completion_length, version
                )
            tools_s += time.perf_counter() - started
            live = [c for c in live if not c.done]
        started = time.perf_counter()
        groups = _finish(conversations, len(prompts), samples_per_prompt, failures, agent, tokenizer, start_version)
        tools_s += time.perf_counter() - started
    except BaseException:
        # A task that fails here (preemption, a backend error) may run again on this worker under the same
        # conversation names: end every conversation it started (the tool process tolerates unknown ones).
        for _, conversation in conversations:
            with contextlib.suppress(Exception):
                conversation.tools.end(conversation.key)
        raise
    return groups, tools_s


def _take_turn(
    conversation: Conversation,
    completion: Completion,
    agent: AgentRun,
    tokenizer: Any,
    eos_token_id: int,
    budget: int,
    version: int = 0,
) -> None:
    """Append a sampled turn (by ``version``); run its tool calls and append their answers, or end the
    conversation."""
    conversation.tokens += completion.token_ids
    conversation.logprobs += completion.logprobs
    conversation.versions += [version] * len(completion.token_ids)
    conversation.mask += [True] * len(completion.token_ids)
    conversation.turns += 1
    conversation.last_turn = list(completion.token_ids)
    if completion.finish_reason == "length":
        conversation.finish_reason, conversation.done = "length", True
        return
    calls = parse_tool_calls(tokenizer, completion.token_ids, agent.config.tool_call_format)
    limit = agent.config.max_tool_calling_iterations
    if not calls or (limit is not None and conversation.turns > limit):
        conversation.done = True
        return
    messages: list[Message] = []
    for call in calls:
        answer = _call(conversation.tools, conversation.key, call)
        conversation.tool_calls += 1
        conversation.tool_failures += int(answer.failed)
        messages.append({"role": "tool", "name": str(call.get("name", "unknown")), "content": answer.text})
    answer_ids = tool_answer_ids(tokenizer, messages, eos_token_id)
    if len(conversation.tokens) + len(answer_ids) >= budget:
        # No room left for the model to read the answers and reply: the conversation ends cut short.
        conversation.finish_reason, conversation.done = "length", True
        return
    conversation.tokens += answer_ids
    conversation.logprobs += [0.0] * len(answer_ids)
    conversation.mask += [False] * len(answer_ids)
    conversation.versions += [version] * len(answer_ids)  # never trained: the turn's, so no token looks older


def _call(tools: ToolProcess, key: str, call: ToolCall) -> ToolAnswer:
    if "error" in call:
        reason = call["error"]
        return ToolAnswer(text=f"Error: {reason}", failed=True, error=reason)
    return tools.call(key, call["name"], call["arguments"])


def _failure_reason(key: str, error: EnvironmentFailed) -> str:
    """A group's rejection reason (a short label: the proxy counts groups by it); the detail goes to the log."""
    reason = "environment_lost" if LOST in str(error) else "environment_error"
    log.warning("generate.environment_failed", conversation=key, reason=reason, error=str(error)[:500])
    return reason


def _finish(
    conversations: list[tuple[int, Conversation]],
    prompts: int,
    samples_per_prompt: int,
    failures: dict[int, str],
    agent: AgentRun,
    tokenizer: Any,
    start_version: int = 0,
) -> list[AgentGroup]:
    """Read each environment's reward, end every conversation, and lay the conversations out by group; a
    conversation's token versions are kept where some turn followed a version newer than ``start_version``."""
    by_group: dict[int, list[AgentCompletion]] = {group: [] for group in range(prompts)}
    for group, conversation in conversations:
        reward = None
        if group not in failures:
            try:
                reward = conversation.tools.reward(conversation.key)
            except EnvironmentFailed as error:
                failures[group] = _failure_reason(conversation.key, error)
        conversation.tools.end(conversation.key)
        by_group[group].append(
            AgentCompletion(
                token_ids=conversation.tokens,
                logprobs=conversation.logprobs,
                finish_reason="length" if conversation.finish_reason == "length" else "stop",
                text=tokenizer.decode(conversation.last_turn, skip_special_tokens=True),
                prompt_token_ids=conversation.prompt_ids,
                mask=conversation.mask,
                turns=conversation.turns,
                tool_calls=conversation.tool_calls,
                tool_failures=conversation.tool_failures,
                environment_reward=reward,
                versions=conversation.versions if any(v != start_version for v in conversation.versions) else None,
            )
        )
    groups = []
    for group in range(prompts):
        completions = by_group[group]
        failure = failures.get(group)
        if failure is None and len(completions) != samples_per_prompt:
            failure = "environment_error"
        groups.append(AgentGroup(completions=completions, failure=failure))
    return groups


def environment_rewards(agent: AgentRun) -> list[ScoredReward]:
    """The rewards the environments own (``get_reward``): one per factory, named after it, weight 1, as TRL."""
    names = {path.rpartition(":")[2] for name, path in agent.config.environments.items() if agent.has_reward(name)}
    return [ScoredReward(name=name) for name in sorted(names)]


def converse(
    backend: GenerationBackend,
    agent: AgentRun,
    records: Sequence[Mapping[str, Any]],
    chats: Sequence[list[Message]],
    *,
    adapter: str | None,
    samples_per_prompt: int,
    max_completion_length: int,
    temperature: float,
    top_p: float,
    seed: int,
    task_id: str,
    version: int = 0,
    follow: VersionSource | None = None,
) -> tuple[list[AgentGroup], dict[str, list[list[float]]], float]:
    """The conversations of a task's groups (``records`` and their ``chats``); also, by environment reward name,
    each group's scores (0 for a conversation whose environment does not own that reward), and the seconds
    spent on tools."""
    prompts = [
        AgentPrompt(
            messages=chat, prompt=record["prompt"], answer=record.get("answer"), environment=record.get("environment")
        )
        for record, chat in zip(records, chats, strict=True)
    ]
    groups, tools_s = run_conversations(
        backend,
        agent,
        prompts,
        adapter=adapter,
        samples_per_prompt=samples_per_prompt,
        max_completion_length=max_completion_length,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        task_id=task_id,
        version=version,
        follow=follow,
    )
    factories = agent.config.environments
    columns: dict[str, list[list[float]]] = {}
    for reward in environment_rewards(agent):
        # A failed group (its environment could not start or score) has no rewards: it is rejected whole.
        columns[reward.name] = [
            [
                float(c.environment_reward)
                if c.environment_reward is not None
                and factories.get(prompt.environment, "").endswith(f":{reward.name}")
                else 0.0
                for c in group.completions
            ]
            for prompt, group in zip(prompts, groups, strict=True)
        ]
    return groups, columns, tools_s


def agent_stats(results: Sequence[PromptResult]) -> AgentStats:
    """The rollout header's per-sample turns, tool calls and failures, of the kept groups' conversations."""
    conversations = [c for result in results for c in result.completions if isinstance(c, AgentCompletion)]
    return AgentStats(
        turns=[c.turns for c in conversations],
        tool_calls=[c.tool_calls for c in conversations],
        tool_failures=[c.tool_failures for c in conversations],
    )


def as_generation_result(groups: Sequence[AgentGroup], indices: Sequence[int], adapter: str | None) -> GenerationResult:
    """The conversations of ``groups[indices]`` in the shape single-turn sampling returns (their group prompt
    ids are the first conversation's; each conversation carries its own)."""
    results = [
        PromptResult(
            prompt="",
            prompt_token_ids=groups[i].completions[0].prompt_token_ids,
            completions=list(groups[i].completions),
        )
        for i in indices
    ]
    return GenerationResult(results=results, adapter=adapter)


def check_agent_of(config_path: str | Path) -> None:
    """For ``run create`` and ``asyncgrpo local``, before anything is stored: the [agent] run's chat template
    renders tool calls, and its tools and environments import and describe themselves in a tool process as a
    worker's would (a ToolSetupError or AgentSetupError names the field). A config that does not validate is
    left to ``create_run``, which names the field."""
    from asyncgrpo.run.config import ConfigError, load_run_config

    try:
        config = load_run_config(config_path)
    except ConfigError:
        return
    if config.agent is None:
        return  # the base install (no transformers) creates runs without [agent]
    try:
        from worker.model.tiny_model import resolve_base_model
        from worker.model.tokenizer import load_tokenizer
    except ImportError as error:
        raise ConfigError(
            f"[agent] is checked against the model's chat template, which needs transformers ({error}); "
            "pip install 'asyncgrpo[train]' where you run `run create`"
        ) from error
    tokenizer = load_tokenizer(resolve_base_model(config.model.base))
    AgentRun.start(config.agent, tokenizer).close()
