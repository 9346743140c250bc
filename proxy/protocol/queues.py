"""Celery task names and queues: the contract between the proxy, which sends tasks by name, and the workers.

Every optimize worker consumes the shared ``optimize`` queue and a queue of its own (``worker_queue``), so
the proxy can send a step to the trainer that already holds the step's base version in memory, and a repair
to the one that holds a version's files; a step sent there while that worker is alive goes nowhere else.
"""

from __future__ import annotations

GENERATE_TASK_NAME = "asyncgrpo.generate"
OPTIMIZE_TASK_NAME = "asyncgrpo.optimize"
REPAIR_TASK_NAME = "asyncgrpo.repair_version"
"""Sent only to a worker's own queue: put a corrupted object of a version back from the holder's memory."""
GENERATE_QUEUE = "generate"
OPTIMIZE_QUEUE = "optimize"


def worker_queue(worker_id: str) -> str:
    """The queue only the optimize worker ``worker_id`` consumes."""
    return f"{OPTIMIZE_QUEUE}.{worker_id}"


def worker_queues(role: str, worker_id: str) -> list[str]:
    """Every queue a worker of ``role`` consumes: its role's shared queue, plus its own for optimize workers."""
    if role == OPTIMIZE_QUEUE:
        return [OPTIMIZE_QUEUE, worker_queue(worker_id)]
    return [role]
