"""Owns vertical scaling inside a container: the thread-control table and the threads it maps slices to.

Paper III-D: a container runs its slices on a pool of threads; a
*thread-control table* says which thread runs which slice. Scaling up or
down installs a new table; no state moves, because a slice's state
belongs to the slice, not to a thread. The table is read once per epoch,
at the barrier between two epochs, through an optimistic readers-writer
latch (a sequence lock): the writer (a control call) bumps a version to
odd, swaps the table, bumps it to even; the reader (the epoch loop, in
another thread) takes the table only when the version it read before and
after is the same even number, so no lock is taken per event, nor per
epoch when nothing changed.

What threads can buy under CPython's GIL: only work that releases it runs
in parallel (Arrow compute kernels, large numpy operations, lmdb and file
I/O, zlib). A per-event Python operator holds the GIL and gains nothing,
or loses a little to thread switches. ``benchmarks.vertical`` measures it.
Knows no Ray.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class ThreadControlTable:
    """Slice -> thread index (0 .. threads - 1); immutable, so a reader never sees it half-written.

    >>> ThreadControlTable.spread([4, 1, 7], 2).thread_of
    {1: 0, 4: 1, 7: 0}
    >>> ThreadControlTable.spread([4, 1, 7], 2).groups([1, 4, 7])
    [[1, 7], [4]]
    """

    threads: int
    thread_of: dict[int, int]
    #: Slice -> cohort: a thread runs each cohort's slices as a group of its own (a compaction
    #: keeps the groups the merged containers had; empty: one group a thread).
    cohort_of: dict[int, int] = field(default_factory=dict)

    @staticmethod
    def spread(slices: list[int], threads: int) -> "ThreadControlTable":
        """Slices round-robin over ``threads`` threads, in slice order."""
        if threads < 1:
            raise ValueError(f"a container needs at least 1 thread, got {threads}")
        return ThreadControlTable(threads, {s: i % threads for i, s in enumerate(sorted(slices))})

    @staticmethod
    def of_cohorts(cohorts: list[list[int]], threads: int) -> "ThreadControlTable":
        """Each of ``cohorts`` on one thread, round-robin over ``threads``, kept apart as groups.

        >>> t = ThreadControlTable.of_cohorts([[1, 4], [2], [0]], 2)
        >>> t.groups([0, 1, 2, 4]), t.cohorts([0, 2])
        ([[0, 1, 4], [2]], [[0], [2]])
        """
        if threads < 1:
            raise ValueError(f"a container needs at least 1 thread, got {threads}")
        return ThreadControlTable(threads, {s: i % threads for i, c in enumerate(cohorts) for s in c},
                                  {s: i for i, c in enumerate(cohorts) for s in c})

    def cohorts(self, slices: list[int]) -> list[list[int]]:
        """One thread's ``slices`` split into the groups it runs: by cohort, in order of each
        cohort's first slice (all of them when the table has no cohorts)."""
        if not self.cohort_of:
            return [sorted(slices)]
        out: dict[int, list[int]] = {}
        for s in sorted(slices):
            out.setdefault(self.cohort_of.get(s, -1), []).append(s)
        return list(out.values())

    def groups(self, slices: list[int]) -> list[list[int]]:
        """``slices`` grouped by thread index (a slice the table does not know goes to thread 0);
        ``groups(...)[i]`` is what thread i runs (possibly nothing)."""
        out: list[list[int]] = [[] for _ in range(self.threads)]
        for s in sorted(slices):
            out[self.thread_of.get(s, 0) % self.threads].append(s)
        return out


class OptimisticLatch:
    """A sequence lock over one value: lock-free reads, writers serialized.

    >>> latch = OptimisticLatch("a")
    >>> latch.read()
    (0, 'a')
    >>> latch.write("b")
    2
    >>> latch.read()
    (2, 'b')
    """

    def __init__(self, value: object) -> None:
        self._value = value
        self._version = 0  # even: stable; odd: a writer is in the middle of a swap
        self._writer = threading.Lock()

    def write(self, value: object) -> int:
        """Install ``value``; returns the new (even) version."""
        with self._writer:
            self._version += 1
            self._value = value
            self._version += 1
            return self._version

    def read(self) -> tuple[int, object]:
        """(version, value) as of one stable moment: retried while a write is in progress."""
        while True:
            before = self._version
            value = self._value
            if before % 2 == 0 and self._version == before:
                return before, value

    @property
    def version(self) -> int:
        """The current version (cheap check: did anything change since a read?)."""
        return self._version


class SliceThreads:
    """The threads of one container and the table mapping its slices to them.

    ``install`` may be called at any time (from a control call);
    ``run_epoch`` picks the newest table up at its start, the epoch
    barrier, and runs each thread's slices on that thread.
    """

    def __init__(self, slices: list[int], threads: int = 1) -> None:
        self.latch = OptimisticLatch(ThreadControlTable.spread(slices, threads))
        self._seen = -1
        self.table: ThreadControlTable = ThreadControlTable.spread(slices, threads)
        self._pool: list[ThreadPoolExecutor] = []  # thread i of the table is _pool[i] (one worker each)
        self.installed_at_epoch: dict[int, int] = {}  # table version -> first epoch run with it

    def install(self, table: ThreadControlTable) -> int:
        """Writer side: a new table, in effect from the next epoch barrier. Returns its version."""
        return self.latch.write(table)

    def resize(self, slices: list[int], threads: int) -> int:
        """Install a table spreading ``slices`` over ``threads`` threads. A table of cohorts (a
        compaction's) with that many threads for these slices stays: its groups stand, where a
        new table would make the thread's slices one group, built anew over all their keys."""
        version, table = self.latch.read()
        assert isinstance(table, ThreadControlTable)
        if table.cohort_of and table.threads == threads and set(table.thread_of) == set(slices):
            return version
        return self.install(ThreadControlTable.spread(slices, threads))

    def planned_threads(self) -> int:
        """Threads of the newest table (in effect from the next epoch barrier)."""
        table = self.latch.read()[1]
        assert isinstance(table, ThreadControlTable)
        return table.threads

    def _barrier(self, epoch: int) -> ThreadControlTable:
        if self.latch.version != self._seen:
            version, table = self.latch.read()
            assert isinstance(table, ThreadControlTable)
            if table.threads != len(self._pool):
                for pool in self._pool:
                    pool.shutdown(wait=True)
                self._pool = ([ThreadPoolExecutor(1, thread_name_prefix=f"slice-thread-{i}")
                               for i in range(table.threads)] if table.threads > 1 else [])
            self.table, self._seen = table, version
            self.installed_at_epoch[version] = epoch
        return self.table

    def run_epoch(self, epoch: int, slices: list[int], work: Callable[[int], T]) -> dict[int, T]:
        """``work(slice)`` for every slice, each on its thread; results by slice, in slice order."""
        return self.run_groups(epoch, slices, lambda group: {s: work(s) for s in sorted(group)})

    def run_groups(self, epoch: int, slices: list[int], work: Callable[[list[int]], dict[int, T]]) -> dict[int, T]:
        """``work(group)`` once per thread, on that thread, for the group of ``slices`` the table
        gives it (the same group epoch after epoch while the table stands); results merged in
        slice order. No slices (a container that released its last ones by migration before
        this epoch): no call, no results."""
        table = self._barrier(epoch)
        if not slices:
            return {}

        def run_thread(group: list[int]) -> dict[int, T]:
            out: dict[int, T] = {}
            for cohort in table.cohorts(group):
                out.update(work(cohort))
            return out
        groups = table.groups(slices)
        if not self._pool or sum(1 for g in groups if g) <= 1:
            return dict(sorted(run_thread(slices).items()))
        futures: list[Future] = [self._pool[i].submit(run_thread, g) for i, g in enumerate(groups) if g]
        results: dict[int, T] = {}
        errors = []
        for f in futures:  # wait for every thread, even after an error (no thread outlives the epoch)
            try:
                results.update(f.result())
            except BaseException as exc:  # noqa: BLE001 - re-raised below, the first one wins
                errors.append(exc)
        if errors:
            raise errors[0]
        return {s: results[s] for s in sorted(results)}

    @property
    def threads(self) -> int:
        """Threads of the table in effect (a newer one waits for the next barrier)."""
        return self.table.threads

    def close(self) -> None:
        """Stop the threads."""
        for pool in self._pool:
            pool.shutdown(wait=False, cancel_futures=True)
        self._pool = []
