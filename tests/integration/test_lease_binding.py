"""Submissions are bound to their lease (issue 12, item 4), over HTTP to a real proxy on real Redis.

A rollout is admitted only from the worker that holds its task's lease, with a version that worker leased for
the task (and the lease it names, if any, one of them); a repeat of an admitted task must be that rollout.
Anything else is 409 ``not_holder`` and changes nothing in Redis: no state, counter, lease or retention.
The legitimate paths stay open: renewals, expired leases, a second lease by the same worker, a task leased
again by another worker, a redelivered task that resubmits the rollout it finds in the bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from proxy.api.app import create_app
from proxy.coordinator.service import Coordinator
from tests.support.fixtures_coordinator import API_TOKEN, served
from tests.support.proxy_harness import ManualClock, advance_version, start_run, submission

AUTH = {"Authorization": f"Bearer {API_TOKEN}"}


@pytest.fixture
def proxy(coord: Coordinator) -> Iterator[httpx.Client]:
    """The proxy's real app on a loopback port (tick loop off: the tests tick), run started: v0 published."""
    start_run(coord)
    with served(create_app(coord, API_TOKEN, run_loop=False)) as url, httpx.Client(base_url=url, timeout=10) as http:
        yield http


def dump(coord: Coordinator) -> dict[str, Any]:
    """Every key of the run: its value, and whether it expires (a retired record gets a TTL)."""
    out: dict[str, Any] = {}
    for key in sorted(coord.redis.scan_iter(match=coord.keys.prefix + "*", count=1000)):
        kind = coord.redis.type(key)
        if kind == "hash":
            value: Any = coord.redis.hgetall(key)
        elif kind == "list":
            value = coord.redis.lrange(key, 0, -1)
        elif kind == "zset":
            value = coord.redis.zrange(key, 0, -1, withscores=True)
        elif kind == "set":  # the snapshot log's notes: a refusal notes nothing either
            value = sorted(coord.redis.smembers(key))
        else:
            value = coord.redis.get(key)
        out[key] = (kind, value, coord.redis.ttl(key) >= 0)
    return out


def lease(http: httpx.Client, worker_id: str, task_id: str) -> dict[str, Any]:
    answer = http.post("/v1/leases", json={"worker_id": worker_id, "task_id": task_id}, headers=AUTH)
    assert answer.status_code == 200, answer.text
    return answer.json()


def submit(
    http: httpx.Client,
    coord: Coordinator,
    task: dict[str, Any],
    version: int,
    worker_id: str = "gen-1",
    **update: Any,
) -> httpx.Response:
    body = submission(coord, task, version, worker_id=worker_id, lease=False).model_copy(update=update)
    return http.post("/v1/rollouts", json=body.model_dump(mode="json"), headers=AUTH)


def assert_refused_changing_nothing(coord: Coordinator, send: Callable[[], httpx.Response], detail: str) -> None:
    before, status_before = dump(coord), coord.status().model_dump()
    answer = send()
    assert answer.status_code == 409, answer.text
    assert answer.json()["error"] == "not_holder" and detail in answer.json()["detail"], answer.json()
    assert dump(coord) == before
    assert coord.status().model_dump() == status_before


# ---- refused: 409 not_holder, nothing changed ----


def test_a_task_never_leased(proxy: httpx.Client, coord: Coordinator) -> None:
    task = coord.dispatcher.generate[0]
    assert_refused_changing_nothing(coord, lambda: submit(proxy, coord, task, 0), "was never leased")


def test_a_worker_that_does_not_hold_the_task(proxy: httpx.Client, coord: Coordinator) -> None:
    task = coord.dispatcher.generate[0]
    mine = lease(proxy, "gen-1", task["task_id"])
    # gen-2 names gen-1's lease: the lease is not released either
    send = lambda: submit(proxy, coord, task, 0, worker_id="gen-2", lease_id=mine["lease_id"])  # noqa: E731
    assert_refused_changing_nothing(coord, send, "leased by another worker")
    assert_refused_changing_nothing(coord, lambda: submit(proxy, coord, task, 0, worker_id="gen-2"), "another worker")


def test_a_version_not_leased_for_the_task(proxy: httpx.Client, coord: Coordinator) -> None:
    task = coord.dispatcher.generate[0]
    advance_version(coord, {task["task_id"]})  # the task stays in flight, not leased yet
    assert lease(proxy, "gen-1", task["task_id"])["version"] == 1
    assert_refused_changing_nothing(coord, lambda: submit(proxy, coord, task, 0), "version v0 was not leased")


def test_a_lease_of_another_task_or_worker(proxy: httpx.Client, coord: Coordinator) -> None:
    task, other = coord.dispatcher.generate[:2]
    lease(proxy, "gen-1", task["task_id"])
    own_other = lease(proxy, "gen-1", other["task_id"])["lease_id"]
    someone_elses = lease(proxy, "gen-2", "not-a-task")["lease_id"]
    for lease_id in (own_other, someone_elses, "0123abcd"):
        send = lambda lease_id=lease_id: submit(proxy, coord, task, 0, lease_id=lease_id)  # noqa: E731
        assert_refused_changing_nothing(coord, send, f"lease {lease_id} is not a lease of task")


def test_a_repeat_of_an_admitted_task_that_is_another_rollout(proxy: httpx.Client, coord: Coordinator) -> None:
    task = coord.dispatcher.generate[0]
    grant = lease(proxy, "gen-1", task["task_id"])
    assert proxy.post(f"/v1/leases/{grant['lease_id']}/renew", json={}, headers=AUTH).json()["version"] == 0
    assert submit(proxy, coord, task, 0, lease_id=grant["lease_id"]).json() == {"status": "admitted"}
    assert coord.status().leases == [], "released with the submission"
    # the worker's retry (its first answer lost), the lease long released: the same rollout again
    assert submit(proxy, coord, task, 0, lease_id=grant["lease_id"]).json() == {"status": "duplicate"}
    spoiled = [
        (lambda: submit(proxy, coord, task, 0, sha256="e" * 64), "another rollout admitted"),
        (lambda: submit(proxy, coord, task, 0, worker_id="gen-2"), "another rollout admitted"),
        (lambda: submit(proxy, coord, task, 0, lease_id="0123abcd"), "lease 0123abcd is not a lease of task"),
    ]
    for send, detail in spoiled:
        assert_refused_changing_nothing(coord, send, detail)


def test_the_first_holder_after_the_task_was_leased_again(proxy: httpx.Client, coord: Coordinator) -> None:
    """A redelivered task leased by gen-2 while gen-1 (presumed lost) still works: gen-1's late rollout is
    refused whenever it comes, and gen-2's admitted."""
    task = coord.dispatcher.generate[0]
    first = lease(proxy, "gen-1", task["task_id"])
    second = lease(proxy, "gen-2", task["task_id"])
    late = lambda: submit(proxy, coord, task, 0, lease_id=first["lease_id"])  # noqa: E731
    assert_refused_changing_nothing(coord, late, "leased by another worker")
    assert submit(proxy, coord, task, 0, worker_id="gen-2", lease_id=second["lease_id"]).json() == {
        "status": "admitted"
    }
    assert_refused_changing_nothing(coord, late, "another rollout admitted")
    assert coord.status().counters["rollouts_admitted"] == 1


# ---- still admitted ----


def test_a_lease_that_expired_before_the_submission(
    proxy: httpx.Client, coord: Coordinator, clock: ManualClock
) -> None:
    """The lease is gone from Redis, but the task still names its holder and the lease: they still bind."""
    task = coord.dispatcher.generate[0]
    grant = lease(proxy, "gen-1", task["task_id"])
    clock.advance(coord.config.async_.lease_ttl_s + 1)
    coord.leases.expire()
    assert coord.status().leases == [] and coord.redis.hget(coord.keys.task(task["task_id"]), "state") == "inflight"
    stolen = lambda: submit(proxy, coord, task, 0, worker_id="gen-2", lease_id=grant["lease_id"])  # noqa: E731
    assert_refused_changing_nothing(coord, stolen, "leased by another worker")
    assert submit(proxy, coord, task, 0, lease_id=grant["lease_id"]).json() == {"status": "admitted"}


def test_a_second_lease_by_the_same_worker(proxy: httpx.Client, coord: Coordinator) -> None:
    """Redelivered to the same worker after the version moved on: each of its leases binds its own version."""
    task, other = coord.dispatcher.generate[:2]
    first, first_other = lease(proxy, "gen-1", task["task_id"]), lease(proxy, "gen-1", other["task_id"])
    advance_version(coord, {task["task_id"], other["task_id"]})
    lease(proxy, "gen-1", task["task_id"])
    again_other = lease(proxy, "gen-1", other["task_id"])
    assert (first["version"], again_other["version"]) == (0, 1)
    assert submit(proxy, coord, task, 0, lease_id=first["lease_id"]).json() == {"status": "admitted"}
    mismatched = lambda: submit(proxy, coord, other, 1, lease_id=first_other["lease_id"])  # noqa: E731
    assert_refused_changing_nothing(coord, mismatched, "version v1 was not leased")
    assert submit(proxy, coord, other, 1, lease_id=again_other["lease_id"]).json() == {"status": "admitted"}


def test_the_task_records_its_holders_leases_only_and_boundedly(proxy: httpx.Client, coord: Coordinator) -> None:
    task = coord.dispatcher.generate[0]
    tk = coord.keys.task(task["task_id"])
    lease(proxy, "gen-2", task["task_id"])
    grants = [lease(proxy, "gen-1", task["task_id"]) for _ in range(20)]
    holder, version, leases = coord.redis.hmget(tk, ["worker_id", "leased_version", "leases"])
    # a new holder starts the list again; a worker leasing one task again and again keeps its last 16
    assert (holder, version) == ("gen-1", "0")
    assert leases.split() == [f"{grant['lease_id']}:0" for grant in grants[-16:]]
    dropped = lambda: submit(proxy, coord, task, 0, lease_id=grants[0]["lease_id"])  # noqa: E731
    assert_refused_changing_nothing(coord, dropped, "is not a lease of task")
    assert submit(proxy, coord, task, 0, lease_id=grants[-1]["lease_id"]).json() == {"status": "admitted"}


def test_a_repeat_after_redis_was_lost_is_checked_against_the_rebuilt_rollout(
    proxy: httpx.Client, coord: Coordinator
) -> None:
    """A rebuild keeps the buffered rollout (its worker and sha256), not the task's lease record."""
    task = coord.dispatcher.generate[0]
    grant = lease(proxy, "gen-1", task["task_id"])
    assert submit(proxy, coord, task, 0, lease_id=grant["lease_id"]).json() == {"status": "admitted"}
    coord.redis.flushdb()
    assert coord.ensure_state() == "rebuilt"
    assert coord.redis.hget(coord.keys.task(task["task_id"]), "worker_id") is None
    for update in ({"worker_id": "gen-2"}, {"sha256": "e" * 64}):
        send = lambda update=update: submit(proxy, coord, task, 0, **update)  # noqa: E731
        assert_refused_changing_nothing(coord, send, "another rollout admitted")
    assert submit(proxy, coord, task, 0, lease_id=grant["lease_id"]).json() == {"status": "duplicate"}
