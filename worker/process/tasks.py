"""A worker process's Celery tasks (the runtime they share is ``worker.process.runtime``).

The tasks are kept thin: validate the JSON message, bind log context, run the task (a generate or eval task
is an object built from the worker's runtime), return a small JSON result. All the work is in
``worker.generate.job``, ``worker.generate.evals`` and ``worker.optimize.job``. A generate task that failed
for good is reported to the proxy (``report_task_failure``: cancel it now, count the attempt of its prompts).

Preemption (a SIGTERM hands the running task back to the queue) is ``worker.process.preemption``; its state, like
everything a worker process keeps between tasks, lives on the process's runtime, not in module globals.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import structlog
import torch
from celery import signals
from celery.exceptions import Reject
from celery.worker import state as worker_state

from asyncgrpo.bucket.backends import BucketError, ObjectNotFound
from asyncgrpo.bucket.layout import IntegrityError
from asyncgrpo.protocol.client import ProxyClient
from asyncgrpo.protocol.errors import Conflict, NotReady, ProxyError, ProxyUnavailable
from asyncgrpo.protocol.evals import EvalTaskMessage
from asyncgrpo.protocol.log_setup import configure_logging
from asyncgrpo.protocol.schemas import (
    EVAL_TASK_NAME,
    REPAIR_TASK_NAME,
    GenerateTaskMessage,
    OptimizeTaskMessage,
    RepairTaskMessage,
    StaleRolloutError,
    TaskFailureReport,
)
from worker.generate.agent import AgentSetupError
from worker.generate.evals import EvalTask
from worker.generate.job import GenerateTask
from worker.generate.partial import Interrupted, LeftWindow
from worker.generate.task_context import TaskContext
from worker.generate.tool_process import ToolSetupError
from worker.model.reward_models import RewardModelError
from worker.optimize.job import OptimizeResult, step_failure_of
from worker.optimize.ranks import RankLost, leave
from worker.process import metrics as worker_metrics
from worker.process.celery_app import app
from worker.process.preemption import WorkerPreempted
from worker.process.runtime import (
    WorkerRuntime,
    get_runtime,
    load_reward_models_at_start,
    start_heartbeat,
    start_prefetcher,
)
from worker.process.settings import RankSettings, process_settings

log = structlog.get_logger()


# ---- the tasks ----


def failure_reason(error: BaseException) -> str:
    """The short label the proxy keeps as the rejection reason at the last attempt."""
    return f"task_error_{type(error).__name__}"


def report_task_failure(client: ProxyClient, task_id: str, worker_id: str, error: BaseException) -> dict[str, Any]:
    """Tell the proxy that ``task_id`` failed with ``error``; returns the task's JSON result."""
    report = TaskFailureReport(
        worker_id=worker_id,
        reason=failure_reason(error),
        detail=repr(error)[:2000],
        # A version that cannot be read is the bucket's fault (reported for repair), not the prompts'.
        prompt_at_fault=not isinstance(error, IntegrityError | ObjectNotFound),
    )
    try:
        cancelled = client.report_task_failure(task_id, report).cancelled
    except ProxyError as report_error:
        # The task's deadline at the proxy is the backstop.
        log.warning("generate.failure_report_failed", task_id=task_id, error=str(report_error))
        cancelled = False
    log.warning("generate.task_failure_reported", task_id=task_id, reason=report.reason, cancelled=cancelled)
    return {"task_id": task_id, "status": "failed", "reason": report.reason, "cancelled": cancelled}


_ERROR_KINDS: dict[type[BaseException], str] = {
    IntegrityError: "integrity",
    ObjectNotFound: "integrity",
    StaleRolloutError: "stale",
    Conflict: "conflict",
    ProxyError: "proxy",
}
# Transient failures: the proxy restarting, no version published yet, the bucket briefly unreachable. The
# task is sent again under the same id (every task is idempotent by id) instead of being dropped; the
# proxy's own timeouts cover a task that keeps failing.
TRANSIENT_ERRORS = (ProxyUnavailable, NotReady, BucketError)
RETRY_OPTIONS = {
    "autoretry_for": TRANSIENT_ERRORS,
    "retry_backoff": 1,
    "retry_backoff_max": 30,
    "retry_jitter": True,
    "max_retries": 30,
}


def _role() -> str:
    return process_settings().worker_role or "generate"


@signals.setup_logging.connect
def _on_setup_logging(**_: Any) -> None:
    # Replaces Celery's own logging set-up: one structlog configuration for the whole process.
    settings = process_settings()
    configure_logging(log_format=settings.log_format, level=settings.log_level, role=_role())


@signals.worker_ready.connect
def _on_worker_ready(**_: Any) -> None:
    role = _role()
    runtime = get_runtime(role)
    settings = runtime.settings
    configure_logging(log_format=settings.log_format, level=settings.log_level, role=role, worker=settings.worker_id)
    if runtime.settings.torch_threads is not None:
        torch.set_num_threads(runtime.settings.torch_threads)
    runtime.metrics.start(runtime.settings.metrics_port, role=role)
    runtime.preemption.install(runtime.settings.soft_shutdown_s)
    if role == "optimize" and RankSettings().world_size > 1:  # the other ranks wait for this one to join
        runtime.join_ranks()
    worker_metrics.set_worker_info(role, runtime.settings.worker_id, runtime.settings.device, "lazy")
    try:
        load_reward_models_at_start(role)
    except SETUP_ERRORS as error:
        _stop_for_setup(error)
        return
    start_heartbeat(role)
    start_prefetcher(role)
    runtime.idle_since = time.monotonic()


EXIT_REWARD_MODEL = 78  # EX_CONFIG: the run's config names a reward model, tool or template this machine cannot use
SETUP_ERRORS = (RewardModelError, ToolSetupError, AgentSetupError)
"""What a generate worker loads for its run and may fail to: reward models, [agent]'s tools and chat template."""


def _stop_for_setup(error: Exception) -> None:
    """A reward model, tool or template this worker cannot use: exit (non-zero) rather than fail every task."""
    log.error("worker.setup_failed", error=str(error), exit_code=EXIT_REWARD_MODEL)
    worker_state.should_stop = EXIT_REWARD_MODEL


@signals.worker_shutting_down.connect
def _on_worker_shutting_down(**_: Any) -> None:
    runtime = get_runtime(_role())
    if runtime.heartbeat is not None:
        runtime.heartbeat.stop()
    if runtime.prefetcher is not None:
        runtime.prefetcher.stop()


@signals.worker_shutdown.connect
def _on_worker_shutdown(**_: Any) -> None:
    # The last call in the main thread before exit (also after a SIGTERM hand-back, which sends no
    # worker_shutting_down): no torch op may run in the prefetcher's daemon thread past this point.
    runtime = get_runtime(_role())
    if _role() == "optimize" and RankSettings().world_size > 1:  # followers of a multi-GPU worker exit with it
        leave(runtime.join_ranks())
    if runtime.prefetcher is not None:
        closed = runtime.prefetcher.close()
        (log.info if closed else log.warning)("worker.prefetch_closed", load_in_progress=not closed)
    if runtime.agent is not None:
        runtime.agent.close()  # its tool process too (it would also die with this process)
    runtime.math_verifier.close()  # its helper process, if a math_verify score started one


def _refuse_other_run(role: str, task: str, run: str) -> None:
    """A worker serves one run (``ASYNCGRPO_RUN``) and consumes only its queues, so a message naming another run
    is a stray (sent by hand, or by hand-moved queues): log it and drop it unrun with no retry. Its own run's
    proxy sends the work again or cancels it when its task times out."""
    own = get_runtime(role).settings.run  # read once at start-up, not from the environment per task
    if run != own:
        log.error("worker.task_refused", task=task, task_run=run, worker_run=own, reason="message of another run")
        raise Reject(f"task {task} is for run {run!r}, this worker serves run {own!r}", requeue=False)


@contextmanager
def _task_scope(role: str, runtime: WorkerRuntime, task_name: str) -> Iterator[None]:
    """Idle time before the task, in-flight gauge, current task for heartbeats, error counting."""
    if runtime.idle_since is not None:
        worker_metrics.observe_idle(role, time.monotonic() - runtime.idle_since)
    runtime.current_task = task_name
    started = time.perf_counter()
    try:
        with worker_metrics.task_in_flight(role), runtime.preemption.running():
            yield
    except (WorkerPreempted, Interrupted) as error:
        # Straight back to the queue: another worker redoes it (tasks are idempotent by id), continuing the
        # partial sequences an interrupted generate task saved.
        log.warning("worker.task_handed_back", task=task_name, reason=str(error))
        if isinstance(error, LeftWindow):
            worker_metrics.observe_left_window()
        raise Reject(str(error), requeue=True) from error
    except SETUP_ERRORS as error:
        # Only a run created after this worker started gets here (its first task loads them): hand the task back
        # for a worker that can, and stop.
        worker_metrics.observe_error("other")
        _stop_for_setup(error)
        raise Reject(str(error), requeue=True) from error
    except RankLost as error:
        # Another rank of this multi-GPU worker died or hung: this worker cannot train any more. Hand the step
        # back and stop; the launcher ends every rank and the unit restarts the worker as a whole.
        worker_state.should_stop = 0
        worker_metrics.observe_error("other")
        log.error("worker.rank_lost", task=task_name, error=str(error))
        raise Reject(str(error), requeue=True) from error
    except BaseException as error:
        kind = next((k for t, k in _ERROR_KINDS.items() if isinstance(error, t)), "other")
        worker_metrics.observe_error(kind)
        log.exception("worker.task_failed", task=task_name, error_kind=kind, seconds=time.perf_counter() - started)
        raise
    finally:
        runtime.current_task = None
        runtime.idle_since = time.monotonic()


def _run(role: str, task_name: str, body: Callable[[WorkerRuntime], dict[str, Any]], **context: Any) -> dict:
    runtime = get_runtime(role)
    with structlog.contextvars.bound_contextvars(worker=runtime.settings.worker_id, **context):
        started = time.perf_counter()
        with _task_scope(role, runtime, task_name):
            summary = body(runtime)
        # The task's wall time is this line's own field: a summary never overrides it, and a name shared with a
        # summary must not turn a finished task into a failure here, after its result was stored.
        log.info(f"{role}.task_done", **{**summary, "seconds": round(time.perf_counter() - started, 4)})
        return summary


@app.task(name="asyncgrpo.generate", acks_late=True, reject_on_worker_lost=True, **RETRY_OPTIONS)
def generate(**payload: Any) -> dict[str, Any]:
    message = GenerateTaskMessage.model_validate(payload)
    _refuse_other_run("generate", message.task_id, message.run)

    def body(runtime: WorkerRuntime) -> dict[str, Any]:
        context = _task_context(runtime, message.run)
        settings = runtime.settings
        worker_metrics.set_worker_info("generate", settings.worker_id, settings.device, type(context.backend).__name__)
        result = GenerateTask(context, message.task_id, message.groups).run()
        worker_metrics.observe_generate_task(result)
        return result.summary()

    return _run_generate_role(body, run=message.run, task_id=message.task_id)


@app.task(name=EVAL_TASK_NAME, acks_late=True, reject_on_worker_lost=True, **RETRY_OPTIONS)
def eval_version(**payload: Any) -> dict[str, Any]:
    """Evaluate a version on a chunk of the held-out prompts ([eval]). A task that fails for good is reported:
    the proxy sends it again at once, and gives the version's evaluation up after a few attempts."""
    message = EvalTaskMessage.model_validate(payload)
    _refuse_other_run("generate", message.task_id, message.run)

    def body(runtime: WorkerRuntime) -> dict[str, Any]:
        return EvalTask(_task_context(runtime, message.run), message.task_id).run().summary()

    summary = _run_generate_role(body, run=message.run, task_id=message.task_id, version=message.version)
    worker_metrics.observe_eval_task(summary["status"])
    return summary


def _task_context(runtime: WorkerRuntime, run: str) -> TaskContext:
    """The context of a generate or eval task of ``run``: the worker's parts for it (the run's config and
    prompts, backend, adapter cache, reward models, math-verify helper and [agent] tools), built on first use."""
    with runtime.adapter_lock:  # the prefetcher may be building them right now
        context = runtime.run_context(run)
        return TaskContext(
            run=run,
            config=context.config,
            bucket=runtime.bucket,
            client=runtime.client,
            backend=runtime.generation_backend(context),
            adapter_cache=runtime.adapter_cache(context),
            worker_id=runtime.settings.worker_id,
            prompts=context.prompts,
            eval_prompts=context.eval_prompts,
            backend_lock=runtime.adapter_lock,
            reward_models=runtime.run_reward_models(context),
            math_verifier=runtime.math_verifier,
            agent=runtime.run_agent(context),
            version_offers=runtime.version_offers,
            stop=runtime.preemption.stop,
        )


def _run_generate_role(body: Callable[[WorkerRuntime], dict[str, Any]], *, task_id: str, **context: Any) -> dict:
    """A generate or eval task: preemption and transient failures go back to Celery; a failure for good is
    reported, so the proxy sends the work again or counts the attempt now, and the message is acked with no
    retry loop (invariant 9)."""
    try:
        return _run("generate", task_id, body, task_id=task_id, **context)
    except (Reject, *TRANSIENT_ERRORS):
        raise  # back to the queue (preemption) or retried (proxy restarting, bucket briefly away)
    except Exception as error:  # already logged and counted by _task_scope
        runtime = get_runtime("generate")
        return report_task_failure(runtime.client, task_id, runtime.settings.worker_id, error)


def _report_step_failure(runtime: WorkerRuntime, message: OptimizeTaskMessage, error: Exception) -> dict | None:
    """Report a step this worker cannot train to the proxy, which decides what comes next (reject, re-send,
    halt); the task then ends acknowledged. None for any other error (a bug, a transient failure)."""
    failure = step_failure_of(error)
    if failure is None:
        return None
    worker_metrics.observe_error("other" if failure.kind == "step" else "integrity")
    answer = runtime.client.report_step_failure(message.step, failure.report(runtime.settings.worker_id))
    log.warning(
        "optimize.step_failed",
        step=message.step,
        kind=failure.kind,
        reason=failure.reason,
        task_id=failure.task_id,
        detail=failure.detail,
        outcome=answer.outcome,
    )
    result = OptimizeResult(step=message.step, status=f"failed_{failure.kind}", version=message.base_version)
    worker_metrics.observe_optimize_step(None, result.status)
    return {**result.summary(), "reason": failure.reason, "outcome": answer.outcome}


@app.task(name="asyncgrpo.optimize", acks_late=True, reject_on_worker_lost=True, **RETRY_OPTIONS)
def optimize(**payload: Any) -> dict[str, Any]:
    message = OptimizeTaskMessage.model_validate(payload)
    _refuse_other_run("optimize", f"step-{message.step}", message.run)

    def body(runtime: WorkerRuntime) -> dict[str, Any]:
        optimizer = runtime.run_optimizer(runtime.run_context(message.run))
        device = str(optimizer.trainer.policy.device)
        worker_metrics.set_worker_info("optimize", runtime.settings.worker_id, device, "trainer")
        try:
            result = optimizer.run_task(message)
        except Exception as error:
            failure = _report_step_failure(runtime, message, error)
            if failure is None:
                raise
            return failure
        worker_metrics.observe_optimize_step(result.record, result.status)
        return result.summary()

    return _run("optimize", f"step-{message.step}", body, run=message.run, step=message.step)


# ---- repair of a corrupted version object from this trainer's memory ----


@app.task(name=REPAIR_TASK_NAME, acks_late=True, reject_on_worker_lost=True, **RETRY_OPTIONS)
def repair_version(**payload: Any) -> dict[str, Any]:
    message = RepairTaskMessage.model_validate(payload)
    _refuse_other_run("optimize", f"repair-{message.version}", message.run)

    def body(runtime: WorkerRuntime) -> dict[str, Any]:
        # Only a trainer that uploaded or loaded a version holds one; none built yet holds nothing.
        outcome = runtime.optimizer.repair(message) if runtime.optimizer is not None else "not_held"
        log_line = log.warning if outcome == "repaired" else log.error
        log_line("optimize.repair_done", version=message.version, key=message.key, outcome=outcome)
        return {"version": message.version, "key": message.key, "outcome": outcome}

    return _run("optimize", f"repair-{message.version}", body, run=message.run, version=message.version)
