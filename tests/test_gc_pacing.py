"""A host's full garbage collections run on its schedule, not whenever state grows (containers/gc_pacing.py)."""

from __future__ import annotations

import gc

import pytest

from chronostream.containers.gc_pacing import CollectorPacing


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pacing():
    clock = FakeClock()
    p = CollectorPacing(full_every_s=10.0, clock=clock)
    p.clock_ = clock
    yield p
    p.uninstall()


def make_cycle() -> None:
    a: list = []
    a.append(a)


def test_installing_stops_automatic_full_collections_and_freezes_what_exists(pacing):
    before = gc.get_threshold()
    pacing.install()
    assert gc.get_threshold() == (before[0], before[1], CollectorPacing.NEVER)
    assert gc.get_freeze_count() > 0


def test_uninstalling_restores_the_thresholds_and_unfreezes(pacing):
    before = gc.get_threshold()
    pacing.install()
    pacing.uninstall()
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_a_full_collection_runs_only_once_its_interval_has_passed(pacing):
    pacing.install()
    make_cycle()
    assert pacing.collect_if_due() is None
    pacing.clock_.now = 9.9
    assert pacing.collect_if_due() is None
    pacing.clock_.now = 10.0
    freed = pacing.collect_if_due()
    assert freed is not None and freed >= 1  # the cycle made above
    assert pacing.full_collections == 1 and pacing.full_pause_s > 0
    assert pacing.collect_if_due() is None  # the next one is 10 s away again


def test_zero_interval_leaves_cpythons_policy_alone():
    before = gc.get_threshold()
    p = CollectorPacing(full_every_s=0.0)
    p.install()
    assert gc.get_threshold() == before and not p.installed
    assert p.collect_if_due() is None


def test_negative_interval_is_refused():
    with pytest.raises(ValueError, match="full_every_s"):
        CollectorPacing(full_every_s=-1.0)
