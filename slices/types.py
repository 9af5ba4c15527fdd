"""Core identifiers and system column names shared by every layer.

Owns: the names of the system columns every stream batch carries, the
derived key-codes column routing adds, and the lineage encoding of the
within-event sub-order. Ids (slices, containers, stages, streams, epochs)
are plain ints. Knows nothing of Ray, lmdb or any executor.
"""

from __future__ import annotations

import numpy as np

#: Global source order of the input event a row derives from (dense from 0
#: over all sources of a job). Assigned once, at the source; never changes.
ORDER = "_order"
#: Lexicographic position of a row among the rows derived from the same input
#: event (see `extend_sub_order`). Source rows carry 0.
SUB = "_sub"
#: Identity of a row on its stream: the producer slice and its dense out_seq.
SLICE = "_slice"
SEQ = "_seq"

SYSTEM_COLUMNS = (ORDER, SUB, SLICE, SEQ)
#: The "event" a dead letter names when an operator's end-of-input hook (``Operator.on_end``) raised.
END_OF_INPUT = "<end of input>"

#: Prefix of the column routing adds beside a stream's one string key column
#: for consumers that group by it: the key dictionary-encoded, as routing's
#: hash computed it, so the consumer does not encode the key again.
KEY_CODES_PREFIX = "_codes."


def key_codes_column(key: str) -> str:
    """Name of the routed dictionary codes of key column ``key``.

    >>> key_codes_column("word")
    '_codes.word'
    """
    return KEY_CODES_PREFIX + key


#: Field metadata of the key-codes column: uint64s (native byte order), the
#: ``binary_fingerprint`` of the dictionary routing encoded, then the stable
#: hash of each of its values, so the consumer does not hash the keys again.
#: A merge of several senders' parts unifies their dictionaries and keeps one
#: part's metadata: the consumer trusts the hashes only for a dictionary with
#: that fingerprint.
KEY_HASHES_META = b"chronostream.key_hashes"

#: Bits reserved per fan-out level in the sub-order. An operator may produce
#: at most 2**SUB_FANOUT_BITS rows from one input row, and a row may pass
#: through at most MAX_FANOUT_LEVELS fan-out operators (flat_map, user
#: operators) before the 63-bit sub-order would overflow.
SUB_FANOUT_BITS = 20
MAX_FANOUT_LEVELS = 63 // SUB_FANOUT_BITS
_SUB_LIMIT = 1 << (63 - SUB_FANOUT_BITS)


class LineageOverflow(ValueError):
    """A row's lineage went through too many fan-out levels (see SUB_FANOUT_BITS)."""


def extend_sub_order(parent_sub: np.ndarray, child_index: np.ndarray) -> np.ndarray:
    """Return the sub-order of rows produced from parents, vectorized.

    The child of a parent with sub-order ``s`` that is the ``k``-th row the
    operator produced for that parent gets ``s * 2**SUB_FANOUT_BITS + k``, so
    comparing sub-orders as integers compares lineage paths lexicographically:
    exactly the order a depth-first serial run would see them in.

    >>> extend_sub_order(np.array([0, 0, 1]), np.array([0, 1, 0])).tolist()
    [0, 1, 1048576]
    """
    parent_sub = np.asarray(parent_sub, dtype=np.int64)
    child_index = np.asarray(child_index, dtype=np.int64)
    if parent_sub.size and int(parent_sub.max()) >= _SUB_LIMIT:
        raise LineageOverflow(
            f"a row went through more than {MAX_FANOUT_LEVELS} fan-out operators; "
            "the sub-order would overflow"
        )
    if child_index.size and int(child_index.max()) >= (1 << SUB_FANOUT_BITS):
        raise LineageOverflow(
            f"an operator produced more than {1 << SUB_FANOUT_BITS} rows from one input row"
        )
    return (parent_sub << SUB_FANOUT_BITS) | child_index
