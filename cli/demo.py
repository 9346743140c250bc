"""``asyncgrpo demo``: ``asyncgrpo local`` (``cli.local_run``) on an embedded config, the tiny model
and the toy task.

The demo always keeps its ``file://`` bucket in its work folder (a temporary one by default), whatever
ASYNCGRPO_BUCKET says, so it never writes into a real run's bucket. It reuses the Redis ASYNCGRPO_REDIS_URL
names under a run name of its own, so another demo there keeps its own state and queues.
"""

from __future__ import annotations

import secrets
import tempfile
from pathlib import Path

from cli.local_run import configured_services, run_local
from worker.process.settings import WorkerSettings

RUN_NAME = "demo"
DEFAULT_STEPS = 200
SAMPLES_PER_PROMPT = 8
# The toy task on the tiny model; every other field keeps RunConfig's defaults (see examples/demo.toml).
DEMO_CONFIG_TOML = """\
seed = 0

[model]
base = "tiny"

[dataset]
generator = "repeat_digit"
num_prompts = 512

[[rewards]]
name = "repeat_digit"

[sampling]
samples_per_prompt = {samples_per_prompt}

[optimizer]
total_steps = {steps}

[async]
max_staleness = 2
groups_per_task = 4
groups_per_step = 8
queue_maxsize = 16
generate_task_timeout_s = 120

[eval]
# Greedy reward on 64 held-out prompts at versions 0, 50, 100, ... and the final one.
every_versions = 50

[eval.dataset]
generator = "repeat_digit"
num_prompts = 64
"""


def run_demo(
    *, steps: int | None, as_json: bool, workdir: Path | None, generate_workers: int, settings: WorkerSettings
) -> int:
    workdir = workdir or Path(tempfile.mkdtemp(prefix="asyncgrpo-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "demo.toml"
    config_path.write_text(DEMO_CONFIG_TOML.format(steps=steps or DEFAULT_STEPS, samples_per_prompt=SAMPLES_PER_PROMPT))
    redis_url, _ = configured_services(settings)
    # On a reused Redis the run gets a name of its own (its Celery queues and Redis keys are named after it).
    run_name = RUN_NAME if redis_url is None else f"{RUN_NAME}-{secrets.token_hex(3)}"
    return run_local(
        config_path,
        run_name=run_name,
        workdir=workdir,
        generate_workers=generate_workers,
        as_json=as_json,
        redis_url=redis_url,
        bucket_url=None,
        title="asyncgrpo demo",
        settings=settings,
    )
