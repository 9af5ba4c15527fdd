"""Backpressure: a fast source into a slow operator keeps memory bounded.

Method: 200 MB of events (2 KB each) flow from a source into an operator that
sleeps on every batch. While the job runs, the master's statistics are
sampled: the slow container never buffers more than the in-flight bound of
epochs (counted and in bytes), the source never runs more than a few epochs
ahead of it, and the memory the slow container owns (RSS without the page cache
of its lmdb maps) stops growing after warm-up.
(Without the bound, the same run buffers 80 epochs, about 160 MB.)
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

import chronostream as cs

WINDOW = 3


class Slow(cs.Operator):
    """Vectorized pass-through that sleeps 20 ms per batch."""

    def consume_batch(self, stream_id: str, batch: pa.Table) -> None:
        time.sleep(0.02)
        self.produce_batch("out", batch.select(["k", "_order", "_sub"]))


def test_fast_source_into_slow_operator_keeps_memory_bounded(ray_session):
    """Buffered epochs stay within the bound and the slow container's RSS stays flat."""
    n, payload = 100_000, 2000
    rng = np.random.default_rng(0)
    blob = pa.array([bytes(rng.integers(65, 90, payload, dtype=np.uint8))] * n, pa.binary())
    table = pa.table({"k": pa.array(np.arange(n) % 4), "blob": blob})
    q = cs.Query(epoch_events=1000)
    q.source("src", table, slices=1).key_by("k").apply(Slow, slices=2, name="slow").sink(name="out")
    job = cs.run(q, containers={"src": 1, "slow": 1}, max_inflight_epochs=WINDOW)
    try:
        samples = []
        while job.status().state == "running":
            stats = job.statistics()
            by_stage = {s.stage: s for s in stats.values()}
            samples.append((by_stage["src"].next_epoch, by_stage["slow"].next_epoch,
                            by_stage["slow"].buffered_epochs, by_stage["slow"].rss_bytes,
                            by_stage["slow"].buffered_bytes))
            time.sleep(0.1)
        job.wait()
        assert job.results("out").num_rows == n
    finally:
        job.stop()
    assert len(samples) >= 10, "the job ran too fast to observe"
    lead = max(s[0] - s[1] for s in samples)
    buffered = max(s[2] for s in samples)
    buffered_mb = max(s[4] for s in samples) / 1e6
    rss = [s[3] for s in samples if s[3]]
    data_mb = n * payload / 1e6
    assert buffered <= WINDOW
    epoch_mb = 1000 * payload / 1e6
    assert buffered_mb <= (WINDOW + 1) * epoch_mb * 1.1, f"{buffered_mb:.0f} MB buffered"
    assert lead <= 2 * WINDOW + 2, f"source ran {lead} epochs ahead"
    # Steady state: after the first quarter of the run (allocator warm-up), RSS
    # must not keep growing with the input (unbounded buffering grows linearly).
    warm = rss[len(rss) // 4]
    growth_mb = (max(rss) - warm) / 1e6
    assert growth_mb < data_mb / 4, f"slow container grew {growth_mb:.0f} MB for {data_mb:.0f} MB of input"
