"""How fast an adapter version travels through the bucket, on each backend.

    python3 benchmarks/bench_bucket.py                  # file and a private SeaweedFS
    python3 benchmarks/bench_bucket.py --backends file,seaweedfs,moto --reps 20
    python3 benchmarks/bench_bucket.py --bucket s3://my-bucket/bench   # an existing store (env credentials)

Figures: median milliseconds of put/get of a 4.4 MB object (a rank-1 LoRA of a 1.5B model in fp32),
of a 1 KB object, of ``write_version`` (adapter + 2x trainer state + config, manifest last) and of
``fetch_version`` (download + sha256 check + atomic rename). Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, FileBucket
from asyncgrpo.bucket.layout import fetch_version, write_version
from tests.support.fixtures_s3 import open_env_bucket

ADAPTER_BYTES = 4_400_000


def _median_ms(action: Callable[[int], object], reps: int) -> float:
    times = []
    for rep in range(reps):
        start = time.perf_counter()
        action(rep)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def measure(bucket: Bucket, reps: int, workdir: Path) -> dict[str, float]:
    big = os.urandom(ADAPTER_BYTES)
    small = os.urandom(1024)
    run = f"bench-{uuid.uuid4().hex[:8]}"
    files = {
        bucket_keys.ADAPTER_WEIGHTS_NAME: big,
        bucket_keys.ADAPTER_CONFIG_NAME: small,
        bucket_keys.TRAINER_STATE_TENSORS_NAME: big + big,  # LoRA weights + two Adam moments
    }
    prefix = bucket_keys.run_prefix(run)
    figures = {
        "put_4.4MB_ms": _median_ms(lambda i: bucket.put(f"{prefix}big/{i}", big), reps),
        "get_4.4MB_ms": _median_ms(lambda i: bucket.get(f"{prefix}big/{i}"), reps),
        "put_1KB_ms": _median_ms(lambda i: bucket.put(f"{prefix}small/{i}", small), reps),
        "get_1KB_ms": _median_ms(lambda i: bucket.get(f"{prefix}small/{i}"), reps),
        "write_version_ms": _median_ms(lambda i: write_version(bucket, run, i, files, {"step": i}), reps),
        "fetch_version_ms": _median_ms(lambda i: fetch_version(bucket, run, i, workdir / run / f"v{i}"), reps),
        "list_dirs_ms": _median_ms(lambda i: bucket.list_dirs(bucket_keys.adapters_prefix(run)), reps),
    }
    figures["put_4.4MB_MBps"] = ADAPTER_BYTES / 1e6 / (figures["put_4.4MB_ms"] / 1000)
    figures["get_4.4MB_MBps"] = ADAPTER_BYTES / 1e6 / (figures["get_4.4MB_ms"] / 1000)
    bucket.delete_prefix(prefix)
    return figures


@contextmanager
def open_backend(name: str, workdir: Path) -> Iterator[Bucket]:
    if name == "file":
        yield FileBucket(workdir / "file-bucket")
        return
    from tests.support.fixtures_s3 import S3Endpoint, start_seaweedfs

    if name == "seaweedfs":
        process, endpoint = start_seaweedfs(workdir)
        try:
            yield endpoint.open("bench")
        finally:
            process.kill()
            process.wait(timeout=10)
        return
    if name == "moto":
        from moto.server import ThreadedMotoServer

        from tests.support.fixtures_s3 import _create_bucket_when_ready, _free_ports

        (port,) = _free_ports(1)
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        endpoint = S3Endpoint(f"http://127.0.0.1:{port}", "testing", "testing", "us-east-1", "bench", "moto")
        try:
            _create_bucket_when_ready(endpoint, None, None)
            yield endpoint.open("bench")
        finally:
            server.stop()
        return
    raise SystemExit(f"unknown backend {name!r}; use file, seaweedfs or moto")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="file,seaweedfs", help="comma list of file, seaweedfs, moto")
    parser.add_argument("--bucket", default=None, help="benchmark this bucket URL instead of --backends")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()

    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="asyncgrpo-bench-") as tmp:
        workdir = Path(tmp)
        if args.bucket:
            results[args.bucket] = measure(open_env_bucket(args.bucket), args.reps, workdir)
        else:
            for name in args.backends.split(","):
                backend_dir = workdir / name
                backend_dir.mkdir()
                with open_backend(name, backend_dir) as bucket:
                    results[name] = measure(bucket, args.reps, backend_dir)

    columns = list(next(iter(results.values())))
    width = max(len(name) for name in results) + 2
    print("backend".ljust(width) + "".join(f"{column:>18}" for column in columns))
    for name, figures in results.items():
        print(name.ljust(width) + "".join(f"{figures[column]:>18.1f}" for column in columns))
    print(json.dumps({"reps": args.reps, "results": results}))


if __name__ == "__main__":
    main()
