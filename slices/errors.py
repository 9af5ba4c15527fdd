"""Errors the user sees. Each names the stage, slice and source order it concerns.

Owns: the exception types. Must not import any executor.
"""

from __future__ import annotations


class ChronoStreamError(Exception):
    """Base class of every error the runtime raises on purpose."""


class QueryError(ChronoStreamError):
    """The query DAG is malformed (caught when it is built or compiled)."""


class EventError(ChronoStreamError):
    """One event could not be processed: a user function raised, or it broke the schema.

    Attributes name exactly where: ``stage``, ``slice_id``, ``order`` (the
    source order of the input event it derives from) and the original
    ``cause`` as text.
    """

    def __init__(self, stage: str, slice_id: int, order: int, cause: str, event: object = None) -> None:
        self.stage = stage
        self.slice_id = slice_id
        self.order = order
        self.cause = cause
        self.event = event
        super().__init__(
            f"stage {stage!r} slice {slice_id} failed on the event with source order {order}: {cause}"
            + (f" (event: {event!r})" if event is not None else "")
        )

    def __reduce__(self):  # keep the attributes across Ray's pickling
        return (EventError, (self.stage, self.slice_id, self.order, self.cause, self.event))


class RuntimeFault(ChronoStreamError):
    """The runtime itself cannot go on where it is (its spill store's disk is nearly full):
    not the event's fault, so never a dead letter. The slice fails the job with an
    ``EventError`` naming stage, slice and order, whose cause is this message."""


class StateEncodingError(ChronoStreamError, TypeError):
    """A value cannot be stored (checkpoint, spill store): its type is none the codec carries
    (``chronostream.slices.codec``). The message names the type and, where known, the state, stage
    and slice. Also a ``TypeError``: it is what a bad value's type is."""


class StoreFullError(RuntimeFault):
    """A local store (backup store, output log, spill store, master catalog) refused a write
    that would leave its disk with less free space than it keeps: the message names the store
    and its path. Raised before the write, so the process never meets a full disk through a
    memory-mapped file (a SIGBUS)."""

    def __init__(self, store: str, path: str, message: str) -> None:
        self.store = store
        self.path = path
        super().__init__(message)

    def __reduce__(self):
        return (StoreFullError, (self.store, self.path, self.args[0]))


class WorkdirError(ChronoStreamError):
    """A job's work directory cannot be used as asked: it holds another job's catalog (and the
    caller did not ask to resume it), or the catalog to resume is another job's."""


class JobFailed(ChronoStreamError):
    """The job stopped because of an error; ``__cause__``/``error`` holds it."""

    def __init__(self, message: str, error: BaseException | None = None) -> None:
        self.error = error
        super().__init__(message)

    def __reduce__(self):
        return (JobFailed, (self.args[0], self.error))


class RecoveryError(ChronoStreamError):
    """A lost slice cannot be rebuilt exactly (every backup is gone, or the rows to replay are).

    The message names the stage, the slice and what is missing. The job
    fails rather than produce output that differs from a failure-free run.
    """


class SinkRowsLost(RecoveryError):
    """Rows a memory sink accepted died with the host that held them and nothing re-makes
    them; ``job.results`` raises it rather than return a short table.

    ``lost`` lists one dict per container whose rows are gone: ``stage``, ``slices``,
    ``container``, ``host``.
    """

    def __init__(self, message: str, lost: list[dict] | None = None) -> None:
        self.lost = list(lost or [])
        super().__init__(message)

    def __reduce__(self):  # keep the attributes across Ray's pickling
        return (SinkRowsLost, (self.args[0], self.lost))

    @staticmethod
    def describe(lost: list[dict]) -> str:
        """``stage 'count' slices [0, 3] (container 3 on host 3)``, joined by "; ".

        >>> SinkRowsLost.describe([{"stage": "c", "slices": [0, 3], "container": 3, "host": 3}])
        "stage 'c' slices [0, 3] (container 3 on host 3)"
        """
        return "; ".join(f"stage {d['stage']!r} slices {d['slices']} (container {d['container']} on host {d['host']})"
                         for d in lost)


class SavepointError(ChronoStreamError):
    """A savepoint cannot be taken, written or read as asked; the message names the savepoint's
    path and the stage or slice concerned."""


class ClusterError(ChronoStreamError):
    """The Ray cluster a job runs on (or should run on) cannot be reached or used as asked: no
    cluster answers at the address, a submitted job has no cluster that outlives its caller, or
    this process is connected to another cluster than the job's. The message names the address."""


class JobNotFound(ChronoStreamError, KeyError):
    """No job of that name runs where it was looked for (its cluster, or this machine's records
    of the jobs started from it); the message says where it looked and what runs there."""

    def __str__(self) -> str:  # (KeyError's own quotes the message)
        return str(self.args[0]) if self.args else ""
