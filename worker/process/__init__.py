"""Celery process plumbing of a worker (either role).

Modules:
    celery_app        the Celery app, configured for preemptible machines (JSON only, acks late, prefetch 1)
    launcher          `asyncgrpo worker`: execs `celery worker` with its run's queues for the role, pool and flags
    tasks             the thin Celery tasks; a generate task that failed for good is reported to the proxy
    preemption        SIGTERM: stop taking tasks, grace period, then the running task goes back to the queue
    runtime           what a worker process builds once and keeps on its Celery app (bucket, client, model,
                      optimizer, ranks, caches, heartbeat, preemption), and the prefetcher thread that loads each
                      new adapter version as it is published
    settings          the workers' environment variables
    heartbeat         heartbeats to the proxy from a background thread
    inspect_commands  custom `celery inspect` commands
    metrics           the workers' Prometheus metrics, and those each task's result moves
"""
