"""How a Lua script is declared, loaded, registered and called (redis-py's ``Lock`` is the model).

A script lives in ``lua/<name>.lua`` (read with ``importlib.resources``, so it works from an installed wheel)
and starts with comment lines that state its contract, in this form::

    -- <name>: what it does
    -- KEYS[1] <RunKeys attribute>  KEYS[2] ...
    -- ARGV[1] prefix  ARGV[2] <argument> <what it is>  ...  ARGV[n..] <argument> (the rest, a list)
    -- returns {"OK", <field>, ...} | {"<CODE>", <field>, ...} (why) | ...

``lua/prelude.lua`` (the key helpers) is prepended at load time. The header is the one statement of the
script's KEYS (by ``RunKeys`` attribute), ARGV (by name) and reply fields: ``LuaScript.contract`` parses it. The
Python declaration (``scripts``) adds only what the header cannot say: which codes are answers (``answers``)
and, for every other code, the one exception of ``proxy.coordinator.errors`` it raises (``errors``).
``contract_problems`` finds every disagreement (a code neither answered nor mapped, a code the body returns
that the header omits, a refusal naming a value nobody has); a test runs it over every script.

A call reads like a method: ``store.scripts.grant_lease(now_ms=..., ttl_ms=..., ...)``. The store passes the
key prefix (``ARGV[1]``) and the keys; the answer is a ``ScriptReply`` with the code and named fields.
"""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from string import Template
from typing import Any

from redis import Redis
from redis.commands.core import Script

from proxy.coordinator import errors
from proxy.coordinator.errors import CoordinatorError
from proxy.coordinator.redis_keys import (
    GROUP_KIND,
    LEASE_KIND,
    ROLLOUT_KIND,
    STEP_KIND,
    TASK_KIND,
    WORKER_KIND,
    RunKeys,
)

LUA_PACKAGE = "proxy.coordinator"
LUA_FOLDER = "lua"
PRELUDE = "prelude"
NO_STATE = "NO_STATE"
"""The code of every script that finds no state for the run (raised as ``StateMissing``)."""


def lua_text(name: str) -> str:
    """The text of ``lua/<name>.lua`` as shipped in the package."""
    return (resources.files(LUA_PACKAGE) / LUA_FOLDER / f"{name}.lua").read_text(encoding="utf-8")


@functools.cache
def script_source(name: str) -> str:
    """The source sent to Redis: the prelude, with the key kinds of ``redis_keys`` filled in, then the script."""
    prelude = Template(lua_text(PRELUDE)).substitute(
        GROUP_KIND=GROUP_KIND,
        TASK_KIND=TASK_KIND,
        ROLLOUT_KIND=ROLLOUT_KIND,
        STEP_KIND=STEP_KIND,
        LEASE_KIND=LEASE_KIND,
        WORKER_KIND=WORKER_KIND,
    )
    return prelude + "\n" + lua_text(name)


@dataclass(frozen=True)
class Refusal:
    """A non-OK code: the exception it raises and its message.

    The message is a ``str.format`` template over the call's ARGV names, the reply's fields, ``run`` and
    ``code``. ``passed`` are reply fields handed to the exception after the message (e.g. the current version
    of a refused publish).
    """

    error: type[CoordinatorError]
    message: str
    passed: tuple[str, ...] = ()


@dataclass(frozen=True)
class ScriptReply:
    """A script's answer: its code and its fields by the names of the file header."""

    code: str
    fields: Mapping[str, Any]

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]


_KEY = re.compile(r"KEYS\[(\d+)\] (\w+)")
_ARG = re.compile(r"ARGV\[(\d+)(\.\.)?\] (\w+)")
_CODE = re.compile(r'\{"([A-Z_]+)"((?:, *\w+)*)\}')
# codes the body can return: a literal first element of a returned table, or assigned to `code` first
_BODY_CODE = re.compile(r"(?:return \{|code = )'([A-Z_]+)'")


class ScriptHeaderError(ValueError):
    """A ``lua/<name>.lua`` header that does not state a contract (misnumbered KEYS or ARGV)."""


@dataclass(frozen=True)
class ScriptContract:
    """What a script's file header states: the one source of its KEYS, ARGV and reply fields."""

    keys: tuple[str, ...]
    """``RunKeys`` attribute names, in KEYS order."""
    argv: tuple[str, ...]
    """ARGV names after ``prefix`` (ARGV[1]), in order; a last name starting with ``*`` takes a list."""
    codes: Mapping[str, tuple[str, ...]]
    """Every return code the header states, with its reply fields."""
    body_codes: frozenset[str]
    """The codes the body returns (a literal first element of a returned table)."""


def parse_contract(text: str) -> ScriptContract:
    """The contract stated by a script's header (its leading ``--`` lines)."""
    lines = text.splitlines()
    count = next((i for i, line in enumerate(lines) if not line.startswith("--")), len(lines))
    head, body = lines[:count], "\n".join(lines[count:])
    keys: list[tuple[int, str]] = []
    argv: list[tuple[int, str]] = []
    returns: list[str] = []
    for line in head:
        keys += [(int(i), name) for i, name in _KEY.findall(line)]
        argv += [(int(i), ("*" if rest else "") + name) for i, rest, name in _ARG.findall(line)]
        if returns or line.startswith("-- returns "):
            returns.append(line)
    for found, what in ((keys, "KEYS"), (argv, "ARGV")):
        numbers = [i for i, _ in found]
        if numbers != list(range(1, len(found) + 1)):
            raise ScriptHeaderError(f"{what} numbered {numbers} in the header")
    if [name for _, name in argv[:1]] != ["prefix"]:
        raise ScriptHeaderError("ARGV[1] must be prefix")
    codes = {
        code: tuple(part.strip() for part in fields.split(",") if part.strip())
        for code, fields in _CODE.findall(" ".join(returns))
    }
    return ScriptContract(
        keys=tuple(name for _, name in keys),
        argv=tuple(name for _, name in argv[1:]),
        codes=codes,
        body_codes=frozenset(_BODY_CODE.findall(body)),
    )


@dataclass(frozen=True)
class LuaScript:
    """One script: its file ``lua/<name>.lua`` states KEYS, ARGV and reply fields (``contract``); this adds
    which codes are answers and the exception of every other code."""

    name: str
    answers: tuple[str, ...] = ("OK",)
    """The codes that are answers; every other code is a refusal."""
    errors: Mapping[str, Refusal] = field(default_factory=dict)
    """Every other code, with the exception it raises."""

    @functools.cached_property
    def contract(self) -> ScriptContract:
        return parse_contract(lua_text(self.name))

    def args(self, values: Mapping[str, Any]) -> list[Any]:
        """The call's ARGV after the prefix, in the header's order; the names must match exactly."""
        argv = self.contract.argv
        names = [name.lstrip("*") for name in argv]
        if set(values) != set(names):
            raise TypeError(f"{self.name} takes {names}, got {sorted(values)}")
        out: list[Any] = []
        for name in argv:
            if name.startswith("*"):
                out.extend(values[name[1:]])
            else:
                out.append(values[name])
        return out

    def answer(self, reply: Sequence[Any], values: Mapping[str, Any], run: str) -> ScriptReply:
        """The reply as a ``ScriptReply``, or the mapped exception for a refusal."""
        code = reply[0]
        names = self.contract.codes.get(code, ())
        if len(reply) - 1 > len(names):
            raise RuntimeError(
                f"script {self.name} answered {code!r} with {len(reply) - 1} fields; its header states {list(names)}"
            )
        named = dict(zip(names, reply[1:], strict=False))
        if code in self.answers:
            return ScriptReply(code, named)
        refusal = self.errors.get(code)
        if refusal is None:
            raise RuntimeError(f"script {self.name} answered {code!r}, which its declaration does not know")
        message = refusal.message.format_map({**values, **named, "run": run, "code": code})
        raise refusal.error(message, *(named[name] for name in refusal.passed))


def contract_problems(script: LuaScript, text: str | None = None) -> list[str]:
    """Every way a declaration and its file disagree (empty when they agree): a code stated but neither an
    answer nor mapped to an exception, a code the body returns that the header does not state, a KEYS name
    that is not a ``RunKeys`` attribute, a refusal message naming a value the call and reply do not have."""
    try:
        contract = parse_contract(text) if text is not None else script.contract
    except ScriptHeaderError as error:
        return [str(error)]
    problems = []
    for name in contract.keys:
        if not isinstance(getattr(RunKeys, name, None), property):
            problems.append(f"KEYS: {name} is not a RunKeys attribute")
    if any(name.startswith("*") for name in contract.argv[:-1]):
        problems.append("ARGV: only the last argument may take a list")
    answers, refused = set(script.answers), set(script.errors)
    if answers & refused:
        problems.append(f"codes both answers and errors: {sorted(answers & refused)}")
    if "OK" not in answers:
        problems.append("no OK answer declared")
    if set(contract.codes) != answers | refused:
        problems.append(f"codes: header {sorted(contract.codes)}, declared {sorted(answers | refused)}")
    if not contract.body_codes <= set(contract.codes):
        problems.append(
            f"codes the body returns but the header omits: {sorted(contract.body_codes - set(contract.codes))}"
        )
    if not set(contract.codes) <= contract.body_codes:
        problems.append(
            f"codes the header states but the body never returns: {sorted(set(contract.codes) - contract.body_codes)}"
        )
    names = {name.lstrip("*") for name in contract.argv} | {"run", "code"}
    for code, refusal in script.errors.items():
        problems += _refusal_problems(code, refusal, names | set(contract.codes.get(code, ())))
    return problems


def _refusal_problems(code: str, refusal: Refusal, names: set[str]) -> list[str]:
    problems = []
    error = refusal.error
    if not (issubclass(error, CoordinatorError) and getattr(errors, error.__name__, None) is error):
        problems.append(f"{code} maps to {error!r}, not an exception of proxy.coordinator.errors")
    used = {name for _, name, _, _ in string.Formatter().parse(refusal.message) if name}
    if not used <= names:
        problems.append(f"{code} message uses {sorted(used - names)}, which neither ARGV nor the reply has")
    if not set(refusal.passed) <= names:
        problems.append(f"{code} passes {list(refusal.passed)} to {error.__name__}, not all in its reply")
    return problems


class BoundScript:
    """A declaration bound to one Redis client and the run's keys: call it with the ARGV names."""

    def __init__(
        self,
        script: LuaScript,
        redis: Redis,
        keys: Callable[[str], str],
        prefix: str,
        run: str,
    ) -> None:
        self.script = script
        # registered once per client: redis-py sends EVALSHA and loads the source only when Redis lacks it
        self._registered: Script = redis.register_script(script_source(script.name))
        self._keys = [keys(name) for name in script.contract.keys]
        self._prefix = prefix
        self._run = run

    def __call__(self, **values: Any) -> ScriptReply:
        args = [self._prefix, *self.script.args(values)]
        reply = self._registered(keys=self._keys, args=args)
        return self.script.answer(reply, values, self._run)
