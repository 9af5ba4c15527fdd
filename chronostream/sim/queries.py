"""Seeded random queries for the simulator, and the check of a run's outputs.

Owns: ``random_query(seed)``, a random DAG of the public operators over seeded data
(``RandomQuery``: a builder of identical fresh ``cs.Query`` objects, a one-line description,
feature tags and, per memory sink, the independent pandas oracle), and ``check_outputs``
(a run's sinks against the serial executor's, the exactly-once identities, the oracle).
Must not touch the runtime's internals: a query is built from the public API only, and
the oracle (``chronostream.sim.oracle``) imports nothing of chronostream.

A query has 1-3 in-memory sources of 40-600 rows (``chronostream.sim.data``), ordered by
event time or by position, small epochs (17-400 events) and 1-8 slices per stage; 1-4
stateful stages, each reading a stream drawn from the sources and the earlier stages'
outputs (a chain, a re-keying, a fan-out of one stream into two stages), through 0-2 stateless
steps (``chronostream.sim.transforms``) and a ``key_by``: a running aggregate, a window of any
kind, a join, one of the simulator's operators over the state library or its two-input one
(``chronostream.sim.stages``). Every stage output no later stage reads has a memory sink;
some intermediate streams have one too.

>>> rq = random_query(7)
>>> rq.description == random_query(7).description, rq.build() is not rq.build()
(True, True)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import pandas as pd
import pyarrow as pa

import chronostream as cs
from chronostream.chaos import compare_tables
from chronostream.sim import oracle
from chronostream.sim.data import DataShape, draw_shape, draw_table
from chronostream.sim.stages import (CUSTOM, Aggregate, Custom, Enrich, Join, Lineage, Model, Stage, Window,
                                     WindowShape, stage_model)
from chronostream.sim.transforms import (NUMERIC, AddColumn, Columns, IntThenFloat, KeepMod, KeyBy, KeyByFunction,
                                         Repeat, Select, Step)

#: Pairs a join may emit at most: a hot key on both sides would emit millions.
MAX_JOIN_ROWS = 20_000
#: Kinds of the columns every source table has (``chronostream.sim.data``).
SOURCE_KINDS: Columns = {"i": "int", "t": "time", "k": "key", "g": "int", "v": "int", "x": "float"}
#: Columns a ``Select`` always keeps: what the stages read.
KEPT = ("i", "t", "k", "g", "v", "x")


# --- the query's nodes ---------------------------------------------------------------------


@dataclass(frozen=True)
class SourceNode:
    """``q.source(name, table, order_by=..., slices=...)``."""

    name: str
    table: pa.Table
    order_by: str | None
    slices: int

    def build(self, q: cs.Query, streams: list) -> cs.Stream:
        return q.source(self.name, self.table, order_by=self.order_by, slices=self.slices)


@dataclass(frozen=True)
class DeriveNode:
    """A stateless step applied to stream ``parent``."""

    parent: int
    step: Step

    def build(self, q: cs.Query, streams: list) -> cs.Stream:
        return self.step.apply(streams[self.parent])


@dataclass(frozen=True)
class StageNode:
    """A stateful stage reading ``inputs`` (input name, stream node)."""

    stage: Stage
    inputs: tuple[tuple[str, int], ...]
    slices: int
    name: str

    def build(self, q: cs.Query, streams: list) -> cs.Stream:
        return self.stage.build({n: streams[i] for n, i in self.inputs}, self.slices, self.name)


@dataclass(frozen=True)
class SinkNode:
    """A memory sink ``name`` on stream ``stream``."""

    name: str
    stream: int

    def build(self, q: cs.Query, streams: list) -> None:
        streams[self.stream].sink(name=self.name)


Node = SourceNode | DeriveNode | StageNode | SinkNode


@dataclass(frozen=True)
class QuerySpec:
    """A random query as data: its epoch size and its nodes, each reading earlier ones."""

    epoch_events: int
    nodes: tuple[Node, ...]

    def build(self) -> cs.Query:
        """A new ``cs.Query`` of these nodes (a stream read twice is one ``Stream`` object)."""
        q = cs.Query(epoch_events=self.epoch_events)
        streams: list = []
        for node in self.nodes:
            streams.append(node.build(q, streams))
        return q


@dataclass(frozen=True)
class RandomQuery:
    """One seed's query: ``build()`` returns a new, identical ``cs.Query`` each call (a run
    consumes one); ``pandas_expected[sink]`` computes the oracle's expected frame
    (``chronostream.sim.oracle``), None where no oracle is written for that sink."""

    seed: int
    spec: QuerySpec
    description: str
    sinks: tuple[str, ...]
    pandas_expected: Mapping[str, Callable[[], pd.DataFrame] | None]
    features: frozenset[str]

    def build(self) -> cs.Query:
        return self.spec.build()


# --- drawing -----------------------------------------------------------------------------------


@dataclass
class _Stream:
    """What the generator knows of a stream node."""

    cols: Columns
    key: tuple[str, ...] | None
    sources: frozenset[int]
    time_ordered: bool  # its ``t`` does not decrease in the order a stage consumes it
    repeated: bool  # a flat map is upstream (one per lineage bounds the fan-out)
    after_stage: bool  # derives from a stage's output
    # Steps upstream that may give one input row several output rows, each a lineage level
    # (``chronostream.extend_sub_order``): flat maps and stages other than running aggregates.
    levels: int = 0


#: Lineage levels a row may pass (``chronostream.extend_sub_order`` numbers 3 of 20 bits each).
LINEAGE_LEVELS = 3


@dataclass
class _Draw:
    """The state of one query being drawn."""

    seed: int
    rng: np.random.Generator
    shape: DataShape
    order_by: str | None
    nodes: list = field(default_factory=list)
    streams: dict[int, _Stream] = field(default_factory=dict)
    features: set[str] = field(default_factory=set)
    used: set[int] = field(default_factory=set)
    stage_inputs: list[int] = field(default_factory=list)  # keyed streams a stage reads
    models: dict[int, Model | None] = field(default_factory=dict)
    frames: list[pd.DataFrame] = field(default_factory=list)

    # -- helpers

    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def pick(self, seq: Any) -> Any:
        seq = list(seq)
        return seq[int(self.rng.integers(len(seq)))]

    def some(self, seq: Any, n: int) -> list:
        """Up to ``n`` items drawn from ``seq`` (with replacement, repeats dropped), in draw order:
        a list, never a set, whose order would follow the process's string hashing."""
        seq = list(seq)
        return list(dict.fromkeys(self.pick(seq) for _ in range(n))) if seq else []

    def fresh(self, prefix: str) -> str:
        return f"{prefix}{len(self.nodes)}"

    def add(self, node: Node, info: _Stream | None) -> int:
        self.nodes.append(node)
        nid = len(self.nodes) - 1
        if info is not None:
            self.streams[nid] = info
        for parent in _parents(node):
            self.used.add(parent)
        return nid

    def rollback(self, size: int, features: set[str], stage_inputs: list[int]) -> None:
        """Forget the nodes from ``size`` on (an attempt that did not fit) and what they added
        to the features and the stage inputs."""
        self.features, self.stage_inputs = features, stage_inputs
        for nid in range(size, len(self.nodes)):
            self.streams.pop(nid, None)
            self.models.pop(nid, None)
        del self.nodes[size:]
        self.used = {p for node in self.nodes for p in _parents(node)}

    def stage_outputs(self) -> list[int]:
        return [i for i, n in enumerate(self.nodes) if isinstance(n, StageNode)]

    def sources(self) -> list[int]:
        return [i for i, n in enumerate(self.nodes) if isinstance(n, SourceNode)]

    # -- models

    def lineage(self, nid: int) -> Lineage | None:
        """What the model of stream ``nid`` would be worth; None: the oracle has no model of it."""
        node = self.nodes[nid]
        if isinstance(node, SourceNode):
            return Lineage(True, True)
        if isinstance(node, DeriveNode):
            return self.lineage(node.parent)
        inputs = {n: self.lineage(i) for n, i in node.inputs}
        if any(x is None for x in inputs.values()):
            return None
        return node.stage.lineage(inputs)  # type: ignore[arg-type]

    def model(self, nid: int) -> Model | None:
        """The oracle's model of stream ``nid`` (computed once), or None."""
        if nid not in self.models:
            node = self.nodes[nid]
            if self.lineage(nid) is None:
                self.models[nid] = None
            elif isinstance(node, SourceNode):
                if not self.frames:
                    tables = [self.nodes[i].table for i in self.sources()]
                    self.frames = oracle.source_frames(tables, self.order_by)
                self.models[nid] = Model(self.frames[self.sources().index(nid)], Lineage(True, True))
            elif isinstance(node, DeriveNode):
                parent = self.model(node.parent)
                self.models[nid] = Model(node.step.frame(parent.frame), parent.lineage)  # type: ignore[union-attr]
            else:
                inputs = {n: self.model(i) for n, i in node.inputs}
                self.models[nid] = stage_model(node.stage, inputs)  # type: ignore[arg-type]
        return self.models[nid]

    def expected(self, nid: int) -> pd.DataFrame | None:
        """The expected frame of a sink on stream ``nid``: the stage's own level when the
        stream is a stage's output, every row of the stream's model otherwise."""
        out = self.model(nid)
        if out is None:
            return None
        node = self.nodes[nid]
        if isinstance(node, StageNode):
            inputs = {n: self.model(i) for n, i in node.inputs}
            return node.stage.expected(inputs, out)  # type: ignore[arg-type]
        return oracle.every_row(out.frame, with_order=out.lineage.orders_known)

    # -- stateless steps

    def derive(self, nid: int, step: Step) -> int:
        info = self.streams[nid]
        keyed = isinstance(step, (KeyBy, KeyByFunction))
        key = step.cols if keyed else info.key if isinstance(step, KeepMod) else None  # type: ignore[union-attr]
        new = _Stream(step.columns(info.cols), key, info.sources, info.time_ordered,
                      info.repeated or isinstance(step, Repeat), info.after_stage,
                      info.levels + isinstance(step, Repeat))
        self.features |= step.tags()
        return self.add(DeriveNode(nid, step), new)

    def random_steps(self, nid: int, most: int) -> int:
        for _ in range(int(self.rng.integers(0, most + 1))):
            info = self.streams[nid]
            ints = [c for c, k in info.cols.items() if k == "int"]
            options = ["keep", "add"] if ints else []
            if ints and not info.repeated:
                options.append("repeat")
            if info.cols.get("i") == "int" and info.cols.get("v") == "int":
                options.append("int_then_float")
            droppable = [c for c in info.cols if c not in KEPT]
            if droppable:
                options.append("select")
            if not options:
                break
            kind = self.pick(options)
            vec = self.chance(0.5)
            if kind == "keep":
                m = int(self.rng.integers(2, 6))
                step: Step = KeepMod(self.pick(ints), m, int(self.rng.integers(0, m)), vec)
            elif kind == "add":
                step = AddColumn(self.fresh("w"), int(self.rng.integers(1, 4)), self.pick(ints), self.pick(ints), vec)
            elif kind == "repeat":
                step = Repeat(self.pick(ints), int(self.rng.integers(2, 5)), self.fresh("j"), vec)
            elif kind == "int_then_float":
                step = IntThenFloat("v", self.fresh("m"), int(self.rng.integers(0, 1500)))
            else:
                drop = self.some(droppable, 2)
                step = Select(tuple(c for c in info.cols if c not in drop), vec)
            nid = self.derive(nid, step)
        return nid

    def keyed(self, nid: int, avoid: set[str]) -> int | None:
        """``nid`` keyed by a random key whose columns are not in ``avoid`` (None: none fits)."""
        info = self.streams[nid]
        keys = [c for c, k in info.cols.items() if k == "key" and c not in avoid]
        ints = [c for c, k in info.cols.items() if k == "int" and c not in avoid]
        r = self.rng.random()
        if info.cols.get("t") == "time" and "t" not in avoid and r < 0.04:
            step: Step = KeyBy(("t",))
        elif keys and r < 0.5:
            step = KeyBy((keys[0],))
        elif keys and "g" in ints and r < 0.65:
            step = KeyBy((keys[0], "g"))
        elif ints and r < 0.85:
            name = self.fresh("b")
            if name in avoid:
                return None
            step = KeyByFunction(self.pick(ints), int(self.rng.integers(2, 13)), name)
        elif ints:
            step = KeyBy((self.pick(ints),))
        elif keys:
            step = KeyBy((keys[0],))
        else:
            return None
        return self.derive(nid, step)

    # -- stages

    def base(self) -> int:
        """The stream a stage starts from: mostly the latest stage's output (a chain), else any
        source or stage output."""
        outs = self.stage_outputs()
        if outs and self.chance(0.55):
            return outs[-1]
        return self.pick(self.sources() + outs)

    def start(self) -> tuple[int, bool]:
        """Where a one-input stage reads from, and whether it is keyed already: sometimes a keyed
        stream another stage reads (a fan-out: one stream object, two consumers), mostly a base
        stream through 0-2 random steps."""
        if self.stage_inputs and self.chance(0.2):
            return self.pick(self.stage_inputs), True
        return self.random_steps(self.base(), 2), False

    def keyed_input(self, nid: int, shared: bool, avoid: set[str]) -> int | None:
        """``nid`` keyed (``keyed``), or as it is when it is a stage's keyed input already and
        its key avoids ``avoid``."""
        if not shared:
            return self.keyed(nid, avoid)
        if set(self.streams[nid].key or ()) & avoid:
            return None
        self.features.add("fan_out")
        return nid

    def add_stage(self, stage: Stage, inputs: dict[str, int], cols: Columns, time_ordered: bool) -> int:
        infos = [self.streams[i] for i in inputs.values()]
        kind = type(stage).__name__.lower()
        name = f"{kind}{len(self.stage_outputs()) + 1}"
        node = StageNode(stage, tuple(inputs.items()), int(self.rng.integers(1, 9)), name)
        if any(i.after_stage for i in infos):
            self.features.add("chain")
            if any(i.after_stage and i.key is not None for i in infos):
                self.features.add("rekey_chain")
        self.features |= stage.tags()
        if len(inputs) == 1:
            self.stage_inputs.extend(s for s in inputs.values() if s not in self.stage_inputs)
        sources = frozenset().union(*(i.sources for i in infos))
        levels = max(i.levels for i in infos) + (not isinstance(stage, Aggregate))
        return self.add(node, _Stream(cols, None, sources, time_ordered, any(i.repeated for i in infos), True,
                                      levels))

    def numeric(self, cols: Columns, exclude: frozenset[str] = frozenset()) -> list[str]:
        return [c for c, k in cols.items() if k in NUMERIC and c not in exclude]

    def try_aggregate(self) -> bool:
        start, shared = self.start()
        cols = self.streams[start].cols
        specs: list[tuple[str, str | None]] = [("count", None)] if self.chance(0.6) else []
        for c in self.some(self.numeric(cols), 2):
            specs += [(a, c) for a in ("sum", "min", "max", "mean") if self.chance(0.45)]
        specs = specs or [("count", None)]
        if self.chance(0.2):  # one aggregate: the shortcuts (count(), sum(c), ...) get their turn
            specs = [specs[int(self.rng.integers(len(specs)))]]
        values = {c for _, c in specs if c is not None}
        avoid = values | {"count"} | {f"{a}_{c}" for a, c in specs}
        nid = self.keyed_input(start, shared, avoid)
        if nid is None:
            return False
        info = self.streams[nid]
        stage = Aggregate(info.key, tuple(specs), len(specs) == 1 and self.chance(0.6))  # type: ignore[arg-type]
        if any(c == "num" for c in (cols.get(x) for x in values)):
            self.features.add("int_to_float_aggregate")
        self.add_stage(stage, {"in": nid}, stage.columns({"in": info.cols}), False)
        return True

    def window_shapes(self, timed: bool) -> tuple[WindowShape, ...]:
        step = self.shape.time_step
        kinds = ["count", "tumbling_counts", "hopping_counts"] + (["sliding", "tumbling", "hopping", "multi"] * 2
                                                                  if timed else [])
        kind = self.pick(kinds)
        size = int(self.rng.integers(1, 30 * step + 1))
        if kind == "sliding":
            return (WindowShape("sliding", size, time="t"),)
        if kind == "count":
            return (WindowShape("count", int(self.rng.integers(1, 9))),)
        if kind == "multi":
            other = WindowShape("count", int(self.rng.integers(1, 9)), name="c") if self.chance(0.5) else \
                WindowShape("sliding", int(self.rng.integers(1, 30 * step + 1)), time="t", name="b")
            return (WindowShape("sliding", size, time="t", name="a"), other)
        time = "t" if kind in ("tumbling", "hopping") else None
        if time is None:
            size = int(self.rng.integers(1, 9))
        hop = size if kind.startswith("tumbling") else int(self.rng.integers(1, size + 1))
        offset = 0 if self.chance(0.6) else int(self.rng.integers(0, hop))
        emit = "close" if self.chance(0.4) else "event"
        clock = "slice" if emit == "close" and time is not None and self.chance(0.5) else "key"
        return (WindowShape(kind.split("_")[0], size, hop, offset, time, emit, clock),)

    def try_window(self) -> bool:
        start, shared = self.start()
        info = self.streams[start]
        timed = info.cols.get("t") == "time" and info.time_ordered
        windows = self.window_shapes(timed)
        nums = self.numeric(info.cols)
        specs: list[tuple[str, str | None]] = [("count", None)] if self.chance(0.6) else []
        for c in self.some(nums, 2):
            specs += [(a, c) for a in ("sum", "mean", "min", "max", "distinct") if self.chance(0.35)]
        specs = specs or [("count", None)]
        stage = Window((), windows, tuple(specs), self.shape.time_kind == "ts")
        avoid = {c for _, c in specs if c is not None} | set(stage.columns({"in": info.cols})) | {"t"}
        nid = self.keyed_input(start, shared, avoid)
        if nid is None:
            return False
        keyed = self.streams[nid]
        stage = Window(keyed.key, windows, tuple(specs), self.shape.time_kind == "ts")  # type: ignore[arg-type]
        cols = stage.columns({"in": keyed.cols})
        self.add_stage(stage, {"in": nid}, cols, keyed.time_ordered and stage.keeps_time_order())
        return True

    def try_custom(self) -> bool:
        op = self.pick(sorted(CUSTOM))
        start, shared = self.start()
        cols = self.streams[start].cols
        outputs = {"n", "total", "size", "last3", "qsum", "qlen", "seen", "distinct", "top"}
        if op in ("running_total", "end_totals"):
            choices = [c for c, k in cols.items() if k == "int"]
        elif op in ("moving_sum", "top_items"):
            choices = self.numeric(cols)
        elif op == "value_counts":
            choices = [c for c, k in cols.items() if k in ("int", "float", "num", "key", "time")] + \
                [c for c in ("txt", "dec", "ts2", "n") if c in cols]
        else:
            choices = list(cols)
        choices = [c for c in choices if c not in outputs]
        if not choices:
            return False
        col = self.pick(choices)
        options: tuple[tuple[str, Any], ...] = ()
        if op == "moving_sum":
            options = (("width", int(self.rng.integers(2, 7))),)
        elif op == "top_items":
            items = [c for c, k in cols.items() if k == "int"]
            if not items:
                return False
            options = (("item", self.pick(items)), ("k", int(self.rng.integers(1, 5))))
        nid = self.keyed_input(start, shared, outputs | {col})
        if nid is None:
            return False
        info = self.streams[nid]
        payloads = ("dec", "txt", "lst", "st", "ts2", "nul")
        carry = tuple(c for c in info.cols if c not in outputs and c != col and
                      ((c == "t" and self.chance(0.7)) or (c in payloads and self.chance(0.3))))
        stage = Custom(op, info.key, col, carry, options)  # type: ignore[arg-type]
        timed = info.time_ordered and op != "end_totals"
        self.add_stage(stage, {"in": nid}, stage.columns({"in": info.cols}), timed)
        return True

    def try_join(self) -> bool:
        left_start = self.random_steps(self.base(), 1)
        self_join = self.chance(0.3)
        right_start = left_start if self_join else self.random_steps(self.base(), 1)
        lc, rc = self.streams[left_start].cols, self.streams[right_start].cols
        common = [c for c in lc if c in rc and lc[c] == rc[c] and lc[c] in ("key", "int")]
        if not common:
            return False
        key = (self.pick(common),)
        if "g" in common and key != ("g",) and self.chance(0.3):
            key = key + ("g",)
        left = self.derive(left_start, KeyBy(key))
        right = left if self_join else self.derive(right_start, KeyBy(key))
        lm, rm = self.model(left), self.model(right)
        if lm is None or rm is None:
            return False
        lk, rk = Counter(oracle.key_tuples(lm.frame, key)), Counter(oracle.key_tuples(rm.frame, key))
        if sum(n * rk[k] for k, n in lk.items()) > MAX_JOIN_ROWS:
            return False
        if self_join:
            self.features.add("self_join")
        self.features.add("multi_input")
        stage = Join(key, key)
        cols = stage.columns({"left": lc, "right": rc})
        self.add_stage(stage, {"left": left, "right": right}, cols, False)
        return True

    def try_enrich(self) -> bool:
        facts_start = self.random_steps(self.base(), 1)
        dims_start = self.random_steps(self.base(), 1)
        fc, dc = self.streams[facts_start].cols, self.streams[dims_start].cols
        common = [c for c in fc if c in dc and fc[c] == dc[c] and fc[c] in ("key", "int")]
        if not common or facts_start == dims_start:
            return False
        key = (self.pick(common),)
        facts, dims = self.derive(facts_start, KeyBy(key)), self.derive(dims_start, KeyBy(key))
        value = self.pick([c for c in fc if c not in key and c != "dim"] or [key[0]])
        col = self.pick(list(dc))
        carry = ("t",) if "t" in fc and value != "t" and self.chance(0.7) else ()
        disjoint = not (self.streams[facts].sources & self.streams[dims].sources)
        stage = Enrich(key, key, col, value, carry, disjoint)
        self.features.add("multi_input")
        cols = stage.columns({"facts": fc, "dims": dc})
        self.add_stage(stage, {"facts": facts, "dims": dims}, cols, self.streams[facts].time_ordered)
        return True

    def draw_stage(self) -> None:
        tries = {"aggregate": self.try_aggregate, "window": self.try_window, "custom": self.try_custom,
                 "join": self.try_join, "enrich": self.try_enrich}
        weights = {"aggregate": 3.0, "window": 3.5, "custom": 3.5, "join": 1.5, "enrich": 1.0}
        for _ in range(8):
            kinds = sorted(weights)
            p = np.array([weights[k] for k in kinds])
            kind = kinds[int(self.rng.choice(len(kinds), p=p / p.sum()))]
            size, features, stage_inputs = len(self.nodes), set(self.features), list(self.stage_inputs)
            # (a stage whose rows would pass more lineage levels than the runtime numbers is not
            # drawn: ``LineageOverflow`` at run time, a limit a query build does not check yet)
            if tries[kind]() and max(i.levels for i in self.streams.values()) <= LINEAGE_LEVELS:
                return
            self.rollback(size, features, stage_inputs)

    def draw_sinks(self) -> list[str]:
        outs = self.stage_outputs()
        chosen = [o for o in outs if o not in self.used or self.chance(0.25)]
        if self.chance(0.35) or not chosen:
            chosen.append(self.random_steps(self.pick(self.sources()), 2))
            self.features.add("stateless_sink")
        names = []
        for nid in chosen:
            names.append(f"out{len(names)}")
            self.add(SinkNode(names[-1], nid), None)
        return names

    # -- description

    def describe_stream(self, nid: int) -> str:
        node = self.nodes[nid]
        if isinstance(node, SourceNode):
            return node.name
        if isinstance(node, StageNode):
            return node.name
        return f"{self.describe_stream(node.parent)}.{node.step.describe()}"

    def describe(self, epoch_events: int) -> str:
        s = self.shape
        srcs = [n for n in self.nodes if isinstance(n, SourceNode)]
        head = (f"seed {self.seed}: {len(srcs)} source(s) of {'+'.join(str(n.table.num_rows) for n in srcs)} rows "
                f"(slices {'/'.join(str(n.slices) for n in srcs)}), "
                f"{'ordered by t' if self.order_by else 'in row order'}, t {s.time_kind}"
                f"{' ' + s.zone if s.time_kind == 'ts' else ''}, {s.key_kind} keys x{s.keys} zipf {s.zipf_a}"
                f"{' with nulls' if s.null_keys else ''}, payloads [{','.join(s.payloads)}], epoch {epoch_events}")
        parts = [head]
        for node in self.nodes:
            if isinstance(node, StageNode):
                ins = ", ".join(f"{n}={self.describe_stream(i)}" for n, i in node.inputs)
                parts.append(f"{node.name}[{node.slices}] = {node.stage.describe()} <- {ins}")
            elif isinstance(node, SinkNode):
                parts.append(f"sink {node.name} <- {self.describe_stream(node.stream)}")
        return " | ".join(parts)


def _parents(node: Node) -> list[int]:
    if isinstance(node, DeriveNode):
        return [node.parent]
    if isinstance(node, StageNode):
        return [i for _, i in node.inputs]
    if isinstance(node, SinkNode):
        return [node.stream]
    return []


def random_query(seed: int) -> RandomQuery:
    """The random query of ``seed``: the same query and data, bit for bit, for the same seed
    (one ``numpy.random.Generator`` seeded with it draws everything)."""
    rng = np.random.default_rng(seed)
    shape = draw_shape(rng)
    d = _Draw(seed, rng, shape, "t" if rng.random() < 0.6 else None)
    d.features |= shape.features()
    n_sources = int(rng.choice([1, 2, 3], p=[0.45, 0.45, 0.1]))
    for s in range(n_sources):
        # (a few hundred rows pass in 12-30 epochs and reach every key shape's hot keys; more
        # rows make a run slower, not its protocols' paths more varied)
        table = draw_table(rng, shape, int(rng.integers(40, 601)), int(rng.integers(0, 40)))
        cols = {**SOURCE_KINDS, **{p: "other" for p in shape.payloads}}
        d.add(SourceNode(f"src{s}", table, d.order_by, int(rng.integers(1, 9))),
              _Stream(cols, None, frozenset({s}), True, False, False))
    if n_sources > 1:
        d.features.add("several_sources")
    epoch_events = int(rng.integers(17, 401))
    for _ in range(int(rng.integers(1, 5))):
        d.draw_stage()
    d.features.add(f"stages_{len(d.stage_outputs())}")
    sinks = d.draw_sinks()
    expected: dict[str, Callable[[], pd.DataFrame] | None] = {}
    for node in d.nodes:
        if isinstance(node, SinkNode):
            expected[node.name] = None if d.lineage(node.stream) is None else _oracle(d, node.stream)
    spec = QuerySpec(epoch_events, tuple(d.nodes))
    return RandomQuery(seed, spec, d.describe(epoch_events), tuple(sinks), expected, frozenset(d.features))


def _oracle(d: _Draw, nid: int) -> Callable[[], pd.DataFrame]:
    """The expected frame of a sink on stream ``nid``, computed once when first asked for."""
    memo: list[pd.DataFrame] = []

    def expected() -> pd.DataFrame:
        if not memo:
            memo.append(d.expected(nid))  # type: ignore[arg-type]
        return memo[0]

    return expected


# --- checking a run ---------------------------------------------------------------------------


def exactly_once_problems(table: pa.Table) -> list[str]:
    """Whether each producer slice's ``_seq`` values in a sink are 0..n-1, no duplicate, no gap.

    >>> exactly_once_problems(pa.table({"_slice": [0, 0, 1], "_seq": [1, 0, 0]}))
    []
    >>> exactly_once_problems(pa.table({"_slice": [0, 0, 1], "_seq": [0, 0, 2]}))
    ['slice 0: 2 rows, seq 0..0: 1 duplicate(s), 0 missing', 'slice 1: 1 rows, seq 2..2: 0 duplicate(s), 2 missing']
    """
    if table.num_rows == 0:
        return []
    if "_slice" not in table.schema.names or "_seq" not in table.schema.names:
        return ["no _slice/_seq columns"]
    s = table.column("_slice").to_numpy()
    q = table.column("_seq").to_numpy()
    order = np.lexsort((q, s))
    s, q = s[order], q[order]
    problems = []
    for slice_id in np.unique(s).tolist():
        seqs = q[s == slice_id]
        if np.array_equal(seqs, np.arange(len(seqs))):
            continue
        dups = int(len(seqs) - len(np.unique(seqs)))
        gaps = int(seqs.max() + 1 - len(np.unique(seqs)))
        problems.append(f"slice {slice_id}: {len(seqs)} rows, seq {seqs.min()}..{seqs.max()}: {dups} duplicate(s), "
                        f"{gaps} missing")
    return problems


def check_outputs(rq: RandomQuery, results: dict[str, pa.Table], serial: dict[str, pa.Table]) -> list[str]:
    """How a run's sinks (``results``: sink name -> table as ``job.results`` gives it) are wrong,
    one description per problem (empty when all is well): (a) row for row against the serial
    executor's (``serial``), values, lineage and identity columns alike (``chaos.compare_tables``);
    (b) exactly once: per producer slice, ``_seq`` is 0..n-1 (``exactly_once_problems``); (c) the
    pandas oracle where it is written (``oracle.compare``)."""
    problems = [f"sink {n}: no output" for n in rq.sinks if n not in results]
    problems += [f"sink {n}: not in the serial executor's output" for n in rq.sinks if n not in serial]
    present = {n: results[n] for n in rq.sinks if n in results and n in serial}
    problems += [f"sink {n}: differs from the serial executor: {why}"
                 for n, why in compare_tables(present, serial).items()]
    for name, table in present.items():
        problems += [f"sink {name}: exactly once: {p}" for p in exactly_once_problems(table)]
        fn = rq.pandas_expected.get(name)
        if fn is not None:
            problems += [f"sink {name}: oracle: {p}" for p in oracle.compare(fn(), table)]
    return problems
