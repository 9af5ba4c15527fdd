"""The stall probe reports when its process ran no Python for longer than its threshold."""

from __future__ import annotations

import time

import pytest

from chronostream.containers.stall_probe import ENV, StallProbe, start_from_env


def test_a_call_holding_the_gil_is_reported_as_a_stall():
    probe = StallProbe("test", threshold_s=0.08)
    try:
        time.sleep(0.05)
        t0 = time.perf_counter()
        sum(range(40_000_000))  # one C call: the GIL is not released until it returns
        held = time.perf_counter() - t0
        time.sleep(0.05)
    finally:
        probe.stop()
    assert held > 0.15, "the machine ran the loop too fast for this test"
    assert any(length > 0.1 for _end, length in probe.stalls)


def test_without_the_variable_no_probe_starts(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert start_from_env("x") is None


def test_the_variable_sets_the_threshold_in_milliseconds(monkeypatch):
    monkeypatch.setenv(ENV, "250")
    probe = start_from_env("x")
    try:
        assert probe is not None and probe.threshold_s == pytest.approx(0.25)
    finally:
        probe.stop()


def test_a_threshold_that_is_no_number_is_refused(monkeypatch):
    monkeypatch.setenv(ENV, "soon")
    with pytest.raises(ValueError, match="CHRONOSTREAM_STALL_MS='soon' is not a number"):
        start_from_env("x")
