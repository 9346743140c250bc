"""The Lua script declarations agree with their files, and every return code has its exception.

Each ``lua/<seam>/<name>.lua`` states its KEYS, ARGV and return codes in its header, the one statement of them;
``proxy.coordinator.scripts`` adds the answers and exceptions. ``contract_problems`` checks the two together
(and the codes the body really returns); the tests at the bottom show it catches drifts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from proxy.coordinator import scripts as errors
from proxy.coordinator.redis_store import LoopScripts, RedisStore, RunKeys, prelude_names
from proxy.coordinator.scripts import (
    ALL_SCRIPTS,
    CLAIM_STEP,
    GRANT_LEASE,
    LUA_FOLDER,
    LUA_PACKAGE,
    PRELUDE,
    LuaScript,
    Refusal,
    Scripts,
    StateMissing,
    contract_problems,
    lua_files,
    lua_text,
    parse_contract,
    script_source,
)
from tests.support.paths import REPO_ROOT


@pytest.mark.parametrize("script", ALL_SCRIPTS, ids=lambda s: s.name)
def test_declaration_matches_its_lua_file(script: LuaScript) -> None:
    assert contract_problems(script, RunKeys, lua_text(script.name)) == []


def test_every_lua_file_is_declared_and_bound() -> None:
    folder = resources.files(LUA_PACKAGE) / LUA_FOLDER
    files = set(lua_files())
    shipped = [item.name for entry in folder.iterdir() for item in (entry.iterdir() if entry.is_dir() else [entry])]
    assert len([name for name in shipped if name.endswith(".lua")]) == len(files)
    names = [script.name for script in ALL_SCRIPTS]
    assert len(set(names)) == len(names)
    assert files == set(names) | {PRELUDE}
    bound: list[LuaScript] = []
    Scripts(lambda script: bound.append(script) or script)  # type: ignore[arg-type,func-returns-value]
    # The fleet's scripts are bound to the event loop's client alone (LoopScripts), every other to the sync one.
    on_loop = [field.name for field in dataclasses.fields(LoopScripts) if field.name != "redis"]
    assert sorted([script.name for script in bound] + on_loop) == sorted(names)
    assert not set(on_loop) & {script.name for script in bound}


def test_every_script_compiles_in_redis(redis_client: Redis) -> None:
    for script in ALL_SCRIPTS:
        sha = redis_client.script_load(script_source(script.name, prelude_names()))
        assert redis_client.script_exists(sha) == [True]


def test_a_call_names_its_arguments(redis_client: Redis) -> None:
    store = RedisStore(redis_client, "r1", clock_ms=lambda: 1000)
    with pytest.raises(TypeError, match="set_logged_field takes"):
        store.scripts.set_logged_field(section="tracking", field="f")


def test_a_script_without_state_raises_state_missing(redis_client: Redis) -> None:
    """The store does not rebuild: the coordinator's entry points do (``tests/integration/test_rebuild.py``)."""
    store = RedisStore(redis_client, "r1", clock_ms=lambda: 1000)
    with pytest.raises(StateMissing, match="no state for run 'r1'"):
        store.scripts.set_logged_field(section="tracking", field="f", op="set", value="1")
    assert not store.has_state()


# ---- the check bites: each drift below is reported ----


def _drifted(old: str, new: str, text: str | None = None) -> list[str]:
    text = text if text is not None else lua_text(GRANT_LEASE.name)
    assert old in text
    return contract_problems(GRANT_LEASE, RunKeys, text.replace(old, new, 1))


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("KEYS[3] leases", "KEYS[3] leased_versions", "KEYS: leased_versions is not a RunKeys attribute"),
        ("KEYS[3] leases", "KEYS[5] leases", "KEYS numbered"),
        ("ARGV[5] worker_id", "ARGV[7] worker_id", "ARGV numbered"),
        ('| {"NO_VERSION"} ', '| {"NO_VERSION"} | {"NO_LUCK"} ', "codes: header"),
        ("if current < 0 then return {'NO_VERSION'} end", "", "codes the header states but the body never returns"),
        ('| {"NO_VERSION"} ', "", "codes the body returns but the header omits"),
        ("return {'NO_VERSION'}", "return {'NO_LEASE'}", "codes the body returns but the header omits"),
    ],
)
def test_a_drifted_file_is_reported(old: str, new: str, expected: str) -> None:
    assert any(problem.startswith(expected) for problem in _drifted(old, new)), _drifted(old, new)


def test_a_code_without_its_exception_is_reported() -> None:
    unmapped = {code: refusal for code, refusal in GRANT_LEASE.errors.items() if code != "NO_VERSION"}
    problems = contract_problems(replace(GRANT_LEASE, errors=unmapped), RunKeys, lua_text(GRANT_LEASE.name))
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
    problems = contract_problems(script, RunKeys, lua_text(GRANT_LEASE.name))
    assert any(problem.startswith(expected) for problem in problems), problems


def test_a_reply_with_more_fields_than_its_header_states_is_refused() -> None:
    values = {
        "now_ms": 1,
        "ttl_ms": 1,
        "lease_id": "l",
        "worker_id": "w",
        "task_id": "t",
        "task_prefix": "p",
        "incarnation": "",
    }
    contract = parse_contract(lua_text(GRANT_LEASE.name))
    assert contract.codes["OK"] == ("version", "manifest_sha256", "expires_ms")
    assert contract.types == {"version": "int", "expires_ms": "int"}
    answer = GRANT_LEASE.answer(["OK", "3", "abc", "99"], values, "r1")
    assert (answer["version"], answer["manifest_sha256"], answer["expires_ms"]) == (3, "abc", 99)
    with pytest.raises(RuntimeError, match="its header states"):
        GRANT_LEASE.answer(["OK", 3, "abc", 99, "extra"], values, "r1")


def test_typed_reply_fields_are_converted_in_one_place() -> None:
    claim = {"now_ms": 1, "min_groups": 1, "max_staleness": 1, "record_ttl_s": 1, "track": "1", "final_version": 9}
    names = [name.lstrip("*") for name in CLAIM_STEP.contract.argv]
    values = {name: claim.get(name, 0) for name in names}
    answer = CLAIM_STEP.answer(["OK", 4, "3", '[{"task_id": "t1"}]', "2:1000:1,3:2000:2", 0], values, "r1")
    assert answer["step"] == 4 and answer["base_version"] == 3
    assert answer["rollouts_json"] == [{"task_id": "t1"}]
    assert answer["claimed"] == [(2, 1000, 1), (3, 2000, 2)]
    assert CLAIM_STEP.answer(["OK", 4, 3, "[]", "", 0], values, "r1")["claimed"] == []


def test_an_unknown_field_type_is_reported() -> None:
    text = lua_text(GRANT_LEASE.name).replace("expires_ms:int}", "expires_ms:float}", 1)
    assert any("has type 'float'" in problem for problem in contract_problems(GRANT_LEASE, RunKeys, text))


def test_each_script_sits_beside_the_one_seam_that_runs_it() -> None:
    """``lua/<seam>/<name>.lua`` is run by ``proxy/coordinator/<seam>.py`` and by no other coordinator module, so
    a reader of a seam finds its scripts in the folder of the same name."""
    coordinator = REPO_ROOT / "proxy" / "coordinator"
    sources = {path.stem: path.read_text() for path in coordinator.glob("*.py") if path.stem != "scripts"}
    misplaced = []
    for name, file in lua_files().items():
        if name == PRELUDE:
            continue
        callers = sorted(stem for stem, text in sources.items() if f"scripts.{name}(" in text)
        seam = Path(str(file)).parent.name
        if callers != [seam]:
            misplaced.append(f"{seam}/{name}.lua is run by {callers or 'nobody'}")
    assert not misplaced, misplaced
