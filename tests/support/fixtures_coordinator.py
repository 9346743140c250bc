"""Fixtures around a real Coordinator: a manual clock, a fresh coordinator on the private Redis, its HTTP app.

A test module that needs the coordinator in another starting state overrides ``coord`` by requesting it
(pytest hands the override this plugin's fixture), e.g. to publish version 0 first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from redis import Redis

from proxy.api.app import create_app
from proxy.coordinator.service import Coordinator
from tests.support.fixtures_redis import free_port
from tests.support.proxy_harness import ManualClock, file_bucket, make_coordinator

API_TOKEN = "test-api-token"
"""The bearer token of the ``http`` fixture's app."""


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def coord(redis_client: Redis, tmp_path: Path, clock: ManualClock) -> Coordinator:
    """A fresh coordinator (run ``r1``, ``small_config()``) on the private Redis and a file bucket."""
    return make_coordinator(redis_client, file_bucket(tmp_path), clock=clock)


@pytest.fixture
def http(coord: Coordinator) -> Iterator[TestClient]:
    """The proxy's app over ``coord`` with the tick loop off (tests tick by hand), token ``API_TOKEN``."""
    with TestClient(create_app(coord, API_TOKEN, run_loop=False)) as client:
        yield client


@contextmanager
def served(app: FastAPI) -> Iterator[str]:
    """``app`` on a real loopback port, in a thread, for tests of what goes over the wire; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
