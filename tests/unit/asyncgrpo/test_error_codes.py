"""The error-code table is the one the server answers with and the client reads: both sides agree on every
code, its status and its exception, and a code added on one side only fails here."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from redis.exceptions import ConnectionError as RedisConnectionError

from asyncgrpo.bucket.backends import BucketError
from asyncgrpo.protocol.client import ProxyClient
from asyncgrpo.protocol.errors import ERROR_CODES, ProxyError, error_code, exception_for
from asyncgrpo.protocol.schemas import StaleRolloutError
from proxy.api import edge as api
from proxy.coordinator.metrics import HTTP_ERROR_CODES, ProxyMetrics
from proxy.coordinator.scripts import (
    BadRollout,
    BadStepFailure,
    CasLost,
    LeaseLostError,
    ManifestMissing,
    NotTaskHolder,
    NoVersionYet,
    SnapshotFailed,
    StateMissing,
    StepNoLongerClaimed,
    StepNotFound,
    TaskCancelled,
    UnknownTask,
)

# One instance of every refusal the coordinator raises (subclasses included), and the code it must get.
REFUSALS: list[tuple[Exception, str]] = [
    (StaleRolloutError(sample_version=3, current=7, max_staleness=2), "stale"),
    (NoVersionYet("no version yet"), "not_ready"),
    (CasLost("v4 is current", current_version=4), "conflict"),
    (ManifestMissing("no manifest", current_version=4), "conflict"),
    (LeaseLostError("lease expired"), "lease_lost"),
    (TaskCancelled("timed out"), "cancelled"),
    (UnknownTask("never dispatched"), "cancelled"),
    (BadRollout("foreign groups"), "bad_request"),
    (NotTaskHolder("task t1 is leased by another worker"), "not_holder"),
    (StepNotFound("no step 9"), "not_found"),
    (StepNoLongerClaimed("step 9 claimed again with another batch"), "not_claimed"),
    (BadStepFailure("rollout t1 is not in the batch of step 9"), "bad_request"),
    (SnapshotFailed("bucket down"), "unavailable"),
    (StateMissing("redis empty"), "unavailable"),
    (RedisConnectionError("refused"), "unavailable"),
    (BucketError("runs/r1/x: timeout"), "unavailable"),
]


def test_the_server_sends_exactly_the_codes_of_the_table() -> None:
    # Fails when a code is added to the table that the server never sends, or the other way round.
    assert set(ERROR_CODES) == api.SENT_CODES
    # The proxy's error counter is labelled by these codes and nothing else.
    assert set(HTTP_ERROR_CODES) == set(ERROR_CODES)


def test_every_code_has_its_own_client_exception() -> None:
    exceptions = [entry.exception for entry in ERROR_CODES.values()]
    assert len(set(exceptions)) == len(exceptions), "two codes raise the same exception on the client"
    assert all(issubclass(kind, ProxyError) for kind in exceptions)
    for code, entry in ERROR_CODES.items():
        assert entry.code == code and entry.statuses and all(400 <= status < 600 for status in entry.statuses)
        assert exception_for(entry.status, code) is entry.exception
    with pytest.raises(KeyError, match="add it there"):
        error_code("teapot")


def test_every_refusal_kind_the_server_maps_is_exercised_here() -> None:
    mapped = set(api.REFUSAL_CODES)
    exercised = {kind for refusal, _ in REFUSALS for kind in type(refusal).__mro__}
    assert mapped <= exercised, f"add an instance of {mapped - exercised} to REFUSALS"


@pytest.fixture
def client_over() -> ProxyClient:
    """A ProxyClient whose every ``GET /v1/steps/{i}`` is answered by raising ``REFUSALS[i]`` on the server."""
    app = FastAPI()
    api.install_error_handlers(app, ProxyMetrics())

    @app.get("/v1/steps/{index}")
    def refuse(index: int) -> None:
        raise REFUSALS[index][0]

    server = TestClient(app, raise_server_exceptions=False)

    def forward(outgoing: httpx.Request) -> httpx.Response:
        answer = server.request(outgoing.method, outgoing.url.path)
        return httpx.Response(answer.status_code, content=answer.content, headers=answer.headers)

    return ProxyClient("http://proxy.test", None, retries=0, transport=httpx.MockTransport(forward))


@pytest.mark.parametrize("index", range(len(REFUSALS)), ids=[type(r).__name__ for r, _ in REFUSALS])
def test_each_refusal_crosses_the_wire_as_its_code(client_over: ProxyClient, index: int) -> None:
    code = REFUSALS[index][1]
    entry = ERROR_CODES[code]
    with pytest.raises(ProxyError) as caught:
        client_over.get_step(index)
    assert type(caught.value) is entry.exception
    assert caught.value.error == code and caught.value.status == entry.status
    if code == "stale":
        assert caught.value.body["current_version"] == 7 and caught.value.body["max_staleness"] == 2
    if code == "conflict":
        assert caught.value.body["reason"] in {"cas_lost", "manifest_missing"}


def test_answers_without_a_code_are_judged_by_status() -> None:
    assert exception_for(404, None) is ERROR_CODES["not_found"].exception
    assert exception_for(401, None) is ERROR_CODES["unauthorized"].exception
    assert exception_for(502, None) is ERROR_CODES["unavailable"].exception
    # 409 and 410 are shared by several codes: without one, nothing more specific can be said.
    assert exception_for(409, None) is ProxyError and exception_for(410, "from-a-newer-proxy") is ProxyError
