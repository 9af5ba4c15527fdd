"""The benchmarks' freeze meter: time in which the whole machine did not run, from /proc/stat."""

from __future__ import annotations

import time

from benchmarks.common import CPU_STATES, FreezeMeter, cpu_seconds_in, unaccounted_s


def test_an_interval_whose_time_every_cpu_accounted_is_not_frozen():
    assert unaccounted_s(0.5, 2 * 50, cpus=2) == 0.0  # busy or idle, the kernel counted it
    assert unaccounted_s(0.5, 2 * 60, cpus=2) == 0.0  # tick rounding never goes negative


def test_the_unaccounted_part_of_an_interval_is_the_freeze():
    assert unaccounted_s(0.523, 3, cpus=2) == 0.508  # 3 ticks on 2 CPUs: 15 ms ran of 523


def test_freeze_time_counts_pro_rata_for_a_freeze_partly_inside_the_window():
    m = FreezeMeter()
    m.freezes = [(10.0, 10.4, 0.4), (20.0, 20.2, 0.1)]
    assert m.frozen_ms(10.2, 30.0) == 200.0 + 100.0
    assert m.frozen_ms(0.0, 10.0) == 0.0
    assert m.frozen_ms(20.1, 20.2) == 50.0


def _ticks(**by_state: int) -> list[int]:
    return [by_state.get(state, 0) for state in CPU_STATES]


def test_cpu_time_is_counted_per_state_and_pro_rata_at_the_window_edges():
    samples = [(0.0, _ticks()), (1.0, _ticks(user=100, system=60, steal=40)),
               (2.0, _ticks(user=100, system=60, idle=200, steal=40))]
    spent = cpu_seconds_in(samples, 0.5, 2.0)
    assert spent["user"] == 0.5 and spent["system"] == 0.3 and spent["steal"] == 0.2  # half the first interval
    assert spent["idle"] == 2.0  # all of the second
    assert cpu_seconds_in(samples, 3.0, 4.0)["idle"] == 0.0  # nothing sampled there


def test_a_saturated_window_shows_no_idle_share():
    m = FreezeMeter()
    m.cpus = 2
    m.samples = [(0.0, _ticks()), (1.0, _ticks(nice=120, system=70, steal=10)),
                 (2.0, _ticks(nice=120, system=70, idle=190, steal=20))]
    busy = m.cpu_shares(0.0, 1.0)
    assert busy["idle"] == 0.0 and busy["system"] == 0.35 and busy["steal"] == 0.05
    assert m.cpu_shares(1.0, 2.0)["idle"] == 0.95
    assert m.cpu_shares(5.0, 6.0) == {}


def test_the_meter_samples_the_machine_until_stopped():
    m = FreezeMeter(min_ms=50).start()
    time.sleep(1.0)
    m.stop()
    assert not m._thread.is_alive()
    n = len(m.samples)
    assert n >= 10  # every 10 ms, however loaded the machine
    time.sleep(0.05)
    assert len(m.samples) == n  # stopped means stopped
    shares = m.cpu_shares(m.samples[0][0], m.samples[-1][0])
    # Every CPU's time is accounted in some state; 100 Hz ticks round, and this VM's hypervisor
    # can hold all its CPUs for a few hundred ms (no state accounted), so loosely.
    assert 0.5 <= sum(shares.values()) <= 1.3
