"""Owns a job's HTTP server: its live dashboard at ``/`` and Prometheus metrics at ``/metrics``.

The master starts one ``aiohttp`` server on its own event loop when the job
runs (deploy, or a restarted master's first deploy call), on
``JobOptions.http_port`` (0: a free port; -1: none), bound to 127.0.0.1 like
every port the project opens; its addresses are in ``Job.status()``
(``dashboard_url``, ``metrics_url``) and ``chronostream status``. It stops with
the job. Routes:

- ``/``: the dashboard page (``master/dashboard.html``), which loads Plotly
  (``/plotly.min.js``, from the ``plotly`` package: nothing from the network)
  and asks ``/api/dashboard`` every second;
- ``/api/dashboard``: ``master.dashboard_view``'s JSON, from the master's
  books (the heartbeats' statistics carry the per-slice figures), made at
  most once every ``FRESH_S`` whatever the number of open pages; only the
  recoveries' first outputs are asked of the hosts, when there were some;
- ``/metrics``: ``master.ray_prometheus``'s collector, from the books only.

Every ``SAMPLE_S`` the server keeps one point of the dashboard's history
(throughput, latency, checkpoints) from the heartbeats' statistics, so a page
opened late shows the past hour. Changes nothing in the master's books.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import logging
import time
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CollectorRegistry

from chronostream.containers.metrics import SliceMetrics
from chronostream.master.autoscaler import Counters, build_snapshot
from chronostream.master.dashboard_view import Dashboard, JobView, StageNode
from chronostream.master.ray_prometheus import EventHistograms, JobCollector

log = logging.getLogger("chronostream.master")

#: Seconds between the history's samples.
SAMPLE_S = 1.0
#: A dashboard answer younger than this is sent again instead of asking the hosts.
FRESH_S = 0.5


class JobHttp:
    """The HTTP server of one ``JobMaster`` (``master``)."""

    def __init__(self, master: Any) -> None:
        self.m = master
        self.runner: web.AppRunner | None = None
        self.base_url = ""
        self.events = EventHistograms()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(JobCollector(master, self.events))
        self.dashboard = Dashboard()
        self._sampler: asyncio.Task | None = None
        self._answer: tuple[float, dict[str, Any]] | None = None
        self._view_counters: Counters | None = None  # the page's rate window
        self._lock = asyncio.Lock()

    @property
    def url(self) -> str:
        """The Prometheus endpoint (``""`` without a server)."""
        return f"{self.base_url}metrics" if self.base_url else ""

    async def start(self) -> None:
        """Serve the job (once; nothing when ``http_port`` is -1). A port that cannot be bound is
        logged: the job runs without the server."""
        m = self.m
        if self.runner is not None or m.opts.http_port < 0:
            return
        app = web.Application()
        app.add_routes([web.get("/", self._page), web.get("/metrics", self._metrics),
                        web.get("/api/dashboard", self._api), web.get("/plotly.min.js", self._plotly)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", m.opts.http_port).start()
        except OSError as exc:
            await runner.cleanup()
            log.warning("job %s: no HTTP server on port %s: %s", m.job_key, m.opts.http_port, exc)
            return
        self.runner = runner
        port = runner.addresses[0][1]
        self.base_url = f"http://127.0.0.1:{port}/"
        for event in m.timeline:  # (a restarted master's, read back: then each new one)
            self.events.observe(event)
        m.timeline.listeners.append(self.events.observe)
        self._sampler = asyncio.get_running_loop().create_task(self._sample_forever())
        m._event("http_server", dashboard=self.base_url, metrics=self.url)

    async def stop(self) -> None:
        """The job stops: so does the server."""
        runner, self.runner = self.runner, None
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
            self._sampler = None
        if runner is not None:
            await runner.cleanup()
        with contextlib.suppress(ValueError):
            self.m.timeline.listeners.remove(self.events.observe)

    # -- the history ---------------------------------------------------------------

    async def _sample_forever(self) -> None:
        prev: Counters | None = None
        while True:
            try:
                prev = self._sample(prev)
            except Exception:  # noqa: BLE001 - the dashboard must never fail the job
                log.exception("job %s: dashboard sample failed", self.m.job_key)
            await asyncio.sleep(SAMPLE_S)

    def _sample(self, prev: Counters | None) -> Counters:
        m = self.m
        t = time.time() - m.started_at if m.started_at else 0.0
        snap, now = build_snapshot(t, m.plan, m.placement, m.host_of, dict(m.stats), {}, prev)
        if prev is not None:
            self.dashboard.sample(snap, sum(self._checkpoints().values()))
        return now

    def _checkpoints(self) -> dict[str, int]:
        """Stage name -> slice checkpoints its live containers took."""
        m = self.m
        out: dict[str, int] = {}
        for sid, ids in m.placement.containers.items():
            out[m.plan.stages[sid].name] = sum(m.stats[c].checkpoints for c in ids if c in m.stats)
        return out

    # -- the routes ------------------------------------------------------------------

    async def _page(self, _request: web.Request) -> web.Response:
        page = importlib.resources.files("chronostream.master").joinpath("dashboard.html").read_text()
        return web.Response(text=page, content_type="text/html")

    async def _plotly(self, _request: web.Request) -> web.Response:
        script = importlib.resources.files("plotly").joinpath("package_data", "plotly.min.js").read_bytes()
        return web.Response(body=script, content_type="application/javascript",
                            headers={"Cache-Control": "max-age=86400"})

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _api(self, _request: web.Request) -> web.Response:
        async with self._lock:  # (several pages: one answer a FRESH_S)
            if self._answer is None or time.monotonic() - self._answer[0] > FRESH_S:
                self._answer = (time.monotonic(), self.dashboard.render(await self.view()))
        return web.json_response(self._answer[1])

    async def view(self) -> JobView:
        """What the master knows now, as the dashboard needs it (from its books; the recoveries'
        first outputs from the hosts, when there were recoveries)."""
        m = self.m
        stats = dict(m.stats)
        slices = {c: [SliceMetrics(s, c, n_in, 0.0, 0, keys, nbytes) for s, n_in, keys, nbytes in st.slice_figures]
                  for c, st in stats.items()}
        t = time.time() - m.started_at if m.started_at else 0.0
        snapshot, self._view_counters = build_snapshot(t, m.plan, m.placement, m.host_of, stats, slices,
                                                       self._view_counters)
        events = (await m.reads.recovery_timeline() if m.timeline.count("slices_restored")
                  else list(m.timeline))
        slices_at = {}
        for sid, ids in m.placement.containers.items():
            for c in ids:
                for s in m.placement.slices_of(c):
                    slices_at[(m.plan.stages[sid].name, s)] = (c, m.host_of.get(c, -1))
        stages = [StageNode(st.stage_id, st.name, st.kind, st.num_slices, tuple(m.plan.downstream_stages(st.stage_id)))
                  for st in m.plan.stages]
        elapsed = (m.finished_at or time.time()) - m.started_at if m.started_at else 0.0
        return JobView(m.job_key, m.state.value, elapsed, stages, slices_at, {h: str(n) for h, n in m.nodes.items()},
                       snapshot, self._checkpoints(), events, m.started_at or time.time())
