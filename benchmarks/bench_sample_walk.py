"""Which first-party code one sample walks through, from the task that makes it to the version it trains.

One prompt group's life runs in this process against the current code: a private redis-server on a free port,
a file:// bucket in a temporary directory, the tiny model (``model.base = "tiny"``, built locally into the
temporary cache: nothing is downloaded), the FastAPI app through Starlette's TestClient, the real
``CeleryDispatcher`` (its messages are also kept here) and the Celery task functions called directly. After a
warm-up to steady state, one sample is traced under ``sys.setprofile``/``threading.setprofile`` (every thread:
the app's, the lease renewer's, the upload pool's) through its steps:

    dispatch   the coordinator round that sends its generate task (a whole round: it also claims earlier steps)
    lease      the generate task until the proxy grants the lease of the current version
    generate   adapter, sampling, scoring, encoding the rollout (and the lease renewals meanwhile)
    upload     the rollout object written to the bucket
    admit      the submission, admitted at the proxy
    claim      the rounds until the step holding the sample is claimed and its optimize task sent
    optimize   the optimize task until its version's upload starts
    publish    the version's files and manifest uploaded, then published at the proxy
    load       the new version reaching the generate side: prefetched, then leased by the next task

Work that is not this sample's (other tasks needed to move the pipeline on) runs untraced. For each step it
prints the first-party modules (``asyncgrpo/``, ``proxy/``, ``worker/``; paths from the repository root) first
seen there and the Lua scripts run there, then the totals: Python modules and distinct Lua scripts. Left out,
as in the earlier analysis: the modules that only record metrics, settings and logging set-up, and process
start-up (all that runs before the traced window). Modules that were entered but did nothing (every call
into them called nothing outside the module and returned None or an empty value, as a part that is switched
off does) are listed apart, still counted. Last, the upward calls: a call from one module into a module of a
higher layer of the same import-linter ``layers`` contract (pyproject.toml), such as a callback handed down or a
method only a subclass defines, which no import check can see.

    python benchmarks/bench_sample_walk.py [--json]

``--json`` prints one JSON line instead of the table. Takes 15 to 30 s on a CPU (the warm-up is most of it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STEPS = ("dispatch", "lease", "generate", "upload", "admit", "claim", "optimize", "publish", "load")
RUN = "walk"
TOKEN = "bench-sample-walk-token"
BASE_URL = "http://testserver"

# Seen but not counted: metrics recording, settings, logging set-up.
EXCLUDED = frozenset(
    {
        "proxy/coordinator/metrics.py",
        "worker/process/metrics.py",
        "asyncgrpo/protocol/settings.py",
        "proxy/api/settings.py",
        "worker/process/settings.py",
        "worker/generate/settings.py",
        "asyncgrpo/protocol/log_setup.py",
    }
)

# The demo run, made small: one generate task fills one step; short leases, so renewals happen.
CONFIG_EDITS = (
    ("num_prompts = 512", "num_prompts = 64"),
    ("samples_per_prompt = 8", "samples_per_prompt = 4"),
    ("max_completion_length = 16", "max_completion_length = 8"),
    ("groups_per_task = 4", "groups_per_task = 2"),
    ("groups_per_step = 8", "groups_per_step = 2"),
    ("lease_ttl_s = 60.0", "lease_ttl_s = 0.6"),
)
WARM_UP_ROUNDS = 8


# ---- the recorder ----

_EMPTY_TYPES = (bool, int, float, str, bytes, list, tuple, dict, set, frozenset)


def _nothing(value: object, function: str) -> bool:
    """True for what a function that did nothing returns: None or an empty or zero builtin value (checked without
    calling into the value: ``bool()`` of a tensor or an array would run code or raise)."""
    if function == "__init__":
        return False
    return value is None or (type(value) in _EMPTY_TYPES and not value)


@dataclass
class Walk:
    """What the profiler saw while ``tracing``: modules by the step they were first seen in, Lua scripts run."""

    repo: Path
    tracing: bool = False
    step: str = "-"
    first_seen: dict[str, str] = field(default_factory=dict)
    busy: set[str] = field(default_factory=set)
    lua: list[tuple[str, str]] = field(default_factory=list)
    calls: set[tuple[str, str]] = field(default_factory=set)
    _modules: dict[str, str | None] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._pattern = re.compile(rf"^{re.escape(str(self.repo))}/((?:asyncgrpo|proxy|worker)/.*\.py)$")

    def module_of(self, code: CodeType) -> str | None:
        """The repository-relative path of a first-party module, None for anything else."""
        filename = code.co_filename
        try:
            return self._modules[filename]
        except KeyError:
            match = self._pattern.match(filename)
            module = match.group(1) if match else None
            self._modules[filename] = module
            return module

    def profile(self, frame: FrameType, event: str, arg: object) -> None:
        """The profile hook of every thread: cheap when not tracing. A module is busy once one of its functions
        calls anything outside it, or returns something (constructors count as doing something)."""
        if not self.tracing:
            return
        if event == "call":
            callee = self.module_of(frame.f_code)
            caller = self.module_of(frame.f_back.f_code) if frame.f_back is not None else None
            with self._lock:
                if callee is not None:
                    self.first_seen.setdefault(callee, self.step)
                if caller is not None and caller != callee:
                    self.busy.add(caller)
                    if callee is not None:
                        self.calls.add((caller, callee))
        elif event == "c_call":
            caller = self.module_of(frame.f_code)
            if caller is not None:
                with self._lock:
                    self.busy.add(caller)
        elif event == "return" and not _nothing(arg, frame.f_code.co_name):
            module = self.module_of(frame.f_code)
            if module is not None:
                with self._lock:
                    self.busy.add(module)

    def ran_script(self, name: str) -> None:
        if self.tracing:
            with self._lock:
                self.lua.append((self.step, name))

    def clear(self) -> None:
        with self._lock:
            self.first_seen.clear()
            self.busy.clear()
            self.lua.clear()
            self.calls.clear()

    @contextmanager
    def traced(self, step: str) -> Iterator[None]:
        self.step = step
        self.tracing = True
        sys.setprofile(self.profile)
        try:
            yield
        finally:
            sys.setprofile(None)
            self.tracing = False

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Untraced work inside a traced stretch (other samples' tasks)."""
        was = self.tracing
        self.tracing = False
        try:
            yield
        finally:
            self.tracing = was

    def report(self) -> dict[str, Any]:
        modules = {m: s for m, s in self.first_seen.items() if m not in EXCLUDED}
        scripts = Counter(self.lua)
        steps = []
        for step in STEPS:
            steps.append(
                {
                    "step": step,
                    "modules": sorted(m for m, s in modules.items() if s == step),
                    "lua": {name: n for (s, name), n in sorted(scripts.items()) if s == step},
                }
            )
        return {
            "steps": steps,
            "python_modules": len(modules),
            "lua_scripts": len({name for _, name in self.lua}),
            "lua_calls": len(self.lua),
            "idle_modules": sorted(m for m in modules if m not in self.busy),
            "excluded_seen": sorted(m for m in self.first_seen if m in EXCLUDED),
            "upward_calls": upward_calls(self.calls, layer_contracts(self.repo)),
        }


def layer_contracts(repo: Path) -> list[list[list[str]]]:
    """The import-linter ``layers`` contracts of pyproject.toml: per contract, its layers top down, each layer the
    modules it names (``a | b`` and ``a : b`` are one layer)."""
    config = tomllib.loads((repo / "pyproject.toml").read_text())
    return [
        [re.split(r"\s*[|:]\s*", layer.strip()) for layer in contract["layers"]]
        for contract in config["tool"]["importlinter"]["contracts"]
        if contract["type"] == "layers"
    ]


def _layer(module: str, layers: list[list[str]]) -> int | None:
    for index, names in enumerate(layers):
        if any(module == name or module.startswith(name + ".") for name in names):
            return index
    return None


def upward_calls(calls: set[tuple[str, str]], contracts: list[list[list[str]]]) -> list[str]:
    """Calls the profiler saw from a module into one of a higher layer of the same contract (a callback handed
    down, or a method a subclass defines): what no import check can see."""
    found = []
    for caller, callee in sorted(calls):
        a, b = (path.removesuffix(".py").replace("/", ".") for path in (caller, callee))
        for layers in contracts:
            low, high = _layer(a, layers), _layer(b, layers)
            if low is not None and high is not None and high < low:
                found.append(f"{caller} -> {callee}")
                break
    return found


# ---- set-up helpers ----


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A private redis-server on a free port, without persistence; returns it and its URL."""
    import redis

    port = free_port()
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(url).ping()
            return process, url
        except redis.ConnectionError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                raise RuntimeError("redis-server did not start") from None
            time.sleep(0.05)


def write_run_config(path: Path) -> Path:
    text = (REPO / "examples" / "demo.toml").read_text()
    for old, new in CONFIG_EDITS:
        if old not in text:
            raise RuntimeError(f"examples/demo.toml no longer has {old!r}: update CONFIG_EDITS")
        text = text.replace(old, new, 1)
    path.write_text(text)
    return path


def wrap_method(
    obj: object, name: str, before: Callable[..., None] | None = None, after: Callable[[], None] | None = None
) -> None:
    """Replace ``obj.name`` on this one instance by a call that runs ``before(*args)`` and ``after()`` around it."""
    method = getattr(obj, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before(*args, **kwargs)
        result = method(*args, **kwargs)
        if after is not None:
            after()
        return result

    setattr(obj, name, wrapped)


# ---- the walk ----


def trace_one_sample(workdir: Path, redis_url: str) -> Walk:
    """Warm the pipeline up, then trace one sample's steps; returns the recorder."""
    walk = Walk(REPO)
    bucket_url = f"file://{workdir / 'bucket'}"
    # The worker's settings are read from the environment by ``process_settings()`` (cached for the process)
    # when the Celery app is built: set them before anything imports ``worker.process``.
    os.environ.update(
        ASYNCGRPO_RUN=RUN,
        ASYNCGRPO_BUCKET=bucket_url,
        ASYNCGRPO_REDIS_URL=redis_url,
        ASYNCGRPO_PROXY_URL=BASE_URL,
        ASYNCGRPO_WORKER_ID="gen-1",
        ASYNCGRPO_CACHE=str(workdir / "cache"),
        ASYNCGRPO_TOKEN=TOKEN,
        ASYNCGRPO_DEVICE="cpu",
        ASYNCGRPO_LOG_LEVEL="ERROR",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
    )
    # Every thread started from here on carries the hook (the app's portal thread, the lease renewers,
    # the upload pools); it records only while ``walk.tracing``.
    threading.setprofile(walk.profile)

    import redis
    from fastapi.testclient import TestClient

    import worker.process.tasks as tasks
    from asyncgrpo.bucket import layout as bucket_keys
    from asyncgrpo.bucket.backends import open_bucket
    from asyncgrpo.protocol.client import ProxyClient
    from asyncgrpo.protocol.log_setup import configure_logging
    from asyncgrpo.protocol.schemas import GenerateTaskMessage, LatestVersion, OptimizeTaskMessage
    from asyncgrpo.run.creation import create_run
    from proxy.api.app import create_app
    from proxy.coordinator.dispatch import CeleryDispatcher
    from proxy.coordinator.scripts import BoundScript
    from proxy.coordinator.service import Coordinator
    from proxy.coordinator.snapshot import Leadership
    from worker.process.heartbeat import Heartbeat
    from worker.process.runtime import AdapterPrefetcher, get_runtime

    configure_logging(log_format="console", level="ERROR", stream=sys.stderr)

    # Lua scripts by name: every script call goes through BoundScript.__call__.
    script_call = BoundScript.__call__

    def recording_call(self: BoundScript, **values: Any) -> Any:
        walk.ran_script(self.script.name)
        return script_call(self, **values)

    BoundScript.__call__ = recording_call  # type: ignore[method-assign]

    class KeepingDispatcher(CeleryDispatcher):
        """Sends to the broker like the proxy does, and keeps each message for this process to run."""

        def __init__(self, broker_url: str) -> None:
            super().__init__(broker_url)
            self.generate: list[GenerateTaskMessage] = []
            self.optimize: list[OptimizeTaskMessage] = []

        def send_generate(self, message: GenerateTaskMessage) -> None:
            super().send_generate(message)
            self.generate.append(message)

        def send_optimize(
            self, message: OptimizeTaskMessage, queue: str | None = None, expires_s: float | None = None
        ) -> None:
            super().send_optimize(message, queue=queue, expires_s=expires_s)
            self.optimize.append(message)

    bucket = open_bucket(bucket_url)
    create_run(write_run_config(workdir / "run.toml"), RUN, bucket)
    rds = redis.Redis.from_url(redis_url, decode_responses=True)
    leadership = Leadership(rds, RUN)
    leadership.acquire()
    dispatcher = KeepingDispatcher(redis_url)
    coordinator = Coordinator.from_bucket(
        rds, bucket, RUN, dispatcher, leadership=leadership, require_generate_worker=True, worker_alive_s=600
    )
    coordinator.ensure_state()
    app = create_app(coordinator, TOKEN, run_loop=False, stop_on_lost_leadership=lambda: None)

    try:
        with TestClient(app, base_url=BASE_URL) as http:
            http.headers["Authorization"] = f"Bearer {TOKEN}"
            # One runtime plays both workers: a generate worker "gen-1" and an optimize worker "opt-1".
            runtime = get_runtime("generate")
            runtime.client = ProxyClient(BASE_URL, TOKEN)
            runtime.client._http = http
            gen_settings = runtime.settings
            opt_settings = gen_settings.model_copy(update={"worker_id": "opt-1"})
            prefetch_client = ProxyClient(BASE_URL, TOKEN, retries=0)
            prefetch_client._http = http
            prefetcher = AdapterPrefetcher(
                prefetch_client,
                runtime.bucket,
                workdir / "cache" / "prefetch",
                runtime.backend_and_cache,
                runtime.adapter_lock,
            )
            prefetched = -1

            def heartbeats() -> None:
                workers = (("gen-1", "generate", gen_settings), ("opt-1", "optimize", opt_settings))
                for worker_id, role, settings in workers:
                    runtime.settings = settings
                    Heartbeat(runtime.client, worker_id, role, 5, runtime.describe).beat()
                runtime.settings = gen_settings

            def run_generate(message: GenerateTaskMessage) -> dict[str, Any]:
                runtime.settings = gen_settings
                return tasks.generate(**message.model_dump(mode="json"))

            def run_optimize(message: OptimizeTaskMessage) -> dict[str, Any]:
                runtime.settings = opt_settings
                try:
                    return tasks.optimize(**message.model_dump(mode="json"))
                finally:
                    runtime.settings = gen_settings

            def prefetch() -> None:
                """What the prefetcher's thread does on one poll: load the newest version."""
                nonlocal prefetched
                latest: LatestVersion = prefetch_client.latest_version(after=prefetched, wait_s=0)
                if latest.version > prefetched and latest.manifest_sha256:
                    prefetcher.load(latest)
                    prefetched = latest.version

            def run_pending() -> None:
                while dispatcher.generate:
                    run_generate(dispatcher.generate.pop(0))
                while dispatcher.optimize:
                    run_optimize(dispatcher.optimize.pop(0))
                    prefetch()

            # ---- warm-up: every code path's first use (model build, caches) happens here ----
            for _ in range(WARM_UP_ROUNDS):
                heartbeats()
                coordinator.tick()
                while dispatcher.generate:
                    run_generate(dispatcher.generate.pop(0))
                    coordinator.tick()
                while dispatcher.optimize:
                    run_optimize(dispatcher.optimize.pop(0))
                    prefetch()
                    coordinator.tick()
            if coordinator.current_version() < 1:
                raise RuntimeError("the warm-up published no version")

            # ---- the step hooks: each moves the walk on when this sample's work reaches it ----
            ours: GenerateTaskMessage | None = None

            def leased() -> None:
                if walk.step == "lease":
                    walk.step = "generate"

            def putting(key: str, *_: Any, **__: Any) -> None:
                ours_key = ours is not None and key == bucket_keys.rollout_key(RUN, ours.task_id)
                if ours_key and walk.step == "generate":
                    walk.step = "upload"
                elif key.startswith(bucket_keys.adapters_prefix(RUN)) and walk.step == "optimize":
                    walk.step = "publish"

            def submitting(*_: Any) -> None:
                if walk.step in ("generate", "upload"):
                    walk.step = "admit"

            def publishing(*_: Any) -> None:
                if walk.step == "optimize":
                    walk.step = "publish"

            # The tiny model may sample faster than a lease is renewed (every ttl/3): our generation waits for one
            # renewal, as a real model's would see several, so that every run walks the same code.
            renewed = threading.Event()

            def sampled() -> None:
                if walk.step == "generate" and not renewed.wait(timeout=10):
                    raise RuntimeError("the lease was not renewed while our group was sampled")

            wrap_method(runtime.client, "renew", after=renewed.set)
            wrap_method(runtime.backend, "generate", after=sampled)
            wrap_method(runtime.client, "lease", after=leased)
            wrap_method(runtime.client, "submit_rollout", before=submitting)
            wrap_method(runtime.client, "publish", before=publishing)
            wrap_method(runtime.bucket, "put", before=putting)

            # ---- dispatch: a round that sends a generate task; earlier work is finished untraced first ----
            for _ in range(30):
                run_pending()
                walk.clear()
                with walk.traced("dispatch"):
                    coordinator.tick()
                if dispatcher.generate:
                    break
            else:
                raise RuntimeError("no round sent a generate task")
            ours, others = dispatcher.generate[0], dispatcher.generate[1:]
            dispatcher.generate = []
            # The step that round claimed (earlier samples) is trained and loaded before ours starts.
            while dispatcher.optimize:
                run_optimize(dispatcher.optimize.pop(0))
                prefetch()

            # ---- lease .. admit: our generate task ----
            renewed.clear()
            with walk.traced("lease"):
                result = run_generate(ours)
            if result.get("status") != "admitted":
                raise RuntimeError(f"our rollout was not admitted: {result}")

            # ---- claim: rounds until a step holding our rollout is claimed ----
            claimed: OptimizeTaskMessage | None = None
            with walk.traced("claim"):
                for _ in range(6):
                    coordinator.tick()
                    hits = [m for m in dispatcher.optimize if any(r.task_id == ours.task_id for r in m.rollouts)]
                    if hits:
                        claimed = hits[0]
                        break
                    with walk.paused():  # other samples' work, needed to move the pipeline on
                        if dispatcher.optimize:
                            run_optimize(dispatcher.optimize.pop(0))
                            prefetch()
                        elif others:
                            run_generate(others.pop(0))
            if claimed is None:
                raise RuntimeError("the step holding our rollout was never claimed")
            dispatcher.optimize.remove(claimed)

            # ---- optimize, publish ----
            with walk.traced("optimize"):
                result = run_optimize(claimed)
            if result.get("status") != "published":
                raise RuntimeError(f"our step was not published: {result}")

            # ---- load: the prefetcher loads the version, a round dispatches on it, the next task leases it ----
            with walk.traced("load"):
                prefetch()
                coordinator.tick()
                # A task sent now, or one sent with ours (and held back by the paced limit since): it leases the
                # new version either way.
                waiting = dispatcher.generate + others
                if not waiting:
                    raise RuntimeError("no generate task left to lease the new version")
                run_generate(waiting[0])
    finally:
        BoundScript.__call__ = script_call  # type: ignore[method-assign]
        threading.setprofile(None)  # type: ignore[arg-type]
    return walk


def print_table(report: dict[str, Any], seconds: float) -> None:
    for step in report["steps"]:
        scripts = ", ".join(f"{name}×{n}" if n > 1 else name for name, n in step["lua"].items()) or "-"
        print(f"{step['step']} ({len(step['modules'])} new modules)")
        for module in step["modules"]:
            print(f"    {module}")
        print(f"    lua: {scripts}")
    print()
    print(f"python modules: {report['python_modules']}")
    print(f"lua scripts:    {report['lua_scripts']} ({report['lua_calls']} calls)")
    print(f"entered, did nothing: {', '.join(report['idle_modules']) or '-'}")
    print(f"seen, not counted:    {', '.join(report['excluded_seen']) or '-'}")
    print(f"upward calls:         {', '.join(report['upward_calls']) or '-'}")
    print(f"wall time: {seconds:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)

    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="bench-sample-walk-"))
    redis_process = None
    try:
        redis_process, redis_url = start_redis(workdir)
        walk = trace_one_sample(workdir, redis_url)
    finally:
        if redis_process is not None:
            redis_process.terminate()
            redis_process.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)
    report = walk.report()
    seconds = time.perf_counter() - started
    if args.json:
        print(json.dumps({**report, "wall_s": round(seconds, 1)}))
    else:
        print_table(report, seconds)


if __name__ == "__main__":
    main()
