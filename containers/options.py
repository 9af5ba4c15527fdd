"""Owns the runtime options of one job (``cs.JobOptions``: what ``chronostream.run`` takes besides the query).

Plain data shared by the client, the master and the containers; no Ray.
Validation happens here, once, so every layer can trust the values.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Seconds between checkpoint rounds when a job gives neither ``checkpoint_interval_s`` nor
#: ``checkpoint_every``: fault tolerance is on unless the job turns it off (``checkpoint_interval_s=0``).
DEFAULT_CHECKPOINT_INTERVAL_S = 1.0


@dataclass(frozen=True)
class JobOptions:
    """The runtime options of one job, with their defaults: ``cs.run(q, options=JobOptions(...))``
    (or the same names as keywords of ``run``). Validated here, once.

    **Fault tolerance** is on by default: every slice is checkpointed at the
    first epoch boundary ``checkpoint_interval_s`` (default 1 s,
    ``DEFAULT_CHECKPOINT_INTERVAL_S``) after its previous round; with
    ``checkpoint_every=K`` every K epochs (K alone: by epochs only; both:
    whichever comes first); ``checkpoint_interval_s=0`` and no
    ``checkpoint_every`` turn checkpoints off. A checkpoint is a full one, then
    deltas merged at the backups (``full_checkpoint_every=N`` forces a full one
    every N), encoded off the epoch in a background thread and shipped to
    ``backup_factor`` peers of its stage along the chain of the ChronoStream paper.
    When a host dies (a failed push, a ping, or ``heartbeat_timeout_s`` of
    silence) its slices are rebuilt in parallel on the peers holding their
    backups, and upstream output logs replay what they missed: the output is the
    same as without the failure. A slice whose every backup is lost fails the job
    unless ``recompute_lost`` (rebuild it from the start); without checkpoints a
    dead host's slices are rebuilt from the start. Every ``gc_interval_s`` the
    master trims output logs below what every consumer's checkpoint covers.
    Shipments above ``ship_by_reference_bytes`` go through Ray's object store
    without a copy; above ``ship_piece_bytes`` in 64 MB pieces, one in flight.

    **Elasticity.** A migration first waits up to ``migration_warm_up_s``
    (pausing nothing) for the destination's backups to reach the source's epoch;
    an autoscaling policy is asked every ``autoscale_interval_s``.

    **State and hosts.** ``spill_state`` keeps the middle chunks of long lists
    and queues in the host's lmdb; ``full_gc_interval_s`` paces each host's full
    garbage collections; ``background_niceness`` lowers its background threads'
    priority; ``shm_transport`` sends large parts between hosts of one node as
    files in ``/dev/shm``; a host whose master is gone exits after
    ``master_lost_s`` (leaving its store for ``chronostream resume``).

    **Dashboard and metrics.** The master serves the job's live dashboard (``/``)
    and Prometheus metrics (``/metrics``) on 127.0.0.1 at ``http_port`` (0: a free
    port; -1: none; ``Job.status().dashboard_url`` and ``metrics_url``).

    **Sources.** A followed source log is tailed every ``source_poll_s``;
    ``source_pace_s`` slows every source by that long per epoch (demos and tests
    that want a fault or a rescale to land mid-stream).

    >>> JobOptions().checkpointing, JobOptions(checkpoint_interval_s=0).checkpointing
    (True, False)
    >>> JobOptions().checkpoint_period_s, JobOptions(checkpoint_every=4).checkpoint_period_s
    (1.0, 0.0)
    >>> JobOptions(backup_factor=-1)
    Traceback (most recent call last):
    ...
    ValueError: backup_factor must be >= 0, got -1
    """

    max_inflight_epochs: int = 4  # epochs in flight per channel (the backpressure bound)
    heartbeat_s: float = 0.5  # host -> master heartbeat and master -> host ping period
    heartbeat_timeout_s: float = 60.0  # silence after which a host counts as dead
    output_log: bool = True  # log routed outputs to lmdb (replay for recovery and migration)
    checkpoint_every: int = 0  # checkpoint every K epochs (0: no epoch trigger)
    # Checkpoint at the first epoch boundary T s after the previous round (0: not by time;
    # None: DEFAULT_CHECKPOINT_INTERVAL_S unless checkpoint_every is given). Read checkpoint_period_s.
    checkpoint_interval_s: float | None = None
    backup_factor: int = 2  # chained backup copies per slice
    full_checkpoint_every: int = 0  # force a full checkpoint every N (0: deltas merged at the backups)
    recompute_lost: bool = False  # rebuild a slice whose every backup is lost from the start
    gc_interval_s: float = 2.0  # how often the master trims output logs below the consumers' checkpoints
    autoscale_interval_s: float = 2.0  # how often the master takes a metrics snapshot and asks the policy
    spill_state: bool = True  # long lists/queues (window contents) keep their middle chunks in the host's lmdb
    source_poll_s: float = 0.01  # how often a source tails a followed log (a stat of its manifest when idle)
    full_gc_interval_s: float = 600.0  # a host's own full garbage collections (0: CPython's automatic ones)
    migration_warm_up_s: float = 30.0  # a migration waits this long at most for fresh backups (0: no wait)
    ship_by_reference_bytes: int = 8 << 20  # checkpoint shipments above this go through the object store
    ship_piece_bytes: int = 768 << 20  # larger shipments travel in 64 MB pieces, one in flight
    source_pace_s: float = 0.0  # sources wait this long after each epoch, from the first (demos and tests)
    # A host's background threads (backup store, checkpoint encoding, restores, replays, shipments)
    # run this many nice levels below its epoch loops (Linux; 0: the same priority). Off by default:
    # 4 showed no gain on the 1 GB migration delay (docs/design.md section 3a).
    background_niceness: int = 0
    # Epoch messages' parts of 100 KB or more between hosts of one node travel as files in
    # /dev/shm instead of through Ray's object store (containers/shm_transport.py).
    shm_transport: bool = True
    # A host whose master is gone for good (its actor dead: the driver that owned it died, or it
    # was killed) and unheard of this long exits itself (0: ``max(3 x heartbeat_s, 60 s)``);
    # a master that restarts is waited for, however long.
    master_lost_s: float = 0.0
    # The master's HTTP port on 127.0.0.1, the dashboard at / and Prometheus at /metrics (0: a
    # free port; -1: none); its addresses are in ``Job.status()`` and ``chronostream status``
    # (master/ray_http.py).
    http_port: int = 0

    def __post_init__(self) -> None:
        for name in ("max_inflight_epochs",):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("checkpoint_every", "backup_factor", "full_checkpoint_every", "ship_by_reference_bytes",
                     "background_niceness"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("heartbeat_s", "heartbeat_timeout_s", "gc_interval_s", "autoscale_interval_s",
                     "source_poll_s", "ship_piece_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.checkpoint_interval_s is not None and self.checkpoint_interval_s < 0:
            raise ValueError(f"checkpoint_interval_s must be >= 0, got {self.checkpoint_interval_s}")
        if not -1 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be a port, 0 (any free one) or -1 (none), got {self.http_port}")
        for name in ("full_gc_interval_s", "migration_warm_up_s", "source_pace_s",
                     "master_lost_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def master_lost_after_s(self) -> float:
        """How long a host waits, its master's actor dead, before it exits (``master_lost_s``)."""
        return self.master_lost_s or max(3 * self.heartbeat_s, 60.0)

    @property
    def checkpoint_period_s(self) -> float:
        """Seconds between a slice's checkpoint rounds by time (0: none by time): ``checkpoint_interval_s``,
        or when it is not given, ``DEFAULT_CHECKPOINT_INTERVAL_S`` unless ``checkpoint_every`` is."""
        if self.checkpoint_interval_s is not None:
            return self.checkpoint_interval_s
        return 0.0 if self.checkpoint_every else DEFAULT_CHECKPOINT_INTERVAL_S

    @property
    def checkpointing(self) -> bool:
        """True when slices are checkpointed to backups (by epochs or by time)."""
        return bool(self.checkpoint_every or self.checkpoint_period_s)
