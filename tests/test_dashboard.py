"""A job's live dashboard, loaded in a real browser (headless Chromium) while the job runs: after a
slice migrated and a host was killed and recovered, the rendered page places the slice on its new
host, in the placement map and its table, and its timeline and events show the migration and the
recovery; a screenshot is kept (``tests/artifacts/dashboard.png``). The same job's ``/metrics``
counts with it, counts the migration's pause and the recovery in their histograms and each
slice's keys, and goes with the job's stop (``test_prometheus`` checks its counters end at the
input's rows, in the extended tests).

Chromium is Debian's package (``.ci/run`` installs it); without it the test is skipped, except
under CI, where it fails."""

from __future__ import annotations

import collections
import html.parser
import importlib
import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import chronostream as cs
from chronostream import cli
from chronostream.chaos import Fault, inject
from chronostream.cluster import _check_ray_dashboard_installed
from chronostream.containers.metrics import MetricsSnapshot
from chronostream.master.dashboard_view import EVENTS_LISTED, Dashboard, JobView, StageNode
from chronostream.slices.errors import ClusterError
from chronostream.slices.hashing import slice_of_scalar

ARTIFACTS = Path(__file__).parent / "artifacts"
#: Chromium as root in a closed network: no sandbox, no GPU, no background connections.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--virtual-time-budget=2500")


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("no Chromium: .ci/run installs Debian's chromium package")
        pytest.skip("no Chromium (apt-get install chromium) for the dashboard's browser test")
    return found


def _browse(chromium: str, url: str, profile: Path, *args: str) -> str:
    out = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, url],
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


class _Page(html.parser.HTMLParser):
    """The rendered page's table rows (their ``data-*`` attributes and cells) and SVG texts."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, list[tuple[dict[str, str], list[str]]]] = {}
        self.svg_texts: list[str] = []
        self._table = ""
        self._row: tuple[dict[str, str], list[str]] | None = None
        self._in: str = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "table":
            self._table = a.get("id", "")
        elif tag == "tr" and self._table:
            self._row = ({k[5:]: v for k, v in a.items() if k.startswith("data-")}, [])
            if self._row[0]:  # (a header row has none)
                self.rows.setdefault(self._table, []).append(self._row)
        self._in = tag

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._table = ""
        self._in = ""

    def handle_data(self, data: str) -> None:
        if self._in == "td" and self._row is not None:
            self._row[1].append(data)
        elif self._in in ("text", "tspan") and data.strip():
            self.svg_texts.append(data.strip())


def test_the_dashboard_shows_a_migration_and_a_recovery_in_a_real_browser(ray_session, tmp_path):
    chromium = _chromium()
    q = cs.Query(epoch_events=100)
    q.source("events", [{"k": i % 17, "v": i} for i in range(40_000)]).key_by("k") \
        .count(slices=6, name="count").sink(name="c")
    job = cs.run(q, containers=2, source_pace_s=0.05, checkpoint_every=2)
    try:
        status = job.status()
        url = status.dashboard_url
        assert url.startswith("http://127.0.0.1:") and status.metrics_url == url + "metrics"
        deadline = time.monotonic() + 60
        while not job.statistics() or min(s.next_epoch for s in job.statistics().values()) < 5:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        # /metrics counts with the job: the count stage's events grow between two scrapes.
        first = _scrape(status.metrics_url)
        time.sleep(0.8)  # (more than a heartbeat)
        second = _scrape(status.metrics_url)
        assert 0 < _events_in(first, "count") < _events_in(second, "count")
        moved = job.migrate("count", 1)["transfers"][0]
        killed = inject(job, Fault("kill", at_epoch=0, stage="count", index=0))
        assert killed["container"] != moved["to"]
        deadline = time.monotonic() + 60
        while not any(k == "recovery_end" for _, k, _ in job.timeline()):
            assert time.monotonic() < deadline, "no recovery"
            time.sleep(0.2)
        assert job.status().state is cs.JobState.RUNNING  # (the page is of a running job)

        page = _Page()
        page.feed(_browse(chromium, url, tmp_path / "profile", "--dump-dom"))
        # The placement table (the map's text form): slice 1 of count on the host it moved to.
        placed = {(int(a["host"]), a["stage"]): a["slices"].split() for a, _ in page.rows["hosts"]}
        assert "1" in placed[(moved["host"], "count")], placed
        assert all("1" not in sl for (h, st), sl in placed.items() if st == "count" and h != moved["host"])
        assert killed["host"] not in {h for h, _ in placed}  # the dead host runs nothing
        # The map itself (Plotly's SVG): the new host's column and its container's label.
        assert f"host {moved['host']}" in page.svg_texts and f"c{moved['to']}" in page.svg_texts
        # The timeline's lanes and the events table: the migration and the recovery.
        assert {"migrations", "recoveries", "faults"} <= set(page.svg_texts)
        kinds = [a["kind"] for a, _ in page.rows["events"]]
        assert {"migration_start", "migration_end", "fault_detected", "recovery_start", "slices_restored",
                "recovery_end"} <= set(kinds), kinds
        (text,) = [cells for a, cells in page.rows["events"] if a["kind"] == "migration_end"]
        assert f"to {moved['to']} on host {moved['host']}" in text[-1]
        stages = {a["stage"]: cells for a, cells in page.rows["stages"]}
        assert set(stages) == {"events", "count"}

        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "dashboard.png"
        shot.unlink(missing_ok=True)
        _browse(chromium, url, tmp_path / "profile", "--window-size=1400,1800", f"--screenshot={shot}")
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 50_000

        # /metrics: the migration's pause and the recovery, counted once each.
        families = _scrape(status.metrics_url)
        count = {name: next(s.value for s in families[name] if s.name == f"{name}_count")
                 for name in ("chronostream_migration_pause_seconds", "chronostream_recovery_seconds",
                              "chronostream_checkpoint_seconds", "chronostream_checkpoint_bytes")}
        assert count["chronostream_migration_pause_seconds"] == len(moved["slices"]) == 1
        assert count["chronostream_recovery_seconds"] == 1
        assert count["chronostream_checkpoint_seconds"] == count["chronostream_checkpoint_bytes"] > 0
        # Per slice: each of count's six slices once, wherever it runs now, holding the keys that
        # hash to it (17 keys in all; slice 0 has none), with bytes where it has keys.
        keys = {int(s.labels["slice"]): s.value for s in families["chronostream_slice_state_keys"]
                if s.labels["stage"] == "count"}
        sizes = {int(s.labels["slice"]): s.value for s in families["chronostream_slice_state_bytes"]
                 if s.labels["stage"] == "count"}
        hashed = collections.Counter(slice_of_scalar([k], 6) for k in range(17))
        assert keys == {s: float(hashed[s]) for s in range(6)}, keys
        assert sorted(sizes) == list(range(6)) and all((sizes[s] > 0) == (keys[s] > 0) for s in range(6)), sizes
        api = json.load(urllib.request.urlopen(url + "api/dashboard", timeout=10))
        assert api["headline"]["migrations"] == 1 and api["headline"]["recoveries"] == 1
    finally:
        job.stop()
    with pytest.raises(urllib.error.URLError):  # (the server goes with the job)
        urllib.request.urlopen(url, timeout=5)


def _scrape(url: str) -> dict[str, list]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return {f.name: f.samples for f in text_string_to_metric_families(r.read().decode())}


def _events_in(families: dict[str, list], stage: str) -> float:
    return sum(s.value for s in families["chronostream_events_in"]
               if s.name == "chronostream_events_in_total" and s.labels["stage"] == stage)


def test_rays_own_dashboard_asks_for_its_packages_before_ray_starts():
    """``CHRONOSTREAM_RAY_DASHBOARD=1`` without ``ray[default]``: one clear error naming the extra
    (Ray itself would start without a dashboard and say so only in its logs)."""
    try:
        importlib.import_module("ray.dashboard.optional_deps")
    except ImportError:
        with pytest.raises(ClusterError, match=r"pip install 'chronostream\[ray-dashboard\]'"):
            _check_ray_dashboard_installed()
    else:
        _check_ray_dashboard_installed()  # (installed: nothing to say)


def test_the_dashboard_view_escapes_names_and_bounds_its_lists():
    """A stage named like markup reaches Plotly's labels escaped; the history and the events listed
    keep their bounds however long the job."""
    view = JobView("j", "running", 1.0, [StageNode(0, "<b>x</b>", "source", 1, ())], {("<b>x</b>", 0): (0, 0)},
                   {}, None, {}, [(float(i), "autoscale_decision", {"action": f"a{i}"}) for i in range(500)], 0.0)
    board = Dashboard(kept=5)
    for t in range(20):
        board.sample(MetricsSnapshot(float(t), {}, {"p50_ms": 1.0, "p99_ms": 2.0}, 10.0), checkpoints=t)
    out = board.render(view)
    assert out["figures"]["graph"]["data"][0]["text"] == ["&lt;b&gt;x&lt;/b&gt;"]
    assert out["figures"]["placement"]["data"][0]["y"] == ["&lt;b&gt;x&lt;/b&gt;/0"]
    assert len(board.history) == 5 and out["figures"]["throughput"]["data"][0]["x"] == [15.0, 16.0, 17.0, 18.0, 19.0]
    assert len(out["events"]) == EVENTS_LISTED and out["events"][0]["text"] == "autoscaler: a499"


def test_chronostream_ui_prints_the_dashboard_and_opens_a_browser_unless_told_not_to(monkeypatch, capsys):
    """``chronostream ui NAME`` (the CLI alone: the job handle and the browser are stand-ins)."""
    opened: list[str] = []

    class _Job:
        key = "nightly"

        def __init__(self, url: str) -> None:
            self.url = url

        def status(self) -> cs.JobStatus:
            return cs.JobStatus(cs.JobState.RUNNING, 2, 0, 1.0, None, self.url + "metrics", self.url)

    monkeypatch.setattr(cli.webbrowser, "open", opened.append)
    monkeypatch.setattr(cli, "_attach", lambda args: _Job("http://127.0.0.1:8123/"))
    assert cli.main(["ui", "nightly"]) == 0 and cli.main(["ui", "nightly", "--no-open"]) == 0
    assert capsys.readouterr().out.split() == ["http://127.0.0.1:8123/"] * 2 and opened == ["http://127.0.0.1:8123/"]
    monkeypatch.setattr(cli, "_attach", lambda args: _Job(""))
    assert cli.main(["ui", "nightly"]) == 1
    assert "serves no dashboard (it runs with http_port=-1)" in capsys.readouterr().err and len(opened) == 1
