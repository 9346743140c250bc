"""Agent tools and environments, run in a long-lived child process (one or several per worker: ``sibling``).

The contract is TRL's. A *tool* is a typed Python function with a Google-style docstring, named
``package.module:function``; what the model sees of it is ``transformers.utils.get_json_schema(function)``.
An *environment* is a factory ``package.module:Factory`` (a class, or any callable returning an instance) whose
instance has:

* ``reset(**kwargs)``: called when a conversation starts; returns ``None`` or a text that the caller appends to
  the last user message. It gets ``prompt=<the prompt text>`` and ``answer=<the answer or None>`` for each of
  the two that its signature names (or all of them when it takes ``**kwargs``); ``reset()`` with no parameter
  gets nothing;
* optionally ``get_reward()``: a finite number, read when the conversation ends; the environment then owns the
  reward (``has_reward``);
* its other public methods (on its class, not starting with ``_``, not ``reset``/``get_reward``): tools of that
  environment, described by ``get_json_schema`` of the bound method.

There may be several named environments (``{name: factory}``); a conversation picks one by name (``None``: the
one unnamed environment, or no environment when none is configured). Instances are pooled as TRL does:
constructed once (one per environment while probing, then whenever the pool is empty), and an ended
conversation's instance goes back to its pool, to be ``reset`` by a later conversation.

Faults. User code runs in a child process, so that nothing it does can kill or stall the worker:

* the child is a fresh interpreter (as ``worker.algo.math_scoring``: the parent's ``sys.path``, no copy of a
  CUDA context or of other threads), in its own process group, ignoring SIGINT, and gone with the worker
  (``PR_SET_PDEATHSIG`` where Linux offers it, and EOF on its socket). Linux sends that signal when the
  *thread* that started the child ends: start it from a thread that lives as long as the worker (the task
  thread of Celery's solo pool does). Requests and answers are JSON, never pickle: a tool's return value is
  never unpickled here;
* the first use (``describe``) imports every tool and environment, builds every schema and constructs one
  instance of each environment: whatever cannot be used raises ``ToolSetupError``, naming the config field
  (``agent.tools.<i>``, ``agent.environment`` or ``agent.environment.<name>``);
* ``call`` never raises for the model's or the tool's faults: it answers ``ToolAnswer(failed=True)`` with an
  error observation the model reads, when the tool is unknown, the arguments are not a JSON object that binds
  to its signature, it raises (any ``BaseException``, ``SystemExit`` included: the child goes on), returns
  anything but a ``str``, runs past ``timeout_s`` (the child's process group is killed, and the next request
  starts a new child) or kills the child (``os._exit``, a signal);
* when the child dies or is killed, the environment instances in it are gone: each conversation that held one
  is *lost*: its later calls answer failed (``environment lost: the tool process restarted``), ``reward``
  raises ``EnvironmentFailed``. Conversations without an environment, and standalone tools, carry on;
* ``reset`` and ``get_reward`` that raise, return a wrong type or run past ``timeout_s`` raise
  ``EnvironmentFailed`` (the caller drops that rollout); an instance whose reset failed is dropped, not pooled.
  A ``start`` that must construct a new instance first gets ``start_timeout_s`` for both;
* anything raised while this process waits for an answer (a preemption hand-back in the task thread) kills the
  child, so that a late answer can never be read as the next request's.

One request is in flight at a time (a lock around each exchange): the class is safe to share between threads.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import importlib
import inspect
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import structlog

log = structlog.get_logger()

LOST = "environment lost: the tool process restarted"
# Methods of an environment that are its protocol, never tools.
RESERVED_METHODS = frozenset({"reset", "get_reward"})
# Longest error text (an exception's message) sent back from the child.
MAX_ERROR_CHARS = 2000
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


@dataclass(frozen=True)
class ToolAnswer:
    """One tool call's outcome: ``text`` is the tool message the model sees (the result or an error
    observation); ``failed`` counts as a tool failure; ``error`` says why, for logs and statistics."""

    text: str
    failed: bool
    error: str | None = None


class ToolSetupError(ValueError):
    """A tool or environment that cannot be used; the message names the config field and what to change."""


class EnvironmentFailed(RuntimeError):
    """``reset()`` or ``get_reward()`` failed, or the conversation's instance was lost with a dead child."""


def _field(environment: str | None) -> str:
    return "agent.environment" if environment is None else f"agent.environment.{environment}"


def _clip(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."


def _raised(error: BaseException) -> str:
    message = str(error)
    return _clip(f"raised {type(error).__name__}: {message}" if message else f"raised {type(error).__name__}")


def _a(kind: str) -> str:
    return f"{'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind}"


def _json_kind(value: object) -> str:
    kinds = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else kinds.get(type(value), _a(type(value).__name__))


def _text_for(name: str, error: str) -> str:
    """The error observation the model reads in place of a result."""
    return f"Error: tool {name} {error}"


# ---------------------------------------------------------------------------------------------------------
# The child side: imports the user's code and serves one request at a time.


class _SetupFault(Exception):
    """Raised in the child: becomes ``ToolSetupError`` in the parent."""


def _load(spec: str, field: str, kind: str) -> Callable[..., Any]:
    """``package.module:attribute``, imported; any fault (``SystemExit`` at import too) is a setup fault."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise _SetupFault(f"{field}: {spec!r} is not 'package.module:{kind}'; name the {kind} that way")
    try:
        module = importlib.import_module(module_name)
    except BaseException as error:
        raise _SetupFault(
            f"{field}: cannot import module {module_name!r} ({_raised(error)}); make it importable from the "
            "worker's Python path"
        ) from None
    value = getattr(module, attribute, None)
    if value is None:
        raise _SetupFault(f"{field}: module {module_name!r} has no attribute {attribute!r}")
    if not callable(value):
        raise _SetupFault(f"{field}: {spec!r} is {_a(type(value).__name__)}, not callable; name a {kind}")
    return value


def _schema(function: Callable[..., Any], field: str, what: str) -> dict[str, Any]:
    from transformers.utils import get_json_schema  # only while probing: a restarted child starts faster

    try:
        return get_json_schema(function)
    except Exception as error:
        raise _SetupFault(
            f"{field}: cannot describe {what} to the model ({type(error).__name__}: {error}); give every "
            "argument a type hint and a line in the docstring's Google-style 'Args:' section"
        ) from None


def _method_names(instance: object) -> list[str]:
    """An instance's tools, listed on its class as TRL does."""
    return [
        name
        for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
        if not name.startswith("_") and name not in RESERVED_METHODS
    ]


def _reset_arguments(reset: Callable[..., Any], prompt: str, answer: str | None) -> dict[str, Any]:
    try:
        parameters = inspect.signature(reset).parameters
    except (TypeError, ValueError):
        return {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    offered = {"prompt": prompt, "answer": answer}
    return {key: value for key, value in offered.items() if takes_any or key in parameters}


def _call_tool(tool: Callable[..., Any], arguments: object) -> tuple[str | None, str | None]:
    """(result, None) or (None, why it failed)."""
    if not isinstance(arguments, dict):
        return None, f"got bad arguments: expected a JSON object of named arguments, got {_json_kind(arguments)}"
    try:
        inspect.signature(tool).bind(**arguments)
    except TypeError as error:
        return None, f"got bad arguments: {error}"
    except ValueError:
        pass  # no signature to check (a builtin): the call itself decides
    try:
        result = tool(**arguments)
    except BaseException as error:  # SystemExit and KeyboardInterrupt are the tool's faults too
        return None, _raised(error)
    if not isinstance(result, str):
        return None, f"returned {_a(type(result).__name__)}, not text"
    return result, None


class _Child:
    """The child's state: the imported tools and factories, the pools, the live conversations' instances."""

    def __init__(self, tools: Sequence[str], environments: Sequence[tuple[str | None, str]]) -> None:
        self.tool_specs = list(tools)
        self.tools: dict[str, Callable[..., Any]] = {}
        fields: dict[str, str] = {}
        for index, spec in enumerate(tools):
            field = f"agent.tools.{index}"
            function = _load(spec, field, "function")
            name = getattr(function, "__name__", spec.partition(":")[2])
            if name in self.tools:
                raise _SetupFault(f"{field}: a second tool named {name!r} ({fields[name]} has it); rename one")
            self.tools[name], fields[name] = function, field
        self.factories = {name: _load(spec, _field(name), "factory") for name, spec in environments}
        self.specs = dict(environments)
        self.pools: dict[str | None, list[object]] = {name: [] for name in self.factories}
        self.conversations: dict[str, tuple[object, dict[str, Callable[..., Any]]]] = {}

    def describe(self) -> list[list[Any]]:
        """``[name, schemas, has_reward]`` per environment (one ``None`` entry without environments), having
        constructed and checked one instance of each, which stays in its pool."""
        schemas = [
            _schema(function, f"agent.tools.{index}", f"tool {spec!r}")
            for index, (spec, function) in enumerate(zip(self.tool_specs, self.tools.values(), strict=True))
        ]
        if not self.factories:
            return [[None, schemas, False]]
        described = []
        for name, factory in self.factories.items():
            field, spec = _field(name), self.specs[name]
            try:
                instance = factory()
            except BaseException as error:
                raise _SetupFault(f"{field}: constructing {spec!r} {_raised(error)}") from None
            if not callable(getattr(instance, "reset", None)):
                raise _SetupFault(
                    f"{field}: {spec!r} made {_a(type(instance).__name__)} without a reset() method; an "
                    "environment needs reset(), returning None or a text to append to the prompt"
                )
            has_reward = hasattr(instance, "get_reward")
            if has_reward and not callable(instance.get_reward):
                raise _SetupFault(f"{field}: {spec!r}: get_reward is not a method; make it one, or remove it")
            methods = []
            for method in _method_names(instance):
                if method in self.tools:
                    raise _SetupFault(
                        f"{field}: method {method!r} of {spec!r} has the name of a tool in agent.tools; rename one"
                    )
                methods.append(_schema(getattr(instance, method), field, f"method {method!r} of {spec!r}"))
            self.pools[name].append(instance)
            described.append([name, schemas + methods, has_reward])
        return described

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request["op"]
        if op == "call":
            return self._call(request["conversation"], request["tool"], request["arguments"])
        if op == "start":
            return self._start(request["conversation"], request["environment"], request["prompt"], request["answer"])
        if op == "reward":
            return self._reward(request["conversation"])
        if op == "end":
            ended = self.conversations.pop(request["conversation"], None)
            if ended is not None:
                self.pools[request["environment"]].append(ended[0])
            return {"value": None, "error": None}
        return {"value": None, "error": f"unknown request {op!r}"}

    def _call(self, conversation: str | None, name: str, arguments: object) -> dict[str, Any]:
        methods: dict[str, Callable[..., Any]] = {}
        if conversation is not None:
            if conversation not in self.conversations:
                return {"value": None, "error": LOST, "plain": True}
            methods = self.conversations[conversation][1]
        tool = methods.get(name) or self.tools.get(name)
        if tool is None:
            names = ", ".join([*self.tools, *methods]) or "none"
            return {"value": None, "error": f"unknown tool {name!r} (the tools are: {names})", "plain": True}
        result, error = _call_tool(tool, arguments)
        return {"value": result, "error": error}

    def _start(self, conversation: str, environment: str | None, prompt: str, answer: str | None) -> dict[str, Any]:
        pool = self.pools[environment]
        if pool:
            instance = pool.pop()
        else:
            try:
                instance = self.factories[environment]()
            except BaseException as error:
                return {"value": None, "error": f"constructing the environment {_raised(error)}"}
        try:
            text = instance.reset(**_reset_arguments(instance.reset, prompt, answer))
        except BaseException as error:
            return {"value": None, "error": f"reset() {_raised(error)}"}  # the instance is dropped, not pooled
        if text is not None and not isinstance(text, str):
            return {"value": None, "error": f"reset() returned {_a(type(text).__name__)}, not text or None"}
        methods = {name: getattr(instance, name) for name in _method_names(instance)}
        self.conversations[conversation] = (instance, methods)
        return {"value": text, "error": None}

    def _reward(self, conversation: str) -> dict[str, Any]:
        if conversation not in self.conversations:
            return {"value": None, "error": LOST}
        try:
            value = self.conversations[conversation][0].get_reward()
        except BaseException as error:
            return {"value": None, "error": f"get_reward() {_raised(error)}"}
        if isinstance(value, bool) or not isinstance(value, int | float):
            return {"value": None, "error": f"get_reward() returned {_a(type(value).__name__)}, not a number"}
        if not math.isfinite(value):
            return {"value": None, "error": f"get_reward() returned {value}, not a finite number"}
        return {"value": float(value), "error": None}


def _send(connection: Connection, message: dict[str, Any]) -> None:
    connection.send_bytes(json.dumps(message).encode())


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL when the parent goes (Linux), so that a child stuck in user code never outlives its worker."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def _serve(fd: int, parent_pid: int, config_text: str) -> None:
    """The child's loop: set up (and probe, on the first start), then answer requests until EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent, which decides when this process ends
    _die_with_parent(parent_pid)
    connection = Connection(fd)
    config = json.loads(config_text)
    try:
        child = _Child(config["tools"], [(name, spec) for name, spec in config["environments"]])
        described = child.describe() if config["probe"] else None
    except _SetupFault as fault:
        _send(connection, {"value": None, "error": str(fault), "setup": True})
        return
    except BaseException as error:  # a fault outside the user's code paths above: still the setup's
        _send(connection, {"value": None, "error": f"setting up the tools {_raised(error)}", "setup": True})
        return
    _send(connection, {"value": described, "error": None})
    while True:
        try:
            request = json.loads(connection.recv_bytes())
        except (EOFError, OSError):
            return  # the parent closed the socket or died
        try:
            answer = child.handle(request)
        except Exception as error:  # a request this loop did not foresee: an answer still, never a dead child
            answer = {"value": None, "error": f"the tool process could not serve the request: {_raised(error)}"}
        _send(connection, answer)


# The child's command: the parent's import path first (as multiprocessing's spawn passes it), then the loop.
_CHILD_CODE = (
    "import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
    "from worker.generate.tool_process import _serve; _serve(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])"
)


# ---------------------------------------------------------------------------------------------------------
# The parent side.


class _ChildLost(Exception):
    """The child timed out (and was killed), died, or could not restart: ``str(self)`` says which."""

    def __init__(self, reason: str, timed_out: bool = False) -> None:
        super().__init__(reason)
        self.timed_out = timed_out


@dataclass
class _Conversation:
    environment: str | None
    generation: int | None  # the child holding its instance; None: no environment instance


class ToolProcess:
    """Tools and environments in a child process (see the module docstring for the contract and the faults)."""

    def __init__(
        self,
        tools: Sequence[str],
        environments: Mapping[str | None, str] | None,
        timeout_s: float,
        start_timeout_s: float = 120.0,
    ) -> None:
        if timeout_s <= 0 or start_timeout_s <= 0:
            raise ValueError(f"timeouts must be positive; got timeout_s={timeout_s}, start_timeout_s={start_timeout_s}")
        self.tools = list(tools)
        self.environments = dict(environments or {})
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._lock = threading.Lock()  # one request in flight on the socket; guards the state below too
        self._process: subprocess.Popen[bytes] | None = None
        self._connection: Connection | None = None
        self._generation = 0  # counts children started: an instance lives in the child of its generation
        self._idle: dict[str | None, int] = {}  # pooled instances in the current child, per environment
        self._schemas: dict[str | None, list[dict[str, Any]]] | None = None
        self._rewards: dict[str | None, bool] = {}
        self._conversations: dict[str, _Conversation] = {}

    def sibling(self) -> ToolProcess:
        """Another tool process for the same tools and environments, described by this one's probe: its child
        starts at its first request, probing nothing again. Instances never cross between the two, so a fault in
        one costs the other's conversations nothing."""
        with self._lock:
            schemas = copy.deepcopy(self._described())
            other = ToolProcess(self.tools, self.environments, self.timeout_s, self.start_timeout_s)
            other._schemas, other._rewards = schemas, dict(self._rewards)
            return other

    @property
    def pid(self) -> int | None:
        """The child's process id while one runs."""
        return self._process.pid if self._process is not None and self._process.poll() is None else None

    def describe(self) -> dict[str | None, list[dict[str, Any]]]:
        """Per environment name (``None`` without environments), the JSON schemas its conversations see:
        the standalone tools, then the environment's methods. The first call starts and probes the child."""
        with self._lock:
            return copy.deepcopy(self._described())

    def has_reward(self, environment: str | None) -> bool:
        with self._lock:
            self._described()
            return self._rewards[self._environment(environment)]

    def start(self, conversation: str, environment: str | None, prompt: str, answer: str | None) -> str | None:
        """Begin a conversation: take (or construct) an instance of ``environment`` and reset it. Returns
        reset's text (``None`` without an environment); raises ``EnvironmentFailed``."""
        with self._lock:
            self._described()
            environment = self._environment(environment)
            if conversation in self._conversations:
                raise ValueError(f"conversation {conversation!r} has started already; end it first")
            if environment not in self.environments:
                self._conversations[conversation] = _Conversation(environment, None)
                return None
            pooled = self._live() is not None and self._idle.get(environment, 0) > 0
            request = {"op": "start", "conversation": conversation, "environment": environment}
            request |= {"prompt": prompt, "answer": answer}
            try:
                self._ensure_child()
                if pooled:
                    self._idle[environment] -= 1  # the child takes it whatever reset does
                answer_ = self._exchange(request, self.timeout_s if pooled else self.start_timeout_s, "reset")
            except _ChildLost as lost:
                raise EnvironmentFailed(f"{_field(environment)}: starting a conversation failed: {lost}") from None
            if answer_["error"] is not None:
                raise EnvironmentFailed(f"{_field(environment)}: {answer_['error']}")
            self._conversations[conversation] = _Conversation(environment, self._generation)
            return answer_["value"]

    def call(self, conversation: str, name: str, arguments: object) -> ToolAnswer:
        """Run tool ``name`` as ``tool(**arguments)``; never raises for the model's or the tool's faults."""
        with self._lock:
            state = self._conversation(conversation)
            if self._lost(state):
                return ToolAnswer(text=f"Error: {LOST}", failed=True, error=LOST)
            if not isinstance(name, str):
                why = f"the tool name is {_json_kind(name)}, not text"
                return ToolAnswer(text=f"Error: {why}", failed=True, error=why)
            request = {"op": "call", "conversation": None if state.generation is None else conversation, "tool": name}
            try:
                encoded = json.dumps(request | {"arguments": arguments})
            except (TypeError, ValueError) as error:
                why = f"got bad arguments: not JSON ({error})"
                return ToolAnswer(text=_text_for(name, why), failed=True, error=why)
            try:
                self._ensure_child()
                answer = self._exchange(encoded, self.timeout_s, name)
            except _ChildLost as lost:
                text = _text_for(name, str(lost) if lost.timed_out else f"failed: {lost}")
                return ToolAnswer(text=text, failed=True, error=str(lost))
            error = answer["error"]
            if error is None:
                return ToolAnswer(text=answer["value"], failed=False)
            text = f"Error: {error}" if answer.get("plain") else _text_for(name, error)
            return ToolAnswer(text=text, failed=True, error=error)

    def reward(self, conversation: str) -> float | None:
        """The environment's ``get_reward()``; ``None`` when it has none. Raises ``EnvironmentFailed``."""
        with self._lock:
            state = self._conversation(conversation)
            if state.generation is None or not self._rewards[state.environment]:
                return None
            if self._lost(state):
                raise EnvironmentFailed(f"{_field(state.environment)}: {LOST}")
            try:
                answer = self._exchange({"op": "reward", "conversation": conversation}, self.timeout_s, "get_reward")
            except _ChildLost as lost:
                raise EnvironmentFailed(f"{_field(state.environment)}: get_reward() failed: {lost}") from None
            if answer["error"] is not None:
                raise EnvironmentFailed(f"{_field(state.environment)}: {answer['error']}")
            return answer["value"]

    def end(self, conversation: str) -> None:
        """Forget the conversation; its instance returns to its environment's pool (unless it was lost)."""
        with self._lock:
            state = self._conversations.pop(conversation, None)
            if state is None or state.generation is None or self._lost(state):
                return
            request = {"op": "end", "conversation": conversation, "environment": state.environment}
            try:
                self._exchange(request, self.timeout_s, "end")
            except _ChildLost:
                return  # the instance is gone with the child: nothing to give back
            self._idle[state.environment] = self._idle.get(state.environment, 0) + 1

    def close(self) -> None:
        """Stop the child; every conversation ends. A later request starts a new child."""
        with self._lock:
            self._stop()
            self._conversations.clear()

    def __enter__(self) -> ToolProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the parent's bookkeeping

    def _described(self) -> dict[str | None, list[dict[str, Any]]]:
        if self._schemas is None:
            self._spawn(probe=True)
        assert self._schemas is not None
        return self._schemas

    def _environment(self, environment: str | None) -> str | None:
        if environment not in self._rewards:
            names = ", ".join(repr(name) for name in self._rewards)
            raise ValueError(f"unknown environment {environment!r}; the agent's environments are: {names}")
        return environment

    def _conversation(self, conversation: str) -> _Conversation:
        state = self._conversations.get(conversation)
        if state is None:
            raise ValueError(f"conversation {conversation!r} was not started (or has ended): call start() first")
        return state

    def _live(self) -> int | None:
        """The running child's generation; None when there is none (one that died is reaped and logged)."""
        if self._process is not None and self._process.poll() is not None:
            log.warning("generate.tool_process.died", pid=self._process.pid, reason=self._stop(), tool=None)
        return self._generation if self._process is not None else None

    def _lost(self, state: _Conversation) -> bool:
        return state.generation is not None and state.generation != self._live()

    def _ensure_child(self) -> None:
        if self._live() is None:
            self._spawn(probe=False)

    def _spawn(self, probe: bool) -> None:
        """Start a child; on ``probe`` also import, describe and construct everything (setup errors raise
        ``ToolSetupError``); otherwise a fault raises ``_ChildLost``."""
        self._stop()
        config = {"tools": self.tools, "environments": [[k, v] for k, v in self.environments.items()], "probe": probe}
        parent_end, child_end = socket.socketpair()
        command = [sys.executable, "-c", _CHILD_CODE, json.dumps([str(entry) for entry in sys.path])]
        command += [str(child_end.fileno()), str(os.getpid()), json.dumps(config)]
        try:
            # Its own process group: a timeout kills what the tool started too, and a terminal's Ctrl-C skips it.
            self._process = subprocess.Popen(
                command, pass_fds=(child_end.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True
            )
        except BaseException:
            parent_end.close()
            raise
        finally:
            child_end.close()  # only the child holds it now: its death reads as EOF here
        self._connection = Connection(parent_end.detach())
        self._generation += 1
        try:
            ready = self._exchange(None, self.start_timeout_s, None)
        except _ChildLost as lost:
            if probe:
                raise ToolSetupError(
                    f"the tool process failed while importing and probing agent.tools and agent.environment: {lost}"
                ) from None
            raise _ChildLost(f"the tool process could not restart: {lost}") from None
        if ready["error"] is not None:
            self._stop()
            if probe:
                raise ToolSetupError(ready["error"])
            raise _ChildLost(f"the tool process could not restart: {ready['error']}")
        log.info("generate.tool_process.started", pid=self._process.pid, generation=self._generation, probe=probe)
        self._idle = {name: 0 for name in self.environments}
        if probe:
            self._schemas = {name: schemas for name, schemas, _ in ready["value"]}
            self._rewards = {name: has_reward for name, _, has_reward in ready["value"]}
            self._idle = {name: 1 for name in self.environments}

    def _exchange(self, request: dict[str, Any] | str | None, deadline_s: float, tool: str | None) -> dict[str, Any]:
        """Send ``request`` (none: only wait for the ready message) and read its answer within ``deadline_s``."""
        connection, process = self._connection, self._process
        assert connection is not None and process is not None
        try:
            if request is not None:
                connection.send_bytes((request if isinstance(request, str) else json.dumps(request)).encode())
            answered = connection.poll(deadline_s)
            raw = connection.recv_bytes() if answered else None
        except (EOFError, OSError):
            reason = self._stop()
            log.warning("generate.tool_process.died", pid=process.pid, reason=reason, tool=tool)
            raise _ChildLost(f"the tool process died ({reason})") from None
        except BaseException:
            self._stop()  # e.g. WorkerPreempted while waiting: the child's answer would come late
            log.warning("generate.tool_process.interrupted", pid=process.pid, tool=tool)
            raise
        if raw is None:
            self._stop()
            log.warning("generate.tool_process.timeout_killed", pid=process.pid, tool=tool, timeout_s=deadline_s)
            raise _ChildLost(f"timed out after {deadline_s:g} s", timed_out=True)
        return json.loads(raw)

    def _stop(self) -> str | None:
        """Kill the child's process group and reap the child; how it ended (None when none ran)."""
        process, connection = self._process, self._connection
        self._process = self._connection = None
        if connection is not None:
            connection.close()
        if process is None:
            return None
        try:
            os.killpg(process.pid, signal.SIGKILL)  # safe: an unreaped child still owns its pid and group
        except (ProcessLookupError, PermissionError):
            process.kill()
        code = process.wait()
        if code < 0:
            try:
                return f"killed by signal {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"
