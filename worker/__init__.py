"""The worker processes: generate and optimize Celery workers, and the operator's tools.

Depends on `proxy` (protocol, storage, run); never the other way round.

Packages:
    process   Celery process plumbing shared by both roles: app, launcher, tasks, runtime, signals, metrics
    generate  the generate role: one task's job and the generation backends
    optimize  the optimize role: one step's job, the trainer and its state
    algo      pure GRPO math, rewards and the rollout format: no I/O, no Celery, no bucket
    model     the policy (base model + LoRA) and the tiny offline model
    tools     the `asyncgrpo` command line and what it runs for people: demo, status, plot, export
"""
