"""The stateful stages of the simulator's random queries, each on a ``cs.Query`` and on the
pandas models of its inputs.

Owns: the stage kinds (``Aggregate``, ``Window``, ``Join``, ``Custom`` over one input,
``Enrich`` over two), how each adds itself to a query, its output's columns for the
generator (``chronostream.sim.transforms.Columns``), its output's model (``Model``) and the
expected frame of a sink reading its output directly, at the level its operator defines
(``chronostream.sim.oracle``: the last value per key of a running aggregate, every row of a
sliding window, every window's final aggregates, every pair of a join). Knows no executor.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, Mapping

import pandas as pd

import chronostream as cs
from chronostream.sim import operators, oracle
from chronostream.sim.transforms import Columns


@dataclass(frozen=True)
class Lineage:
    """What the lineage columns of a stream's model are worth."""

    ordered: bool  # (_o, _p) order the rows as the runtime consumes them (per key)
    orders_known: bool  # _o is each row's _order


@dataclass(frozen=True)
class Model:
    """A stream's model frame (``oracle``) and what its lineage columns are worth."""

    frame: pd.DataFrame
    lineage: Lineage

    @property
    def rows(self) -> int:
        return len(self.frame)


def stage_model(stage: "Stage", inputs: Mapping[str, Model]) -> Model | None:
    """The model of a stage's output from its inputs' (None when the stage's oracle cannot
    model them: ``lineage`` says when)."""
    lineage = stage.lineage({n: m.lineage for n, m in inputs.items()})
    return None if lineage is None else Model(stage.frame(inputs), lineage)


def _running(lineage: Lineage) -> Lineage | None:
    """A running operator's output lineage (each row's the input row's, or extended from it):
    modelled only over an input in the order the runtime consumes it."""
    return lineage if lineage.ordered else None


def _kind_of_result(kind: str) -> str:
    return kind if kind in ("int", "float", "num") else "other"


@dataclass(frozen=True)
class Aggregate:
    """``key_by(key).aggregate(...)``, or one of its shortcuts (``count()``, ``sum(c)``...)
    when ``shortcut`` and a single aggregate."""

    key: tuple[str, ...]
    specs: tuple[tuple[str, str | None], ...]
    shortcut: bool

    def build(self, inputs: Mapping[str, cs.Stream], slices: int, name: str) -> cs.Stream:
        s = inputs["in"]
        if self.shortcut:
            agg, col = self.specs[0]
            return s.count(slices=slices, name=name) if agg == "count" else \
                getattr(s, agg)(col, slices=slices, name=name)
        kw: dict[str, Any] = {"count": any(a == "count" for a, _ in self.specs)}
        for agg in ("sum", "min", "max", "mean"):
            kw[agg] = [c for a, c in self.specs if a == agg]
        return s.aggregate(**kw, slices=slices, name=name)

    def columns(self, inputs: Mapping[str, Columns]) -> Columns:
        cols = inputs["in"]
        out = {c: cols[c] for c in self.key}
        for agg, col in self.specs:
            if agg == "count":
                out["count"] = "int"
            else:
                out[f"{agg}_{col}"] = "float" if agg == "mean" else _kind_of_result(cols[col])  # type: ignore[index]
        return out

    def lineage(self, inputs: Mapping[str, Lineage]) -> Lineage | None:
        return _running(inputs["in"])

    def frame(self, inputs: Mapping[str, Model]) -> pd.DataFrame:
        return oracle.running_aggregate(inputs["in"].frame, self.key, self.specs)

    def expected(self, inputs: Mapping[str, Model], out: Model) -> pd.DataFrame:
        return oracle.last_per_key(out.frame, self.key, inputs["in"].rows)

    def tags(self) -> set[str]:
        return {"aggregate"} | {a for a, _ in self.specs} | ({"shortcut"} if self.shortcut else set())

    def describe(self) -> str:
        aggs = ",".join(a if c is None else f"{a}({c})" for a, c in self.specs)
        return f"{'' if self.shortcut else 'aggregate:'}{aggs}"


@dataclass(frozen=True)
class WindowShape:
    """One window of a ``Window`` stage: ``kind`` ``sliding``/``count``/``tumbling``/``hopping``;
    sizes in the time column's units (seconds for a timestamp column: made timedeltas)."""

    kind: str
    size: int
    hop: int = 0
    offset: int = 0
    time: str | None = None
    emit: str = "event"
    clock: str = "key"
    name: str | None = None

    def spec(self, temporal: bool) -> Any:
        span = (lambda s: dt.timedelta(seconds=s)) if temporal and self.time else (lambda s: s)
        if self.kind == "sliding":
            return cs.SlidingWindow(span(self.size), time=self.time, name=self.name)  # type: ignore[arg-type]
        if self.kind == "count":
            return cs.CountWindow(self.size, name=self.name)
        if self.kind == "tumbling":
            return cs.TumblingWindow(span(self.size), time=self.time, offset=span(self.offset), emit=self.emit,
                                     clock=self.clock)
        return cs.HoppingWindow(span(self.size), span(self.hop), time=self.time, offset=span(self.offset),
                                emit=self.emit, clock=self.clock)

    def units(self, temporal: bool) -> int:
        """Microseconds per size unit in the model (a timestamp's times are microseconds)."""
        return 1_000_000 if temporal and self.time else 1

    def describe(self) -> str:
        if self.kind in ("sliding", "count"):
            return f"{self.kind}({self.size}{'' if self.name is None else ' ' + self.name})"
        hop = f"/{self.hop}" if self.kind == "hopping" else ""
        return (f"{self.kind}({self.size}{hop}+{self.offset} over {self.time or 'counts'}, emit={self.emit}"
                f"{', clock=slice' if self.clock == 'slice' else ''})")


@dataclass(frozen=True)
class Window:
    """``key_by(key).window(windows, count=..., sum=..., ...)``: several sliding/count windows,
    or one tumbling or hopping window."""

    key: tuple[str, ...]
    windows: tuple[WindowShape, ...]
    specs: tuple[tuple[str, str | None], ...]
    temporal: bool  # the time column holds timestamps

    @property
    def hopping(self) -> bool:
        return self.windows[0].kind in ("tumbling", "hopping")

    def build(self, inputs: Mapping[str, cs.Stream], slices: int, name: str) -> cs.Stream:
        kw: dict[str, Any] = {"count": any(a == "count" for a, _ in self.specs)}
        for agg in ("sum", "mean", "min", "max", "distinct"):
            kw[agg] = [c for a, c in self.specs if a == agg]
        specs = [w.spec(self.temporal) for w in self.windows]
        return inputs["in"].window(specs if len(specs) > 1 else specs[0], **kw, slices=slices, name=name)

    def _time(self) -> str | None:
        return next((w.time for w in self.windows if w.time is not None), None)

    def columns(self, inputs: Mapping[str, Columns]) -> Columns:
        cols = inputs["in"]
        out = {c: cols[c] for c in self.key}
        time = self._time()
        if time is not None and not (self.hopping and self.windows[0].emit == "close"):
            out[time] = cols[time]
        if self.hopping:
            bound = "int" if not self.temporal or time is None else "other"
            out["window_start"] = out["window_end"] = bound
        suffixes = [f"_{w.name}" if len(self.windows) > 1 else "" for w in self.windows]
        for suffix in suffixes:
            for agg, col in self.specs:
                kind = "int" if agg in ("count", "distinct") else "float" if agg == "mean" else \
                    _kind_of_result(cols[col])  # type: ignore[index]
                out[(agg if agg == "count" else f"{agg}_{col}") + suffix] = kind
        return out

    def keeps_time_order(self) -> bool:
        """Whether the output's time column (when it has one) stays in time order."""
        return not (self.hopping and self.windows[0].emit == "close")

    def lineage(self, inputs: Mapping[str, Lineage]) -> Lineage | None:
        running = _running(inputs["in"])
        if running is not None and not self.keeps_time_order():
            return Lineage(False, False)  # a closed window's lineage: the event that closed it, or the end
        return running

    def frame(self, inputs: Mapping[str, Model]) -> pd.DataFrame:
        f = inputs["in"].frame
        if not self.hopping:
            shapes = [("count" if w.kind == "count" else "time", w.size * w.units(self.temporal),
                       f"_{w.name}" if len(self.windows) > 1 else "") for w in self.windows]
            return oracle.sliding_windows(f, self.key, shapes, self.specs, self._time())
        w = self.windows[0]
        u = w.units(self.temporal)
        hop = w.size if w.kind == "tumbling" else w.hop
        return oracle.hopping_windows(f, self.key, w.size * u, hop * u, w.offset * u, w.time, self.specs, w.emit)

    def expected(self, inputs: Mapping[str, Model], out: Model) -> pd.DataFrame:
        if not self.hopping:
            return oracle.every_row(out.frame, with_order=out.lineage.orders_known)
        if self.windows[0].emit == "close":
            return oracle.every_row(out.frame, with_order=False)
        return oracle.last_per_key(out.frame, list(self.key) + ["window_start"], out.rows)

    def tags(self) -> set[str]:
        out = {"window", *(f"window_{a}" for a, _ in self.specs)}
        for w in self.windows:
            out.add(f"window_{w.kind}")
            if w.emit == "close":
                out.add("window_close")
            if w.clock == "slice":
                out.add("window_slice_clock")
        if len(self.windows) > 1:
            out.add("window_multi")
        return out

    def describe(self) -> str:
        aggs = ",".join(a if c is None else f"{a}({c})" for a, c in self.specs)
        return f"window:{'+'.join(w.describe() for w in self.windows)}:{aggs}"


@dataclass(frozen=True)
class Join:
    """``cs.join(left, right)`` of two keyed streams (its inputs ``left`` and ``right``)."""

    left_key: tuple[str, ...]
    right_key: tuple[str, ...]

    def build(self, inputs: Mapping[str, cs.Stream], slices: int, name: str) -> cs.Stream:
        return cs.join(inputs["left"], inputs["right"], slices=slices, name=name)

    def columns(self, inputs: Mapping[str, Columns]) -> Columns:
        left, right = inputs["left"], inputs["right"]
        out = dict(left)
        for c, kind in right.items():
            name = c
            while name in out:
                name = "right_" + name
            out[name] = kind
        return out

    def lineage(self, inputs: Mapping[str, Lineage]) -> Lineage:
        # A pair's lineage is the later row's (its _order known), its sub-order the model's guess.
        return Lineage(False, inputs["left"].orders_known and inputs["right"].orders_known)

    def frame(self, inputs: Mapping[str, Model]) -> pd.DataFrame:
        return oracle.join(inputs["left"].frame, inputs["right"].frame, self.left_key, self.right_key)

    def expected(self, inputs: Mapping[str, Model], out: Model) -> pd.DataFrame:
        return oracle.every_row(out.frame, with_order=out.lineage.orders_known)

    def tags(self) -> set[str]:
        return {"join"}

    def describe(self) -> str:
        return f"join({','.join(self.left_key)}={','.join(self.right_key)})"


#: The simulator's one-input operators: name -> (class, feature tag).
CUSTOM = {
    "running_total": (operators.RunningTotal, "op_value_state"),
    "recent_list": (operators.RecentList, "op_list_state"),
    "moving_sum": (operators.MovingSum, "op_queue_state"),
    "value_counts": (operators.ValueCounts, "op_map_state"),
    "top_items": (operators.TopItems, "op_topk_state"),
    "end_totals": (operators.EndTotals, "op_end_hook"),
    "batch_count": (operators.BatchCount, "op_vectorized"),
}


@dataclass(frozen=True)
class Custom:
    """``stream.apply(op, key, col, carry, **options)`` of one of ``CUSTOM``."""

    op: str
    key: tuple[str, ...]
    col: str
    carry: tuple[str, ...]
    options: tuple[tuple[str, Any], ...] = ()

    def build(self, inputs: Mapping[str, cs.Stream], slices: int, name: str) -> cs.Stream:
        cls = CUSTOM[self.op][0]
        out = inputs["in"].apply(cls, list(self.key), self.col, list(self.carry), **dict(self.options),
                                 slices=slices, name=name)
        return out  # type: ignore[return-value]

    def _carried(self) -> list[str]:
        return [c for c in self.carry if c not in self.key]

    def columns(self, inputs: Mapping[str, Columns]) -> Columns:
        cols = inputs["in"]
        out = {c: cols[c] for c in self.key}
        if self.op == "end_totals":
            return {**out, "n": "int", "total": "int"}
        out.update({c: cols[c] for c in self._carried()})
        added = {"running_total": {"n": "int", "total": "int"}, "recent_list": {"size": "int", "last3": "other"},
                 "moving_sum": {"qsum": _kind_of_result(cols[self.col]), "qlen": "int"},
                 "value_counts": {self.col: cols[self.col], "seen": "int", "distinct": "int"},
                 "top_items": {"top": "other"}, "batch_count": {"seen": "int"}}[self.op]
        return {**out, **added}

    def lineage(self, inputs: Mapping[str, Lineage]) -> Lineage | None:
        running = _running(inputs["in"])
        if running is not None and self.op == "end_totals":
            # The end's lineage: each slice numbers its rows from 0, so a later stage takes them
            # in an order the hash of their keys decides.
            return Lineage(False, False)
        return running

    def frame(self, inputs: Mapping[str, Model]) -> pd.DataFrame:
        f, key, carry, options = inputs["in"].frame, self.key, self._carried(), dict(self.options)
        if self.op == "end_totals":
            return oracle.end_totals(f, key, self.col)
        return {"running_total": lambda: oracle.running_total(f, key, self.col, carry),
                 "recent_list": lambda: oracle.recent_list(f, key, self.col, carry),
                 "moving_sum": lambda: oracle.moving_sum(f, key, self.col, carry, options["width"]),
                 "value_counts": lambda: oracle.value_counts(f, key, self.col, carry),
                 "top_items": lambda: oracle.top_items(f, key, self.col, carry, options["item"], options["k"]),
                 "batch_count": lambda: oracle.batch_count(f, key, carry)}[self.op]()

    def expected(self, inputs: Mapping[str, Model], out: Model) -> pd.DataFrame:
        if self.op == "running_total":
            return oracle.last_per_key(out.frame, self.key, inputs["in"].rows)
        return oracle.every_row(out.frame, with_order=out.lineage.orders_known)

    def tags(self) -> set[str]:
        return {"custom", CUSTOM[self.op][1]}

    def describe(self) -> str:
        opts = "".join(f",{k}={v}" for k, v in self.options)
        return f"{CUSTOM[self.op][0].__name__}({self.col}{opts})"


@dataclass(frozen=True)
class Enrich:
    """``q.operator(Enrich, {"facts": ..., "dims": ...})``: two inputs keyed alike."""

    fact_key: tuple[str, ...]
    dim_key: tuple[str, ...]
    col: str
    value: str
    carry: tuple[str, ...]
    disjoint: bool  # the inputs never share a source event (else the model does not order them)

    def build(self, inputs: Mapping[str, cs.Stream], slices: int, name: str) -> cs.Stream:
        facts, dims = inputs["facts"], inputs["dims"]
        out = facts.query.operator(operators.Enrich, {"facts": facts, "dims": dims}, list(self.fact_key),
                                   list(self.dim_key), self.col, self.value, list(self.carry), slices=slices, name=name)
        return out  # type: ignore[return-value]

    def _carried(self) -> list[str]:
        return [c for c in self.carry if c not in self.fact_key and c != self.value]

    def columns(self, inputs: Mapping[str, Columns]) -> Columns:
        facts = inputs["facts"]
        out = {c: facts[c] for c in [*self.fact_key, self.value, *self._carried()]}
        return {**out, "dim": "other"}

    def lineage(self, inputs: Mapping[str, Lineage]) -> Lineage | None:
        facts, dims = inputs["facts"], inputs["dims"]
        if not (self.disjoint and facts.ordered and dims.ordered and facts.orders_known and dims.orders_known):
            return None
        return Lineage(True, True)

    def frame(self, inputs: Mapping[str, Model]) -> pd.DataFrame:
        return oracle.enrich(inputs["facts"].frame, inputs["dims"].frame, self.fact_key, self.dim_key, self.col,
                             self.value, self._carried())

    def expected(self, inputs: Mapping[str, Model], out: Model) -> pd.DataFrame:
        return oracle.every_row(out.frame, with_order=True)

    def tags(self) -> set[str]:
        return {"custom", "op_two_inputs", "op_value_state"}

    def describe(self) -> str:
        return f"Enrich(dim={self.col}, value={self.value})"


Stage = Aggregate | Window | Join | Custom | Enrich
