"""The states a job goes through, as one enum.

Owns: ``JobState`` and which of its values are terminal. The transitions
themselves belong to ``master.protocols.job.JobLifecycle`` (the table is
docs/design.md section 7a). Knows nothing else: the master, the client and
the CLI all import it, and the catalog stores its values as plain strings.

>>> JobState("finished").terminal, JobState.RUNNING.terminal
(True, False)
>>> JobState.FAILED == "failed", str(JobState.STOPPED), f"job_{JobState.RUNNING}"
(True, 'stopped', 'job_running')
"""

from __future__ import annotations

import enum


class JobState(enum.StrEnum):
    """A job's state. A ``str``: it compares equal to its value, prints and serializes (JSON,
    msgpack) as that value, and ``JobState(value)`` reads a stored one back.

    created -> running -> finished | failed | stopped; created -> failed (a container that
    fails during the deploy). The last three are terminal: no transition leaves them.
    """

    CREATED = "created"    # the master exists; its hosts are being made and started (``deploy``)
    RUNNING = "running"    # every host started; containers process epochs
    FINISHED = "finished"  # every container of the placement processed its last epoch
    FAILED = "failed"      # a container failed, or a recovery could not be exact
    STOPPED = "stopped"    # ``Job.stop()`` while it ran

    @property
    def terminal(self) -> bool:
        """Whether no transition leaves this state (finished, failed, stopped)."""
        return self in _TERMINAL


_TERMINAL = frozenset({JobState.FINISHED, JobState.FAILED, JobState.STOPPED})
