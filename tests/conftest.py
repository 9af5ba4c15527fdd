"""Session fixtures: Ray starts once per test session, sized for this 2-core machine."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Every routed part between hosts of this one node goes through shared-memory files
# (containers/shm_transport.py), however small: the suite's kills, migrations and recoveries then
# exercise that path, where the default (100 KB and more) would leave most of its small epochs on Ray.
os.environ.setdefault("CHRONOSTREAM_SHM_MIN_BYTES", "0")

#: Spare hosts the test session keeps warm (a job here runs 3-9 hosts).
WARM_HOSTS = 6


@pytest.fixture(scope="session")
def ray_session():
    """An in-process Ray instance shared by every integration test."""
    import ray

    import chronostream as cs

    cs.ensure_ray(num_cpus=2)
    # Warm spare hosts (master.host_pool): jobs deploy onto processes started while the tests
    # before them ran. $CHRONOSTREAM_TEST_WARM_HOSTS=0 runs every test on hosts started for it.
    cs.keep_warm_hosts(int(os.environ.get("CHRONOSTREAM_TEST_WARM_HOSTS", WARM_HOSTS)))
    yield ray
    from chronostream.source_ref_keeper import stop_all

    stop_all()  # no Job's keeper thread inside a Ray call while Ray shuts down
    ray.shutdown()


@pytest.fixture(scope="session")
def spark():
    """One local[2] SparkSession for the whole test session."""
    from chronostream.spark import spark_session

    session = spark_session("local[2]")
    yield session
    session.stop()
