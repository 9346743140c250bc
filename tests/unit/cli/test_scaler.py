"""The systemd scaler's decisions (``cli.scaler``) with its default policy: pure logic, a fake clock."""

from __future__ import annotations

import pytest

from cli.scaler import ScalePolicy, Scaler, scale_once


class RecordingUnits:
    """Instances by index, as a unit manager would hold them."""

    def __init__(self, running: list[int]) -> None:
        self.active = set(running)
        self.calls: list[tuple[str, int]] = []

    def running(self) -> list[int]:
        return sorted(self.active)

    def start(self, index: int) -> None:
        self.calls.append(("start", index))
        self.active.add(index)

    def stop(self, index: int) -> None:
        self.calls.append(("stop", index))
        self.active.discard(index)


def test_scales_up_at_once_to_the_wanted_count_within_the_host() -> None:
    scaler = Scaler(ScalePolicy(max_workers=8))
    units = RecordingUnits([0, 2])
    scale_once(scaler, units, wanted=5, now=0.0)
    assert units.running() == [0, 1, 2, 3, 4], "the lowest free GPUs are started"
    scale_once(scaler, units, wanted=50, now=1.0)
    assert units.running() == list(range(8)), "never more than the host's GPUs"


def test_scales_down_only_after_the_default_five_minutes_of_wanting_fewer() -> None:
    policy = ScalePolicy(max_workers=8)
    assert policy.down_after_s == 300.0 and policy.min_workers == 1
    scaler = Scaler(policy)
    units = RecordingUnits([0, 1, 2, 3])
    scale_once(scaler, units, wanted=2, now=0.0)
    scale_once(scaler, units, wanted=2, now=299.0)
    assert units.running() == [0, 1, 2, 3] and units.calls == []
    scale_once(scaler, units, wanted=2, now=300.0)
    assert units.running() == [0, 1], "the highest instances go first"
    assert units.calls == [("stop", 3), ("stop", 2)]


def test_a_signal_back_up_restarts_the_wait_to_scale_down() -> None:
    scaler = Scaler(ScalePolicy(max_workers=8))
    units = RecordingUnits([0, 1, 2, 3])
    scale_once(scaler, units, wanted=1, now=0.0)
    scale_once(scaler, units, wanted=4, now=200.0)  # the trainer needs them again
    scale_once(scaler, units, wanted=1, now=400.0)
    assert units.running() == [0, 1, 2, 3], "only 200 s of wanting fewer since the signal came back"
    scale_once(scaler, units, wanted=1, now=700.0)
    assert units.running() == [0]


def test_no_signal_holds_the_fleet_but_keeps_the_minimum() -> None:
    scaler = Scaler(ScalePolicy(max_workers=4, min_workers=2))
    units = RecordingUnits([0, 1, 2])
    scale_once(scaler, units, wanted=None, now=0.0)
    scale_once(scaler, units, wanted=None, now=10_000.0)
    assert units.running() == [0, 1, 2]
    empty = RecordingUnits([])
    scale_once(scaler, empty, wanted=None, now=0.0)
    assert empty.running() == [0, 1]
    finished = Scaler(ScalePolicy(max_workers=4, min_workers=0, down_after_s=0))
    scale_once(finished, units, wanted=0, now=0.0)
    assert units.running() == [], "a finished run (wanted 0) frees every GPU when the minimum is 0"


def test_hosts_share_the_fleet() -> None:
    scaler = Scaler(ScalePolicy(max_workers=8, hosts=3))
    units = RecordingUnits([])
    scale_once(scaler, units, wanted=10, now=0.0)
    assert units.running() == [0, 1, 2, 3], "ceil(10 / 3) on each host"


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"max_workers": 0}, "max_workers"),
        ({"max_workers": 2, "min_workers": 3}, "min_workers"),
        ({"max_workers": 2, "hosts": 0}, "hosts"),
        ({"max_workers": 2, "down_after_s": -1}, "down_after_s"),
    ],
)
def test_bad_policies_name_the_setting(fields: dict[str, float], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ScalePolicy(**fields)  # type: ignore[arg-type]
