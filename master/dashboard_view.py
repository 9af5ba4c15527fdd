"""Owns what a job's live dashboard shows: its figures (Plotly specifications), tables and history.

Pure functions over plain data: the server (``master.ray_http``) gathers a
``JobView`` from the master's books and sends ``render``'s JSON to the page
(``master/dashboard.html``), which hands each figure to Plotly and fills
the tables. No Ray, no server, no clock of its own (times come in).

What the page shows (docs/guide.md, "The dashboard"):

- the query graph, each stage coloured by its busy share, with its rates,
  and each stage's busy / backpressured / idle shares as stacked bars;
- the placement map: slices (rows) by hosts (columns), each placed slice's
  cell coloured by its input rate relative to its stage's mean (a hot
  slice and a skewed host show at a glance), labelled with its container;
- the timeline: faults, recoveries (detection, start, slices restored,
  first output, end), migrations (with each slice's pause), autoscaler
  decisions with their reasons, and checkpoint rounds;
- throughput and end-to-end latency (p50, p99) over the recent past;
- the same facts as text: a stage table, a host table and the latest events.

>>> view = JobView("j", "running", 3.0, [StageNode(0, "src", "source", 2, (1,)), StageNode(1, "count", "count", 2, ())],
...                {("src", 0): (0, 1), ("src", 1): (0, 1), ("count", 0): (1, 1), ("count", 1): (2, 2)},
...                {1: "n1", 2: "n1"}, None, {}, [(10.5, "fault_detected", {"host": 2, "by": "probe"})], 10.0)
>>> out = Dashboard().render(view)
>>> sorted(out["figures"])
['graph', 'latency', 'placement', 'shares', 'throughput', 'timeline']
>>> [(h["host"], h["stage"], h["slices"]) for h in out["hosts"]]
[(1, 'src', [0, 1]), (1, 'count', [0]), (2, 'count', [1])]
>>> out["events"][0]["text"]
'host 2 found dead (probe)'
"""

from __future__ import annotations

import collections
import html
from dataclasses import dataclass
from typing import Any

from chronostream.containers.metrics import MetricsSnapshot

#: Samples of the job's throughput, latency and shares kept for the charts (one a second: an hour).
HISTORY_KEPT = 3600
#: Events listed in the page's table (the newest).
EVENTS_LISTED = 40
#: Timeline kinds the page shows, by lane.
LANES = {"fault_detected": "faults", "host_kill_injected": "faults", "master_restarted": "faults",
         "recovery_start": "recoveries", "slices_restored": "recoveries", "recovery_end": "recoveries",
         "first_output": "recoveries", "migration_start": "migrations", "migration_end": "migrations",
         "migration_interrupted": "migrations", "threads_set": "migrations", "autoscale_decision": "autoscaler",
         "autoscale_refused": "autoscaler", "savepoint": "checkpoints", "sink_committed": "checkpoints"}
LANE_ORDER = ("checkpoints", "autoscaler", "migrations", "recoveries", "faults")


@dataclass(frozen=True)
class StageNode:
    """One stage of the query graph: its id, name, kind, slice count and the stages it feeds."""

    stage_id: int
    name: str
    kind: str
    slices: int
    downstream: tuple[int, ...]


@dataclass
class JobView:
    """What the master knows at one moment, as the dashboard needs it.

    ``slices_at``: (stage name, slice) -> (container, host); ``nodes``: host -> node id;
    ``snapshot``: the latest ``MetricsSnapshot`` with per-slice figures (None before the first);
    ``checkpoints``: stage name -> checkpoint rounds its live containers took; ``events``: the
    timeline (``(time, kind, info)``) with recoveries' first outputs; ``started_at``: the job's
    start, on the events' clock."""

    job: str
    state: str
    elapsed_s: float
    stages: list[StageNode]
    slices_at: dict[tuple[str, int], tuple[int, int]]
    nodes: dict[int, str]
    snapshot: MetricsSnapshot | None
    checkpoints: dict[str, int]
    events: list[tuple[float, str, dict[str, Any]]]
    started_at: float


@dataclass(frozen=True)
class Sample:
    """One point of the charts' history (seconds since the job's start)."""

    t: float
    throughput: float
    p50_ms: float
    p99_ms: float
    checkpoints: int  # rounds taken by the job's live containers so far


class Dashboard:
    """The dashboard of one job: its history of samples and its rendering."""

    def __init__(self, kept: int = HISTORY_KEPT) -> None:
        self.history: collections.deque[Sample] = collections.deque(maxlen=kept)

    def sample(self, snapshot: MetricsSnapshot, checkpoints: int) -> None:
        """Keep one point of the charts (a snapshot whose rates are over the last second)."""
        lat = snapshot.latency or {}
        self.history.append(Sample(snapshot.t, snapshot.throughput, float(lat.get("p50_ms", 0.0)),
                                   float(lat.get("p99_ms", 0.0)), checkpoints))

    def render(self, view: JobView) -> dict[str, Any]:
        """The page's JSON: headline figures, Plotly figures, and the text tables."""
        stages = stage_rows(view)
        return {"job": view.job, "state": view.state, "elapsed_s": round(view.elapsed_s, 1),
                "headline": self.headline(view),
                "figures": {"graph": graph_figure(view, stages), "shares": shares_figure(stages),
                            "placement": placement_figure(view), "timeline": self.timeline_figure(view),
                            "throughput": self.throughput_figure(), "latency": self.latency_figure()},
                "stages": stages, "hosts": host_rows(view), "events": event_rows(view)}

    def headline(self, view: JobView) -> dict[str, Any]:
        """Throughput, latency, hosts and the counts of recoveries and migrations."""
        last = self.history[-1] if self.history else None
        kinds = collections.Counter(kind for _, kind, _ in view.events)
        return {"throughput": last.throughput if last else 0.0, "p50_ms": last.p50_ms if last else 0.0,
                "p99_ms": last.p99_ms if last else 0.0, "hosts": len({h for _, h in view.slices_at.values()}),
                "recoveries": kinds["recovery_end"], "migrations": kinds["migration_end"]}

    def timeline_figure(self, view: JobView) -> dict[str, Any]:
        """Events as markers in lanes, over seconds since the job's start; checkpoint rounds from
        the history (a marker where rounds were taken, sized by how many)."""
        lanes: dict[str, tuple[list, list]] = {lane: ([], []) for lane in LANE_ORDER}
        for t, kind, info in view.events:
            lane = LANES.get(kind)
            if lane is not None:
                lanes[lane][0].append(round(t - view.started_at, 3))
                lanes[lane][1].append(_escape(describe_event(kind, info)))
        points = list(self.history)
        rounds = [(b.t, b.checkpoints - a.checkpoints) for a, b in zip(points, points[1:])
                  if b.checkpoints > a.checkpoints]
        data = [{"type": "scatter", "mode": "markers", "name": "checkpoint rounds", "x": [t for t, _ in rounds],
                 "y": ["checkpoints"] * len(rounds), "text": [f"{n} checkpoint rounds" for _, n in rounds],
                 "hoverinfo": "x+text", "marker": {"symbol": "line-ns-open", "size": 10, "color": "#888"}}]
        for lane in LANE_ORDER[1:] + ("checkpoints",):
            xs, texts = lanes[lane]
            if xs:
                data.append({"type": "scatter", "mode": "markers", "name": lane, "x": xs, "y": [lane] * len(xs),
                             "text": texts, "hoverinfo": "x+text", "marker": {"size": 11}})
        return {"data": data, "layout": _layout("Timeline (s since start)", height=260,
                                                yaxis={"categoryorder": "array", "categoryarray": list(LANE_ORDER)})}

    def throughput_figure(self) -> dict[str, Any]:
        """Source events per second over the history."""
        pts = list(self.history)
        return {"data": [{"type": "scatter", "mode": "lines", "name": "events/s", "x": [p.t for p in pts],
                          "y": [p.throughput for p in pts]}],
                "layout": _layout("Throughput (source events/s)", height=240, xaxis={"title": "s"})}

    def latency_figure(self) -> dict[str, Any]:
        """End-to-end latency p50 and p99 (over each second's written rows) over the history."""
        pts = [p for p in self.history if p.p99_ms > 0]
        return {"data": [{"type": "scatter", "mode": "lines", "name": q, "x": [p.t for p in pts],
                          "y": [getattr(p, f"{q}_ms") for p in pts]} for q in ("p50", "p99")],
                "layout": _layout("End-to-end latency (ms)", height=240, xaxis={"title": "s"})}


def stage_rows(view: JobView) -> list[dict[str, Any]]:
    """Per stage: containers, slices, input rate, busy / backpressured / idle shares, backlog, state."""
    snap = view.snapshot.stages if view.snapshot is not None else {}
    rows = []
    for st in view.stages:
        m = snap.get(st.name)
        busy = min(m.utilization, 1.0) if m else 0.0
        held = min(m.backpressured, 1.0 - busy) if m else 0.0
        rows.append({"stage": st.name, "kind": st.kind, "slices": st.slices,
                     "containers": len(m.containers) if m else 0, "input_rate": m.input_rate if m else 0.0,
                     "busy": round(busy, 3), "backpressured": round(held, 3),
                     "idle": round(max(0.0, 1.0 - busy - held), 3), "backlog": m.backlog_events if m else 0,
                     "state_mb": round(sum(x.state_bytes for x in m.per_slice) / 1e6, 2) if m else 0.0,
                     "checkpoints": view.checkpoints.get(st.name, 0)})
    return rows


def host_rows(view: JobView) -> list[dict[str, Any]]:
    """Per host and stage: the slices it runs and their containers."""
    by: dict[tuple[int, str], tuple[list[int], set[int]]] = {}
    order = {st.name: i for i, st in enumerate(view.stages)}
    for (stage, s), (c, h) in view.slices_at.items():
        slices, containers = by.setdefault((h, stage), ([], set()))
        slices.append(s)
        containers.add(c)
    return [{"host": h, "node": view.nodes.get(h, "")[:8], "stage": stage, "slices": sorted(sl),
             "containers": sorted(cs_)}
            for (h, stage), (sl, cs_) in sorted(by.items(), key=lambda kv: (kv[0][0], order.get(kv[0][1], 0)))]


def event_rows(view: JobView) -> list[dict[str, Any]]:
    """The newest events (of the timeline's lanes and the job's state changes), newest first."""
    shown = [(t, kind, info) for t, kind, info in view.events if kind in LANES or kind.startswith("job_")]
    return [{"t": round(t - view.started_at, 2), "kind": kind, "text": describe_event(kind, info)}
            for t, kind, info in reversed(shown[-EVENTS_LISTED:])]


def describe_event(kind: str, info: dict[str, Any]) -> str:
    """One line a person reads for a timeline event.

    >>> describe_event("migration_end", {"stage": "count", "seconds": 1.5, "reason": "requested",
    ...     "transfers": [{"from": 3, "to": 7, "host": 4, "slices": [2], "pause_ms": {2: 12.0}}]})
    'migration of count (requested) done in 1.5 s: slices [2] from container 3 to 7 on host 4, pause 12 ms'
    >>> describe_event("recovery_end", {"containers": [5], "seconds": 0.8, "epochs_replayed": 3})
    'recovery of containers [5] done in 0.8 s (3 epochs replayed)'
    """
    if kind == "fault_detected":
        who = info.get("host", info.get("hosts"))
        return f"host {who} found dead ({info.get('by', '')})"
    if kind == "recovery_start":
        return (f"recovery: container {info.get('container')}'s slices {info.get('slices')} to container "
                f"{info.get('new')} on host {info.get('host')}")
    if kind == "slices_restored":
        return (f"slices {info.get('slices')} restored in container {info.get('container')} on host "
                f"{info.get('host')} in {info.get('seconds')} s ({info.get('mb')} MB)")
    if kind == "first_output":
        return f"slice {info.get('slice')} of container {info.get('container')}: first output after recovery"
    if kind == "recovery_end":
        return (f"recovery of containers {info.get('containers')} done in {info.get('seconds')} s "
                f"({info.get('epochs_replayed', 0)} epochs replayed)")
    if kind == "migration_start":
        moves = "; ".join(f"slices {t.get('slices')} from container {t.get('from')}"
                          for t in info.get("transfers", []) if isinstance(t, dict))
        return f"migration of {info.get('stage')} ({info.get('reason', '')}) started: {moves}"
    if kind == "migration_end":
        moves = "; ".join(f"slices {t.get('slices')} from container {t.get('from')} to {t.get('to')} on host "
                          f"{t.get('host')}, pause {max((t.get('pause_ms') or {0: 0}).values()):.0f} ms"
                          for t in info.get("transfers", []) if isinstance(t, dict))
        return f"migration of {info.get('stage')} ({info.get('reason', '')}) done in {info.get('seconds')} s: {moves}"
    if kind == "autoscale_decision":
        return f"autoscaler: {info.get('action')}"
    if kind == "autoscale_refused":
        return f"autoscaler refused: {info.get('action')} ({info.get('error')})"
    text = ", ".join(f"{k}={v}" for k, v in info.items())
    return f"{kind.replace('_', ' ')}" + (f": {text}" if text else "")[:200]


def graph_figure(view: JobView, stages: list[dict[str, Any]]) -> dict[str, Any]:
    """The query graph: stages placed by depth from the sources, arrows along the streams, each
    coloured by its busy share."""
    depth: dict[int, int] = {}
    for st in view.stages:  # (stage ids are in topological order: a stage reads only earlier ones)
        depth.setdefault(st.stage_id, 0)
        for d in st.downstream:
            depth[d] = max(depth.get(d, 0), depth[st.stage_id] + 1)
    rank: dict[int, int] = collections.Counter()
    pos = {}
    for st in view.stages:
        pos[st.stage_id] = (depth[st.stage_id], -rank[depth[st.stage_id]])
        rank[depth[st.stage_id]] += 1
    row = {r["stage"]: r for r in stages}
    names = [_escape(st.name) for st in view.stages]
    hover = [_escape(f"{st.name} ({st.kind}, {st.slices} slices): {row[st.name]['input_rate']:.0f} ev/s, "
                     f"busy {row[st.name]['busy']:.0%}, backpressured {row[st.name]['backpressured']:.0%}, "
                     f"backlog {row[st.name]['backlog']}") for st in view.stages]
    arrows = [{"x": pos[d][0], "y": pos[d][1], "ax": pos[st.stage_id][0], "ay": pos[st.stage_id][1],
               "xref": "x", "yref": "y", "axref": "x", "ayref": "y", "showarrow": True, "arrowhead": 3,
               "standoff": 22, "startstandoff": 22, "text": ""}
              for st in view.stages for d in st.downstream if d in pos]
    return {"data": [{"type": "scatter", "mode": "markers+text", "x": [pos[s.stage_id][0] for s in view.stages],
                      "y": [pos[s.stage_id][1] for s in view.stages], "text": names, "textposition": "bottom center",
                      "hovertext": hover, "hoverinfo": "text",
                      "marker": {"size": 36, "color": [row[s.name]["busy"] for s in view.stages], "cmin": 0,
                                 "cmax": 1, "colorscale": "YlOrRd", "reversescale": True, "showscale": True,
                                 "colorbar": {"title": {"text": "busy"}, "thickness": 10},
                                 "line": {"width": 1, "color": "#333"}}}],
            "layout": _layout("Query graph (colour: busy share)", height=260, annotations=arrows, showlegend=False,
                              xaxis={"visible": False, "range": [-0.5, max(depth.values(), default=0) + 0.5]},
                              yaxis={"visible": False, "range": [-max(rank.values(), default=1) + 0.4, 0.6]})}


def shares_figure(stages: list[dict[str, Any]]) -> dict[str, Any]:
    """Each stage's busy, backpressured and idle shares of its hosts' time, stacked."""
    names = [_escape(r["stage"]) for r in stages]
    colours = {"busy": "#d62728", "backpressured": "#ff7f0e", "idle": "#c7c7c7"}
    return {"data": [{"type": "bar", "orientation": "h", "name": part, "y": names,
                      "x": [round(100 * r[part], 1) for r in stages], "marker": {"color": colours[part]}}
                     for part in ("busy", "backpressured", "idle")],
            "layout": _layout("Time share per stage (%)", height=260, barmode="stack",
                              yaxis={"autorange": "reversed"}, xaxis={"range": [0, 100]})}


def placement_figure(view: JobView) -> dict[str, Any]:
    """Slices by hosts: a placed slice's cell is its input rate over its stage's mean (1 = even;
    0 before the first rates), labelled with its container; empty where the slice is not."""
    hosts = sorted({h for _, h in view.slices_at.values()})
    col = {h: i for i, h in enumerate(hosts)}
    per_slice = {}
    if view.snapshot is not None:
        for name, m in view.snapshot.stages.items():
            for sm in m.per_slice:
                per_slice[(name, sm.slice_id)] = sm
    rows: list[str] = []
    z: list[list[float | None]] = []
    text: list[list[str]] = []
    for st in view.stages:
        rates = [per_slice[(st.name, s)].input_rate for s in range(st.slices) if (st.name, s) in per_slice]
        mean = sum(rates) / len(rates) if rates else 0.0
        for s in range(st.slices):
            rows.append(_escape(f"{st.name}/{s}"))
            zr: list[float | None] = [None] * len(hosts)
            tr = [""] * len(hosts)
            at = view.slices_at.get((st.name, s))
            if at is not None:
                sm = per_slice.get((st.name, s))
                zr[col[at[1]]] = round(sm.input_rate / mean, 2) if sm is not None and mean > 0 else 0.0
                tr[col[at[1]]] = f"c{at[0]}"
            z.append(zr)
            text.append(tr)
    return {"data": [{"type": "heatmap", "x": [f"host {h}" for h in hosts], "y": rows, "z": z, "text": text,
                      "texttemplate": "%{text}", "zmin": 0, "zmax": 2, "colorscale": "RdBu",
                      "hovertemplate": "%{y} on %{x}: %{text}, load %{z}× its stage's mean<extra></extra>",
                      "xgap": 2, "ygap": 1, "colorbar": {"title": {"text": "load"}, "thickness": 10}}],
            "layout": _layout("Placement: slices by hosts (colour: input rate / stage mean)",
                              height=min(160 + 14 * len(rows), 900), yaxis={"autorange": "reversed"})}


def _layout(title: str, height: int, **more: Any) -> dict[str, Any]:
    return {"title": {"text": title, "font": {"size": 14}}, "height": height,
            "margin": {"l": 70, "r": 20, "t": 36, "b": 30}, **{"showlegend": True, **more}}


def _escape(text: str) -> str:
    """A user's name in a Plotly label: Plotly reads a few HTML tags in text, so none pass."""
    return html.escape(text, quote=False)
