"""Owns the job metrics every layer shares: latency histograms, per-slice and per-stage figures, snapshots.

Plain data and arithmetic; no Ray, no clocks of its own (times come in as
arguments), so the autoscaling policies that read a ``MetricsSnapshot``
decide the same way live and in the offline simulator.

Definitions (docs/design.md section 7g):

- **end-to-end latency** of an output row: the time from the source
  container reading the row's epoch (ingest) to the sink writing it;
  recorded per (sink write, epoch), weighted by its rows, in a
  log-bucketed histogram (``LatencyHistogram``; about 5% resolution).
  Time an event spent waiting in the source log before being read is not
  in it (a followed log is read as soon as the writer's high-water mark
  passes an epoch);
- **input rate** of a stage: events admitted per second over the last
  interval; **processing rate**: events per *busy* second (its capacity
  per host when it runs flat out); **utilization**: busy seconds per
  wall second per host. A container is busy while it processes an epoch
  and while it hands the epoch's messages to the transport (on Ray each
  push serializes its message into the object store: a few ms an epoch,
  up to 40% of a source's CPU, ``ContainerStatistics.send_s``);
  **backlog**: events received but not processed; **upstream lag**:
  events readable in the stage's sources and not read yet (backpressure
  keeps a slow stage's own backlog small: the excess waits there);
  **backpressured** share: seconds a stage's containers waited for their
  receivers to acknowledge epochs beyond the in-flight window, per wall
  second per host (a stage held back by a slower downstream one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_LO_MS = 0.01
_RATIO = 1.05
_BUCKETS = int(math.log(1e7 / _LO_MS) / math.log(_RATIO)) + 2  # 0.01 ms .. ~3 hours


class LatencyHistogram:
    """Counts of latencies in log-spaced buckets (about 5% wide); mergeable, percentiles by interpolation.

    >>> h = LatencyHistogram()
    >>> h.add(10.0, 99)
    >>> h.add(500.0, 1)
    >>> round(h.percentile(50)), round(h.percentile(99.9)), h.count
    (10, 500, 100)
    """

    def __init__(self, counts: np.ndarray | None = None, max_ms: float = 0.0) -> None:
        self.counts = np.zeros(_BUCKETS, dtype=np.int64) if counts is None else counts
        self.max_ms = max_ms

    @staticmethod
    def _bucket(ms: np.ndarray) -> np.ndarray:
        ms = np.maximum(np.asarray(ms, dtype=np.float64), _LO_MS)
        return np.minimum((np.log(ms / _LO_MS) / math.log(_RATIO)).astype(np.int64) + 1, _BUCKETS - 1)

    def add(self, ms: float, weight: int = 1) -> None:
        """Record ``weight`` rows that took ``ms`` milliseconds."""
        if weight <= 0:
            return
        self.counts[int(self._bucket(np.array([ms]))[0])] += weight
        self.max_ms = max(self.max_ms, float(ms))

    def merge(self, other: "LatencyHistogram") -> "LatencyHistogram":
        """A new histogram holding both."""
        return LatencyHistogram(self.counts + other.counts, max(self.max_ms, other.max_ms))

    @property
    def count(self) -> int:
        """Rows recorded."""
        return int(self.counts.sum())

    def percentile(self, q: float) -> float:
        """The q-th percentile in ms: the geometric middle of its bucket, or the exact maximum
        when it falls in the highest bucket (0 when empty)."""
        n = self.count
        if n == 0:
            return 0.0
        rank = max(1, math.ceil(q / 100 * n))
        b = int(np.searchsorted(np.cumsum(self.counts), rank))
        if b == int(np.flatnonzero(self.counts)[-1]) and self.max_ms:
            return self.max_ms  # the highest bucket holds the maximum: report it exactly
        if b == 0:
            return _LO_MS
        lo, hi = _LO_MS * _RATIO ** (b - 1), _LO_MS * _RATIO ** b
        return min(math.sqrt(lo * hi), self.max_ms) if self.max_ms else math.sqrt(lo * hi)

    def counts_at_or_below(self, bounds_ms: list[float]) -> list[int]:
        """Rows recorded at or below each bound (ms, ascending): a bucket counts under the first
        bound its upper edge does not exceed (so within a bucket's 5% of the bound); the
        cumulative counts of a Prometheus histogram.

        >>> h = LatencyHistogram(); h.add(3.0, 2); h.add(40.0)
        >>> h.counts_at_or_below([1.0, 5.0, 50.0])
        [0, 2, 3]
        """
        upper = _LO_MS * _RATIO ** np.arange(_BUCKETS)  # (bucket b holds (upper[b-1], upper[b]])
        cum = np.cumsum(self.counts)
        return [int(cum[int(np.searchsorted(upper, bound, side="right")) - 1]) if bound >= upper[0] else 0
                for bound in bounds_ms]

    def approximate_sum_ms(self) -> float:
        """The rows' total latency in ms, each taken at its bucket's geometric middle."""
        mid = _LO_MS * _RATIO ** (np.arange(_BUCKETS) - 0.5)
        return float((self.counts * mid).sum())

    def summary(self) -> dict[str, float]:
        """``{"count", "p50_ms", "p99_ms", "p999_ms", "max_ms"}``."""
        return {"count": self.count, "p50_ms": round(self.percentile(50), 2), "p99_ms": round(self.percentile(99), 2),
                "p999_ms": round(self.percentile(99.9), 2), "max_ms": round(self.max_ms, 2)}

    def to_plain(self) -> dict[str, Any]:
        """Sparse plain form (for messages and traces)."""
        nz = np.flatnonzero(self.counts)
        return {"b": nz.tolist(), "c": self.counts[nz].tolist(), "max": self.max_ms}

    @staticmethod
    def from_plain(d: dict[str, Any]) -> "LatencyHistogram":
        """Inverse of ``to_plain``."""
        h = LatencyHistogram(max_ms=float(d.get("max", 0.0)))
        h.counts[np.asarray(d.get("b", []), dtype=np.int64)] = np.asarray(d.get("c", []), dtype=np.int64)
        return h


#: Upper bounds of a checkpoint round's duration (capture and encoding), in seconds.
CHECKPOINT_SECONDS_BOUNDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Upper bounds of a checkpoint round's encoded size (one copy of each slice's frames), in bytes.
CHECKPOINT_BYTES_BOUNDS = (1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9)


class BoundedHistogram:
    """Counts of observations under fixed upper bounds (Prometheus' buckets), with their sum.

    A few counters whatever the job's length; mergeable by adding plain forms.

    >>> h = BoundedHistogram((1.0, 10.0)); h.observe(0.5); h.observe(7.0); h.observe(70.0)
    >>> h.to_plain()
    {'counts': [1, 1, 1], 'sum': 77.5}
    >>> BoundedHistogram.cumulative([h.to_plain(), h.to_plain()])
    ([2, 4, 6], 155.0)
    """

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = np.asarray(bounds, dtype=np.float64)
        self.counts = np.zeros(len(bounds) + 1, dtype=np.int64)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count one observation."""
        self.counts[int(np.searchsorted(self.bounds, value, side="left"))] += 1
        self.sum += float(value)

    def to_plain(self) -> dict[str, Any]:
        """Plain form (``ContainerStatistics`` carries it)."""
        return {"counts": self.counts.tolist(), "sum": round(self.sum, 6)}

    @staticmethod
    def cumulative(plains: list[dict[str, Any]]) -> tuple[list[int], float]:
        """Several plain forms of one bounds' histograms merged: counts at or below each bound
        (the last: all of them) and the sum."""
        if not plains:
            return [], 0.0
        counts = np.sum([np.asarray(p["counts"], dtype=np.int64) for p in plains], axis=0)
        return np.cumsum(counts).tolist(), float(sum(p["sum"] for p in plains))


#: Seconds between two estimates of a slice's state bytes per key (``StateSizes``).
STATE_SIZE_EVERY_S = 10.0


class StateSizes:
    """Per local slice (slice, events in, state keys, approximate state bytes) for a container's
    statistics, which every heartbeat carries: keys are counted each time (cheap); bytes are keys
    times the slice's bytes per key, estimated by ``SliceRuntime.state_size`` (a strided pass
    over its entries, O(keys)) at most every ``every_s`` seconds a slice, and at once while a
    slice with keys has no estimate.

    >>> class Rt:
    ...     events_in, keys, passes = 5, 4, 0
    ...     def state_keys(self): return self.keys
    ...     def state_size(self): Rt.passes += 1; return self.keys, 8 * self.keys
    >>> sizes, rt = StateSizes(every_s=10.0), Rt()
    >>> sizes.figures({3: rt}, now=0.0), sizes.figures({3: rt}, now=1.0)
    (((3, 5, 4, 32),), ((3, 5, 4, 32),))
    >>> rt.keys = 6; sizes.figures({3: rt}, now=2.0), Rt.passes
    (((3, 5, 6, 48),), 1)
    """

    def __init__(self, every_s: float = STATE_SIZE_EVERY_S) -> None:
        self.every_s = every_s
        self._per_key: dict[int, tuple[float, float]] = {}  # slice -> (estimated at, bytes per key)

    def figures(self, slices: dict[int, Any], now: float) -> tuple[tuple[int, int, int, int], ...]:
        """The figures of ``slices`` (slice id -> its runtime) at time ``now``."""
        out = []
        for s, rt in slices.items():
            keys = rt.state_keys()
            at, per = self._per_key.get(s, (-math.inf, 0.0))
            if keys and (per == 0.0 or now - at >= self.every_s):
                k, nbytes = rt.state_size()
                per = nbytes / k if k else 0.0
                self._per_key[s] = (now, per)
            out.append((s, rt.events_in, keys, int(keys * per)))
        for s in set(self._per_key) - set(slices):  # (slices that left)
            del self._per_key[s]
        return tuple(out)


@dataclass(frozen=True)
class SliceMetrics:
    """One slice over the last interval: events in, busy time, backlog, state size."""

    slice_id: int
    container: int
    events_in: int  # cumulative
    busy_s: float  # cumulative
    backlog_events: int
    state_keys: int
    state_bytes: int
    input_rate: float = 0.0  # events/s over the last interval
    state_cold_keys: int = 0  # of state_keys, entries in the host's spill store (lmdb), not in memory


@dataclass(frozen=True)
class StageMetrics:
    """One stage as a policy sees it (rates over the last interval)."""

    name: str
    hosts: int
    containers: tuple[int, ...]
    slices: int
    input_rate: float  # events/s admitted
    processing_rate: float  # events per busy second, per host (capacity when running flat out)
    utilization: float  # busy seconds per wall second, averaged over the stage's hosts
    backlog_events: int
    backlog_epochs: int
    threads: int
    per_slice: tuple[SliceMetrics, ...] = ()
    upstream_lag_events: int = 0  # events waiting in the sources this stage reads from (directly or not)
    backpressured: float = 0.0  # seconds held back by receivers per wall second, averaged over its hosts


@dataclass(frozen=True)
class MetricsSnapshot:
    """What the master knows at one moment: per stage, per host and job-wide figures.

    ``t`` is seconds since the job started (the only clock a policy sees).
    """

    t: float
    stages: dict[str, StageMetrics]
    latency: dict[str, float] = field(default_factory=dict)  # summary of the end-to-end histogram
    throughput: float = 0.0  # source events/s over the last interval
    host_cpu: dict[int, float] = field(default_factory=dict)  # host -> CPU fraction (psutil) over the interval
    host_rss_mb: dict[int, float] = field(default_factory=dict)

    def to_plain(self) -> dict[str, Any]:
        """JSON-ready form (a trace line)."""
        return {"t": self.t, "latency": self.latency, "throughput": self.throughput,
                "host_cpu": {str(k): v for k, v in self.host_cpu.items()},
                "host_rss_mb": {str(k): v for k, v in self.host_rss_mb.items()},
                "stages": {n: {**{k: v for k, v in vars(s).items() if k != "per_slice"},
                               "containers": list(s.containers),
                               "per_slice": [vars(x) for x in s.per_slice]} for n, s in self.stages.items()}}

    @staticmethod
    def from_plain(d: dict[str, Any]) -> "MetricsSnapshot":
        """Inverse of ``to_plain``."""
        stages = {}
        for n, s in d["stages"].items():
            per = tuple(SliceMetrics(**x) for x in s.get("per_slice", []))
            fields = {k: v for k, v in s.items() if k not in ("per_slice", "containers")}
            stages[n] = StageMetrics(**fields, containers=tuple(s["containers"]), per_slice=per)
        return MetricsSnapshot(d["t"], stages, dict(d.get("latency", {})), d.get("throughput", 0.0),
                               {int(k): v for k, v in d.get("host_cpu", {}).items()},
                               {int(k): v for k, v in d.get("host_rss_mb", {}).items()})
