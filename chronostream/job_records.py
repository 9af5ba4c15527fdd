"""Owns this machine's records of the jobs started from it: a job's name -> the Ray cluster it runs on.

A job's master is a named actor on its Ray cluster, and a process that wants
it (the CLI, another script) must join that cluster first. A machine may run
several clusters: every ``cs.run`` without an address starts one of its own,
so "the newest cluster on this machine" (Ray's ``auto``) is often another
program's. ``run`` and ``submit`` write a record per job under
``$CHRONOSTREAM_HOME/jobs`` (default ``~/.chronostream/jobs``; the directory
mode 0700, each record 0600); ``Job.stop`` removes it. A record of a job
whose cluster died stays until ``chronostream stop NAME`` forgets it: it
says where the job's files are.

Must not touch: Ray (this module knows files only), the job's own files.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path

#: Environment variable naming the directory of this machine's job records.
HOME_ENV = "CHRONOSTREAM_HOME"
#: A job's name: what the records' file names and Ray's actor names are made of.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


@dataclass(frozen=True)
class JobRecord:
    """Where a job runs: its ``name``, its cluster's GCS ``address`` (``host:port``), its
    ``workdir``, whether it was ``submitted`` (it outlives the process that started it),
    whether its cluster wants Ray's authentication token (``token_auth``), the process that
    started it (``driver_pid``) and when (``started_at``, Unix seconds)."""

    name: str
    address: str
    workdir: str
    submitted: bool = False
    token_auth: bool = False
    driver_pid: int = 0
    started_at: float = 0.0


def check_name(name: str) -> str:
    """``name`` when it can name a job (letters, digits, ``_.-``, at most 100, not starting
    with a punctuation mark); ``ValueError`` naming the rule otherwise.

    >>> check_name("nightly-counts.v2")
    'nightly-counts.v2'
    >>> check_name("../etc")
    Traceback (most recent call last):
    ...
    ValueError: job name '../etc': use letters, digits and _.- (at most 100, starting with a letter or digit)
    """
    if not isinstance(name, str) or NAME_PATTERN.fullmatch(name) is None:
        raise ValueError(f"job name {name!r}: use letters, digits and _.- (at most 100, starting with a letter "
                         "or digit)")
    return name


def records_dir() -> Path:
    """The directory of this machine's records (``$CHRONOSTREAM_HOME/jobs``), made 0700 when missing."""
    home = Path(os.environ.get(HOME_ENV) or Path.home() / ".chronostream")
    path = home / "jobs"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def write_record(record: JobRecord) -> Path:
    """Write (or replace) ``record``, atomically (a temporary file renamed over it); its path."""
    path = records_dir() / f"{check_name(record.name)}.json"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".record-")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(record), f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def read_record(name: str) -> JobRecord | None:
    """The record of job ``name``, or None when this machine has none (or it is unreadable).

    >>> import tempfile, shutil; before = os.environ.get(HOME_ENV); os.environ[HOME_ENV] = home = tempfile.mkdtemp()
    >>> _ = write_record(JobRecord("j1", "127.0.0.1:6379", "/tmp/w"))
    >>> read_record("j1").address, read_record("j2")
    ('127.0.0.1:6379', None)
    >>> remove_record("j1"); read_record("j1") is None
    True
    >>> shutil.rmtree(home)
    >>> os.environ.pop(HOME_ENV) if before is None else os.environ.update({HOME_ENV: before})
    """
    try:
        path = records_dir() / f"{check_name(name)}.json"
    except ValueError:
        return None
    return _load(path)


def remove_record(name: str) -> None:
    """Forget job ``name`` (nothing when there is no record)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(records_dir() / f"{check_name(name)}.json")


def all_records() -> list[JobRecord]:
    """Every readable record of this machine, oldest first."""
    found = [_load(p) for p in records_dir().glob("*.json")]
    return sorted((r for r in found if r is not None), key=lambda r: (r.started_at, r.name))


def _load(path: Path) -> JobRecord | None:
    """A record file as a ``JobRecord``; None when it is missing or not a record (a record is
    data only: its fields are typed here, its name must match its file's)."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    known = {f.name: f.type for f in fields(JobRecord)}
    kinds = {"str": str, "bool": bool, "int": int, "float": (int, float)}
    values = {k: v for k, v in raw.items() if k in known}
    if any(not isinstance(v, kinds[known[k]]) for k, v in values.items()):
        return None
    try:
        record = JobRecord(**values)
    except TypeError:
        return None
    return record if record.name == path.stem and NAME_PATTERN.fullmatch(record.name) else None

