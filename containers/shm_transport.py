"""Owns how an epoch message's large routed parts travel between two hosts on one node: as files in shared memory.

On Ray every ``push.remote`` of a message larger than Ray's inline limit
(100 KB) puts it in the object store: measured on the 2-vCPU machine, 2.2-3.9 ms
in the sender for a 2 MB part (41,000 words and their system columns), of which
about 0.8 ms is a fixed cost per object. Written as an Arrow IPC stream into a
file under ``/dev/shm`` (tmpfs: memory, no disk) it costs the sender 1.0-1.2 ms,
and the receiver maps it without a copy (0.14-0.17 ms). So a host sends a part
of ``SHM_MIN_BYTES`` or more to a host on its own node as a ``ShmPart`` (the
file's path) and the call itself carries only that path and the message's
control fields (``EpochMessage``: ``end``, ``coverage``, ``release``, ``ingest``).

Lifetime: the receiver maps and unlinks each file first thing in ``push``,
whatever it then does with the message (a refused or late message too); the
mapping lives as long as the tables that use it. A file whose push never ran
(the receiver died) is unlinked by the sender when that push fails
(``discard``); a stopped receiver unlinks what it is sent unread; every file
of a job left after all its hosts stopped goes with ``remove_job_files``. A
host's own stop unlinks none of its files: one may be queued at a receiver
still running (the master stops hosts one by one), which would find it gone.

Files are created exclusively (``O_CREAT | O_EXCL``), mode 0600: only the job's user reads them.

Knows no Ray: the caller decides which destinations share its node.
"""

from __future__ import annotations

import glob
import itertools
import logging
import os
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa

from chronostream.slices.arrow_ipc import write_stream
from chronostream.containers.epoch_message import EpochMessage

log = logging.getLogger("chronostream.container")

#: Where the files go (tmpfs on Linux). Without it (or not writable) every part goes through Ray.
SHM_DIR = "/dev/shm"
#: Parts smaller than this travel inside the call (Ray inlines arguments up to 100 KB: cheaper).
#: ``$CHRONOSTREAM_SHM_MIN_BYTES`` overrides it for a host (the test suite sets 0: every part of
#: its small epochs then goes through the files, kills and migrations included).
SHM_MIN_BYTES = 100 * 1024
#: The share of the directory's size a sender leaves free: a part that would eat into it goes
#: through Ray. Ray's object store lives in ``/dev/shm`` too, and a tmpfs that fills up fails
#: its writers (a process writing through a mapping gets SIGBUS, not ENOSPC).
SHM_RESERVE_FRACTION = 0.25
#: The hidden column that carries a part's consumer slice per row inside its file.
_DST = "_shm_dst"


@dataclass(frozen=True)
class ShmPart:
    """A routed part written to ``path`` (an IPC stream with its rows' consumer slices as a column)."""

    path: str


def shm_available(directory: str = SHM_DIR) -> bool:
    """Whether ``directory`` exists and this process may create files in it."""
    return os.path.isdir(directory) and os.access(directory, os.W_OK)


def job_prefix(job_tag: str, directory: str = SHM_DIR) -> str:
    """The path prefix of every file of the job tagged ``job_tag``."""
    return os.path.join(directory, f"chronostream-{job_tag}-")


class ShmSender:
    """Writes one host's large parts to files named ``<job prefix><host>-<n>``.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> s = ShmSender("job1", 3, d)
    >>> t = pa.table({"w": ["x"] * 20000, "_seq": np.arange(20000)})
    >>> msg, paths = s.pack(EpochMessage({0: (t, np.zeros(20000, np.int64))}, end=5))
    >>> isinstance(msg.parts[0], ShmPart), msg.end, len(paths)
    (True, 5, 1)
    >>> out = unpack(msg)
    >>> out.parts[0][0].equals(t), out.parts[0][1].dtype, out.end, os.path.exists(paths[0])
    (True, dtype('int64'), 5, False)
    >>> os.rmdir(d)
    """

    def __init__(self, job_tag: str, host_id: int, directory: str = SHM_DIR,
                 min_bytes: int | None = None, reserve_fraction: float = SHM_RESERVE_FRACTION) -> None:
        self.directory = directory
        self.prefix = f"{job_prefix(job_tag, directory)}{host_id}-"
        self.min_bytes = int(os.environ.get("CHRONOSTREAM_SHM_MIN_BYTES", SHM_MIN_BYTES)) if min_bytes is None \
            else min_bytes
        self.reserve_fraction = reserve_fraction
        #: Parts that went through Ray because the directory was too full (``room_for``).
        self.refused_for_room = 0
        self._numbers = itertools.count()

    def pack(self, message: EpochMessage) -> tuple[EpochMessage, list[str]]:
        """``message`` with each routed part of ``min_bytes`` or more replaced by a ``ShmPart``
        (its control fields kept), and the paths written (the caller discards them if the push
        fails). A part whose table cannot be written so (an Arrow type IPC refuses) stays in the
        message; a message with no part written is returned as is."""
        parts: dict[int, Any] = {}
        paths: list[str] = []
        for stream_id, part in message.parts.items():
            table, dst = part
            if table.num_rows and table.nbytes + dst.nbytes >= self.min_bytes:
                path = self._write(table, dst)
                if path is not None:
                    parts[stream_id] = ShmPart(path)
                    paths.append(path)
                    continue
            parts[stream_id] = part
        return (replace(message, parts=parts) if paths else message), paths

    def room_for(self, nbytes: int) -> bool:
        """Whether writing ``nbytes`` leaves the directory's reserve free (one ``statvfs``; a
        directory it cannot read is the write's to fail: True)."""
        try:
            st = os.statvfs(self.directory)
        except OSError:
            return True
        return (st.f_bavail - st.f_blocks * self.reserve_fraction) * st.f_frsize >= nbytes

    def _write(self, table: pa.Table, dst: np.ndarray) -> str | None:
        if not self.room_for(table.nbytes + 4 * len(dst)):
            if not self.refused_for_room:
                log.warning("%s is more than %.0f%% full: parts go through Ray until it has room",
                            self.directory, 100 * (1 - self.reserve_fraction))
            self.refused_for_room += 1
            return None
        path = f"{self.prefix}{next(self._numbers)}"
        try:
            # Made here, by this process alone, readable by its user only: a file of that name
            # already there (planted, or left by another process) is never written into nor
            # removed, and the part goes through Ray. In /dev/shm (sticky) no other user can
            # swap the file before it is reopened below.
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        except OSError:
            return None
        try:
            with pa.OSFile(path, "wb") as f:  # (slice ids: int32 is half the bytes of int64)
                write_stream(f, table.append_column(_DST, pa.array(dst.astype(np.int32))))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError):
            discard([path])
            return None
        return path


def unpack(message: EpochMessage) -> EpochMessage:
    """``message`` with every ``ShmPart`` read back as ``(table, dst)`` (its control fields
    kept), each file unlinked once mapped (the tables keep the mapping: no copy). A message
    without one is returned as is."""
    if not any(isinstance(v, ShmPart) for v in message.parts.values()):
        return message
    parts = dict(message.parts)
    try:
        for stream_id, value in message.parts.items():
            if isinstance(value, ShmPart):
                with pa.memory_map(value.path) as source:
                    table = pa.ipc.open_stream(source).read_all()
                dst = np.asarray(table.column(_DST)).astype(np.int64)
                parts[stream_id] = (table.drop_columns([_DST]), dst)
    finally:  # mapped or not, unlinked: the tables keep their mapping
        discard(shm_paths(message))
    return replace(message, parts=parts)


def discard(paths: list[str]) -> None:
    """Unlink ``paths`` that still exist (a push that never ran, or an unpack that failed midway)."""
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def shm_paths(message: EpochMessage) -> list[str]:
    """The files of ``message``'s ``ShmPart``s (a message its receiver refuses unread)."""
    return [v.path for v in message.parts.values() if isinstance(v, ShmPart)]


def remove_job_files(job_tag: str, directory: str = SHM_DIR) -> int:
    """Unlink every file the job tagged ``job_tag`` left on this node; returns how many. Only
    once every host of the job has stopped: a file still queued at a live receiver is its
    message (a host's own stop leaves its files to their receivers for that reason)."""
    paths = glob.glob(glob.escape(job_prefix(job_tag, directory)) + "*")
    discard(paths)
    return len(paths)


def shm_job_tag(master: Any) -> str:
    """The tag in a job's shared-memory file names (``containers.shm_transport``): its master
    actor's id, which a restarted master keeps."""
    return master._actor_id.hex()
