"""How a Lua script is declared, loaded, registered and called (redis-py's ``Lock`` is the model).

A script lives in ``lua/<name>.lua`` (read with ``importlib.resources``, so it works from an installed wheel)
and starts with comment lines that state its contract, in this form::

    -- <name>: what it does
    -- KEYS[1] <RunKeys attribute>  KEYS[2] ...
    -- ARGV[1] prefix  ARGV[2] <argument> <what it is>  ...  ARGV[n..] <argument> (the rest, a list)
    -- returns {"OK", <field>, ...} | {"<CODE>", <field>, ...} (why) | ...

``lua/prelude.lua`` (the key helpers) is prepended at load time. A ``LuaScript`` declaration restates that
contract in Python: its KEYS by ``RunKeys`` attribute, its ARGV by name, the codes that are answers
(``ok``) and, for every other code, the one exception of ``proxy.coordinator.errors`` it raises
(``errors``). ``tests/test_coordinator_scripts.py`` keeps the declarations and the file headers equal.

A call reads like a method: ``store.scripts.grant_lease(now_ms=..., ttl_ms=..., ...)``. The store passes the
key prefix (``ARGV[1]``) and the keys; the answer is a ``ScriptReply`` with the code and named fields.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from string import Template
from typing import Any

from redis import Redis
from redis.commands.core import Script

from proxy.coordinator.errors import CoordinatorError
from proxy.coordinator.redis_keys import GROUP_KIND, LEASE_KIND, ROLLOUT_KIND, STEP_KIND, TASK_KIND, WORKER_KIND

LUA_PACKAGE = "proxy.coordinator"
LUA_FOLDER = "lua"
PRELUDE = "prelude"
NO_STATE = "NO_STATE"
"""The code of every script that finds no state for the run: the store rebuilds the state once and retries."""


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


@dataclass(frozen=True)
class LuaScript:
    """One script's contract: the file ``lua/<name>.lua`` states it in its header, this restates it."""

    name: str
    keys: tuple[str, ...]
    """``RunKeys`` attribute names, in KEYS order."""
    argv: tuple[str, ...]
    """ARGV names after ``prefix`` (ARGV[1]), in order; a last name starting with ``*`` takes a list."""
    ok: Mapping[str, tuple[str, ...]]
    """The codes that are answers, each with its reply fields."""
    errors: Mapping[str, Refusal] = field(default_factory=dict)
    """Every other code, with the exception it raises."""
    fields: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Reply fields of refusal codes that have any."""
    rebuilds: bool = True
    """On NO_STATE, rebuild the run's state once and call again (off for the scripts a rebuild itself uses)."""

    def args(self, values: Mapping[str, Any]) -> list[Any]:
        """The call's ARGV after the prefix, in declared order; the names must match exactly."""
        names = [name.lstrip("*") for name in self.argv]
        if set(values) != set(names):
            raise TypeError(f"{self.name} takes {names}, got {sorted(values)}")
        out: list[Any] = []
        for name in self.argv:
            if name.startswith("*"):
                out.extend(values[name[1:]])
            else:
                out.append(values[name])
        return out

    def answer(self, reply: Sequence[Any], values: Mapping[str, Any], run: str) -> ScriptReply:
        """The reply as a ``ScriptReply``, or the mapped exception for a refusal."""
        code = reply[0]
        names = self.ok.get(code, self.fields.get(code, ()))
        named = dict(zip(names, reply[1:], strict=False))
        if code in self.ok:
            return ScriptReply(code, named)
        refusal = self.errors.get(code)
        if refusal is None:
            raise RuntimeError(f"script {self.name} answered {code!r}, which its declaration does not know")
        message = refusal.message.format_map({**values, **named, "run": run, "code": code})
        raise refusal.error(message, *(named[name] for name in refusal.passed))


class BoundScript:
    """A declaration bound to one Redis client, the run's keys and its rebuild: call it with the ARGV names."""

    def __init__(
        self,
        script: LuaScript,
        redis: Redis,
        keys: Callable[[str], str],
        prefix: str,
        run: str,
        rebuild: Callable[[], object],
    ) -> None:
        self.script = script
        # registered once per client: redis-py sends EVALSHA and loads the source only when Redis lacks it
        self._registered: Script = redis.register_script(script_source(script.name))
        self._keys = [keys(name) for name in script.keys]
        self._prefix = prefix
        self._run = run
        self._rebuild = rebuild

    def __call__(self, **values: Any) -> ScriptReply:
        args = [self._prefix, *self.script.args(values)]
        reply = self._registered(keys=self._keys, args=args)
        if reply[0] == NO_STATE and self.script.rebuilds:
            self._rebuild()
            reply = self._registered(keys=self._keys, args=args)
        return self.script.answer(reply, values, self._run)
