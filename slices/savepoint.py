"""Owns the savepoint format: a job's state at one epoch boundary, as files anyone can read.

A savepoint is a directory::

    manifest.json                 what is where (format, version, job, epoch, stages, slices)
    <stage>/<state>.parquet       one table per stage and state name, every slice's rows
    <stage>/slice-<n>.ckpt        each slice's checkpoint frame (``slices.checkpoint``: CRC'd,
                                  msgpack and Arrow IPC, nothing that executes on load)

The Parquet files are the open view: pandas or pyarrow read them without
this runtime. A key-value state (``KeyValueState``) has columns ``slice``,
``key``, ``value`` (a column Arrow cannot type as one, e.g. ints and strings
mixed, holds each value's msgpack bytes, and the manifest says so:
``"key_encoding"`` / ``"value_encoding": "msgpack"``, else ``"arrow"``); a built-in aggregate (``__op__aggregate``) has ``slice``, the
stage's key columns by name and its running values (``count``, ``<col>_i``
sums of ints, ``<col>_f`` of floats, ``<col>_b`` flags). The frames are
what a resumed job restores, exactly. Every slice's checkpoint is at the
manifest's ``epoch``: the cut is consistent (each slice has consumed
exactly its producers' rows of epochs up to it), so a job resumed from it
needs no output log.

Writing goes to a hidden sibling directory renamed into place at the end:
a reader sees a whole savepoint or none. Nothing here knows Ray or the
master; ``write_savepoint`` takes encoded frames, ``read_state`` reads files.

>>> import tempfile, os
>>> from chronostream.dag import Query, compile_query
>>> from chronostream.slices.checkpoint import SliceCheckpoint, encode, table_part
>>> q = Query()
>>> _ = q.source("w", [{"word": "a"}], slices=1).key_by("word").count(slices=1, name="counts").sink(name="c")
>>> plan = compile_query(q)[0]
>>> agg = pa.table({"slot": [0], "key0": ["a"], "count": [3]})
>>> counts = SliceCheckpoint(1, 0, 4, "full", -1, {}, {}, {"__op__aggregate": table_part(agg)})
>>> source = SliceCheckpoint(0, 0, 4, "full", -1, {}, {}, {})
>>> path = os.path.join(tempfile.mkdtemp(), "sp")
>>> write_savepoint(path, plan, 4, [encode(source), encode(counts)], job="demo")["epoch"]
4
>>> read_state(path, "counts").to_pylist()
[{'slice': 0, 'word': 'a', 'count': 3, 'state': '__op__aggregate'}]
>>> shutil.rmtree(os.path.dirname(path))
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from chronostream.slices import codec
from chronostream.slices.checkpoint import SliceCheckpoint, decode, encode, read_table_part
from chronostream.slices.errors import SavepointError
from chronostream.slices.plan import JobPlan

FORMAT = "chronostream-savepoint"
VERSION = 1
MANIFEST = "manifest.json"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def _file_name(name: str) -> str:
    """A stage or state name as one safe path component (never ``..`` nor a separator)."""
    safe = _SAFE.sub("_", name).lstrip(".")
    return safe or "_"


def key_names(plan: JobPlan, stage_id: int) -> list[str]:
    """The stage's key columns by name (its first keyed input's key), or ``[]``."""
    for inp in plan.stages[stage_id].inputs:
        key = plan.streams[inp.stream_id].key
        if key:
            return list(key)
    return []


def unwrap_key(k: Any) -> Any:
    return k[0] if isinstance(k, tuple) and len(k) == 1 else k


def typed_column(values: list[Any]) -> tuple[pa.Array, str]:
    """Python values as one Arrow column, typed by Arrow (``"arrow"``) or, when Arrow cannot
    type them as one column, each value's msgpack bytes (``"msgpack"``)."""
    try:
        return pa.array(values), "arrow"
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
        return pa.array([codec.packb(v) for v in values], pa.binary()), "msgpack"


class _KvRows:
    """A kv state's rows over every slice, typed once all are in (a column types as a whole)."""

    def __init__(self) -> None:
        self.slices: list[int] = []
        self.keys: list[Any] = []
        self.values: list[Any] = []

    def add(self, slice_id: int, part: dict[str, Any]) -> None:
        keys = [unwrap_key(k) for k in codec.unpackb(part["keys"], use_list=False)]
        self.keys += keys
        self.values += codec.unpackb(part["values"], use_list=True)
        self.slices += [slice_id] * len(keys)

    def table(self) -> tuple[pa.Table, dict[str, str]]:
        keys, key_enc = typed_column(self.keys)
        values, value_enc = typed_column(self.values)
        return (pa.table({"slice": pa.array(self.slices, pa.int32()), "key": keys, "value": values}),
                {"key_encoding": key_enc, "value_encoding": value_enc})


def table_state_rows(slice_id: int, part: dict[str, Any], key_names: list[str]) -> pa.Table:
    """A table part (slot-keyed) as rows: ``slice``, key columns by name, the running values."""
    t = read_table_part(part)
    if "slot" in t.schema.names:
        t = t.drop_columns(["slot"])
    names = [key_names[int(n[3:])] if n.startswith("key") and n[3:].isdigit() and int(n[3:]) < len(key_names)
             else n for n in t.schema.names]
    t = t.rename_columns(names)
    return t.add_column(0, "slice", pa.array([slice_id] * t.num_rows, pa.int32()))


def write_savepoint(path: str | os.PathLike, plan: JobPlan, epoch: int, frames: Iterable[bytes | memoryview],
                    job: str = "", fingerprint: str = "", kinds: dict[int, dict[str, str]] | None = None
                    ) -> dict[str, Any]:
    """Write the savepoint of every slice's full checkpoint at ``epoch`` (``frames``: each an
    encoded ``SliceCheckpoint``) to ``path``, which must not exist yet; return its manifest.
    ``kinds``: stage id -> each key-value state's kind (``ContainerCore.state_kinds``), kept in
    the manifest so that a resume refuses an operator that registers a state as another kind.

    Refuses (``SavepointError``) a frame that is damaged, not full, at another epoch, or a
    slice missing or given twice."""
    dest = Path(path)
    if dest.exists():
        raise SavepointError(f"savepoint {dest}: the path exists; a savepoint is written only to a new path")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        manifest = _write_into(tmp, plan, epoch, frames, job, fingerprint, kinds or {})
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # (only the directory this call made)
        raise
    return manifest


def _write_into(root: Path, plan: JobPlan, epoch: int, frames: Iterable[bytes | memoryview],
                job: str, fingerprint: str, kinds: dict[int, dict[str, str]]) -> dict[str, Any]:
    seen: dict[tuple[int, int], str] = {}
    tables: dict[tuple[int, str], list[pa.Table]] = {}
    kv: dict[tuple[int, str], _KvRows] = {}
    slices_out = []
    for data in frames:
        ck: SliceCheckpoint = decode(data, "savepoint frame")
        where = f"stage {plan.stages[ck.stage_id].name!r} slice {ck.slice_id}" \
            if 0 <= ck.stage_id < len(plan.stages) else f"stage id {ck.stage_id}"
        if ck.kind != "full" or ck.epoch != epoch:
            raise SavepointError(f"savepoint: {where}: a {ck.kind} checkpoint at epoch {ck.epoch}, "
                                 f"not a full one at epoch {epoch}")
        if (ck.stage_id, ck.slice_id) in seen:
            raise SavepointError(f"savepoint: {where} given twice")
        stage = plan.stages[ck.stage_id]
        sdir = root / _file_name(stage.name)
        sdir.mkdir(exist_ok=True)
        rel = f"{_file_name(stage.name)}/slice-{ck.slice_id}.ckpt"
        (root / rel).write_bytes(data)
        seen[(ck.stage_id, ck.slice_id)] = rel
        slices_out.append({"stage": stage.name, "stage_id": ck.stage_id, "slice": ck.slice_id, "file": rel,
                           "bytes": len(data), "progress": {str(k): v for k, v in ck.progress.items()},
                           "next_seq": {str(k): v for k, v in ck.next_seq.items()}})
        for name, part in ck.state.items():
            if part.get("shape") == "kv":
                kv.setdefault((ck.stage_id, name), _KvRows()).add(ck.slice_id, part)
            else:
                tables.setdefault((ck.stage_id, name), []).append(
                    table_state_rows(ck.slice_id, part, key_names(plan, ck.stage_id)))
    missing = [f"{st.name!r} slice {s}" for st in plan.stages for s in range(st.num_slices)
               if (st.stage_id, s) not in seen]
    if missing:
        raise SavepointError(f"savepoint: no checkpoint of {', '.join(missing[:8])}"
                             + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    stages = []
    for st in plan.stages:
        states = {}
        names = sorted({name for sid, name in [*tables, *kv] if sid == st.stage_id})
        for name in names:
            if (st.stage_id, name) in kv:
                table, encodings = kv[(st.stage_id, name)].table()
                if name in kinds.get(st.stage_id, {}):
                    encodings["kind"] = kinds[st.stage_id][name]
            else:
                table, encodings = pa.concat_tables(tables[(st.stage_id, name)], promote_options="permissive"), {}
            rel = f"{_file_name(st.name)}/{_file_name(name)}.parquet"
            pq.write_table(table, root / rel)
            states[name] = {"file": rel, "rows": table.num_rows, "columns": table.schema.names, **encodings}
        stages.append({"name": st.name, "stage_id": st.stage_id, "kind": st.kind, "slices": st.num_slices,
                       "states": states})
    manifest = {"format": FORMAT, "version": VERSION, "job": job, "plan_fingerprint": fingerprint,
                "epoch": epoch, "epoch_events": plan.epoch_events, "created_at": time.time(),
                "stages": stages, "slices": slices_out,
                "streams": [[sp.stream_id, sp.name, sp.stage_id] for sp in plan.streams]}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the savepoint at ``path`` (``SavepointError`` when it is not one)."""
    f = Path(path) / MANIFEST
    try:
        manifest = json.loads(f.read_text())
    except FileNotFoundError:
        raise SavepointError(f"{path}: not a savepoint (no {MANIFEST})") from None
    except ValueError as exc:
        raise SavepointError(f"{path}: {MANIFEST} is not JSON: {exc}") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise SavepointError(f"{path}: {MANIFEST} is not a {FORMAT} version {VERSION} manifest")
    return manifest


def _inside(root: Path, rel: str) -> Path:
    """``root / rel``, refused unless it stays inside ``root`` (a path read from disk)."""
    p = (root / rel).resolve()
    if root.resolve() not in p.parents:
        raise SavepointError(f"{root}: the manifest names {rel!r}, outside the savepoint")
    return p


def read_state(path: str | os.PathLike, stage: str, state: str | None = None) -> pa.Table:
    """The state of ``stage`` in the savepoint at ``path`` as one Arrow table with a ``state``
    column: every state of the stage (``state=None``) or the one named. A stage without state
    gives an empty table; an unknown stage or state is a ``SavepointError`` naming what exists."""
    root = Path(path)
    manifest = read_manifest(root)
    by_name = {s["name"]: s for s in manifest["stages"]}
    if stage not in by_name:
        raise SavepointError(f"{path}: no stage {stage!r}; stages: {sorted(by_name)}")
    states = by_name[stage]["states"]
    if state is not None and state not in states:
        raise SavepointError(f"{path}: stage {stage!r} has no state {state!r}; states: {sorted(states)}")
    names = [state] if state is not None else sorted(states)
    tables = []
    for name in names:
        t = pq.read_table(_inside(root, states[name]["file"]))
        tables.append(t.append_column("state", pa.array([name] * t.num_rows, pa.string())))
    if not tables:
        return pa.table({"slice": pa.array([], pa.int32()), "state": pa.array([], pa.string())})
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise SavepointError(f"{path}: stage {stage!r}: its states {names} have columns that do not "
                             f"combine ({exc}); name one: read_state(path, {stage!r}, state=...)") from None


def read_frames(path: str | os.PathLike) -> tuple[dict[str, Any], dict[tuple[int, int], bytes]]:
    """The manifest and every slice's checkpoint frame, by (stage id, slice): what a resume restores."""
    root = Path(path)
    manifest = read_manifest(root)
    frames = {(s["stage_id"], s["slice"]): _inside(root, s["file"]).read_bytes() for s in manifest["slices"]}
    return manifest, frames


def check_restorable(path: str | os.PathLike, plan: JobPlan,
                     drop_states: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """The manifest of the savepoint at ``path``, once it is checked to fit ``plan``: the same
    stages by name, each with the same number of slices and the savepoint holding every slice
    (an operator's code may differ: an upgrade keeps its state names), and each state of
    ``drop_states`` (stage name -> state names to leave behind) held there. ``SavepointError``
    names the first stage that does not fit."""
    manifest = read_manifest(path)
    saved = {s["name"]: s for s in manifest["stages"]}
    for stage, names in (drop_states or {}).items():
        if stage not in saved:
            raise SavepointError(f"savepoint {path}: drop_states names stage {stage!r}; its stages: {sorted(saved)}")
        unknown = sorted(set(names) - set(saved[stage]["states"]))
        if unknown or any(n.startswith("__op__") for n in names):
            raise SavepointError(f"savepoint {path}: stage {stage!r} holds no state {unknown or names} to drop "
                                 f"(its registered states: "
                                 f"{sorted(n for n in saved[stage]['states'] if not n.startswith('__op__'))})")
    names = [st.name for st in plan.stages]
    if sorted(saved) != sorted(names):
        raise SavepointError(f"savepoint {path}: its stages {sorted(saved)} are not the query's {sorted(names)}")
    held = {(s["stage"], s["slice"]) for s in manifest["slices"]}
    streams = [[sp.stream_id, sp.name, sp.stage_id] for sp in plan.streams]
    if manifest["streams"] != streams:  # progress vectors are by stream id
        raise SavepointError(f"savepoint {path}: its streams {manifest['streams']} are not the query's {streams} "
                             "(stream id, name, producing stage)")
    for st in plan.stages:
        if saved[st.name]["stage_id"] != st.stage_id:
            raise SavepointError(f"savepoint {path}: stage {st.name!r} is stage {saved[st.name]['stage_id']} there "
                                 f"and {st.stage_id} in the query; declare the stages in the same order")
        if saved[st.name]["slices"] != st.num_slices:
            raise SavepointError(f"savepoint {path}: stage {st.name!r} has {saved[st.name]['slices']} slices there "
                                 f"and {st.num_slices} in the query; a stage keeps its slices across a resume")
        missing = [s for s in range(st.num_slices) if (st.name, s) not in held]
        if missing:
            raise SavepointError(f"savepoint {path}: stage {st.name!r} slices {missing} are missing")
    if manifest["epoch_events"] != plan.epoch_events:
        raise SavepointError(f"savepoint {path}: epochs of {manifest['epoch_events']} events there and "
                             f"{plan.epoch_events} in the query; a resume keeps the epoch size")
    return manifest


def without_states(frame: bytes, names: Iterable[str]) -> bytes:
    """A checkpoint frame with the states ``names`` left out (a resume that drops them)."""
    ck: SliceCheckpoint = decode(frame, "savepoint frame")
    gone = set(names)
    return bytes(encode(dataclasses.replace(ck, state={n: p for n, p in ck.state.items() if n not in gone})))


def saved_kinds(manifest: dict[str, Any], stage: str) -> dict[str, str]:
    """The kind of each key-value state of ``stage`` the savepoint recorded (older ones: none)."""
    states = next((s["states"] for s in manifest["stages"] if s["name"] == stage), {})
    return {n: st["kind"] for n, st in states.items() if "kind" in st}


def slice_files(path: str | os.PathLike) -> dict[tuple[str, int], Path]:
    """Each slice's checkpoint file in the savepoint at ``path``, by (stage name, slice)."""
    root = Path(path)
    return {(s["stage"], s["slice"]): _inside(root, s["file"]) for s in read_manifest(root)["slices"]}
