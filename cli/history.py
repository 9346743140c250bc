"""Read the per-step records (``runs/<run>/metrics/step-S.json``) back from the bucket, for people.

The optimize worker copies each published version's step record there (the original sits in the version's
folder, covered by its manifest, until the version is collected). These copies feed ``asyncgrpo status``
and ``asyncgrpo plot``: display only, never training, so they are read as they are, each parsed as a
``asyncgrpo.protocol.records.StepRecord``. Likewise the eval records of ``[eval]``
(``runs/<run>/evals/vNNNNNNNN.json``, ``EvalRecord``).
"""

from __future__ import annotations

import re

import structlog
from pydantic import ValidationError

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, ObjectNotFound
from asyncgrpo.protocol.records import EvalRecord, StepRecord

log = structlog.get_logger()

_STEP_FILE = re.compile(r"step-(\d{8})\.json$")


def step_record_steps(bucket: Bucket, run: str) -> list[int]:
    """Steps that have a record in the bucket, ascending."""
    steps = []
    for key in bucket.list(bucket_keys.metrics_prefix(run)):
        match = _STEP_FILE.search(key)
        if match:
            steps.append(int(match.group(1)))
    return sorted(steps)


def load_step_records(bucket: Bucket, run: str, *, last: int | None = None) -> list[StepRecord]:
    """The run's step records in step order (only the ``last`` ones when given).

    A record that cannot be parsed is skipped with a warning naming its key, so one bad object does not hide
    the rest of the run's history.
    """
    if last is not None and last < 1:
        raise ValueError(f"last must be at least 1, got {last}")
    steps = step_record_steps(bucket, run)
    if last is not None:
        steps = steps[-last:]
    records = []
    for step in steps:
        key = bucket_keys.metrics_key(run, step)
        try:
            data = bucket.get(key)
        except ObjectNotFound:
            continue  # collected between the listing and the read
        try:
            records.append(StepRecord.model_validate_json(data))
        except ValidationError as error:
            log.warning("tools.step_record_skipped", key=key, error=str(error))
    return records


def load_eval_records(bucket: Bucket, run: str) -> list[EvalRecord]:
    """The run's eval records in version order ([] for a run without ``[eval]``); an unparsable one is skipped
    with a warning naming its key."""
    records = []
    for key in bucket.list(bucket_keys.evals_prefix(run)):
        if bucket_keys.version_from_eval_key(key) is None:
            continue
        try:
            records.append(EvalRecord.model_validate_json(bucket.get(key)))
        except ObjectNotFound:
            continue
        except ValidationError as error:
            log.warning("tools.eval_record_skipped", key=key, error=str(error))
    return sorted(records, key=lambda record: record.version)
