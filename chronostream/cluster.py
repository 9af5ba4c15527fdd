"""Owns this process's connection to a Ray cluster: starting a private one, joining one by
address, the namespace and settings jobs' actors use.

Must not touch: jobs (``client``), their records (``job_records``).
"""

from __future__ import annotations

import contextlib
import importlib
import ipaddress
import os
import socket
from typing import Iterator

import ray
from ray._private import ray_constants
from ray._private.authentication.authentication_token_setup import AUTH_MODE_ENV_VAR, _enable_token_auth
from ray._private.services import get_ray_address_from_environment
from ray._raylet import AuthenticationTokenLoader

from chronostream.slices.errors import ClusterError

#: Seconds a cluster's address gets to accept a connection before ``ensure_ray`` gives up
#: (Ray's own ``ray.init`` retries a dead address for minutes).
PROBE_TIMEOUT_S = 3.0
#: Whether ``ensure_ray`` started this process's Ray (a cluster that dies with the process).
_started_here = False


#: Ray namespace of the jobs' actors (hosts are detached named actors, found again by a restarted master).
RAY_NAMESPACE = "chronostream"


#: Ray settings a cluster that runs jobs should have (``ensure_ray`` starts Ray with them; set
#: them as ``RAY_<name>`` environment variables of ``ray start`` for a cluster of your own).
#: ``oom_grace_period_s`` = 0: when the object store is full and spilling cannot free room (the
#: objects are mapped by readers: a source's input table is, for the job's life), Ray waits this
#: long before it allocates the object from the filesystem instead. Its default, 2 s, stalled
#: every container of a job: a 100 MB migration seed or checkpoint put waited 2.0-2.3 s, and
#: every push between containers waited behind it (``benchmarks.migration`` 100 MB rows, 2 runs
#: of 3; docs/design.md section 5).
RAY_SYSTEM_CONFIG = {"oom_grace_period_s": 0}


def ensure_ray(address: str | None = None, num_cpus: int | None = None, ray_dashboard: bool | None = None) -> None:
    """Start Ray in this process (default) or connect to ``address`` / ``$RAY_ADDRESS``.

    ``ray_dashboard`` (default: ``$CHRONOSTREAM_RAY_DASHBOARD`` is ``1``) turns on Ray's own
    dashboard, on 127.0.0.1, in a Ray started here (it needs ``ray[default]``: ``pip install
    'chronostream[ray-dashboard]'``; ``ClusterError`` says so before Ray starts). Each job's own
    dashboard needs nothing of it (``Job.status().dashboard_url``).

    Ray started here gets ``RAY_SYSTEM_CONFIG`` and an object store of
    ``$CHRONOSTREAM_OBJECT_STORE_BYTES`` (default 1 GiB); a cluster you connect to keeps its own.
    Joining a cluster by address, the process sends Ray's authentication token when it has one
    (``$RAY_AUTH_TOKEN``, ``~/.ray/auth_token``): Ray sends it only to a cluster it finds with
    ``auto``, and a cluster with token authentication (Ray's default) refuses the rest. An
    address where nothing answers raises ``ClusterError`` within ``PROBE_TIMEOUT_S``.
    Without an address this always starts a Ray of its own: Ray's own default would join the
    latest cluster started on the machine (``/tmp/ray/ray_current_cluster``), another
    program's, or fail with a ``ValueError`` when that file names one that died. A Ray started
    here is a single-machine node on 127.0.0.1: nothing of it listens beyond loopback.
    """

    global _started_here
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        _started_here = False
        probe(address)
        _send_token_if_there_is_one()
        # A node on loopback (one this project started) is joined on loopback: Ray would
        # otherwise look for it at the machine's address, where nothing of it listens.
        with _ray_on_loopback() if _on_loopback(address) else contextlib.nullcontext():
            ray.init(address=address, logging_level="WARNING", log_to_driver=True, namespace=RAY_NAMESPACE)
        return
    if ray_dashboard is None:
        ray_dashboard = os.environ.get(RAY_DASHBOARD_ENV, "") == "1"
    if ray_dashboard:
        _check_ray_dashboard_installed()
    with _ray_on_loopback():
        _started_here = True
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 2, include_dashboard=ray_dashboard,
                 dashboard_host="127.0.0.1", logging_level="WARNING", namespace=RAY_NAMESPACE,
                 object_store_memory=int(os.environ.get("CHRONOSTREAM_OBJECT_STORE_BYTES", 1 << 30)),
                 log_to_driver=True, _system_config=dict(RAY_SYSTEM_CONFIG))


#: Turns Ray's own dashboard on in a Ray this project starts (``ensure_ray``).
RAY_DASHBOARD_ENV = "CHRONOSTREAM_RAY_DASHBOARD"


def _check_ray_dashboard_installed() -> None:
    """Ray's dashboard needs ``ray[default]``'s packages; without them Ray starts without it
    and says so only in its logs."""
    try:
        importlib.import_module("ray.dashboard.optional_deps")
    except ImportError as exc:
        raise ClusterError(f"Ray's dashboard needs ray[default] ({exc}): pip install "
                           f"'chronostream[ray-dashboard]', or leave it off (each job serves its own "
                           f"dashboard: Job.status().dashboard_url)") from None


#: Ray's switch between a node reachable from other machines (its default on Linux: servers on
#: every interface, the node's address the machine's) and a single-machine node on 127.0.0.1.
_RAY_CLUSTER_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _on_loopback(address: str) -> bool:
    """Whether the Ray cluster at ``address`` (``host:port``, or ``auto``: the latest started on
    this machine) is on a loopback address. A Ray client address (``ray://``) is not."""
    if address == "auto":
        try:
            address = get_ray_address_from_environment("auto", None) or ""
        except (ConnectionError, ValueError):  # (no cluster to find: ray.init says so itself)
            return False
    if "://" in address:
        return False
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@contextlib.contextmanager
def _ray_on_loopback() -> Iterator[None]:
    """While Ray starts in this process: its node takes 127.0.0.1 as its address, so the GCS,
    the raylet and the workers listen on loopback only. ``ray.init(_node_ip_address=
    "127.0.0.1")`` cannot ask for this: Ray replaces a loopback address by the machine's
    unless its cluster switch is off, which it reads once at import (the driver) and from the
    environment (the processes it starts). Both are restored afterwards, so a cluster this
    process joins later, or a subprocess it starts, is as Ray makes it."""
    saved_env, saved_flag = os.environ.get(_RAY_CLUSTER_SWITCH), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_RAY_CLUSTER_SWITCH] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(_RAY_CLUSTER_SWITCH, None)
        else:
            os.environ[_RAY_CLUSTER_SWITCH] = saved_env


def probe(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Raise ``ClusterError`` unless something accepts a connection at ``address`` (``host:port``
    of a cluster's GCS) within ``timeout_s``; ``auto`` and Ray client addresses are left to Ray.

    >>> probe("127.0.0.1:1")
    Traceback (most recent call last):
    ...
    chronostream.slices.errors.ClusterError: no Ray cluster answers at 127.0.0.1:1 (Connection refused): it stopped, or the address is wrong
    """
    if address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise ClusterError(f"no Ray cluster answers at {address} ({why}): it stopped, or the address is wrong") from None


def _send_token_if_there_is_one() -> None:
    """Turn Ray's token authentication on for this process when a token is at hand and the
    user did not choose a mode (``$RAY_AUTH_MODE``). A cluster without authentication ignores
    the token, so sending it is never wrong."""
    if os.environ.get(AUTH_MODE_ENV_VAR) is None and AuthenticationTokenLoader.instance().has_token(
            ignore_auth_mode=True):
        _enable_token_auth()


def connected_address() -> str | None:
    """The GCS address (``host:port``) of the cluster this process is connected to, or None."""
    return ray.get_runtime_context().gcs_address if ray.is_initialized() else None


def token_auth_on() -> bool:
    """Whether this process talks to its cluster with Ray's token authentication."""
    return (os.environ.get(AUTH_MODE_ENV_VAR) or "").lower() == "token"


def started_here() -> bool:
    """Whether this process is connected to a Ray that ``ensure_ray`` started in it (it ends with
    the process, so a job that must outlive the process cannot run there)."""
    return _started_here and ray.is_initialized()
