"""SourceRefKeeper: when the client's thread hands the source tables' references back, and when it stops.

Unit tests of the thread alone, with plain functions for the master's two calls; the
integration test on Ray is in test_recovery_ray.py (a restarted master with every host dead).
"""

from __future__ import annotations

import time

import pytest

from chronostream import source_ref_keeper
from chronostream.master.job_state import JobState
from chronostream.source_ref_keeper import SourceRefKeeper


def _ended(keeper: SourceRefKeeper, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while keeper.running and time.monotonic() < deadline:
        time.sleep(0.005)
    return not keeper.running


def test_it_gives_the_references_each_time_the_master_wants_them_and_stops_when_the_job_ends():
    answers = iter([(False, JobState.RUNNING), (True, JobState.RUNNING), (False, JobState.RUNNING),
                    (True, JobState.CREATED), (False, JobState.FINISHED), (True, JobState.RUNNING)])
    given = []
    keeper = SourceRefKeeper(lambda: next(answers), lambda: given.append(time.monotonic()), ask_every_s=0.001)
    assert _ended(keeper)
    assert len(given) == keeper.answers == 2  # the ask after "finished" never came


def test_failed_asks_while_the_master_restarts_are_asked_again():
    calls = []

    def ask():
        calls.append(1)
        if len(calls) <= 5:
            raise ConnectionError("master restarting")
        return (True, JobState.RUNNING) if len(calls) == 6 else (False, JobState.STOPPED)

    keeper = SourceRefKeeper(ask, lambda: None, ask_every_s=0.001)
    assert _ended(keeper)
    assert keeper.answers == 1 and len(calls) == 7


def test_it_gives_up_after_a_run_of_failed_asks(monkeypatch):
    monkeypatch.setattr(source_ref_keeper, "GIVE_UP_AFTER", 4)
    calls = []

    def ask():
        calls.append(1)
        raise ConnectionError("master gone for good")

    keeper = SourceRefKeeper(ask, lambda: None, ask_every_s=0.001)
    assert _ended(keeper)
    assert len(calls) == 4


def test_a_failed_ask_after_ray_shut_down_ends_it_at_once():
    calls = []

    def ask():
        calls.append(1)
        raise RuntimeError("Ray is not initialized")

    keeper = SourceRefKeeper(ask, lambda: None, ask_every_s=0.001, connected=lambda: False)
    assert _ended(keeper)
    assert len(calls) == 1


@pytest.mark.parametrize("ask_every_s", [0.05, 30.0])
def test_stop_ends_it_without_waiting_for_the_next_ask(ask_every_s):
    keeper = SourceRefKeeper(lambda: (False, JobState.RUNNING), lambda: None, ask_every_s=ask_every_s)
    assert keeper.running
    keeper.stop()
    assert _ended(keeper, within_s=1.0)


def test_stop_all_ends_every_keeper_of_the_process():
    keepers = [SourceRefKeeper(lambda: (False, JobState.RUNNING), lambda: None, ask_every_s=30.0)
               for _ in range(3)]
    source_ref_keeper.stop_all(within_s=2.0)
    assert not any(k.running for k in keepers)
