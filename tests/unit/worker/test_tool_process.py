"""Agent tools and environments in their child process (``worker.generate.tool_process``), with real children.

The tools and environments are in ``tests.support.agent_tools``. Most tests share one process (tools and the
unnamed ``Counter`` environment, 1 s timeout): a test that kills its child leaves the next request a new one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from worker.generate.tool_process import LOST, EnvironmentFailed, ToolAnswer, ToolProcess, ToolSetupError

pytestmark = pytest.mark.processes  # a child process per test (see tests/conftest.py)

T = "tests.support.agent_tools:"
TOOLS = [T + name for name in ("add", "fail", "as_dict", "hang", "exit_hard", "segfault", "sys_exit")]
TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def shared() -> Iterator[ToolProcess]:
    process = ToolProcess(TOOLS, {None: T + "Counter"}, timeout_s=TIMEOUT_S, start_timeout_s=60)
    yield process
    process.close()


def begin(process: ToolProcess, environment: str | None = None, prompt: str = "go", answer: str | None = "3") -> str:
    conversation = uuid.uuid4().hex
    process.start(conversation, environment, prompt, answer)
    return conversation


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie left to a non-reaping init counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def names(schemas: list[dict]) -> list[str]:
    return [schema["function"]["name"] for schema in schemas]


def test_a_typed_tool_answers_its_text(shared: ToolProcess) -> None:
    conversation = begin(shared)
    assert shared.call(conversation, "add", {"a": 2, "b": 40}) == ToolAnswer(text="42", failed=False, error=None)


def test_describe_shows_the_tools_then_the_environment_methods(shared: ToolProcess) -> None:
    described = shared.describe()
    assert list(described) == [None]
    assert names(described[None]) == [
        *("add", "fail", "as_dict", "hang", "exit_hard", "segfault", "sys_exit"),
        *("increment", "whoami"),  # not reset, get_reward or _hidden
    ]
    add = described[None][0]
    assert add["type"] == "function"
    assert add["function"]["description"] == "Add two integers."
    assert add["function"]["parameters"] == {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "description": "The first integer."},
            "b": {"type": "integer", "description": "The second integer."},
        },
        "required": ["a", "b"],
    }
    increment = described[None][7]["function"]["parameters"]
    assert increment["properties"]["by"]["type"] == "integer" and increment["required"] == ["by"]
    assert shared.has_reward(None) is True


@pytest.mark.parametrize(
    ("tool", "arguments", "error", "text"),
    [
        ("fail", {"reason": "no luck"}, "raised ValueError: no luck", "Error: tool fail raised ValueError: no luck"),
        ("as_dict", {"key": "k"}, "returned a dict, not text", "Error: tool as_dict returned a dict, not text"),
        ("sys_exit", {}, "raised SystemExit: 1", "Error: tool sys_exit raised SystemExit: 1"),
        ("nope", {}, "unknown tool 'nope'", "Error: unknown tool 'nope' (the tools are: add, fail,"),
        ("add", [1, 2], "expected a JSON object of named arguments, got an array", "Error: tool add got bad"),
        ("add", "a=1", "got a string", "Error: tool add got bad arguments"),
        (["add"], {}, "the tool name is an array, not text", "Error: the tool name is an array, not text"),
        ("add", {"a": 1}, "got bad arguments: missing a required argument: 'b'", "Error: tool add got bad"),
        ("add", {"a": 1, "b": 2, "c": 3}, "unexpected keyword argument 'c'", "Error: tool add got bad arguments"),
    ],
)
def test_faults_that_the_child_survives_are_failed_answers(
    shared: ToolProcess, tool: object, arguments: object, error: str, text: str
) -> None:
    conversation = begin(shared)
    assert shared.call(conversation, "increment", {"by": 5}).text == "5"
    pid = shared.pid
    answer = shared.call(conversation, tool, arguments)
    assert answer.failed and answer.error is not None and error in answer.error, answer
    assert answer.text.startswith(text), answer
    assert shared.pid == pid  # the same child, with the environment's state
    assert shared.call(conversation, "increment", {"by": 1}) == ToolAnswer(text="6", failed=False)


def test_a_hanging_tool_times_out_then_the_next_call_is_fast(shared: ToolProcess) -> None:
    conversation = begin(shared)
    pid = shared.pid
    assert pid is not None
    started = time.monotonic()
    answer = shared.call(conversation, "hang", {"seconds": 60})
    waited = time.monotonic() - started
    assert answer == ToolAnswer(text="Error: tool hang timed out after 1 s", failed=True, error="timed out after 1 s")
    assert TIMEOUT_S * 0.9 <= waited < TIMEOUT_S + 2
    assert not alive(pid)  # killed, not left sleeping
    started = time.monotonic()
    assert shared.call(begin(shared), "add", {"a": 1, "b": 1}).text == "2"
    assert time.monotonic() - started < 3  # a new child, not a wait on the old one
    assert shared.pid not in (None, pid)


@pytest.mark.parametrize(
    ("tool", "arguments", "how"),
    [("exit_hard", {"code": 3}, "exit code 3"), ("segfault", {}, "killed by signal SIGSEGV")],
)
def test_a_tool_that_kills_the_child_is_a_failed_answer(
    shared: ToolProcess, tool: str, arguments: dict, how: str
) -> None:
    conversation = begin(shared)
    pid = shared.pid
    answer = shared.call(conversation, tool, arguments)
    assert answer.failed and answer.error == f"the tool process died ({how})", answer
    assert answer.text == f"Error: tool {tool} failed: the tool process died ({how})"
    assert pid is not None and not alive(pid)
    assert shared.call(begin(shared), "add", {"a": 1, "b": 2}) == ToolAnswer(text="3", failed=False)


def test_the_child_ignores_sigint(shared: ToolProcess) -> None:
    conversation = begin(shared)
    pid = shared.pid
    assert pid is not None
    os.kill(pid, signal.SIGINT)
    time.sleep(0.1)
    assert shared.call(conversation, "add", {"a": 1, "b": 2}).text == "3"
    assert shared.pid == pid


def test_an_environment_keeps_state_per_conversation(shared: ToolProcess) -> None:
    first, second = begin(shared, answer="4"), begin(shared, answer="4")
    assert shared.call(first, "increment", {"by": 2}).text == "2"
    assert shared.call(second, "increment", {"by": 1}).text == "1"
    assert shared.call(first, "increment", {"by": 2}).text == "4"
    assert shared.reward(first) == 1.0
    assert shared.reward(second) == 0.0
    assert shared.call(first, "whoami", {}).text != shared.call(second, "whoami", {}).text


def test_reset_gets_the_prompt_and_answer_and_its_text_comes_back(shared: ToolProcess) -> None:
    assert shared.start("reset-text", None, "Count to seven.", "7") == "The count is 0; bring it to 7."
    with pytest.raises(EnvironmentFailed, match=r"agent\.environment: reset\(\) raised RuntimeError: cannot reset"):
        shared.start("exploding", None, "explode", None)
    with pytest.raises(ValueError, match="was not started"):
        shared.call("exploding", "add", {"a": 1, "b": 1})


def test_a_reward_of_the_wrong_type_fails_the_environment(shared: ToolProcess) -> None:
    conversation = begin(shared, answer="not a number")
    with pytest.raises(EnvironmentFailed, match=r"get_reward\(\) returned a str, not a number"):
        shared.reward(conversation)


def test_an_ended_conversations_instance_is_reused_and_reset_again(shared: ToolProcess) -> None:
    first = begin(shared)
    instance, resets = shared.call(first, "whoami", {}).text.removeprefix("instance ").split(", reset ")
    shared.call(first, "increment", {"by": 9})
    shared.end(first)
    second = begin(shared, answer="0")
    assert shared.call(second, "whoami", {}).text == f"instance {instance}, reset {int(resets.split()[0]) + 1} times"
    assert shared.reward(second) == 1.0  # reset to 0
    third = begin(shared)  # the pool is empty while the second one runs: a new instance
    assert not shared.call(third, "whoami", {}).text.startswith(f"instance {instance},")


def test_a_crash_loses_the_environment_but_not_the_tools(shared: ToolProcess) -> None:
    conversation = begin(shared)
    assert shared.call(conversation, "increment", {"by": 1}).text == "1"
    assert shared.call(conversation, "exit_hard", {"code": 3}).failed
    for tool, arguments in (("increment", {"by": 1}), ("add", {"a": 1, "b": 1})):
        assert shared.call(conversation, tool, arguments) == ToolAnswer(text=f"Error: {LOST}", failed=True, error=LOST)
    with pytest.raises(EnvironmentFailed, match="environment lost: the tool process restarted"):
        shared.reward(conversation)
    shared.end(conversation)
    fresh = begin(shared)
    assert shared.call(fresh, "increment", {"by": 1}).text == "1"
    assert shared.call(fresh, "add", {"a": 1, "b": 1}).text == "2"


class Interrupted(Exception):
    pass


def test_an_exception_while_waiting_kills_the_child(shared: ToolProcess) -> None:
    conversation = begin(shared)
    pid = shared.pid
    assert pid is not None

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupt)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        timer.start()
        with pytest.raises(Interrupted):
            shared.call(conversation, "hang", {"seconds": 60})
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)
    assert not alive(pid)  # its late answer can never be read as the next call's
    assert shared.call(conversation, "increment", {"by": 1}).error == LOST
    assert shared.call(begin(shared), "add", {"a": 2, "b": 2}).text == "4"


def test_named_environments_and_one_without_a_reward() -> None:
    with ToolProcess([T + "add"], {"counter": T + "Counter", "notebook": T + "make_notebook"}, TIMEOUT_S) as process:
        described = process.describe()
        assert {name: names(schemas) for name, schemas in described.items()} == {
            "counter": ["add", "increment", "whoami"],
            "notebook": ["add", "read", "write"],
        }
        assert process.has_reward("counter") and not process.has_reward("notebook")
        assert process.start("n", "notebook", "take notes", None) is None
        assert process.call("n", "write", {"text": "first"}).text == "ok"
        assert process.call("n", "write", {"text": "second"}).text == "ok"
        assert process.call("n", "read", {}).text == "first\nsecond"
        assert process.call("n", "increment", {"by": 1}).error.startswith("unknown tool 'increment'")
        assert process.reward("n") is None
        assert process.start("c", "counter", "count", "2") == "The count is 0; bring it to 2."
        with pytest.raises(ValueError, match="unknown environment None"):
            process.start("x", None, "count", "2")
        with pytest.raises(ValueError, match="unknown environment 'other'"):
            process.start("x", "other", "count", "2")


def test_without_environments_tools_survive_a_crash() -> None:
    with ToolProcess([T + "add", T + "exit_hard"], None, TIMEOUT_S) as process:
        assert names(process.describe()[None]) == ["add", "exit_hard"]
        assert process.has_reward(None) is False
        assert process.start("c", None, "p", None) is None
        assert process.call("c", "exit_hard", {"code": 4}).error == "the tool process died (exit code 4)"
        assert process.call("c", "add", {"a": 1, "b": 2}) == ToolAnswer(text="3", failed=False)
        assert process.reward("c") is None


def test_a_quick_tool_answers_at_once_under_a_long_timeout() -> None:
    with ToolProcess([T + "add"], None, timeout_s=600) as process:
        process.start("c", None, "p", None)
        started = time.monotonic()
        assert process.call("c", "add", {"a": 1, "b": 2}).text == "3"
        assert time.monotonic() - started < 1


@pytest.mark.parametrize(
    ("tools", "environments", "message"),
    [
        (["tests.support.no_such_module:f"], None, r"agent\.tools\.0: cannot import module 'tests\.support\.no_such"),
        ([T + "add", T + "NOT_CALLABLE"], None, r"agent\.tools\.1: .*NOT_CALLABLE' is an int, not callable"),
        ([T + "missing"], None, r"agent\.tools\.0: module 'tests\.support\.agent_tools' has no attribute 'missing'"),
        (["add"], None, r"agent\.tools\.0: 'add' is not 'package\.module:function'"),
        ([T + "untyped"], None, r"agent\.tools\.0: cannot describe tool .*untyped.*type hint"),
        ([T + "undocumented"], None, r"agent\.tools\.0: cannot describe tool .*undocumented.*docstring"),
        ([T + "add", T + "add"], None, r"agent\.tools\.1: a second tool named 'add' \(agent\.tools\.0 has it\)"),
        ([], {None: T + "NoReset"}, r"agent\.environment: .*NoReset' made a NoReset without a reset\(\) method"),
        ([], {"bad": T + "NoReset"}, r"agent\.environment\.bad: .*without a reset\(\) method"),
        ([], {"e": T + "NOT_CALLABLE"}, r"agent\.environment\.e: .* is an int, not callable; name a factory"),
    ],
)
def test_unusable_tools_and_environments_are_setup_errors(
    tools: list[str], environments: dict | None, message: str
) -> None:
    with ToolProcess(tools, environments, TIMEOUT_S) as process, pytest.raises(ToolSetupError, match=message):
        process.describe()


def test_the_child_exits_on_eof() -> None:
    with ToolProcess([T + "add"], None, TIMEOUT_S) as process:
        process.describe()
        child = process._process
        assert child is not None and process._connection is not None
        process._connection.close()  # as when the worker dies: EOF on the socket
        assert child.wait(timeout=10) == 0


def test_a_busy_child_dies_with_its_parent(tmp_path: Path) -> None:
    code = (
        "import os; from worker.generate.tool_process import ToolProcess; "
        f"p = ToolProcess([{T + 'hang'!r}], None, 60); p.start('c', None, 'p', None); print('PID', p.pid); "
        "import threading, time; threading.Thread(target=p.call, args=('c', 'hang', {'seconds': 60})).start(); "
        "time.sleep(0.5); os._exit(0)"  # the child is busy in the tool: it reads no EOF
    )
    output = tmp_path / "parent.out"
    with output.open("w") as stdout:  # a file, not a pipe: an orphaned child would hold a pipe open
        subprocess.run([sys.executable, "-c", code], stdout=stdout, timeout=60, check=True)
    pid = int(output.read_text().split("PID ")[1].split()[0])
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)
