"""The user operators of the simulator's random queries: one per kind of state the state
library offers, a vectorized one, one with an end-of-input hook and one with two inputs.

Owns: ``RunningTotal`` (``register_value``), ``RecentList`` (``register_list``),
``MovingSum`` (``register_queue``), ``ValueCounts`` (``register_map``), ``TopItems``
(``register_topk``), ``EndTotals`` (``register_state`` and ``on_end``), ``BatchCount``
(``consume_batch`` over ``register_value``) and ``Enrich`` (inputs ``facts`` and ``dims``).
Each takes its key columns, the column it reads and the columns it carries to its output
(``carry``: the event time, so a window can follow it), and keys its state by the tuple of
the key columns' values. They follow the operator rules (``cs.Operator``): state only in
registered state, no clock, ``consume_batch`` row-wise, ``on_end`` in a fixed key order.
"""

from __future__ import annotations

from typing import Any, Sequence

import pyarrow as pa

import chronostream as cs
from chronostream.slices.types import ORDER, SUB


class _Keyed(cs.Operator):
    """Shared by the operators: the key columns, the column read, the columns carried."""

    def __init__(self, key: Sequence[str], col: str, carry: Sequence[str] = ()) -> None:
        self.key = list(key)
        self.col = col
        self.carry = [c for c in carry if c not in self.key]

    def _key(self, event: dict) -> tuple:
        return tuple(event[c] for c in self.key)

    def _row(self, event: dict) -> dict:
        return {c: event[c] for c in self.key + self.carry}


class RunningTotal(_Keyed):
    """Per key, a running count and total of an int column (a value state): one row per event,
    ``n`` and ``total`` after it."""

    def setup(self) -> None:
        self.acc = self.register_value("acc")

    def consume(self, stream_id: str, event: dict) -> None:
        key = self._key(event)
        n, total = self.acc.get(key, (0, 0))
        n, total = n + 1, total + event[self.col]
        self.acc.set(key, [n, total])
        self.produce_update("out", {**self._row(event), "n": n, "total": total})


class RecentList(_Keyed):
    """Per key, every value so far in a list state: one row per event, the list's ``size`` and
    its ``last3`` items (a list column)."""

    def setup(self) -> None:
        self.values = self.register_list("values")

    def consume(self, stream_id: str, event: dict) -> None:
        key = self._key(event)
        self.values.append(key, event[self.col])
        size = self.values.len(key)
        last = [self.values.get(key, i) for i in range(-min(3, size), 0)]
        self.produce_update("out", {**self._row(event), "size": size, "last3": last})


class MovingSum(_Keyed):
    """Per key, the last ``width`` values in a queue state: one row per event, their sum
    ``qsum`` and how many there are, ``qlen``."""

    def __init__(self, key: Sequence[str], col: str, carry: Sequence[str] = (), width: int = 4) -> None:
        super().__init__(key, col, carry)
        self.width = width

    def setup(self) -> None:
        self.window = self.register_queue("window")

    def consume(self, stream_id: str, event: dict) -> None:
        key = self._key(event)
        self.window.append(key, event[self.col])
        while self.window.len(key) > self.width:
            self.window.popleft(key)
        items = list(self.window.items(key))
        self.produce_update("out", {**self._row(event), "qsum": sum(items), "qlen": len(items)})


class ValueCounts(_Keyed):
    """Per key, a map from value to how often it came (a map state): one row per event, the
    event's value, ``seen`` (its count so far) and ``distinct`` (the map's size)."""

    def setup(self) -> None:
        self.counts = self.register_map("counts")

    def consume(self, stream_id: str, event: dict) -> None:
        key = self._key(event)
        seen = self.counts.increment(key, event[self.col], 1)
        self.produce_update("out", {**self._row(event), self.col: event[self.col], "seen": seen,
                                    "distinct": self.counts.len(key)})


class TopItems(_Keyed):
    """Per key, the ``k`` largest values of ``col`` (a top-k state; ties: the earlier one),
    each offered with the event's ``item`` column: one row per event, ``top`` the items best
    first (a list column)."""

    def __init__(self, key: Sequence[str], col: str, carry: Sequence[str] = (), item: str = "i",
                 k: int = 3) -> None:
        super().__init__(key, col, carry)
        self.item = item
        self.k = k

    def setup(self) -> None:
        self.top = self.register_topk("top", self.k)

    def consume(self, stream_id: str, event: dict) -> None:
        key = self._key(event)
        self.top.offer(key, event[self.col], event[self.item])
        self.produce_update("out", {**self._row(event), "top": [item for _, item in self.top.items(key)]})


class EndTotals(_Keyed):
    """Per key, a count and total of an int column (a key-value state), emitted once at the end
    of the input (``on_end``): one row per key, keys in the order of their ``repr``."""

    def setup(self) -> None:
        self.acc = self.register_state("acc")

    def consume(self, stream_id: str, event: dict) -> None:
        key = self._key(event)
        n, total = self.acc.get(key, (0, 0))
        self.acc.set(key, [n + 1, total + event[self.col]])

    def on_end(self) -> None:
        for key, (n, total) in sorted(self.acc.items(), key=lambda kv: repr(tuple(kv[0]))):
            self.produce("out", {**dict(zip(self.key, key)), "n": n, "total": total})


class BatchCount(_Keyed):
    """Per key, a running count (a value state), vectorized: each batch's rows in order, one
    output row per input row keeping its lineage, ``seen`` the key's count after it."""

    def setup(self) -> None:
        self.seen = self.register_value("seen")

    def consume_batch(self, stream_id: str, batch: pa.Table) -> None:
        keys = list(zip(*(batch.column(c).to_pylist() for c in self.key)))
        now: dict[Any, int] = {}
        seen = []
        for key in keys:
            n = (now[key] if key in now else self.seen.get(key, 0)) + 1
            now[key] = n
            seen.append(n)
        for key, n in now.items():
            self.seen.set(key, n)
        out = batch.select(self.key + self.carry + [ORDER, SUB])
        self.produce_batch("out", out.append_column("seen", pa.array(seen, pa.int64())))


class Enrich(cs.Operator):
    """Two inputs keyed alike: ``dims`` events set their key's latest ``col`` value (a value
    state) and emit nothing; each ``facts`` event emits itself (its key columns, ``value`` and
    the carried columns) with that latest value as ``dim`` (null before the first)."""

    def __init__(self, fact_key: Sequence[str], dim_key: Sequence[str], col: str, value: str,
                 carry: Sequence[str] = ()) -> None:
        self.fact_key = list(fact_key)
        self.dim_key = list(dim_key)
        self.col = col
        self.value = value
        self.carry = [c for c in carry if c not in self.fact_key and c != value]

    def setup(self) -> None:
        self.latest = self.register_value("latest")

    def consume(self, stream_id: str, event: dict) -> None:
        if stream_id == "dims":
            self.latest.set(tuple(event[c] for c in self.dim_key), event[self.col])
            return
        key = tuple(event[c] for c in self.fact_key)
        row = {c: event[c] for c in self.fact_key + [self.value] + self.carry}
        self.produce_update("out", {**row, "dim": self.latest.get(key)})
