"""Background threads of a host run below its epoch loops' OS priority (Linux per-thread niceness).

Unit tests run the pools in this process; the Ray test asks a running
job's hosts what their threads run at. Output equality with the serial
executor is checked under the option at 4 and at 0 (the default, which
every other Ray test runs).
"""

from __future__ import annotations

import sys

import pytest
import ray

import chronostream as cs
from chronostream.containers.options import JobOptions
from chronostream.containers import thread_priority as tp
from queries import running_sum

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")


@pytest.fixture
def increment():
    """Restores the process's configured increment after a test changes it."""
    before = tp._increment
    yield
    tp.set_background_niceness(before)


@linux_only
def test_a_background_pool_thread_runs_the_configured_levels_below_the_process(increment):
    tp.set_background_niceness(3)
    pool = tp.background_pool(1, "test-bg")
    try:
        got = pool.submit(tp.thread_niceness).result()
    finally:
        pool.shutdown()
    assert got == min(tp.MAX_NICENESS, tp.process_niceness() + 3)
    assert tp.thread_niceness() == tp.process_niceness(), "the calling thread keeps its priority"


@linux_only
def test_niceness_is_capped_at_the_lowest_priority(increment):
    tp.set_background_niceness(100)
    pool = tp.background_pool(1, "test-cap")
    try:
        assert pool.submit(tp.thread_niceness).result() == tp.MAX_NICENESS
    finally:
        pool.shutdown()


@linux_only
def test_increment_zero_keeps_the_process_priority(increment):
    tp.set_background_niceness(0)
    pool = tp.background_pool(1, "test-zero")
    try:
        assert pool.submit(tp.thread_niceness).result() == tp.process_niceness()
    finally:
        pool.shutdown()


def test_a_negative_increment_is_refused():
    with pytest.raises(ValueError, match="background_niceness must be >= 0"):
        tp.set_background_niceness(-1)
    with pytest.raises(ValueError, match="background_niceness must be >= 0"):
        JobOptions(background_niceness=-2)


@linux_only
@pytest.mark.parametrize("niceness", [4, 0])
def test_a_hosts_store_and_worker_threads_run_below_its_epoch_loop(ray_session, niceness):
    """Every host of a running job: backup store and ``to_thread`` workers at the loop's niceness
    plus the option (capped at 19), the loop itself untouched; the output is the serial one."""
    job = cs.run(running_sum(5), containers=2, checkpoint_every=2, backup_factor=1, background_niceness=niceness)
    try:
        job.wait(timeout_s=120)
        expected = cs.run(running_sum(5), executor="serial")
        assert job.results("sums").to_pylist() == expected.results("sums").to_pylist()
        hosts = ray.get(job.master.host_handles.remote())
        seen = ray.get([h.thread_priorities.remote() for h in hosts.values()])
    finally:
        job.stop()
    assert len(seen) >= 2
    for p in seen:
        low = min(tp.MAX_NICENESS, p["epoch_loop"] + niceness)
        assert p == {"epoch_loop": p["epoch_loop"], "backup_store": low, "worker": low}
