"""Which versions a rebuild adopts: never go back behind the latest published version, never a foreign batch.

A snapshot can lag the bucket: a trainer uploads version N+1 and Redis dies before the publish reaches it,
or the last snapshot writes failed. The rebuild then walks the complete, contiguous manifests above the
snapshot's current version, oldest first, and adopts each one whose batch it can account for:

- the step the snapshot recorded as claimed: the manifest must name that step, its base version, and
  (``rollouts`` in its metadata) exactly the claimed task ids; a manifest written before the metadata had
  ``rollouts`` is matched on step and base alone;
- any later version: a step claimed after the snapshot was written, so its ``rollouts`` must all be admitted
  rollouts of the snapshot's buffer; they count as trained into that version.

The first manifest that fails these (another batch, a gap, a base that is not the version before) stops the
walk: it is logged (``proxy.rebuild_version_not_adopted``) and counted (``versions_not_adopted``), and the
claimed step, if any, is sent again.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import structlog

from asyncgrpo.bucket.backends import Bucket, ObjectNotFound
from asyncgrpo.bucket.manifest import read_manifest

log = structlog.get_logger()


@dataclass(frozen=True)
class Claimed:
    """The step the snapshot recorded as claimed (in flight)."""

    step: int
    base: int
    task_ids: list[str]


@dataclass
class Adoption:
    """What the walk decided: the new current version, the manifests adopted, and where each buffered task
    went (trained into which version)."""

    current: int
    versions: dict[int, str] = field(default_factory=dict)
    claimed_adopted: bool = False
    trained_from_buffer: dict[str, int] = field(default_factory=dict)
    not_adopted: int = 0


def _newer_manifests(bucket: Bucket, run: str, current: int, latest: int | None) -> Iterator[tuple[int, dict, str]]:
    """Manifests of current+1, current+2, ... up to the first missing one (a gap ends the contiguous run)."""
    if latest is None:
        return
    for version in range(current + 1, latest + 1):
        try:
            manifest, sha = read_manifest(bucket, run, version)
        except ObjectNotFound:
            return
        yield version, manifest.metadata, sha


def _refusal(meta: dict[str, Any], version: int, current: int, claimed: Claimed | None, buffered: set[str]) -> str:
    """Why version ``version`` cannot be adopted on top of ``current`` ('' if it can)."""
    if meta.get("step") != version or meta.get("base_version") != current:
        return f"it names step {meta.get('step')} on base {meta.get('base_version')}, not step {version} on {current}"
    rollouts = meta.get("rollouts")
    if claimed is not None:
        if claimed.step != version or claimed.base != current:
            return f"the snapshot claimed step {claimed.step} on base {claimed.base} for it"
        if rollouts is not None and sorted(rollouts) != sorted(claimed.task_ids):
            return f"its batch {sorted(rollouts)} is not the claimed batch {sorted(claimed.task_ids)}"
        return ""
    if not isinstance(rollouts, list):
        return "its manifest names no rollouts, so its batch cannot be matched with the snapshot's buffer"
    unknown = sorted(set(rollouts) - buffered)
    if unknown:
        return f"its batch holds rollouts the snapshot's buffer does not: {unknown[:5]}"
    return ""


def adopt_newer_versions(
    bucket: Bucket, run: str, current: int, latest: int | None, claimed: Claimed | None, buffered: set[str]
) -> Adoption:
    """Walk the manifests above ``current`` (see the module doc); ``buffered``: task ids of the snapshot's
    buffer."""
    result = Adoption(current=current)
    remaining = set(buffered)
    for version, meta, sha in _newer_manifests(bucket, run, current, latest):
        pending = None if result.claimed_adopted else claimed
        reason = _refusal(meta, version, result.current, pending, remaining)
        if reason:
            result.not_adopted += 1
            log.error(
                "proxy.rebuild_version_not_adopted",
                run=run,
                version=version,
                current=result.current,
                reason=reason,
                hint="the bucket holds a version this run's snapshot does not explain; inspect it before going on",
            )
            break
        result.versions[version] = sha
        if pending is not None:
            result.claimed_adopted = True
        else:
            for tid in meta["rollouts"]:
                result.trained_from_buffer[tid] = version
                remaining.discard(tid)
        result.current = version
        log.warning("proxy.rebuild_adopted_version", run=run, version=version, base_version=version - 1)
    return result
