"""Agent rollouts end to end: a real proxy, Redis, SeaweedFS bucket, and generate and optimize workers as
processes, on the tiny agent model and the toy agent task (a digit hidden behind a ``reveal()`` tool).

* The run learns: the share of conversations that call the tool and the reward both rise from the random
  policy's, and the step records show the turns and calls.
* Tool faults stay local, with every setting as shipped: tool calls raise, return a dict, hang past
  ``agent.tool_timeout_s``, exit their process and crash it with SIGSEGV. A fault that leaves the tool process
  alive is a counted failure of a conversation that trains; one that takes it down loses the environments of
  the conversations in that process, one group's (a tool process per group of a task, by default): that group is
  rejected, the rest of its task trains. The generate worker never restarts, and the run reaches its final
  version.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from asyncgrpo.protocol.records import StepRecord
from cli.local_cluster import LocalCluster
from tests.support.e2e_harness import records_of, version_reached, wait_for
from tests.support.faulty_environment import FAULTS, SPACING, script_file

pytestmark = pytest.mark.slow

AGENT_HEAD = """\
seed = 0

[model]
base = "tiny-agent"

[dataset]
generator = "hidden_digit"
num_prompts = {num_prompts}
chat_template = true

[[rewards]]
name = "repeat_digit"
weight = 0.75

[agent]
environment = "{environment}"
max_tool_calling_iterations = 2

[sampling]
samples_per_prompt = {samples}
max_completion_length = {max_len}

[optimizer]
total_steps = {total_steps}

[async]
max_staleness = {max_staleness}
groups_per_task = 4
groups_per_step = 8
queue_maxsize = 16
"""
LEARN_STEPS = 60


def _head(environment: str) -> str:
    # The environment's import path is fixed per test; the harness fills the other placeholders.
    return AGENT_HEAD.replace("{environment}", environment)


def _window(records: list[StepRecord], figure: Callable[[StepRecord], float]) -> tuple[float, float]:
    first, last = records[:10], records[-10:]
    return sum(map(figure, first)) / len(first), sum(map(figure, last)) / len(last)


def test_the_toy_agent_task_learns_to_call_its_tool(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(
        head=_head("worker.generate.toy_agent:HiddenDigit"),
        total_steps=LEARN_STEPS,
        max_len=16,
        samples_per_prompt=8,
        num_prompts=256,
    )
    cluster.start_worker("optimize", name="opt-1")
    cluster.start_worker("generate", name="gen-1")
    cluster.start_worker("generate", name="gen-2")
    wait_for(version_reached(cluster, LEARN_STEPS), 900, f"version {LEARN_STEPS}", cluster)

    records = records_of(cluster)[:LEARN_STEPS]
    assert all(record.tools is not None for record in records)
    call_first, call_last = _window(records, lambda r: r.tools.call_rate)  # type: ignore[union-attr]
    reward_first, reward_last = _window(records, lambda r: r.reward_mean or 0.0)
    turns_last = _window(records, lambda r: r.tools.turns_mean)[1]  # type: ignore[union-attr]
    print(f"call rate {call_first:.2f} -> {call_last:.2f}, reward {reward_first:.3f} -> {reward_last:.3f}")
    assert call_first < 0.4, f"the random policy already calls the tool in {call_first:.0%} of conversations"
    assert call_last >= 0.8 and call_last >= 2 * call_first, (call_first, call_last)
    assert reward_last >= 2 * reward_first and reward_last >= 0.2, (reward_first, reward_last)
    assert turns_last > 1.5  # the model reads the answer and replies in a turn of its own
    for record in records:
        assert record.tools.failures == 0  # type: ignore[union-attr]
        assert set(record.rewards_by_name) == {"repeat_digit", "HiddenDigit"}
        assert record.rescore_ratio is not None and abs(record.rescore_ratio - 1.0) < 1e-3


def test_tool_faults_are_counted_failures_and_the_run_finishes_with_default_settings(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    steps = 60
    cluster = make_cluster(
        defaults=True,
        head=_head("tests.support.faulty_environment:FaultyDigit"),
        total_steps=steps,
        max_len=16,
        samples_per_prompt=8,
        num_prompts=256,
    )
    cluster.start_worker("optimize", name="opt-1")
    generator = cluster.start_worker("generate", name="gen-1")
    script = script_file(generator.pid)
    script.unlink(missing_ok=True)
    try:
        wait_for(version_reached(cluster, steps), 900, f"version {steps}", cluster)
        served = int(script.read_text()) if script.exists() else 0
    finally:
        script.unlink(missing_ok=True)

    assert served > SPACING * (len(FAULTS) - 1), f"only {served} reveal() calls: the fault script did not run through"
    assert generator.alive(), "the generate worker exited"
    records = records_of(cluster)[:steps]
    failures = sum(record.tools.failures for record in records if record.tools is not None)
    # The raising and the non-text calls leave the tool process (and every conversation's environment) alive:
    # each is one failed call of a conversation that trains, and the model read the error.
    assert failures == 2, failures
    # The hang (killed at agent.tool_timeout_s), the exit and the segfault each take one tool process down with
    # the environments of the one group it held: exactly that group is rejected, once for each of the three;
    # the other groups of the task train, and the run goes on.
    rejected = cluster.status()["rejected_by_reason"]
    assert rejected == {"environment_lost": 3}, rejected
