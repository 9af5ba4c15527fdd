"""The benchmarks' freeze meter: time in which the whole machine did not run, from /proc/stat."""

from __future__ import annotations

from benchmarks.common import FreezeMeter, unaccounted_s


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


def test_the_meter_samples_and_stops():
    m = FreezeMeter(min_ms=50).start()
    m.stop()
    assert not m._thread.is_alive()
