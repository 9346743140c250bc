"""``math_verify`` scoring in a long-lived helper process, so its timeouts never touch this process's signals.

math-verify bounds its parsing and comparisons with ``signal.alarm``, which shares the one ITIMER_REAL of the
process with the preemption grace timer of a worker (``worker.process.tasks``): a scoring call would
replace that timer and then cancel it, and a preemption notice during scoring would never hand the task back.
So math-verify runs in a child process, where its alarms are its own, and this process only waits on a pipe:

* one ``MathVerifier`` per worker process, owned by its runtime (``worker.process.runtime``) and handed to the
  tasks in their context; it closes the child at the worker's shutdown;
* the child is a fresh interpreter (no copy of a CUDA context or of other threads' locks, and unlike
  multiprocessing's ``spawn`` it never re-runs the parent's main script), started on first use; it serves one
  request at a time over a socket pair for the rest of the worker's life: no per-call start-up cost;
* math-verify's own timeouts (``timeout_s`` per parse or comparison) end slow inputs inside the child, which
  then scores 0, as math-verify does;
* a call the child has not answered within ``deadline_s`` (an input stuck where a signal cannot interrupt it)
  gets the child killed and scores 0; the next call starts a new child;
* anything raised while waiting (the preemption hand-back itself) kills the child too, so a late answer can
  never be read as the answer to the next request.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection

import structlog

log = structlog.get_logger()

# math-verify's defaults: seconds for each parse and each comparison, inside the child.
TIMEOUT_S = 5
# Seconds one completion may take in all (two parses and several comparisons) before the child is killed.
DEADLINE_S = 60.0
# Seconds the child may take to start and import math-verify (sympy is a large import).
START_TIMEOUT_S = 120.0

MISSING_PACKAGE = "reward 'math_verify' needs the math-verify package: pip install 'asyncgrpo[math]'"


class ScoringError(RuntimeError):
    """The helper process could not score a completion (it failed, or died twice on it)."""


def _serve(fd: int) -> None:
    """The child's loop: one ``(gold, completion, timeout_s)`` request at a time, until the parent goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent, which decides when this process ends
    connection = Connection(fd)
    from math_verify import parse, verify

    connection.send(("ready", None))
    while True:
        try:
            gold_text, completion, timeout_s = connection.recv()
        except (EOFError, OSError):
            return  # the parent closed the socket or died
        try:
            gold = parse(gold_text, parsing_timeout=timeout_s)
            if not gold:
                connection.send(("unparsable_answer", None))
                continue
            predicted = parse(completion, parsing_timeout=timeout_s)
            connection.send(("score", 1.0 if verify(gold, predicted, timeout_seconds=timeout_s) else 0.0))
        except Exception as error:
            connection.send(("error", f"{type(error).__name__}: {error}"[:2000]))


# The child's command: the parent's import path first (as multiprocessing's spawn passes it), then the loop.
_CHILD_CODE = (
    "import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
    "from worker.algo.math_scoring import _serve; _serve(int(sys.argv[2]))"
)


class MathVerifier:
    """A math-verify helper process: ``score(gold, completion)`` is 1.0 or 0.0 (see the module docstring)."""

    def __init__(self, timeout_s: int = TIMEOUT_S, deadline_s: float = DEADLINE_S) -> None:
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s
        self._lock = threading.Lock()  # one request in flight on the pipe
        self._process: subprocess.Popen[bytes] | None = None
        self._connection: Connection | None = None

    @property
    def pid(self) -> int | None:
        """The helper's process id while one runs."""
        return self._process.pid if self._process is not None and self._process.poll() is None else None

    def score(self, gold: str, completion: str) -> float:
        with self._lock:
            for attempt in (1, 2):
                try:
                    return self._request(gold, completion)
                except (EOFError, BrokenPipeError, ConnectionResetError) as error:
                    # Not the input's doing as far as we know (e.g. a stop signal sent to the whole group):
                    # once more with a new helper; a second death on the same input is the input's.
                    self._stop()
                    if attempt == 2:
                        raise ScoringError(
                            f"the math-verify helper process died twice (starting, or on this completion): {error!r}; "
                            "see its output in this worker's log"
                        ) from error
                    log.warning("reward.math_verify.helper_died", error=repr(error))
        raise AssertionError("unreachable")

    def _request(self, gold: str, completion: str) -> float:
        connection = self._connection if self.pid is not None else None
        if connection is None:
            connection = self._start()
        try:
            connection.send((gold, completion, self.timeout_s))
            if not connection.poll(self.deadline_s):
                log.warning("reward.math_verify.deadline", deadline_s=self.deadline_s, completion=completion[:200])
                self._stop()
                return 0.0
            kind, value = connection.recv()
        except BaseException as error:
            if not isinstance(error, EOFError | BrokenPipeError | ConnectionResetError):
                self._stop()  # e.g. WorkerPreempted while waiting: the child's answer would come late
            raise
        if kind == "score":
            return value
        if kind == "unparsable_answer":
            log.warning("reward.math_verify.unparsable_answer", answer=gold[:200])
            return 0.0
        raise ScoringError(f"math-verify failed: {value}")

    def _start(self) -> Connection:
        self._stop()
        if importlib.util.find_spec("math_verify") is None:
            raise ScoringError(MISSING_PACKAGE)
        parent_end, child_end = socket.socketpair()
        import_path = json.dumps([str(entry) for entry in sys.path])
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", _CHILD_CODE, import_path, str(child_end.fileno())],
                pass_fds=(child_end.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            parent_end.close()
            raise
        finally:
            child_end.close()  # only the child holds it now: its death reads as EOF here
        self._process, self._connection = process, Connection(parent_end.detach())
        connection = self._connection
        try:
            ready = connection.poll(START_TIMEOUT_S) and connection.recv()
        except BaseException:
            self._stop()
            raise
        if ready != ("ready", None):
            self._stop()
            raise ScoringError(f"the math-verify helper process did not start within {START_TIMEOUT_S} s")
        log.info("reward.math_verify.helper_started", pid=process.pid)
        return connection

    def _stop(self) -> None:
        process, connection = self._process, self._connection
        self._process = self._connection = None
        if connection is not None:
            connection.close()
        if process is not None:
            process.kill()
            process.wait()

    def close(self) -> None:
        with self._lock:
            self._stop()
