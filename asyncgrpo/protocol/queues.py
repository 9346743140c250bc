"""Celery task names and queues: the contract between the proxy, which sends tasks by name, and the workers.

Queues are named per run, so several runs share one Redis broker without taking each other's tasks::

    asyncgrpo:<run>:generate                  every generate worker of the run
    asyncgrpo:<run>:optimize                  every optimize worker of the run
    asyncgrpo:<run>:optimize:<worker_id>      only the optimize worker ``worker_id`` of the run

``:`` never occurs in a run name (``asyncgrpo.bucket.keys``: letters, digits, ``.``, ``_``, ``-``), so the
prefix ``asyncgrpo:<run>:`` names exactly one run: with ``.`` as the separator, the generate queue of run
``a.optimize`` would be the own queue of worker ``generate`` of run ``a``. The coordinator's own keys are
``asyncgrpo:{<run>}:...`` (braces, ``proxy.coordinator.redis_keys``), which no queue name matches.

Every optimize worker consumes its run's ``optimize`` queue and a queue of its own (``worker_queue``), so
the proxy can send a step to the trainer that already holds the step's base version in memory, and a repair
to the one that holds a version's files; a step sent there while that worker is alive goes nowhere else.
"""

from __future__ import annotations

import re

from asyncgrpo.protocol.schemas import ID_PATTERN

GENERATE_TASK_NAME = "asyncgrpo.generate"
OPTIMIZE_TASK_NAME = "asyncgrpo.optimize"
EVALUATE_TASK_NAME = "asyncgrpo.evaluate"
"""Sent to the run's generate queue: evaluate one version on a chunk of the held-out prompts."""
REPAIR_TASK_NAME = "asyncgrpo.repair_version"
"""Sent only to a worker's own queue: put a corrupted object of a version back from the holder's memory."""

QUEUE_PREFIX = "asyncgrpo"
SEPARATOR = ":"
ROLES = ("generate", "optimize")
# The run names ``asyncgrpo.bucket.keys.check_run_name`` accepts (that layer is above this one): none
# holds the separator, a comma (``celery worker --queues`` splits on it) or a space.
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_WORKER_ID = re.compile(ID_PATTERN)


def check_queue_run(run: str) -> str:
    """``run`` if it can be part of a queue name, else ValueError saying which names are allowed."""
    if not RUN_NAME.fullmatch(run):  # fullmatch: no trailing newline slips through
        raise ValueError(
            f"run name {run!r} cannot name a queue: use 1-64 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit"
        )
    return run


def run_queue_prefix(run: str) -> str:
    """What every queue of ``run`` starts with, and no queue of another run does."""
    return f"{QUEUE_PREFIX}{SEPARATOR}{check_queue_run(run)}{SEPARATOR}"


def role_queue(run: str, role: str) -> str:
    """The queue every worker of ``role`` in ``run`` consumes."""
    if role not in ROLES:
        raise ValueError(f"worker role {role!r} is unknown; use one of {', '.join(ROLES)}")
    return run_queue_prefix(run) + role


def generate_queue(run: str) -> str:
    return role_queue(run, "generate")


def optimize_queue(run: str) -> str:
    return role_queue(run, "optimize")


def worker_queue(run: str, worker_id: str) -> str:
    """The queue only the optimize worker ``worker_id`` of ``run`` consumes."""
    if not _WORKER_ID.fullmatch(worker_id):  # fullmatch: no trailing newline slips through
        raise ValueError(f"worker id {worker_id!r} cannot name a queue: it must match {ID_PATTERN}")
    return optimize_queue(run) + SEPARATOR + worker_id


def worker_queues(run: str, role: str, worker_id: str) -> list[str]:
    """Every queue a worker of ``role`` in ``run`` consumes: its role's queue, plus its own for optimize workers."""
    if role == "optimize":
        return [optimize_queue(run), worker_queue(run, worker_id)]
    return [role_queue(run, role)]
