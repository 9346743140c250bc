"""This process's incarnation: what tells a restarted worker from the process that had its worker id before.

A systemd unit or a Procfile restarts a crashed worker under the same ``ASYNCGRPO_WORKER_ID`` within seconds,
so heartbeats alone cannot tell the proxy that the old process is gone: the id never goes silent. Every worker
sends its incarnation with its heartbeats, leases and step starts; the proxy ends whatever an older
incarnation of the id still held (tasks, leases, steps) as soon as it hears a new one.

An incarnation is the machine's boot id, the pid and the process's start time (clock ticks since boot), so it
is the same for every thread of one process, readable by an operator in ``/v1/workers``, and never repeats:
the pid and start time together are unique within a boot, and the boot id across boots. Where ``/proc`` does
not exist, a random id drawn once per process stands in.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

_cached: tuple[int, str] | None = None


def _linux_incarnation(pid: int) -> str | None:
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:12]
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22 is the start time; the command name (field 2) may hold spaces, so count after its ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    return f"{boot_id}-{pid}-{fields[19]}"


def process_incarnation() -> str:
    """This process's incarnation (matches ``schemas.ID_PATTERN``); a forked child gets its own."""
    global _cached
    pid = os.getpid()
    if _cached is None or _cached[0] != pid:
        _cached = (pid, _linux_incarnation(pid) or f"{uuid.uuid4().hex[:12]}-{pid}")
    return _cached[1]
