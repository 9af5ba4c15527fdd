"""Owns the client's side of a restarted master's question for the source tables' references.

A job's in-memory source tables are the client's: ``run`` puts them in Ray's
object store, the ``Job`` handle holds the references, the master and the
hosts borrow them. A master that restarts while every host is dead finds
them nowhere and asks the client (``JobMaster.wants_source_refs``; it waits
``SOURCE_REFS_CLIENT_WAIT_S``, 30 s, then fails the job). ``Job.status``,
``wait`` and ``progress`` answer when they happen to be called; this keeper
answers when the process that started the job is doing something else: a
daemon thread asks the master every ``ASK_EVERY_S`` and hands the references
back when it wants them.

It stops when the job ends (finished, failed or stopped), when ``stop`` is
called (``Job.stop``, or the ``Job`` handle collected: the thread holds no
reference to it), and after ``GIVE_UP_AFTER`` failed asks in a row (a master
gone for good, or Ray shut down). ``ray_keeper`` binds it to a master's two
calls; the thread itself knows no Ray.

A submitted job outlives the process that submitted it, so its tables
cannot be that process's: a ``SourceHolder`` (a detached actor named after
the job) puts them in the object store itself, owns them for the job's
life, and runs the keeper; ``Job.stop`` kills it.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any, Callable

import pyarrow as pa

import ray

from chronostream.master.job_state import JobState

log = logging.getLogger("chronostream.client")

#: Seconds between two asks: a restarted master waits 30 s for an answer.
ASK_EVERY_S = 1.0
#: Failed asks in a row (a master restarting takes a few) after which the keeper stops.
GIVE_UP_AFTER = 60
#: The keepers whose threads may still run (``stop_all``).
_LIVE: "weakref.WeakSet[SourceRefKeeper]" = weakref.WeakSet()


def stop_all(within_s: float = 2.0) -> None:
    """Stop every keeper of this process and wait up to ``within_s`` for their threads: call it
    before ``ray.shutdown()`` so that no thread is inside a Ray call while Ray goes away."""
    keepers = list(_LIVE)
    for k in keepers:
        k.stop()
    deadline = time.monotonic() + within_s
    for k in keepers:
        k._thread.join(max(0.0, deadline - time.monotonic()))


class SourceRefKeeper:
    """A daemon thread that calls ``ask()`` (-> whether the master wants the references, the
    job's state) every ``ask_every_s`` and ``give()`` when it does, for the job's life;
    ``connected()`` false (Ray shut down) ends it at the next failed ask.

    >>> import time
    >>> states = iter([(False, JobState.RUNNING), (True, JobState.RUNNING), (False, JobState.FINISHED)])
    >>> given = []
    >>> k = SourceRefKeeper(lambda: next(states), lambda: given.append(1), ask_every_s=0.01)
    >>> while k.running: time.sleep(0.01)
    >>> given, k.answers
    ([1], 1)
    """

    def __init__(self, ask: Callable[[], tuple[bool, JobState]], give: Callable[[], object],
                 ask_every_s: float = ASK_EVERY_S, connected: Callable[[], bool] = lambda: True) -> None:
        self._stopped = threading.Event()
        self.answers = 0  # times the references were handed back
        self._thread = threading.Thread(target=self._keep, args=(ask, give, ask_every_s, connected),
                                        name="chronostream-source-refs", daemon=True)
        _LIVE.add(self)
        self._thread.start()

    def stop(self) -> None:
        """Ask no more (the thread ends at its next wake-up, at once when it is waiting)."""
        self._stopped.set()

    @property
    def running(self) -> bool:
        """Whether the thread still runs."""
        return self._thread.is_alive()

    def _keep(self, ask: Callable[[], tuple[bool, JobState]], give: Callable[[], object], ask_every_s: float,
              connected: Callable[[], bool]) -> None:
        failures = 0
        while not self._stopped.wait(ask_every_s):
            try:
                wanted, state = ask()
                if wanted:
                    give()
                    self.answers += 1
                    log.info("gave the source tables' references back to the restarted master")
                failures = 0
            except Exception:  # a master restarting or gone, Ray shut down: asked again, or given up
                failures += 1
                if failures >= GIVE_UP_AFTER or not connected():
                    return
                continue
            if state.terminal:  # the job ended: nothing will ask again
                return


def ray_keeper(master: Any, source_refs: dict[int, list]) -> SourceRefKeeper:
    """The keeper of a job on Ray: asks ``master`` (a ``JobMaster`` handle), gives ``source_refs``
    (stage id -> [reference]). Holds the handle and the references, nothing of the ``Job``."""

    def ask() -> tuple[bool, JobState]:
        return ray.get(master.wants_source_refs.remote(), timeout=10)

    def give() -> object:
        return ray.get(master.give_source_refs.remote(source_refs), timeout=30)

    return SourceRefKeeper(ask, give, connected=ray.is_initialized)


def holder_name(key: str) -> str:
    """Ray actor name of a submitted job's ``SourceHolder``."""
    return f"chronostream-{key}-sources"


@ray.remote(num_cpus=0)
class SourceHolder:
    """Owns a submitted job's in-memory source tables: ``hold`` puts them in the object store
    from this actor (which then owns them; their first copies, the submitter's, may go) and
    answers a restarted master's question for them, as a ``Job`` handle would."""

    def __init__(self) -> None:
        self.refs: dict[int, list] = {}
        self.keeper: SourceRefKeeper | None = None

    def hold(self, tables: dict[int, pa.Table]) -> dict[int, list]:
        """Put every table (stage id -> table) in the object store; stage id -> [reference]."""
        self.refs = {sid: [ray.put(t)] for sid, t in tables.items()}
        return self.refs

    def keep_for(self, master: Any) -> None:
        """Answer ``master``'s question for the references for the job's life."""
        self.keeper = ray_keeper(master, self.refs)
