"""The coordinator's default clock (``RedisClock``): Redis ``TIME`` read once per interval, extrapolated between."""

from __future__ import annotations

from redis import Redis

from proxy.coordinator.redis_store import CLOCK_RESYNC_S, RedisClock, RedisStore, wall_clock_ms


class Monotonic:
    """A monotonic clock that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def time_calls(redis_client: Redis) -> int:
    return int(redis_client.info("commandstats").get("cmdstat_time", {}).get("calls", 0))


def test_reads_redis_time_once_per_interval_and_extrapolates_between(redis_client: Redis) -> None:
    monotonic = Monotonic()
    clock = RedisClock(redis_client, monotonic=monotonic)
    before = time_calls(redis_client)
    first = clock()
    assert abs(first - wall_clock_ms(redis_client)) < 1000, "the clock is Redis's, not this host's"
    monotonic.now += 0.25
    assert clock() == first + 250
    monotonic.now += 0.5
    assert clock() == first + 750
    # Ours and the one the test took to compare: none between readings.
    assert time_calls(redis_client) - before == 2
    monotonic.now += CLOCK_RESYNC_S
    clock()
    assert time_calls(redis_client) - before == 3, "read again once the interval is over"


def test_never_goes_backwards_when_a_new_reading_is_behind(redis_client: Redis) -> None:
    monotonic = Monotonic()
    clock = RedisClock(redis_client, monotonic=monotonic)
    first = clock()
    monotonic.now += 0.9 * CLOCK_RESYNC_S  # this host's clock runs ahead of Redis's (which barely moved)
    extrapolated = clock()
    assert extrapolated == first + round(900 * CLOCK_RESYNC_S)
    monotonic.now += 0.1 * CLOCK_RESYNC_S
    resynced = clock()  # a new reading: Redis's real time, a few ms after first, behind the extrapolation
    assert wall_clock_ms(redis_client) < extrapolated, "the test needs a reading behind what was handed out"
    assert resynced == extrapolated, "held where it was, not moved back"


def test_the_store_uses_it_by_default(redis_client: Redis) -> None:
    store = RedisStore(Redis(connection_pool=redis_client.connection_pool), "r1")
    assert isinstance(store.clock_ms, RedisClock)
    assert abs(store.clock_ms() - wall_clock_ms(redis_client)) < 1000
