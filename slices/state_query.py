"""Owns point queries of live state (``Job.query_state``): the values some keys have in every
state of a slice, read between two of its epochs, and those answers as rows.

A host answers for its slices (``query_slice``: reads only, the slice changes nothing); the
client puts the answers together (``answer_rows``) in the savepoint's row format
(``slices.savepoint``: a key-value state's rows are ``slice, key, value``; a built-in
aggregate's ``slice``, the key columns by name and its running values), so a query and
``read_state`` of a savepoint give the same columns. Must not touch: a slice's state, its
dirty sets (no checkpoint sees a query), the routing of events.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from chronostream.slices.checkpoint import read_table_part
from chronostream.slices.errors import QueryError
from chronostream.slices.hashing import hash_columns
from chronostream.slices.savepoint import table_state_rows, typed_column
from chronostream.slices.state import canonical_key

_MISSING = object()


def query_slice(rt: Any, keys: list[tuple]) -> dict[str, dict[str, Any]]:
    """The values of ``keys`` (each a tuple of the stage's key values) in every state of the
    slice runtime ``rt``: state name -> ``{"shape": "kv", "keys": [...], "values": [...]}`` (the
    keys a key-value state holds a value for, looked up as the operator would: one key value
    alone, several as a tuple) or ``{"shape": "table", "frozen": table}`` (the rows of a built-in
    aggregate's running values whose key columns equal a key's; its running values are copied
    whole first, as a checkpoint copies them), each with the slice's last processed ``epoch``
    (the values are as of its end).

    >>> from chronostream.slices.state import KeyValueState
    >>> class Ctx: states = {"sums": KeyValueState("sums")}
    >>> class Rt: op = object(); ctx = Ctx(); last_epoch = 4
    >>> Rt.ctx.states["sums"].set("a", 3)
    >>> query_slice(Rt, [("a",), ("b",)])
    {'sums': {'shape': 'kv', 'keys': ['a'], 'values': [3], 'epoch': 4}}
    """
    out: dict[str, dict[str, Any]] = {}
    epoch = int(rt.last_epoch)
    op = rt.op
    if op is None:
        return out
    if hasattr(op, "checkpoint_state"):
        for name, part in op.checkpoint_state(False, clear=False).items():
            if part.get("shape") == "table":
                out[name] = {"shape": "table", "frozen": _rows_with_keys(read_table_part(part), keys), "epoch": epoch}
    lookups = [(k, canonical_key(k[0] if len(k) == 1 else tuple(k))) for k in keys]
    for name, st in rt.ctx.states.items():
        found_keys, found_values = [], []
        for key, at in lookups:
            value = st.get(at, _MISSING)
            if value is not _MISSING:
                found_keys.append(key[0] if len(key) == 1 else tuple(key))
                found_values.append(value)
        out[name] = {"shape": "kv", "keys": found_keys, "values": found_values, "epoch": epoch}
    return out


def _rows_with_keys(table: pa.Table, keys: list[tuple]) -> pa.Table:
    """The rows of a slot table (``key0``, ``key1``... columns) whose key equals one of ``keys``
    (compared by the runtime's 64-bit key hash, the keys cast to the columns' types)."""
    names = [n for n in table.schema.names if n.startswith("key") and n[3:].isdigit()]
    if not names or not keys or table.num_rows == 0:
        return table.slice(0, 0)
    if any(len(k) != len(names) for k in keys):
        raise QueryError(f"query_state: each key has {len(names)} value(s) (the stage's key columns), got {keys[:3]}")
    wanted = []
    for i, name in enumerate(names):
        try:
            wanted.append(pa.array([k[i] for k in keys]).cast(table.schema.field(name).type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
            raise QueryError(f"query_state: key values {[k[i] for k in keys][:3]} are not of the key column's "
                             f"type {table.schema.field(name).type}: {exc}") from None
    mask = np.isin(hash_columns([table[n] for n in names]), hash_columns(wanted))
    return table.filter(pa.array(mask))


def answer_rows(answers: dict[int, dict[str, dict[str, Any]]], key_names: list[str],
                state: str | None = None) -> pa.Table:
    """The hosts' answers (slice -> ``query_slice``'s dict) as one table with a ``state``
    column and an ``epoch`` one (the slice's epoch the values are as of): every state
    (``state=None``) or the one named, each state's rows by slice.

    >>> t = answer_rows({1: {"sums": {"shape": "kv", "keys": ["a"], "values": [3], "epoch": 4}}}, ["user"])
    >>> t.to_pylist()
    [{'slice': 1, 'key': 'a', 'value': 3, 'epoch': 4, 'state': 'sums'}]
    """
    by_state: dict[str, list[pa.Table]] = {}
    kv: dict[str, tuple[list[int], list[Any], list[Any], list[int]]] = {}
    for slice_id in sorted(answers):
        for name, part in answers[slice_id].items():
            if state is not None and name != state:
                continue
            if part["shape"] == "kv":
                slices, ks, vs, epochs = kv.setdefault(name, ([], [], [], []))
                slices += [slice_id] * len(part["keys"])
                epochs += [part["epoch"]] * len(part["keys"])
                ks += part["keys"]
                vs += part["values"]
            else:
                t = table_state_rows(slice_id, part, key_names)
                by_state.setdefault(name, []).append(
                    t.append_column("epoch", pa.array([part["epoch"]] * t.num_rows, pa.int64())))
    tables = []
    for name, (slices, ks, vs, epochs) in kv.items():
        tables.append(pa.table({"slice": pa.array(slices, pa.int32()), "key": typed_column(ks)[0],
                                "value": typed_column(vs)[0], "epoch": pa.array(epochs, pa.int64()),
                                "state": pa.array([name] * len(ks), pa.string())}))
    for name, parts in by_state.items():
        t = pa.concat_tables(parts, promote_options="permissive")
        tables.append(t.append_column("state", pa.array([name] * t.num_rows, pa.string())))
    if not tables:
        return pa.table({"slice": pa.array([], pa.int32()), "state": pa.array([], pa.string())})
    return pa.concat_tables(tables, promote_options="permissive")
