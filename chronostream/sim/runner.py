"""Owns one simulated run: a seed becomes a random query, a cluster shape and a fault schedule,
run in this process by the in-process driver with every delivery decided by the seed, then checked.

Checked three ways: each sink equals the serial executor row for row
(``check_outputs``, with the exactly-once identities of ``out_seq`` and,
where written, the pandas oracle), every scheduled fault landed
(``faults.Injector.judge``), and the run finished in a bounded number of
rounds. Same seed, same run: no wall clock, no threads (checkpoints are encoded
in the step that takes them), every choice drawn from generators seeded by
the seed.
"""

from __future__ import annotations

import ctypes
import functools
import multiprocessing
import random
import signal
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import pyarrow as pa

import chronostream as cs
from chronostream.dag import compile_query
from chronostream.master.job_state import JobState
from chronostream.master.local import LocalCluster
from chronostream.master.placement import initial_placement
from chronostream.sim.faults import FAULT_KINDS, Fault, Injector, Landing, SimNetwork, random_schedule
from chronostream.sim.queries import RandomQuery, check_outputs, random_query

#: Faults per schedule: a few of any kind, drawn per seed.
FAULTS_PER_RUN = (2, 6)
#: Over how many rounds a seed's hosts start (``LocalCluster(deploy_rounds=...)``): the started
#: hosts' containers run while the deploy waits for the others.
DEPLOY_ROUNDS = (0, 0, 1, 2, 3)


@dataclass
class SimResult:
    """The outcome of one seed: what ran, what was injected, what was found wrong."""

    seed: int
    shape: str
    faults: list[Landing]
    failures: list[str]
    rounds: int = 0
    seconds: float = 0.0
    story: list[tuple[int, str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when the outputs were exact and every fault landed."""
        return not self.failures

    def replay_command(self) -> str:
        """The command that replays this seed with its story."""
        return f"python -m chronostream.sim --seed {self.seed} --story"

    def format_story(self) -> str:
        """The run's timeline: one line per injected fault and per protocol event, by round."""
        lines = [f"seed {self.seed}: {self.shape}"]
        lines += [f"  round {r:4d}  {kind:16s} {what}" for r, kind, what in self.story]
        lines += [f"  fault {x.fault.describe()}: {'landed' if x.landed else 'DID NOT LAND'} - {x.effect}"
                  for x in self.faults]
        lines += [f"  FAILURE: {f}" for f in self.failures]
        return "\n".join(lines)


def serial_results(rq: RandomQuery, build: Callable[[], cs.Query]) -> dict[str, pa.Table]:
    """Every sink of the query (``build``: a fresh copy of ``rq``'s) as the serial executor
    computes it (the first oracle)."""
    job = cs.run(build(), executor="serial")
    return {name: job.results(name) for name in rq.sinks}


def epochs_for_faults(rq: RandomQuery, rng: random.Random) -> int:
    """Source events per epoch for the run: the query's own, made smaller when its input would
    pass in fewer than 16-32 epochs, so a schedule's faults meet a running job (the serial
    oracle runs with the same epochs: rows made at the end of the input take its last order)."""
    plan, _ = compile_query(rq.build())
    rows = plan.order_end or plan.total_events or 1
    return max(2, min(plan.epoch_events, rows // rng.randint(16, 32)))


def run_seed(seed: int, kinds: list[str] | None = None,
             make_query: Callable[[int], RandomQuery] = random_query) -> SimResult:
    """Run seed ``seed``: its random query, cluster shape and fault schedule; check everything."""
    t0 = time.perf_counter()
    rng = random.Random(f"chronostream.sim/{seed}")
    rq = make_query(seed)
    epoch_events = epochs_for_faults(rq, rng)

    def build() -> cs.Query:
        q = rq.build()
        q.epoch_events = epoch_events
        return q

    story: list[tuple[int, str, str]] = []
    failures: list[str] = []
    plan, sources = compile_query(build())
    per_stage = {st.stage_id: rng.randint(1, min(3, st.num_slices)) for st in plan.stages}
    checkpoint_every = rng.choice([1, 2, 3])
    backup_factor = rng.choice([1, 2, 2])
    kinds = list(kinds or FAULT_KINDS)
    if backup_factor < 2 and "damaged_backup" in kinds and len(kinds) > 1:
        kinds.remove("damaged_backup")  # one copy only: a damaged one leaves nothing to restore
    num_epochs = plan.num_epochs or 1
    schedule = random_schedule(rng, num_epochs, rng.randint(*FAULTS_PER_RUN), kinds)
    # (from a generator of its own: the query, shape and schedule of a seed stay what they were)
    deploy_rounds = random.Random(f"chronostream.sim/deploy/{seed}").choice(DEPLOY_ROUNDS)
    shape = (f"{rq.description}; {epoch_events} events an epoch; containers {per_stage}, checkpoint every {checkpoint_every}, "
             f"{backup_factor} backups, {num_epochs} epochs, deployed over {deploy_rounds} rounds; "
             f"faults {[f.describe() for f in schedule]}")
    network = SimNetwork()
    injector = Injector(schedule, network, story)
    cl = LocalCluster(plan, initial_placement(plan, per_stage), sources, seed=rng.randrange(1 << 30),
                      checkpoint_every=checkpoint_every, backup_factor=backup_factor, network=network,
                      async_checkpoints=False, deploy_rounds=deploy_rounds)
    seen = 0

    def on_round(cluster: LocalCluster) -> None:
        nonlocal seen
        injector(cluster)
        events = list(cluster.timeline)
        for _, kind, info in events[seen:]:
            story.append((cluster.round, kind, _plain(info)))
        seen = len(events)

    try:
        cl.run(on_round=on_round, max_rounds=50 * num_epochs + 500, poll_s=0.0, timeout_s=600.0)
        results = {name: cl.results(name) for name in rq.sinks}
        failures += check_outputs(rq, results, serial_results(rq, build))
        if cl.job.state is not JobState.FINISHED:
            failures.append(f"the job ended {cl.job.state.value}, not finished")
    except Exception as exc:  # any crash of the runtime is a finding, reported with the seed
        failures.append(f"the run raised {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}")
    finally:
        landings = injector.judge(cl)
        failures += [f"fault {x.fault.describe()} did not land: {x.effect}" for x in landings
                     if not x.landed and not x.effect.startswith("inapplicable")]
        cl.close()
    return SimResult(seed, shape, landings, failures, cl.round, time.perf_counter() - t0, story)


def run_seeds(seeds: Iterable[int], kinds: list[str] | None = None, jobs: int = 1) -> Iterator[SimResult]:
    """``run_seed`` over ``seeds``, in order, on ``jobs`` processes (each seed's run is the same
    whichever process runs it: every choice comes from the seed)."""
    if jobs <= 1:
        for seed in seeds:
            yield run_seed(seed, kinds)
        return
    # (spawned, not forked: the caller may hold threads, e.g. a Ray client's)
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_die_with_parent) as pool:
        yield from pool.map(functools.partial(run_seed, kinds=kinds), seeds, chunksize=2)


def _die_with_parent() -> None:
    """A worker process ends with the campaign's process (Linux ``PR_SET_PDEATHSIG``): a campaign
    killed mid-way leaves no worker running seeds for no one."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # (not Linux: the worker ends when it finds its task queue gone)


_PR_SET_PDEATHSIG = 1


def _plain(info: dict) -> str:
    """A timeline event's details, without wall-clock fields (the story repeats bit for bit): a
    migration's transfers without their measured pauses."""
    shown = {k: v for k, v in info.items() if not k.endswith(("_s", "_ms", "time"))}
    if "transfers" in shown:
        shown["transfers"] = [tuple(t)[:4] for t in shown["transfers"]]
    return " ".join(f"{k}={v}" for k, v in sorted(shown.items()))


def fault_counts(results: list[SimResult]) -> dict[str, int]:
    """Faults that landed, by kind, over ``results``."""
    out = {k: 0 for k in FAULT_KINDS}
    for r in results:
        for x in r.faults:
            out[x.fault.kind] += x.landed
    return out


__all__ = ["SimResult", "run_seed", "run_seeds", "serial_results", "fault_counts", "Fault"]
