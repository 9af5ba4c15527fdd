"""Owns a job's state as a sans-IO state machine: events in, commands out.

The states are ``master.job_state.JobState``; this module owns which event
moves the job from one to another, and what a report arriving after the end
does (nothing but a ``state_kept`` line). It knows no Ray, no clock, no
container: the driver (``master.actor.JobMaster`` on Ray,
``master.local.LocalCluster`` in process) feeds it the hosts' reports and
carries out its commands (save the state and log ``job_<state>``, stop the
hosts).

Transitions (``TRANSITIONS``; docs/design.md section 7a): created -> running
once every host started (``Deployed``); created or running -> failed when a
container fails or a recovery cannot be exact (``ContainerFailed``); running
-> finished once every container of the placement is done and no control
operation (a migration, a recovery) is changing the placement; running ->
stopped on ``StopAsked``. Failed, finished and stopped are final: a later
event changes nothing (``Kept``), so a deploy that finishes awaiting its
hosts after a container failed leaves the job failed.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from chronostream.master.job_state import JobState

#: Events a job's story keeps (the latest).
STORY_MAX = 256

_J = JobState
#: Allowed transitions, each with the event that causes it.
TRANSITIONS: dict[tuple[JobState, JobState], str] = {
    (_J.CREATED, _J.RUNNING): "Deployed",
    (_J.CREATED, _J.FAILED): "ContainerFailed",
    (_J.RUNNING, _J.FAILED): "ContainerFailed",
    (_J.RUNNING, _J.FINISHED): "ContainerDone or Settled: every container of the placement done, none busy",
    (_J.RUNNING, _J.STOPPED): "StopAsked",
}


# -- events ------------------------------------------------------------------------


@dataclass(frozen=True)
class Deployed:
    """Every host started; ``live``: the placement's containers. ``info`` goes with ``job_running``."""

    live: frozenset[int]
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ContainerDone:
    """A container processed its last epoch. ``live``: the placement's containers now; ``busy``:
    a control operation is changing the placement (the finish waits for it)."""

    container: int
    live: frozenset[int]
    busy: bool = False


@dataclass(frozen=True)
class Settled:
    """The placement may have changed (a migration or recovery ended, a restart): check the finish."""

    live: frozenset[int]
    busy: bool = False


@dataclass(frozen=True)
class ContainerFailed:
    """A container failed, or a recovery could not be exact (``where``: which container, if any)."""

    where: str
    error: str


@dataclass(frozen=True)
class StopAsked:
    """``Job.stop()``."""


Event = Deployed | ContainerDone | Settled | ContainerFailed | StopAsked


# -- commands ----------------------------------------------------------------------


@dataclass(frozen=True)
class Enter:
    """Save the new state and log ``job_<state>`` with ``info``."""

    state: JobState
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Kept:
    """A change arrived after the end: log ``state_kept`` (the state stays)."""

    state: JobState
    refused: JobState


@dataclass(frozen=True)
class StopHosts:
    """The job failed: every host stops its containers."""


Command = Enter | Kept | StopHosts


class JobLifecycle:
    """A job's state as a state machine: ``handle(event) -> commands``.

    >>> job = JobLifecycle()
    >>> job.handle(ContainerFailed("in container 3", "boom"))
    [Enter(state=<JobState.FAILED: 'failed'>, info={'where': 'in container 3', 'error': 'boom'}), StopHosts()]
    >>> job.handle(Deployed(frozenset({0, 1, 2, 3})))  # (the deploy ends after the failure)
    [Kept(state=<JobState.FAILED: 'failed'>, refused=<JobState.RUNNING: 'running'>)]
    >>> ok = JobLifecycle()
    >>> [c.state.value for c in ok.handle(Deployed(frozenset({0, 1})))]
    ['running']
    >>> ok.handle(ContainerDone(0, frozenset({0, 1}))), ok.handle(ContainerDone(1, frozenset({0, 1}), busy=True))
    ([], [])
    >>> [c.state.value for c in ok.handle(Settled(frozenset({0, 1})))]
    ['finished']
    """

    def __init__(self, state: JobState = JobState.CREATED, done: set[int] | frozenset = frozenset()) -> None:
        """``state``, ``done``: a restarted master's saved state and finished containers."""
        self.state = state
        self.done: set[int] = set(done)
        self.live: frozenset[int] = frozenset()
        # (event, state after it, commands): the latest ``STORY_MAX`` (a job lives long; its
        # status polls check the finish)
        self.story: collections.deque[tuple[str, str, str]] = collections.deque(maxlen=STORY_MAX)
        self._ended = state if state.terminal else None

    def timeline(self) -> str:
        """The story as lines: each event, the state after it, and the commands it gave."""
        return "\n".join(f"{e} -> {s}: {c}" for e, s, c in self.story)

    def handle(self, event: Event) -> list[Command]:
        """Take one event; return what the driver must do."""
        if isinstance(event, Deployed):
            self.live = event.live
            out = self._to(JobState.RUNNING, **event.info)
            out += self._finish_if_due(False)
        elif isinstance(event, ContainerDone):
            self.done.add(event.container)
            self.live = event.live
            out = self._finish_if_due(event.busy)
        elif isinstance(event, Settled):
            self.live = event.live
            out = self._finish_if_due(event.busy)
        elif isinstance(event, ContainerFailed):
            out = self._to(JobState.FAILED, where=event.where, error=event.error)
            if out and isinstance(out[0], Enter):
                out.append(StopHosts())
        elif isinstance(event, StopAsked):
            out = self._to(JobState.STOPPED) if self.state is JobState.RUNNING else []
        else:
            raise TypeError(f"job lifecycle: unknown event {event!r}")
        self.story.append((type(event).__name__, self.state.value, ", ".join(type(c).__name__ for c in out) or "-"))
        self._check()
        return out

    def _to(self, state: JobState, **info: Any) -> list[Command]:
        if self.state.terminal or state is self.state:
            return [Kept(self.state, state)] if state is not self.state else []
        assert (self.state, state) in TRANSITIONS, f"job: no transition {self.state.value} -> {state.value}"
        # finished only with every container of the placement done
        assert state is not JobState.FINISHED or (self.live and self.live <= self.done), "finished with work left"
        self.state = state
        if state.terminal:
            self._ended = state
        return [Enter(state, info)]

    def _finish_if_due(self, busy: bool) -> list[Command]:
        if self.state is JobState.RUNNING and self.live and self.live <= self.done and not busy:
            return self._to(JobState.FINISHED)
        return []

    def _check(self) -> None:
        """Invariants after every event (docs/design.md section 7a)."""
        # a terminal state is final
        assert self._ended is None or self.state is self._ended, \
            f"job left {self._ended.value} for {self.state.value}"
