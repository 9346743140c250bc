"""The Lua script declarations agree with their files, and every return code has its exception.

Each ``lua/<name>.lua`` states its KEYS, ARGV and return codes in its header; ``proxy.coordinator.scripts``
restates them. ``contract_problems`` compares the two (and the codes the body really returns), so a drift on
either side fails here; the tests at the bottom show it catches drifts.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

import pytest
from redis import Redis

from proxy.coordinator import errors
from proxy.coordinator.errors import CoordinatorError, StateMissing
from proxy.coordinator.lua_script import LUA_FOLDER, LUA_PACKAGE, PRELUDE, LuaScript, Refusal, lua_text, script_source
from proxy.coordinator.redis_keys import RunKeys
from proxy.coordinator.scripts import ALL_SCRIPTS, GRANT_LEASE, Scripts
from proxy.coordinator.store import RunStore

_KEY = re.compile(r"KEYS\[(\d+)\] (\w+)")
_ARG = re.compile(r"ARGV\[(\d+)(\.\.)?\] (\w+)")
_CODE = re.compile(r'\{"([A-Z_]+)"((?:, *\w+)*)\}')
# codes the body can return: a literal first element of a returned table, or assigned to `code` first
_BODY_CODE = re.compile(r"(?:return \{|code = )'([A-Z_]+)'")


@dataclass
class Header:
    keys: list[str]
    argv: list[str]
    codes: dict[str, tuple[str, ...]]
    body_codes: set[str]


def parse(text: str) -> Header:
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
    codes = {
        code: tuple(part.strip() for part in fields.split(",") if part.strip())
        for code, fields in _CODE.findall(" ".join(returns))
    }
    for found, what in ((keys, "KEYS"), (argv, "ARGV")):
        numbers = [i for i, _ in found]
        assert numbers == list(range(1, len(found) + 1)), f"{what} numbered {numbers} in the header"
    return Header([n for _, n in keys], [n for _, n in argv], codes, set(_BODY_CODE.findall(body)))


def contract_problems(script: LuaScript, text: str) -> list[str]:
    """Every disagreement between a declaration and its file (empty when they agree)."""
    header = parse(text)
    problems = []
    if tuple(header.keys) != script.keys:
        problems.append(f"KEYS: header {header.keys}, declared {list(script.keys)}")
    for name in script.keys:
        if not isinstance(getattr(RunKeys, name, None), property):
            problems.append(f"KEYS: {name} is not a RunKeys attribute")
    if header.argv[:1] != ["prefix"] or tuple(header.argv[1:]) != script.argv:
        problems.append(f"ARGV: header {header.argv}, declared ['prefix', {', '.join(script.argv)}]")
    if any(name.startswith("*") for name in script.argv[:-1]):
        problems.append("ARGV: only the last argument may take a list")
    declared = set(script.ok) | set(script.errors)
    if set(script.ok) & set(script.errors):
        problems.append(f"codes both answers and errors: {sorted(set(script.ok) & set(script.errors))}")
    if "OK" not in script.ok:
        problems.append("no OK answer declared")
    if set(header.codes) != declared:
        problems.append(f"codes: header {sorted(header.codes)}, declared {sorted(declared)}")
    if not header.body_codes <= set(header.codes):
        problems.append(f"codes the body returns but the header omits: {sorted(header.body_codes - set(header.codes))}")
    if not set(header.codes) <= header.body_codes:
        problems.append(
            f"codes the header states but the body never returns: {sorted(set(header.codes) - header.body_codes)}"
        )
    for code, fields in header.codes.items():
        mine = script.ok.get(code, script.fields.get(code, ()))
        if code in declared and fields != mine:
            problems.append(f"{code} fields: header {list(fields)}, declared {list(mine)}")
    names = {name.lstrip("*") for name in script.argv} | {"run", "code"}
    for code, refusal in script.errors.items():
        problems += refusal_problems(code, refusal, names | set(script.fields.get(code, ())))
    return problems


def refusal_problems(code: str, refusal: Refusal, names: set[str]) -> list[str]:
    problems = []
    error = refusal.error
    if not (issubclass(error, CoordinatorError) and getattr(errors, error.__name__, None) is error):
        problems.append(f"{code} maps to {error!r}, not an exception of proxy.coordinator.errors")
    used = {field for _, field, _, _ in string.Formatter().parse(refusal.message) if field}
    if not used <= names:
        problems.append(f"{code} message uses {sorted(used - names)}, which neither ARGV nor the reply has")
    if not set(refusal.passed) <= names:
        problems.append(f"{code} passes {list(refusal.passed)} to {error.__name__}, not all in its reply")
    return problems


@pytest.mark.parametrize("script", ALL_SCRIPTS, ids=lambda s: s.name)
def test_declaration_matches_its_lua_file(script: LuaScript) -> None:
    assert contract_problems(script, lua_text(script.name)) == []


def test_every_lua_file_is_declared_and_bound() -> None:
    folder = resources.files(LUA_PACKAGE) / LUA_FOLDER
    files = {entry.name.removesuffix(".lua") for entry in folder.iterdir() if entry.name.endswith(".lua")}
    names = [script.name for script in ALL_SCRIPTS]
    assert len(set(names)) == len(names)
    assert files == set(names) | {PRELUDE}
    bound: list[LuaScript] = []
    Scripts(lambda script: bound.append(script) or script)  # type: ignore[arg-type,func-returns-value]
    assert [script.name for script in bound] == names


def test_every_script_compiles_in_redis(redis_client: Redis) -> None:
    for script in ALL_SCRIPTS:
        sha = redis_client.script_load(script_source(script.name))
        assert redis_client.script_exists(sha) == [True]


def test_a_call_names_its_arguments(redis_client: Redis) -> None:
    store = RunStore(redis_client, "r1", rebuild=lambda: None, clock_ms=lambda: 1000)
    with pytest.raises(TypeError, match="grant_lease takes"):
        store.scripts.grant_lease(now_ms=1000, ttl_ms=5000, lease_id="l1", worker_id="w1")


def test_no_state_rebuilds_once_then_raises(redis_client: Redis) -> None:
    rebuilds: list[int] = []
    store = RunStore(redis_client, "r1", rebuild=lambda: rebuilds.append(1), clock_ms=lambda: 1000)
    with pytest.raises(StateMissing, match="even after a rebuild"):
        store.scripts.grant_lease(
            now_ms=1000, ttl_ms=5000, lease_id="l1", worker_id="w1", task_id="t1", task_prefix="gen-r1-", incarnation=""
        )
    assert rebuilds == [1]


# ---- the check bites: each drift below is reported ----


def _drifted(old: str, new: str, text: str | None = None) -> list[str]:
    text = text if text is not None else lua_text(GRANT_LEASE.name)
    assert old in text
    return contract_problems(GRANT_LEASE, text.replace(old, new, 1))


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("KEYS[3] leases  KEYS[4] versions", "KEYS[3] versions  KEYS[4] leases", "KEYS: header"),
        ("ARGV[5] worker_id  ARGV[6] task_id", "ARGV[5] task_id  ARGV[6] worker_id", "ARGV: header"),
        ('| {"NO_VERSION"} ', '| {"NO_VERSION"} | {"NO_LUCK"} ', "codes: header"),
        ("if current < 0 then return {'NO_VERSION'} end", "", "codes the header states but the body never returns"),
        ('| {"NO_VERSION"} ', "", "codes the body returns but the header omits"),
        ('{"OK", version, manifest_sha256, expires_ms}', '{"OK", version, expires_ms}', "OK fields"),
        ("return {'NO_VERSION'}", "return {'NO_LEASE'}", "codes the body returns but the header omits"),
    ],
)
def test_a_drifted_file_is_reported(old: str, new: str, expected: str) -> None:
    assert any(problem.startswith(expected) for problem in _drifted(old, new)), _drifted(old, new)


def test_a_code_without_its_exception_is_reported() -> None:
    unmapped = {code: refusal for code, refusal in GRANT_LEASE.errors.items() if code != "NO_VERSION"}
    problems = contract_problems(replace(GRANT_LEASE, errors=unmapped), lua_text(GRANT_LEASE.name))
    assert any(problem.startswith("codes: header") for problem in problems)


@pytest.mark.parametrize(
    ("refusal", "expected"),
    [
        (Refusal(ValueError, "run {run!r}"), "NO_VERSION maps to"),  # type: ignore[arg-type]
        (Refusal(errors.NoVersionYet, "lease {lease}"), "NO_VERSION message uses ['lease']"),
        (Refusal(errors.NoVersionYet, "run {run!r}", passed=("current",)), "NO_VERSION passes"),
    ],
)
def test_a_bad_refusal_is_reported(refusal: Any, expected: str) -> None:
    script = replace(GRANT_LEASE, errors={**GRANT_LEASE.errors, "NO_VERSION": refusal})
    problems = contract_problems(script, lua_text(GRANT_LEASE.name))
    assert any(problem.startswith(expected) for problem in problems), problems
