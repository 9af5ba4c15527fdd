"""Throughput by slice count in one container (paper Fig. 21): what finer slices cost.

One container runs a word count (vectorized ``flat_map_batches`` split and
the built-in ``count``) on seeded Zipf text, in one process (the runtime's
container cores, ``executor="local"``, one container per stage), with 1,
2, 4, 8, 16 and 64 slices in the counting stage. More slices mean finer
units of migration and recovery; the cost is per-slice work per epoch
(cutting the epoch's rows by slice, admitting them, the operator's key
lookups and state updates per slice). A container runs its slices of a
fusing operator (the built-in aggregates) as one group: one merge, one
operator call and one numbering per epoch for all of them
(``slices/group.py``). Reported per slice count: events/s (median of
``--repeat`` runs, the configurations interleaved run by run so drift hits
them alike) and the overhead against 1 slice, with groups (the default)
and with every slice run alone (``alone_*``, groups turned off).

    python -m benchmarks.slices --json
    python -m benchmarks.slices --json --words 2000000 --epoch 65536
    python -m benchmarks.slices --json --counts 1,64 --repeat 9   # one ratio, more runs
    python -m benchmarks.slices --json --chained   # a vectorized map after the count

``--rekey`` counts the counts: a second built-in ``count`` keyed by the
first one's ``count`` column, in as many slices. Its slices get each
line's rows from many of the first stage's slices, interleaved, to be put
back into source order every epoch, by routing, in the copy into slice
order it makes anyway (``containers.routing.by_consumer_slice``).

    python -m benchmarks.slices --json --rekey --counts 1,64 --repeat 5

``--ray`` runs each job on Ray instead (one container a stage, each an actor
process of its own; the source's and the first count's outputs go to output
logs for replay, as in any Ray job) and times its processing (``job.wait()``:
from every container started to the last epoch, actor start-up left out).
A stage's slices always run as a group there: no ``alone_*`` figures. Rows
then carry ``busy_s_by_stage`` (each stage's containers' busy seconds, the
median over the runs): the busiest stage's process bounds the run, and with
more slices the producer's routing (hashing the key, ordering rows by
consumer slice) grows while the consumer's work shrinks; and
``send_s_by_stage`` (seconds each stage's containers spent handing their
epoch messages to the transport, outside their busy time). ``--no-shm``
sends every message through Ray's object store (``shm_transport=False``).

    python -m benchmarks.slices --json --ray --counts 1,64 --repeat 3 --words 10000000 --rekey

``--chained`` puts a stateless step after the count (``map_batches`` adding
a column): a group runs it once over the group's output; the ``alone_*``
figures run such a stage slice by slice.
``--per-event`` counts with a per-event operator (``WordTally``: registered
state, one ``produce`` an event): a group admits, merges and turns the rows
into dicts once, runs each slice's loop over its share, then builds, chains and
numbers one output table (the schema is declared; slices/group.py).

    python -m benchmarks.slices --json --per-event --words 200000 --epoch 1024

``--undeclared`` (with ``--per-event``): ``WordTally`` without its output
schema. A group builds each slice's output table as alone (Arrow infers
its types) and, when every slice's inferred schema is the same, joins them
and chains and numbers them once.

``--vectorized`` counts with a user's vectorized operator that does not fuse
slices (``BatchWordCount``: ``consume_batch`` with Arrow and numpy, one
state lookup per distinct word of a batch): a group admits and merges once,
then runs each slice's call on its share.

``--join`` runs a keyed join instead of the word count: ``--words`` orders
joined with a twentieth as many customer updates on one of 20,000
customers (seeded, uniform keys, event-time order), the join in
``--counts`` slices; its slices run as a group (one admission per input,
one merge).

    python -m benchmarks.slices --json --join --words 60000 --epoch 2048 --counts 1,64 --repeat 5

``--topk`` runs the paper's own Fig. 21 application instead: Top-K frequent
words per category (``examples.topk``: a sliding window of each category's
last ``--window`` words, then its 10 most frequent, both per-event operators
with declared output schemas, each stage in ``--counts`` slices) over
``--words`` words of ``topic_text`` (seeded; ``--categories`` categories,
Zipf 0.5, so that 64 slices all have keys; stop words dropped before the
window). Events are the word events that reach the window; the paper
measured 1 to 10 slices (worst case +4.69%).

    python -m benchmarks.slices --json --topk --words 300000 --epoch 2048 --repeat 3

``--floor`` measures what no layout of a many-slice run removes: the
one-slice count's output shares the split's buffers down to
``job.results``, while with more slices ``results`` gives each slice's rows
together (identity order), so the columns that pass through the count
unchanged (the word, ``_order``, ``_sub``) are moved into slice order once.
It runs the one-slice count (``--repeat`` times), cuts its output by epoch,
and times taking each epoch's rows in the order the largest of
``--counts`` would give them (``containers.routing.by_consumer_slice``
over the same hash), for every output column, for the pass-through ones,
and for the word alone; rows give each as milliseconds a run and as a
share of the one-slice run.

    python -m benchmarks.slices --json --floor --repeat 9
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import chronostream as cs
from benchmarks.common import emit, median, parser
from chronostream.datasets import split_words, topic_text, zipf_text
from chronostream.slices.sorting import take_permuted
from chronostream.slices.types import ORDER, SUB
from chronostream.containers.core import ContainerCore
from chronostream.containers.routing import by_consumer_slice, consumer_slices
from examples.topk import split_category_words, topk_query

COUNTS = (1, 2, 4, 8, 16, 64)


def doubled_count(batch: pa.Table) -> pa.Table:
    """The ``--chained`` step: the batch with a column ``twice`` = 2 x ``count``."""
    return batch.append_column("twice", pc.multiply(batch["count"], 2))


class WordTally(cs.Operator):
    """The ``--per-event`` count: a per-event operator with registered state, one row an event
    (``word``, ``count``), as a user would write it, its output schema declared (a group then
    builds one output table for all its slices)."""

    output_schemas = {"out": pa.schema([("word", pa.string()), ("count", pa.int64())])}

    def setup(self) -> None:
        self.counts = self.register_state("counts")

    def consume(self, stream_id: str, event: dict) -> None:
        n = self.counts.get(event["word"], 0) + 1
        self.counts.set(event["word"], n)
        self.produce("out", {"word": event["word"], "count": n})


class UndeclaredWordTally(WordTally):
    """``--undeclared``: ``WordTally`` whose output types Arrow infers, per slice and epoch."""

    output_schemas: dict[str, pa.Schema] = {}


class BatchWordCount(cs.Operator):
    """The ``--vectorized`` count: ``consume_batch`` with Arrow and numpy, as a user would write
    it without ``consume_slices`` (so slices are not fused): each row gets its word's running
    count; the words' counts before the batch come from registered state, one lookup and one
    update per distinct word of the batch."""

    def setup(self) -> None:
        self.counts = self.register_state("counts")

    def consume_batch(self, stream_id: str, batch: pa.Table) -> None:
        encoded = pc.dictionary_encode(batch["word"]).combine_chunks()
        codes = np.asarray(encoded.indices, dtype=np.int64)
        words = encoded.dictionary.to_pylist()
        before = np.array([self.counts.get(w, 0) for w in words], dtype=np.int64)
        by_word = np.argsort(codes, kind="stable")
        run_start = np.searchsorted(codes[by_word], codes[by_word])  # first row of each word's run
        nth = np.empty(len(codes), dtype=np.int64)
        nth[by_word] = np.arange(len(codes)) - run_start  # the row's place among its word's rows
        for w, n in zip(words, (before + np.bincount(codes, minlength=len(words))).tolist()):
            self.counts.set(w, n)
        self.produce_batch("out", batch.select(["word", ORDER, SUB]).append_column(
            "count", pa.array(before[codes] + nth + 1)))


def word_count(table, slices: int, epoch: int, chained: bool = False, per_event: bool = False,
               vectorized: bool = False, undeclared: bool = False, rekey: bool = False) -> cs.Query:
    """The benchmark's query: ``table``'s lines split into words (one source slice), counted by
    the built-in ``count`` (``per_event``: by ``WordTally``; ``vectorized``: by
    ``BatchWordCount``) in ``slices`` slices (stage ``count``), into the memory sink ``counts``;
    ``chained``: through ``doubled_count`` on the way; ``undeclared``: ``UndeclaredWordTally``;
    ``rekey``: then counted again keyed by the count (stage ``by_count``, ``slices`` slices too:
    how many words have reached each count so far)."""
    q = cs.Query(epoch_events=epoch)
    words = q.source("lines", table, slices=1).flat_map_batches(split_words).key_by("word")
    counter = (UndeclaredWordTally if undeclared else WordTally) if per_event else \
        BatchWordCount if vectorized else None
    counts = (words.apply(counter, slices=slices, name="count") if counter is not None
              else words.count(slices=slices, name="count"))
    counts = counts.map_batches(doubled_count) if chained else counts
    if rekey:
        counts = counts.key_by("count").count(slices=slices, name="by_count")
    counts.sink(name="counts")
    return q


def orders_and_customers(n_orders: int, seed: int = 5) -> tuple[pa.Table, pa.Table]:
    """The ``--join`` inputs: ``n_orders`` orders and ``n_orders // 20`` customer updates, each
    on one of 20,000 customers (uniform), with event times ``t`` in increasing order."""
    rng = np.random.default_rng(seed)
    n_cust = max(1, n_orders // 20)
    cust = pa.table({"cust": rng.integers(0, 20_000, n_cust), "tier": rng.choice(["a", "b", "c"], n_cust),
                     "t": np.sort(rng.integers(0, 10**6, n_cust))})
    orders = pa.table({"cust": rng.integers(0, 20_000, n_orders), "qty": rng.integers(1, 9, n_orders),
                       "t": np.sort(rng.integers(0, 10**6, n_orders))})
    return orders, cust


def join_query(inputs: tuple[pa.Table, pa.Table], slices: int, epoch: int) -> cs.Query:
    """The ``--join`` query: orders x customer updates on ``cust`` in ``slices`` slices (stage
    ``join``), into the memory sink ``counts``."""
    orders, cust = inputs
    q = cs.Query(epoch_events=epoch)
    o = q.source("orders", orders, order_by="t").key_by("cust")
    c = q.source("customers", cust, order_by="t").key_by("cust")
    cs.join(o, c, slices=slices, name="join").sink(name="counts")
    return q


def one_run(table, slices: int, epoch: int, grouped: bool = True, chained: bool = False,
            per_event: bool = False, vectorized: bool = False, join: bool = False, undeclared: bool = False,
            topk_window: int | None = None, rekey: bool = False, ray: bool = False,
            busy: list[dict[str, tuple[float, float]]] | None = None, shm: bool = True) -> float:
    """One job to its end in process: seconds from ``cs.run`` to its return (``table``: the
    mode's input; ``topk_window``: run the ``--topk`` query with that window). ``ray``: on Ray
    instead (one container a stage, each its own actor process, with output logs), the job's
    processing time (``job.wait()``: from every container started to the last epoch; actor
    start-up left out); its slices always run as groups there (``grouped`` must be True), and
    ``busy`` (when given) gets each stage's (busy seconds, seconds handing messages to the
    transport), its containers' ``busy_s`` and ``send_s``: which stage's process bounds the run;
    ``shm``: the shared-memory transport on (``JobOptions.shm_transport``)."""
    if topk_window is not None:
        q = topk_query(table, window=topk_window, slices=slices, epoch_events=epoch)
    elif join:
        q = join_query(table, slices, epoch)
    else:
        q = word_count(table, slices, epoch, chained, per_event, vectorized, undeclared, rekey)
    sink = "topk" if topk_window is not None else "counts"
    if ray:
        if not grouped:
            raise ValueError("on Ray a stage's slices always run as groups")
        job = cs.run(q, containers=1, shm_transport=shm, checkpoint_interval_s=0)
        try:
            elapsed = job.wait().elapsed_s
            # (not ``results``: collecting millions of rows through the master takes longer than the run)
            stats = job.statistics().values()
            assert sum(s.events_out for s in stats) > 0
            if busy is not None:
                by_stage: dict[str, tuple[float, float]] = {}
                for st in stats:
                    b, s = by_stage.get(st.stage, (0.0, 0.0))
                    by_stage[st.stage] = (b + st.busy_s, s + st.send_s)
                busy.append(by_stage)
        finally:
            job.stop()
        return elapsed
    ContainerCore.GROUP_SLICES = grouped
    try:
        t0 = time.perf_counter()
        job = cs.run(q, executor="local", containers=1, checkpoint_interval_s=0)
        elapsed = time.perf_counter() - t0
    finally:
        ContainerCore.GROUP_SLICES = True
    assert job.results(sink).num_rows > 0
    return elapsed


#: ``--floor``'s column sets: every output column, the ones that pass through the count
#: unchanged (the key and the lineage), the key alone.
FLOOR_COLUMNS = {"all": None, "pass_through": ["word", ORDER, SUB], "word": ["word"]}


def slice_ordered_epochs(out: pa.Table, slices: int, epoch: int) -> list[tuple[pa.Table, np.ndarray]]:
    """The one-slice count's output ``out`` cut by epoch (``epoch`` lines each; a word's
    ``_order`` is its line's), each with the permutation that puts its rows in the order a
    ``slices``-slice count's output holds them: by consumer slice, each slice's rows as they
    came (routing's, ``by_consumer_slice``, over the same hash of the word)."""
    order = np.asarray(out.column(ORDER))
    cuts = np.searchsorted(order, np.arange(0, int(order.max()) + epoch + 1, epoch)).tolist()
    chunks = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        if hi > lo:
            t = out.slice(lo, hi - lo)
            perm = by_consumer_slice(consumer_slices(t, ("word",), slices), t)
            chunks.append((t, np.arange(t.num_rows) if perm is None else perm))
    return chunks


def copy_floor(table: pa.Table, slices: int, epoch: int, repeat: int) -> dict:
    """``--floor``: the one-slice run's median seconds, and per column set (``FLOOR_COLUMNS``) the
    median milliseconds of taking its output into ``slices``-slice order, epoch by epoch."""
    one = [one_run(table, 1, epoch) for _ in range(repeat)]
    out = cs.run(word_count(table, 1, epoch), executor="local", containers=1,
                 checkpoint_interval_s=0).results("counts")
    chunks = slice_ordered_epochs(out, slices, epoch)
    base = median(one)
    rows = []
    for name, cols in FLOOR_COLUMNS.items():
        picked = [(t if cols is None else t.select(cols), perm) for t, perm in chunks]
        for t, perm in picked:  # (warm: a process's first takes are slower)
            take_permuted(t, perm)
        took = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            for t, perm in picked:
                take_permuted(t, perm)
            took.append(time.perf_counter() - t0)
        rows.append({"columns": name, "names": picked[0][0].schema.names, "copy_ms": round(median(took) * 1e3, 1),
                     "pct_of_one_slice": round(median(took) / base * 100, 1)})
    return {"one_slice_s": round(base, 3), "one_slice_runs_s": [round(t, 3) for t in one], "slices": slices,
            "epochs": len(chunks), "rows": rows}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--words", type=int, default=1_000_000, help="words of text (default 1,000,000)")
    p.add_argument("--epoch", type=int, default=4096, help="lines per epoch (default 4096)")
    p.add_argument("--counts", default=",".join(map(str, COUNTS)),
                   help="slice counts, comma-separated; 1 is always run (the baseline)")
    p.add_argument("--chained", action="store_true", help="a vectorized map after the count")
    p.add_argument("--rekey", action="store_true",
                   help="a second count after the first, keyed by the count, in as many slices")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--per-event", action="store_true",
                     help="count with a per-event operator (WordTally) instead of the built-in count")
    how.add_argument("--vectorized", action="store_true",
                     help="count with a user's vectorized operator that does not fuse slices (BatchWordCount)")
    how.add_argument("--join", action="store_true",
                     help="a keyed join of --words orders with customer updates instead of the word count")
    how.add_argument("--topk", action="store_true",
                     help="the paper's Fig. 21 application: Top-K frequent words per category (examples.topk)")
    p.add_argument("--no-shm", action="store_true",
                   help="with --ray: epoch messages through Ray's object store only (no shared-memory files)")
    p.add_argument("--ray", action="store_true",
                   help="run each job on Ray (one container a stage) and time its processing; no alone_* runs")
    p.add_argument("--undeclared", action="store_true",
                   help="with --per-event: the operator declares no output schema (Arrow infers it per slice)")
    p.add_argument("--categories", type=int, default=1000, help="with --topk: categories of the text (default 1000)")
    p.add_argument("--window", type=int, default=1000, help="with --topk: words per category's window (default 1000)")
    p.add_argument("--floor", action="store_true",
                   help="time moving the one-slice count's output into the largest --counts' slice order")
    args = p.parse_args()
    if args.floor and (args.ray or args.chained or args.rekey or args.per_event or args.vectorized or args.join
                       or args.topk):
        raise SystemExit("--floor goes with the built-in word count in process (no other mode flag)")
    if args.undeclared and not args.per_event:
        raise SystemExit("--undeclared goes with --per-event")
    if args.rekey and (args.join or args.topk):
        raise SystemExit("--rekey goes with the word count (not --join or --topk)")
    counts = sorted({1} | {int(x) for x in args.counts.split(",")})
    if counts[0] < 1:
        raise SystemExit(f"--counts: a slice count must be at least 1, got {counts[0]}")
    if args.floor and counts[-1] < 2:
        raise SystemExit("--floor needs a slice count above 1 in --counts (the order it moves rows into)")
    words = 100_000 if args.quick else args.words
    if args.topk:
        table = topic_text(words // 10, categories=args.categories)  # 10 words per line
        n_words = split_category_words(table)[0].num_rows  # word events into the window
    elif args.join:
        table = orders_and_customers(words)
        n_words = table[0].num_rows + table[1].num_rows  # events in
    else:
        table = zipf_text(words // 10, seed=1)  # 10 words per line
        n_words = sum(len(line.split()) for line in table.column("line").to_pylist())
    if args.floor:
        emit({"words": n_words, "lines": table.num_rows, "epoch_lines": args.epoch,
              **copy_floor(table, counts[-1], args.epoch, 1 if args.quick else args.repeat)}, args.json)
        return
    times: dict[tuple[int, bool], list[float]] = {(n, g): [] for n in counts for g in (True, False)}
    busy: dict[int, list[dict[str, tuple[float, float]]]] = {n: [] for n in counts}  # (--ray) stage -> busy, send s
    # 1 slice: no group to turn off; on Ray, groups cannot be turned off.
    configs = [(n, g) for n in counts for g in (True, False) if g or (n > 1 and not args.ray)]
    if args.ray:
        cs.ensure_ray()
    for r in range(1 if args.quick else args.repeat):
        for n, g in (configs if r % 2 == 0 else configs[::-1]):
            times[(n, g)].append(one_run(table, n, args.epoch, grouped=g, chained=args.chained,
                                            per_event=args.per_event, vectorized=args.vectorized,
                                            join=args.join, undeclared=args.undeclared,
                                            topk_window=args.window if args.topk else None, rekey=args.rekey,
                                            ray=args.ray, busy=busy[n] if args.ray else None,
                                            shm=not args.no_shm))
    times[(1, False)] = times[(1, True)]
    base = median(times[(1, True)])
    rows = [{"slices": n, "events_per_s": round(n_words / median(times[(n, True)])),
             "overhead_pct": round((median(times[(n, True)]) / base - 1) * 100, 1),
             "alone_events_per_s": round(n_words / median(times[(n, False)])) if times[(n, False)] else None,
             "alone_overhead_pct": round((median(times[(n, False)]) / base - 1) * 100, 1)
             if times[(n, False)] else None,
             "runs_s": [round(t, 3) for t in times[(n, True)]],
             "alone_runs_s": [round(t, 3) for t in times[(n, False)]],
             # (--ray) each stage's busy seconds (processing epochs), and its seconds handing their
             # messages to Ray (``send_s``), medians over the runs: the busiest process bounds the job
             "busy_s_by_stage": {st: round(median([b[st][0] for b in busy[n]]), 3) for st in busy[n][0]}
             if busy[n] else None,
             "send_s_by_stage": {st: round(median([b[st][1] for b in busy[n]]), 3) for st in busy[n][0]}
             if busy[n] else None} for n in counts]
    emit({"words": n_words, "lines": None if args.join else table.num_rows, "epoch_lines": args.epoch,
          "chained": args.chained, "rekey": args.rekey, "ray": args.ray, "shm": args.ray and not args.no_shm,
          "per_event": args.per_event,
          "vectorized": args.vectorized, "join": args.join,
          "undeclared": args.undeclared, "topk": args.topk,
          "categories": args.categories if args.topk else None, "window": args.window if args.topk else None,
          "rows": rows}, args.json)


if __name__ == "__main__":
    main()
