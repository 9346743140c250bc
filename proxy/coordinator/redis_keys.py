"""Every Redis key of the coordinator is named here, and nowhere else.

All keys of one run share the prefix ``asyncgrpo:{<run>}:``. The braces are a Redis Cluster hash tag: every
key of a run lands in one slot, so a Lua script may touch any of them. Keys built inside Lua scripts (one
per group, task, rollout, lease, step or worker) are ``prefix + kind + ":" + id``; the kinds are the
``*_KIND`` constants below, passed to the scripts so that the names still come from this module.

Fixed keys:

- ``state``      hash: current_version, step_inflight, epoch, epoch_pos, task_seq, incarnation, ...
- ``counters``   hash: monotonic totals (admitted, stale, rejected, cancelled, trained, publish, ...)
- ``rejected_reasons`` hash: reason -> groups rejected for it
- ``versions``   hash: version -> manifest sha256 of each published version
- ``requeue``    list: prompt indices put back in line (served before the permutation)
- ``buffer``     list: task ids of admitted rollouts not yet claimed, oldest first
- ``tasks_inflight`` sorted set: generate task id -> deadline (ms)
- ``leases``     sorted set: lease id -> expiry (ms)
- ``workers``    sorted set: worker id -> last heartbeat (ms)
- ``workers_generate``, ``workers_optimize`` sorted sets: the same, per role, so ``/metrics`` counts the
  live workers of a role with one ZCOUNT
- ``rollout_retention`` sorted set: task id -> the version after which its rollout object may be deleted
  from the bucket (trained, stale, rejected or cancelled; never a buffered or claimed one)
- ``proxy_lease`` string (JSON, with a TTL): the one live proxy of the run and its fencing epoch
- ``proxy_epoch`` counter: the last fencing epoch handed out (``proxy.coordinator.snapshot``)
- ``prompt_attempts`` hash: prompt index -> failed attempts of its group since it last ran to a submission
  (and ``reason:<index>`` -> the last failure its worker reported); at ``async.max_group_attempts`` the
  group is rejected and ``quarantined:<index>`` -> the reason keeps the prompt from being dispatched again
  (``quarantined`` counts them)
- ``tracking``   hash: what the proxy sent to each experiment tracker (``proxy.tracking.forwarder``):
  ``<tracker>:step`` -> the last step record sent, ``<tracker>:eval:<version>`` -> when that eval was sent
  (unix seconds; a rebuild writes its own time); the snapshot carries it, compacted to the cursor and the
  sorted versions per tracker (``tracking_step_field`` / ``tracking_eval_field`` name the fields)
- ``evals``      hash ([eval], ``proxy.coordinator.evaluations``): ``cursor`` (the next version to consider),
  ``latest`` (JSON of the newest eval summary) and ``latest_version``; per due version not yet recorded
  ``v:<version>`` (JSON: chunks left, task ids); per evaluate task in flight ``t:<task_id>`` (JSON: version,
  prompt range, attempts, worker) and, once its result came, ``s:<task_id>`` (its chunk summary)
- ``evals_inflight`` sorted set: evaluate task id -> deadline (ms)
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncgrpo.bucket.layout import check_run_name

GROUP_KIND = "group"
TASK_KIND = "task"
ROLLOUT_KIND = "rollout"
LEASE_KIND = "lease"
STEP_KIND = "step"
WORKER_KIND = "worker"


def tracking_step_field(tracker: str) -> str:
    """The ``tracking`` hash field holding the last step sent to ``tracker``."""
    return f"{tracker}:step"


def tracking_eval_field(tracker: str, version: int) -> str:
    """The ``tracking`` hash field marking the eval of ``version`` as sent to ``tracker``."""
    return tracking_eval_prefix(tracker) + str(version)


def tracking_eval_prefix(tracker: str) -> str:
    """What every eval field of ``tracker`` starts with (the version follows)."""
    return f"{tracker}:eval:"


@dataclass(frozen=True)
class RunKeys:
    """The Redis key names of one run."""

    run: str

    def __post_init__(self) -> None:
        check_run_name(self.run)

    @property
    def prefix(self) -> str:
        return f"asyncgrpo:{{{self.run}}}:"

    @property
    def pattern(self) -> str:
        """A SCAN/KEYS pattern matching every key of the run (braces escaped for glob)."""
        return f"asyncgrpo:\\{{{self.run}\\}}:*"

    @property
    def state(self) -> str:
        return self.prefix + "state"

    @property
    def counters(self) -> str:
        return self.prefix + "counters"

    @property
    def rejected_reasons(self) -> str:
        return self.prefix + "rejected_reasons"

    @property
    def versions(self) -> str:
        return self.prefix + "versions"

    @property
    def requeue(self) -> str:
        return self.prefix + "requeue"

    @property
    def buffer(self) -> str:
        return self.prefix + "buffer"

    @property
    def tasks_inflight(self) -> str:
        return self.prefix + "tasks_inflight"

    @property
    def leases(self) -> str:
        return self.prefix + "leases"

    @property
    def workers(self) -> str:
        return self.prefix + "workers"

    @property
    def workers_generate(self) -> str:
        return self.prefix + "workers_generate"

    @property
    def workers_optimize(self) -> str:
        return self.prefix + "workers_optimize"

    @property
    def rollout_retention(self) -> str:
        return self.prefix + "rollout_retention"

    @property
    def proxy_lease(self) -> str:
        return self.prefix + "proxy_lease"

    @property
    def proxy_epoch(self) -> str:
        return self.prefix + "proxy_epoch"

    @property
    def prompt_attempts(self) -> str:
        return self.prefix + "prompt_attempts"

    @property
    def tracking(self) -> str:
        return self.prefix + "tracking"

    @property
    def evals(self) -> str:
        return self.prefix + "evals"

    @property
    def evals_inflight(self) -> str:
        return self.prefix + "evals_inflight"

    def _item(self, kind: str, item_id: str | int) -> str:
        return f"{self.prefix}{kind}:{item_id}"

    def group(self, group_id: str) -> str:
        return self._item(GROUP_KIND, group_id)

    def task(self, task_id: str) -> str:
        return self._item(TASK_KIND, task_id)

    def rollout(self, task_id: str) -> str:
        return self._item(ROLLOUT_KIND, task_id)

    def lease(self, lease_id: str) -> str:
        return self._item(LEASE_KIND, lease_id)

    def step(self, step: int) -> str:
        return self._item(STEP_KIND, step)

    def worker(self, worker_id: str) -> str:
        return self._item(WORKER_KIND, worker_id)
