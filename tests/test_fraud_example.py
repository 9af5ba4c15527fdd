"""The fraud example (examples/fraud.py): the in-process runtime equals the serial oracle, and the rule reads right.

Method: the example's query on 4,000 seeded payments, run by executor="serial"
(the oracle) and executor="local" (the container cores in one process, 3
containers per stage, shuffled delivery): every sink equal row for row,
_order/_sub/_slice/_seq included. Then the exact window catches every card
the hopping approximation catches (a hopping window is a subset of some
sliding window ending at its last event).
"""

from __future__ import annotations

import pytest

import chronostream as cs
from examples.fraud import fraud_query

SINKS = ("profiles", "alerts", "hopping_alerts")


@pytest.fixture(scope="module")
def serial():
    return cs.run(fraud_query(4_000, cards=300, seed=3), executor="serial")


def test_fraud_profiles_on_the_runtime_equal_the_serial_oracle(serial):
    """Every sink of the fraud query: local executor rows == serial rows, identity columns included."""
    local = cs.run(fraud_query(4_000, cards=300, seed=3), executor="local", containers=3, seed=7)
    for sink in SINKS:
        assert local.results(sink).to_pylist() == serial.results(sink).to_pylist(), sink
    assert serial.results("profiles").num_rows == 4_000


def test_exact_sliding_windows_alert_on_every_card_hopping_windows_alert_on(serial):
    """Cards flagged by 1-minute-hop windows are flagged by the exact sliding window too, and bursts are caught."""
    exact = set(serial.results("alerts")["card"].to_pylist())
    hopping = set(serial.results("hopping_alerts")["card"].to_pylist())
    assert hopping <= exact
    assert exact  # the generator's card-testing bursts trip the rule


def test_sliding_and_hopping_windows_survive_a_killed_container_and_a_scale_out_on_ray(ray_session):
    """Window state recovers and migrates with its slices: a profiles container dies, hopping scales out."""
    from chronostream.chaos import Fault, run_with_faults

    q = fraud_query(3_000, cards=200, seed=5, slices=6)
    q.epoch_events = 50
    faults = [Fault("delay", 0, "payments", seconds=0.03), Fault("kill", 8, "profiles", index=0),
              Fault("scale_out", 14, "hopping", n=1)]
    report = run_with_faults(q, faults, containers={"payments": 1, "profiles": 2, "hopping": 1},
                             checkpoint_every=3)
    assert report.ok, report.mismatches
    assert len(report.applied) == 3, "the kill and the scale-out landed mid-stream"
    kinds = [k for _, k, _ in report.timeline]
    assert "recovery_end" in kinds and "migration_end" in kinds
