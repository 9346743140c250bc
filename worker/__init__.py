"""The worker processes: generate and optimize Celery workers.

Imports neither `proxy` nor `cli`: a worker meets the coordinator over HTTP, its Celery queues and the bucket, in the
vocabulary of `asyncgrpo` (protocol, bucket, run). Import-linter contracts in pyproject.toml check it.
`python -m worker ROLE` (`__main__`) is the worker's command, which `cli` offers as `asyncgrpo worker ROLE`.

Packages:
    process   Celery process plumbing shared by both roles: app, launcher, tasks and their runtime, prefetch,
              signals, metrics
    generate  the generate role: one task's job and the generation backends
    optimize  the optimize role: one step's job, the trainer and its state
    algo      GRPO math, rewards and the rollout format: no broker, Redis or bucket
    model     the policy (base model + LoRA) and the tiny offline model

Modules:
    corrupt_report  reporting a corrupted object of a published version to the proxy (either role)
"""
