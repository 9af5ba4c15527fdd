"""The stateless steps of the simulator's random queries, each in three forms: on a
``cs.Stream`` (per event or vectorized), on a pandas model of the stream, and on the
generator's column bookkeeping.

Owns: the step kinds (``KeyBy``, ``KeyByFunction``, ``KeepMod``, ``AddColumn``, ``Repeat``,
``IntThenFloat``, ``Select``) and the picklable functions they give the runtime. A model
frame (``chronostream.sim.oracle``) holds a stream's user columns plus ``_o`` (the source
event's global order) and ``_p`` (the lineage path below it: a tuple, one position per
fan-out); a step's ``frame`` keeps them right. Knows no executor.

Column kinds (``Columns``: name -> kind) say what a step may read: ``int`` (int64, never
null), ``float`` (float64, never null), ``num`` (never null, int in some rows and float in
others: the type of the column then differs between epochs), ``key`` (the key ``k``: string
or int, may be null), ``time`` (the event time ``t``), ``other`` (anything else).
"""

from __future__ import annotations

from dataclasses import dataclass
import numpy as np
import pandas as pd
import pyarrow as pa

import chronostream as cs

Columns = dict[str, str]
#: Kinds a step may compute with (non-null numbers).
NUMERIC = ("int", "float", "num")


# --- the functions the runtime runs (module-level classes: picklable) -------------------------


@dataclass(frozen=True)
class ModKey:
    """``event[col] % m``: a key function (``key_by(fn)``)."""

    col: str
    m: int

    def __call__(self, event: dict) -> int:
        return event[self.col] % self.m


@dataclass(frozen=True)
class KeepModEvent:
    """Keep an event unless ``event[col] % m == r``."""

    col: str
    m: int
    r: int

    def __call__(self, event: dict) -> bool:
        return event[self.col] % self.m != self.r


@dataclass(frozen=True)
class KeepModBatch:
    """``KeepModEvent`` over a table: a boolean mask."""

    col: str
    m: int
    r: int

    def __call__(self, table: pa.Table) -> pa.Array:
        return pa.array(np.mod(table.column(self.col).to_numpy(), self.m) != self.r)


@dataclass(frozen=True)
class AddEvent:
    """``{**event, name: a * event[c1] + event[c2]}``."""

    name: str
    a: int
    c1: str
    c2: str

    def __call__(self, event: dict) -> dict:
        return {**event, self.name: self.a * event[self.c1] + event[self.c2]}


@dataclass(frozen=True)
class AddBatch:
    """``AddEvent`` over a table."""

    name: str
    a: int
    c1: str
    c2: str

    def __call__(self, table: pa.Table) -> pa.Table:
        values = self.a * table.column(self.c1).to_numpy() + table.column(self.c2).to_numpy()
        return table.append_column(self.name, pa.array(values.astype(np.int64)))


@dataclass(frozen=True)
class RepeatEvent:
    """``abs(event[col]) % m`` copies of the event, the j-th with ``name: j``."""

    col: str
    m: int
    name: str

    def __call__(self, event: dict) -> list[dict]:
        return [{**event, self.name: j} for j in range(abs(event[self.col]) % self.m)]


@dataclass(frozen=True)
class RepeatBatch:
    """``RepeatEvent`` over a table: (the copies, each copy's parent row)."""

    col: str
    m: int
    name: str

    def __call__(self, table: pa.Table) -> tuple[pa.Table, np.ndarray]:
        counts = np.abs(table.column(self.col).to_numpy()) % self.m
        parent = np.repeat(np.arange(table.num_rows), counts)
        starts = np.repeat(np.cumsum(counts) - counts, counts)
        j = np.arange(len(parent)) - starts
        return table.take(pa.array(parent, pa.int64())).append_column(self.name, pa.array(j.astype(np.int64))), parent


@dataclass(frozen=True)
class IntThenFloatEvent:
    """``name``: ``event[col]`` (an int) in rows with ``i < cut``, ``event[col] + 0.5`` (a float)
    in the others: a column Arrow infers as int64 in early epochs and double in later ones."""

    col: str
    name: str
    cut: int

    def __call__(self, event: dict) -> dict:
        v = event[self.col]
        return {**event, self.name: v if event["i"] < self.cut else v + 0.5}


@dataclass(frozen=True)
class SelectEvent:
    """The event's ``keep`` columns."""

    keep: tuple[str, ...]

    def __call__(self, event: dict) -> dict:
        return {c: event[c] for c in self.keep}


@dataclass(frozen=True)
class SelectBatch:
    """``SelectEvent`` over a table."""

    keep: tuple[str, ...]

    def __call__(self, table: pa.Table) -> pa.Table:
        return table.select(list(self.keep))


# --- the steps ------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyBy:
    """``stream.key_by(cols)``."""

    cols: tuple[str, ...]

    def apply(self, stream: cs.Stream) -> cs.Stream:
        return stream.key_by(list(self.cols) if len(self.cols) > 1 else self.cols[0])

    def frame(self, df: pd.DataFrame) -> pd.DataFrame:
        return df

    def columns(self, cols: Columns) -> Columns:
        return cols

    def tags(self) -> set[str]:
        return {"key_by"} | ({"compound_key"} if len(self.cols) > 1 else set()) | \
            ({"temporal_key"} if "t" in self.cols else set())

    def describe(self) -> str:
        return f"key_by({','.join(self.cols)})"


@dataclass(frozen=True)
class KeyByFunction:
    """``stream.key_by(col % m, name=name)``: keyed by a function, stored in column ``name``."""

    col: str
    m: int
    name: str

    @property
    def cols(self) -> tuple[str, ...]:
        return (self.name,)

    def apply(self, stream: cs.Stream) -> cs.Stream:
        return stream.key_by(ModKey(self.col, self.m), name=self.name)

    def frame(self, df: pd.DataFrame) -> pd.DataFrame:
        return df.assign(**{self.name: df[self.col] % self.m})

    def columns(self, cols: Columns) -> Columns:
        return {**cols, self.name: "int"}

    def tags(self) -> set[str]:
        return {"key_by_fn", "rekey"}

    def describe(self) -> str:
        return f"key_by({self.col}%{self.m})"


@dataclass(frozen=True)
class KeepMod:
    """Keep rows unless ``col % m == r``: ``filter`` or ``filter_batches``."""

    col: str
    m: int
    r: int
    vectorized: bool

    def apply(self, stream: cs.Stream) -> cs.Stream:
        if self.vectorized:
            return stream.filter_batches(KeepModBatch(self.col, self.m, self.r))
        return stream.filter(KeepModEvent(self.col, self.m, self.r))

    def frame(self, df: pd.DataFrame) -> pd.DataFrame:
        return df[df[self.col].astype(np.int64) % self.m != self.r]

    def columns(self, cols: Columns) -> Columns:
        return cols

    def tags(self) -> set[str]:
        return {"filter_batches" if self.vectorized else "filter"}

    def describe(self) -> str:
        return f"{'filter_batches' if self.vectorized else 'filter'}({self.col}%{self.m}!={self.r})"


@dataclass(frozen=True)
class AddColumn:
    """``name = a * c1 + c2`` (ints): ``map`` or ``map_batches``."""

    name: str
    a: int
    c1: str
    c2: str
    vectorized: bool

    def apply(self, stream: cs.Stream) -> cs.Stream:
        if self.vectorized:
            return stream.map_batches(AddBatch(self.name, self.a, self.c1, self.c2))
        return stream.map(AddEvent(self.name, self.a, self.c1, self.c2))

    def frame(self, df: pd.DataFrame) -> pd.DataFrame:
        values = self.a * df[self.c1].astype(np.int64) + df[self.c2].astype(np.int64)
        return df.assign(**{self.name: values.astype(np.int64)})

    def columns(self, cols: Columns) -> Columns:
        return {**cols, self.name: "int"}

    def tags(self) -> set[str]:
        return {"map_batches" if self.vectorized else "map"}

    def describe(self) -> str:
        return f"{'map_batches' if self.vectorized else 'map'}({self.name}={self.a}*{self.c1}+{self.c2})"


@dataclass(frozen=True)
class Repeat:
    """``abs(col) % m`` copies of each row, numbered in ``name``: ``flat_map`` or ``flat_map_batches``."""

    col: str
    m: int
    name: str
    vectorized: bool

    def apply(self, stream: cs.Stream) -> cs.Stream:
        if self.vectorized:
            return stream.flat_map_batches(RepeatBatch(self.col, self.m, self.name))
        return stream.flat_map(RepeatEvent(self.col, self.m, self.name))

    def frame(self, df: pd.DataFrame) -> pd.DataFrame:
        counts = (df[self.col].astype(np.int64).abs() % self.m).to_numpy()
        out = df.iloc[np.repeat(np.arange(len(df)), counts)].copy()
        j = np.arange(len(out)) - np.repeat(np.cumsum(counts) - counts, counts)
        out[self.name] = j.astype(np.int64)
        out["_p"] = [p + (int(x),) for p, x in zip(out["_p"].tolist(), j.tolist())]
        return out.reset_index(drop=True)

    def columns(self, cols: Columns) -> Columns:
        return {**cols, self.name: "int"}

    def tags(self) -> set[str]:
        return {"flat_map_batches" if self.vectorized else "flat_map"}

    def describe(self) -> str:
        return f"{'flat_map_batches' if self.vectorized else 'flat_map'}(|{self.col}|%{self.m} copies)"


@dataclass(frozen=True)
class IntThenFloat:
    """``name``: ``col`` (an int) while ``i < cut``, ``col + 0.5`` after: a per-event ``map``."""

    col: str
    name: str
    cut: int

    def apply(self, stream: cs.Stream) -> cs.Stream:
        return stream.map(IntThenFloatEvent(self.col, self.name, self.cut))

    def frame(self, df: pd.DataFrame) -> pd.DataFrame:
        # As floats: the model compares numbers by value, an int equal to its float.
        v = df[self.col].astype(np.float64).to_numpy()
        return df.assign(**{self.name: np.where(df["i"].to_numpy() < self.cut, v, v + 0.5)})

    def columns(self, cols: Columns) -> Columns:
        return {**cols, self.name: "num"}

    def tags(self) -> set[str]:
        return {"map", "int_to_float"}

    def describe(self) -> str:
        return f"map({self.name}={self.col} then +0.5 from i={self.cut})"


@dataclass(frozen=True)
class Select:
    """Keep columns ``keep``: ``map`` or ``map_batches``."""

    keep: tuple[str, ...]
    vectorized: bool

    def apply(self, stream: cs.Stream) -> cs.Stream:
        if self.vectorized:
            return stream.map_batches(SelectBatch(self.keep))
        return stream.map(SelectEvent(self.keep))

    def frame(self, df: pd.DataFrame) -> pd.DataFrame:
        return df[list(self.keep) + ["_o", "_p"]]

    def columns(self, cols: Columns) -> Columns:
        return {c: cols[c] for c in self.keep}

    def tags(self) -> set[str]:
        return {"map_batches" if self.vectorized else "map"}

    def describe(self) -> str:
        return f"{'map_batches' if self.vectorized else 'map'}(select {','.join(self.keep)})"


Step = KeyBy | KeyByFunction | KeepMod | AddColumn | Repeat | IntThenFloat | Select
