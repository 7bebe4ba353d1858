"""Busy time of RL roles: a worker's BusyClock, the scheduler's RoleBusyRates over reported
totals, and the live scheduler counting what a role holds as busy only in that proportion.
Plain logic with hand-driven clocks."""

from __future__ import annotations

import pytest

from rollmesh.messages.metrics import MetricPoint, MetricSeries, MetricsReported
from rollmesh.scheduling.role_busy import RoleBusyRates
from rollmesh.telemetry import metrics_catalog
from rollmesh.telemetry.busy_clock import BusyClock
from test_scheduling_lending_service import service

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_overlapping_busy_intervals_count_once_and_an_open_one_counts_so_far() -> None:
    clock = Clock()
    busy = BusyClock(clock)
    with busy.busy():
        clock.now += 2
        with busy.busy():  # a second call served meanwhile
            clock.now += 3
        clock.now += 1
    clock.now += 10  # idle
    assert busy.total() == 6
    with busy.busy():
        clock.now += 4
        assert busy.total() == 10
    assert busy.total() == 10


def test_an_exception_inside_still_closes_the_interval() -> None:
    clock = Clock()
    busy = BusyClock(clock)
    with pytest.raises(RuntimeError), busy.busy():
        clock.now += 2
        raise RuntimeError("step failed")
    clock.now += 5
    assert busy.total() == 2


def test_a_roles_fraction_is_the_mean_rate_of_its_recent_processes() -> None:
    rates = RoleBusyRates(stale_s=6.0)
    rates.record("decode-0", "decode", 10.0, reported_at=0.0, now=0.0)
    assert rates.fraction("decode", 0.0) is None  # one snapshot gives no rate
    rates.record("decode-0", "decode", 11.0, reported_at=2.0, now=2.0)  # 1 s busy in 2 s
    rates.record("decode-1", "decode", 0.0, reported_at=0.0, now=0.0)
    rates.record("decode-1", "decode", 2.0, reported_at=2.0, now=2.0)  # busy throughout
    assert rates.fraction("decode", 2.0) == pytest.approx(0.75)
    assert rates.fraction("trainer", 2.0) is None
    # A late or repeated snapshot changes nothing; a total that went down (a restart under the
    # same source, which cannot happen but must not go negative) is bounded to 0.
    rates.record("decode-0", "decode", 11.5, reported_at=1.0, now=3.0)
    assert rates.fraction("decode", 3.0) == pytest.approx(0.75)
    rates.record("decode-1", "decode", 0.0, reported_at=4.0, now=4.0)
    assert rates.fraction("decode", 4.0) == pytest.approx(0.25)
    # decode-0 unheard of for longer than stale_s: only decode-1 counts, then none.
    assert rates.fraction("decode", 8.5) == pytest.approx(0.0)
    assert rates.fraction("decode", 10.5) is None
    rates.forget_stale(100.0)
    assert rates.fraction("decode", 100.0) is None


def busy_report(source: str, role: str, total_s: float, at: float) -> MetricsReported:
    return MetricsReported(source=source, reported_at=at, metrics=[MetricSeries(
        name=metrics_catalog.ROLE_BUSY.name, kind="counter",
        points=[MetricPoint(labels={"role": role}, value=total_s)])])


async def test_the_scheduler_counts_held_accelerators_as_busy_as_their_workers_report(tmp_path) -> None:
    logic, _, clock = service(tmp_path, start_grants={"decode": 2}, capacity=4)
    await logic.start()
    start = clock.now
    clock.now += 100  # no reports yet: decode's 2 held accelerators count as busy
    logic.record_busy(busy_report("decode-0", "decode", 0.0, clock.now))
    logic.record_busy(busy_report("decode-1", "decode", 0.0, clock.now))
    clock.now += 10
    logic.record_busy(busy_report("decode-0", "decode", 5.0, clock.now))  # half busy
    logic.record_busy(busy_report("decode-1", "decode", 0.0, clock.now))  # idle
    assert logic.status().roles_busy == {"decode": pytest.approx(0.25)}
    clock.now += 100  # 2 held at a quarter busy: 0.5 accelerator busy
    status = logic.status()
    window = clock.now - start
    assert status.allocated_utilization == pytest.approx(2 * window / (4 * window))
    assert status.busy_utilization == pytest.approx((2 * 110 + 0.5 * 100) / (4 * window))
