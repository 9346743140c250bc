"""``math_verify`` scoring keeps the worker's signals: the preemption grace timer holds while it scores.

math-verify's own timeouts use ``signal.alarm``; the reward runs it in a helper process
(``worker.algo.math_scoring``), so the SIGALRM grace timer of ``worker.process.preemption`` still fires. The tests
own their ``MathVerifier`` (a worker's runtime owns its own) and close it.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from celery.worker import state as worker_state

from worker.algo.math_scoring import MathVerifier
from worker.algo.rewards import RewardFn, resolve_reward
from worker.process.preemption import Preemption, WorkerPreempted

pytestmark = pytest.mark.processes  # a child process per test (see tests/conftest.py)

pytest.importorskip("math_verify")

# sympy compares this tower by evaluating it: it runs until a timeout stops it.
PATHOLOGICAL = r"The answer is $\boxed{9^{9^{9^{9}}}}$"


@pytest.fixture(scope="module")
def verifier() -> Iterator[MathVerifier]:
    helper = MathVerifier()
    yield helper
    helper.close()


@pytest.fixture
def math_verify_reward(verifier: MathVerifier) -> RewardFn:
    """The ``math_verify`` reward as a worker resolves it: bound to the verifier it is given."""
    return resolve_reward("math_verify", verifier)


@pytest.fixture
def worker_signals() -> Iterator[None]:
    """Let a test install the worker's SIGTERM/SIGALRM handlers, and give pytest's own back afterwards."""
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGALRM)}
    saved_timer = signal.setitimer(signal.ITIMER_REAL, 0)  # pytest-timeout's, when it uses SIGALRM
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    for signum, handler in saved.items():
        signal.signal(signum, handler)
    if saved_timer[0] > 0:
        signal.setitimer(signal.ITIMER_REAL, *saved_timer)
    worker_state.should_stop = None


def _preemption_notice() -> None:
    """SIGTERM to this process inside a task: the preemption handler arms the grace timer."""
    os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getitimer(signal.ITIMER_REAL)[0] > 0


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        (r"so the result is $\frac{1}{2}$", "0.5", 1.0),
        (r"The answer is \boxed{42}", "42", 1.0),
        (r"The answer is \boxed{41}", "42", 0.0),
        (r"$x = \sqrt{4}$, so \boxed{2}", r"$2$", 1.0),
        (r"\boxed{\{1, 2\}}", r"$\{2, 1\}$", 1.0),
        ("no number here", "7", 0.0),
        (r"\boxed{3}", "not math at all {", 0.0),  # an answer math-verify cannot parse scores 0
    ],
)
def test_answers_score_as_math_verify_says(
    math_verify_reward: RewardFn, completion: str, answer: str, expected: float
) -> None:
    assert math_verify_reward("q", completion, answer) == expected


def test_grace_timer_armed_before_scoring_still_runs_after_it(
    math_verify_reward: RewardFn, worker_signals: None
) -> None:
    preemption = Preemption()
    preemption.install(grace_s=3600.0)
    with preemption.running():
        _preemption_notice()
        assert math_verify_reward("q", r"The answer is \boxed{42}", "42") == 1.0
        assert math_verify_reward("q", PATHOLOGICAL, "1") == 0.0  # math-verify's own timeout, in the helper
        # The grace period is still running, under the preemption handler.
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 0
        assert signal.getsignal(signal.SIGALRM) == preemption._on_grace_over


def test_grace_period_ending_during_scoring_hands_the_task_back(
    verifier: MathVerifier, math_verify_reward: RewardFn, worker_signals: None
) -> None:
    assert math_verify_reward("q", r"\boxed{1}", "1") == 1.0  # the helper is up: the wait below is the scoring
    helper = verifier
    first_pid = helper.pid
    preemption = Preemption()
    preemption.install(grace_s=0.2)
    with pytest.raises(WorkerPreempted, match="grace period"), preemption.running():
        _preemption_notice()
        math_verify_reward("q", PATHOLOGICAL, "1")  # takes math-verify's 5 s timeout, far past the grace period
    # The helper was busy with the abandoned completion: it is replaced, and its late answer is never read.
    assert helper.pid is None
    assert math_verify_reward("q", r"\boxed{42}", "42") == 1.0
    assert helper.pid not in (None, first_pid)


def test_slow_input_times_out_inside_the_helper_and_scores_zero() -> None:
    verifier = MathVerifier(timeout_s=1)
    try:
        # From a thread too: the old in-process scoring could only time out in the main thread.
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(verifier.score, "1", PATHOLOGICAL).result() == 0.0
        pid = verifier.pid
        assert pid is not None and verifier.score("42", r"\boxed{42}") == 1.0 and verifier.pid == pid
    finally:
        verifier.close()


def test_input_past_the_deadline_kills_the_helper_and_scores_zero() -> None:
    # math-verify's timeouts longer than the deadline: as for an input stuck where no signal reaches it.
    verifier = MathVerifier(timeout_s=600, deadline_s=1.0)
    try:
        assert verifier.score("2", "$2$") == 1.0
        stuck_pid = verifier.pid
        assert verifier.score("1", PATHOLOGICAL) == 0.0
        assert verifier.pid is None
        with pytest.raises(ProcessLookupError):
            os.kill(stuck_pid, 0)  # killed and reaped, not left spinning
        assert verifier.score("2", "$2$") == 1.0 and verifier.pid not in (None, stuck_pid)
    finally:
        verifier.close()


def test_helper_that_died_is_replaced() -> None:
    verifier = MathVerifier()
    try:
        assert verifier.score("2", "$2$") == 1.0
        dead_pid = verifier.pid
        os.kill(dead_pid, signal.SIGKILL)
        assert verifier.score("3", r"\boxed{3}") == 1.0
        assert verifier.pid not in (None, dead_pid)
    finally:
        verifier.close()
