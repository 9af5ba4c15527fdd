"""Session fixtures: Ray starts once per test session, sized for this 2-core machine."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def ray_session():
    """An in-process Ray instance shared by every integration test."""
    import ray

    import chronostream as cs

    cs.ensure_ray(num_cpus=2)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def spark():
    """One local[2] SparkSession for the whole test session."""
    from chronostream.spark import spark_session

    session = spark_session("local[2]")
    yield session
    session.stop()
