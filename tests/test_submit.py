"""Jobs that outlive the process that started them: submitted to a Ray cluster started with
``ray start --head`` (token authentication on), found by name from other processes through this
machine's job records, controlled from the CLI after the submitter was killed, and given up on
in one line when their cluster is gone."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from ray._private.authentication.authentication_token_generator import generate_new_authentication_token

import chronostream as cs
from chronostream.chaos import compare_tables
from chronostream.job_records import HOME_ENV, JobRecord, write_record


QUERY = '''
import chronostream as cs

def build(path={path!r}):
    q = cs.Query(epoch_events=100)
    rows = [{{"k": f"k{{i % 37}}", "v": i}} for i in range(ROWS)]
    q.source("events", rows).key_by("k").count(slices=4, name="count").sink(cs.ParquetSink(path, name="counts"))
    return q

ROWS = {rows}
'''

SUBMITTER = '''
import importlib.util, sys, time
import chronostream as cs
spec = importlib.util.spec_from_file_location("user_query", sys.argv[1])
mod = importlib.util.module_from_spec(spec); sys.modules["user_query"] = mod; spec.loader.exec_module(mod)
job = cs.submit(mod.build(), address=sys.argv[2], containers=1, name=sys.argv[3], source_pace_s=0.25)
print(job.key, flush=True)
time.sleep(600)
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cluster(tmp_path):
    """A Ray head started with ``ray start --head`` on loopback with token authentication on (its
    own token file); yields (address, the environment a user's shell would have: the token at
    hand, no auth mode chosen, a job records directory of its own)."""
    token = tmp_path / "auth_token"
    token.write_text(generate_new_authentication_token())
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    env.update({"RAY_AUTH_TOKEN_PATH": str(token), HOME_ENV: str(tmp_path / "home")})
    port = _free_port()
    head = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}",
         "--node-ip-address=127.0.0.1", "--num-cpus=2", "--include-dashboard=false",
         "--object-store-memory=300000000"],
        env={**env, "RAY_AUTH_MODE": "token", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
             "RAY_oom_grace_period_s": "0"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert head.poll() is None, "ray start --head exited"
            time.sleep(0.5)
    try:
        yield address, env, head
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)  # (the head's session: ray start and the cluster it started)
        head.wait(30)


def _cli(env: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "chronostream", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def _json(run: subprocess.CompletedProcess) -> object:
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.ray
def test_a_submitted_job_outlives_its_submitter_and_is_controlled_by_name(cluster, tmp_path):
    address, env, _ = cluster
    rows = 6000
    query_file = tmp_path / "query.py"
    query_file.write_text(QUERY.format(path=str(tmp_path / "out"), rows=rows))

    # The submitter is killed (SIGKILL) once the job runs: nothing of the job is its.
    submitter = subprocess.Popen([sys.executable, "-c", SUBMITTER, str(query_file), address, "nightly"], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    name = submitter.stdout.readline().strip()
    assert name == "nightly", submitter.stderr.read()[-3000:] if submitter.poll() is not None else name
    submitter.kill()
    submitter.wait(30)

    # Found by name with no address given (this machine's record), token authentication on.
    status = _json(_cli(env, "status", name))
    assert status["state"] == "running" and status["address"] == address, status
    # Its dashboard's address (loopback), and a live table of its stages.
    assert status["dashboard_url"].startswith("http://127.0.0.1:"), status
    shown = _cli(env, "top", name, "-n", "1")
    assert shown.returncode == 0 and f"{name}: running" in shown.stdout, shown.stderr[-2000:]
    assert all(word in shown.stdout for word in ("count", "events/s", "backpressured")), shown.stdout
    listed = _json(_cli(env, "jobs"))
    assert [(j["name"], j["state"], j["submitted"]) for j in listed] == [(name, "running", True)], listed
    moved = _json(_cli(env, "scale-out", name, "count"))
    assert moved["transfers"] and all(t["phase"] == "done" for t in moved["transfers"]), moved

    # Followed to its end; every row once, as the serial executor makes them.
    assert _json(_cli(env, "attach", name, "--timeout", "120")) == {"counts": rows}
    sys.path.insert(0, str(tmp_path))
    try:
        import query as user_query  # noqa: PLC0415 (the file the test wrote)
    finally:
        sys.path.remove(str(tmp_path))
    serial = cs.run(user_query.build(str(tmp_path / "serial")), executor="serial").results("counts")
    assert compare_tables({"counts": cs.read_parquet_sink(str(tmp_path / "out"))}, {"counts": serial}) == {}
    assert _json(_cli(env, "stop", name)) == {"name": name, "stopped": True}
    gone = _cli(env, "status", name)
    assert gone.returncode == 1 and f"no job {name!r}" in gone.stderr, gone.stderr[-2000:]
    assert _json(_cli(env, "jobs")) == []


def test_a_job_whose_cluster_is_gone_is_one_line_at_once_and_stop_forgets_it(tmp_path):
    """A record of a job whose cluster no longer answers (every process of it died): ``status``
    gives up in one line within seconds (Ray's own connect retries for minutes), ``jobs`` lists
    it as gone, ``stop`` forgets it and leaves its files; ``submit`` refuses a sink directory in
    use, and a dead address, in one line each."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    env[HOME_ENV] = str(tmp_path / "home")
    dead = f"127.0.0.1:{_free_port()}"
    workdir = tmp_path / "work"
    workdir.mkdir()
    os.environ[HOME_ENV], before = env[HOME_ENV], os.environ.get(HOME_ENV)
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    try:
        write_record(JobRecord("orphan", dead, str(workdir), submitted=True, started_at=time.time()))
        # A run's job whose process ended: listed once as gone, then forgotten.
        write_record(JobRecord("script", dead, str(workdir), driver_pid=int(ended.stdout), started_at=time.time()))
    finally:
        os.environ.pop(HOME_ENV) if before is None else os.environ.update({HOME_ENV: before})
    t0 = time.monotonic()
    lost = _cli(env, "status", "orphan", timeout=60)
    assert lost.returncode == 1 and time.monotonic() - t0 < 20, lost.stderr[-2000:]
    assert lost.stderr.startswith(f"chronostream status: job 'orphan': no Ray cluster answers at {dead}"), lost.stderr
    assert f"its files are in {workdir}" in lost.stderr and "Traceback" not in lost.stderr
    listed = sorted((j["name"], j["state"], j["submitted"]) for j in _json(_cli(env, "jobs")))
    assert listed == [("orphan", "gone", True), ("script", "gone", False)]
    assert [(j["name"], j["state"]) for j in _json(_cli(env, "jobs"))] == [("orphan", "gone")]
    forgotten = _json(_cli(env, "stop", "orphan"))
    assert forgotten == {"name": "orphan", "stopped": False, "forgotten": True, "workdir": str(workdir)}
    assert workdir.is_dir() and _json(_cli(env, "jobs")) == []

    query_file = tmp_path / "query.py"
    query_file.write_text(QUERY.format(path=str(tmp_path / "out"), rows=10))
    (tmp_path / "out" / "slice=00000").mkdir(parents=True)  # an earlier run's output
    in_use = _cli(env, "submit", str(query_file), "--address", dead)
    assert in_use.returncode == 1 and in_use.stderr.startswith("chronostream submit: ParquetSink 'counts': ")
    (tmp_path / "out" / "slice=00000").rmdir()
    no_cluster = _cli(env, "submit", str(query_file), "--address", dead)
    assert no_cluster.returncode == 1 and "Traceback" not in no_cluster.stderr
    assert no_cluster.stderr.startswith(f"chronostream submit: no Ray cluster answers at {dead}"), no_cluster.stderr


def test_a_control_command_waiting_on_ray_ends_at_sigterm_and_leaves_the_job_running(ray_session):
    """``chronostream attach`` follows a long job; SIGTERM ends it within seconds (the default
    action, set once connected: Ray's own handler ran only when its call returned)."""
    import queue
    import threading

    q = cs.Query(epoch_events=100)
    q.source("w", [{"w": f"w{i % 7}"} for i in range(20_000)]).key_by("w").count(slices=2, name="count") \
        .sink(name="c")
    job = cs.run(q, containers=1, source_pace_s=0.5, checkpoint_interval_s=0)
    try:
        attach = subprocess.Popen([sys.executable, "-m", "chronostream", "attach", job.key],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in attach.stderr], daemon=True).start()
        deadline = time.monotonic() + 60
        while not lines.get(timeout=max(0.1, deadline - time.monotonic())).startswith(f"{job.key}: running"):
            pass  # (Ray's own lines first; then the first progress line: connected, polling)
        t0 = time.monotonic()
        attach.send_signal(signal.SIGTERM)
        assert attach.wait(10) == -signal.SIGTERM and time.monotonic() - t0 < 5
        assert job.status().state == "running"
    finally:
        job.stop()
