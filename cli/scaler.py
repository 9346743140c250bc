"""`asyncgrpo scale-generate`: one host's generate workers follow the proxy's autoscaling signal.

The proxy computes how many generate workers keep the trainer busy (``fleet.wanted`` in ``/v1/status``, the
``asyncgrpo_generate_workers_wanted`` gauge). This loop starts and stops the host's ``asyncgrpo-generate@N``
systemd instances (N is the GPU index, deploy/systemd) to match: up at once, since a starving trainer wastes
the most expensive GPU; down only after the signal stayed lower for ``down_after_s``, since a spot worker
that is stopped and started again pays its model load twice. Stopping is systemd's ``stop``: the worker's
soft shutdown hands its task back. With no signal (a proxy that has not measured yet, or is unreachable) the
fleet is held as it is, never below ``min_workers``.
"""

from __future__ import annotations

import math
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog

log = structlog.get_logger()

RUNNING_STATES = frozenset({"active", "activating", "reloading"})
"""systemd ACTIVE states of an instance that holds its GPU (or is about to)."""


@dataclass(frozen=True)
class ScalePolicy:
    max_workers: int
    """The host's GPUs: instances 0 .. max_workers - 1."""
    min_workers: int = 1
    hosts: int = 1
    """Hosts sharing the fleet, each running this loop: each takes ceil(wanted / hosts)."""
    down_after_s: float = 300.0

    def __post_init__(self) -> None:
        if self.max_workers < 1:
            raise ValueError(f"max_workers is {self.max_workers}; set it to the host's GPU count (at least 1)")
        if not 0 <= self.min_workers <= self.max_workers:
            raise ValueError(f"min_workers is {self.min_workers}; it must lie in 0 .. max_workers ({self.max_workers})")
        if self.hosts < 1:
            raise ValueError(f"hosts is {self.hosts}; it must be at least 1")
        if self.down_after_s < 0:
            raise ValueError(f"down_after_s is {self.down_after_s}; it must be >= 0")

    def target(self, wanted: int | None, running: int) -> int:
        """This host's share of ``wanted`` within [min, max]; ``running`` (held) when there is no signal."""
        share = running if wanted is None else math.ceil(wanted / self.hosts)
        return max(self.min_workers, min(self.max_workers, share))


@dataclass(frozen=True)
class ScaleAction:
    start: list[int]
    stop: list[int]


class Scaler:
    """Decides, call by call, which instances to start and stop; remembers since when it wanted fewer."""

    def __init__(self, policy: ScalePolicy) -> None:
        self.policy = policy
        self._fewer_since: float | None = None

    def decide(self, wanted: int | None, running: list[int], now: float) -> ScaleAction:
        target = self.policy.target(wanted, len(running))
        if target > len(running):
            self._fewer_since = None
            free = [n for n in range(self.policy.max_workers) if n not in running]
            return ScaleAction(start=free[: target - len(running)], stop=[])
        if target == len(running):
            self._fewer_since = None
            return ScaleAction(start=[], stop=[])
        if self._fewer_since is None:
            self._fewer_since = now
        if now - self._fewer_since < self.policy.down_after_s:
            return ScaleAction(start=[], stop=[])
        self._fewer_since = None
        # The highest indices go first, so the instances that stay are always the low GPUs.
        return ScaleAction(start=[], stop=sorted(running, reverse=True)[: len(running) - target])


class Units(Protocol):
    """The host's generate worker instances."""

    def running(self) -> list[int]: ...

    def start(self, index: int) -> None: ...

    def stop(self, index: int) -> None: ...


class SystemdUnits:
    """``<template>N.service`` instances through ``systemctl`` (as root, or with a polkit rule allowing it)."""

    def __init__(self, template: str = "asyncgrpo-generate@", systemctl: str = "systemctl") -> None:
        self.template = template
        self.systemctl = systemctl

    def running(self) -> list[int]:
        listing = self._run("list-units", "--all", "--plain", "--no-legend", f"{self.template}*.service")
        indices = []
        for line in listing.splitlines():
            fields = line.split()
            if len(fields) < 3 or not fields[0].startswith(self.template) or fields[2] not in RUNNING_STATES:
                continue
            instance = fields[0][len(self.template) :].removesuffix(".service")
            if instance.isdigit():
                indices.append(int(instance))
        return sorted(indices)

    def start(self, index: int) -> None:
        self._run("start", "--no-block", f"{self.template}{index}.service")

    def stop(self, index: int) -> None:
        self._run("stop", "--no-block", f"{self.template}{index}.service")

    def _run(self, *args: str) -> str:
        done = subprocess.run([self.systemctl, *args], capture_output=True, text=True, timeout=60, check=False)
        if done.returncode != 0:
            raise UnitError(f"{self.systemctl} {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout


class UnitError(RuntimeError):
    """The unit manager refused a command."""


def scale_once(scaler: Scaler, units: Units, wanted: int | None, now: float) -> ScaleAction:
    """One round: read the instances, decide, start and stop."""
    running = units.running()
    action = scaler.decide(wanted, running, now)
    for index in action.start:
        units.start(index)
    for index in action.stop:
        units.stop(index)
    if action.start or action.stop:
        log.info("scaler.scaled", wanted=wanted, running=running, started=action.start, stopped=action.stop)
    return action


def run_scaler(
    scaler: Scaler,
    units: Units,
    read_wanted: Callable[[], int | None],
    *,
    interval_s: float,
    rounds: int | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Scale every ``interval_s`` (``rounds`` times, or until stopped); returns the rounds that failed. A round
    that fails is logged and the next one tries again: the loop outlives a transient systemctl error."""
    done = failed = 0
    while rounds is None or done < rounds:
        try:
            scale_once(scaler, units, read_wanted(), clock())
        except (UnitError, OSError, subprocess.TimeoutExpired) as error:
            failed += 1
            log.warning("scaler.round_failed", error=str(error))
        done += 1
        if rounds is None or done < rounds:
            sleep(interval_s)
    return failed
