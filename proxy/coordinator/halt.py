"""The run's halt: a reason string in the state hash that stops steps from being claimed or sent.

A halt is for a fault no worker can get past on its own (every live trainer failed to load the base version
of the step in flight, or the current version is corrupted): the run waits, visibly, for an operator instead
of re-sending a step that cannot succeed. ``/v1/status`` and ``asyncgrpo status`` show the reason, the
``asyncgrpo_run_halted`` gauge is 1 and the ``AsyncgrpoRunHalted`` alert fires. Each halt names its source
(``by``), so a source clears only its own halt once the cause is gone; generation goes on meanwhile.
"""

from __future__ import annotations

import structlog

from proxy.coordinator.store import RunStore

log = structlog.get_logger()

HALTED_FIELD = "halted"
HALTED_BY_FIELD = "halted_by"


def halted_reason(store: RunStore) -> str | None:
    """The reason the run is halted, or None when it is not."""
    return store.redis.hget(store.keys.state, HALTED_FIELD) or None


def halt(store: RunStore, reason: str, *, by: str) -> None:
    """Halt the run's steps with ``reason`` (a sentence naming what to fix); ``by`` names the source.

    Logged (at error level) once per new reason: sources re-assert their halt on every check."""
    if halted_reason(store) == reason:
        return
    store.scripts.set_halt(reason=reason, by=by)
    store.mark_changed()
    log.error("proxy.run_halted", reason=reason, by=by)


def clear_halt(store: RunStore, *, by: str) -> bool:
    """Lift a halt set by ``by`` (another source's halt stays); True if one was lifted."""
    lifted = int(store.scripts.clear_halt(by=by)["cleared"]) > 0
    if lifted:
        store.mark_changed()
        log.warning("proxy.run_halt_cleared", by=by)
    return lifted
