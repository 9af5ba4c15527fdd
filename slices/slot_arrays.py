"""Room for more slots in dense per-slot arrays, without a stall that grows with them.

Owns: how a set of equally long numpy arrays indexed by a slot (the built-in
aggregate's running values and its dirty mask) gets longer, and how several
slices' sets are laid out back to back (``SlotArena``). Knows nothing
of keys, operators or checkpoints; the caller says how many slots are in
use and which slots it wrote.

Doubling the arrays when they are full copies all of them on the thread
that needs the room, inside one epoch: 76-166 ms for a 16 M-slot
aggregate of four arrays (one process, 2026-11-25), against 21-37 ms for
its usual batch, and twice as long at every next doubling. Large arrays
(``SPREAD_MIN`` slots and more) therefore start their next doubling early,
once ``START_SHARE`` of them is in use: ``SpreadGrowth`` holds the doubled
arrays and copies a share of the used slots into them at each call, at
least ``STEP_MIN`` slots and, while keys keep coming, enough to be done
before the old arrays are full; the caller mirrors its writes into them
meanwhile. When the copy has reached the slots in use the doubled arrays
replace the old ones. The doubled arrays are ``np.zeros``: zero pages,
touched only as slots are copied or used.

>>> arrays = {"count": np.arange(8, dtype=np.int64)}
>>> g = SpreadGrowth(arrays, capacity=16, step_min=3)
>>> g.step(arrays, in_use=6), g.copied
(False, 3)
>>> arrays["count"][1] = 100; g.mirror(arrays, np.array([1]))
>>> g.step(arrays, in_use=6), g.new["count"][:7].tolist()
(True, [0, 100, 2, 3, 4, 5, 0])
"""

from __future__ import annotations

import numpy as np

#: Arrays shorter than this double at once when full (a copy of a few ms at most).
SPREAD_MIN = 1 << 20
#: A spread doubling starts once this share of the slots is in use.
START_SHARE = 0.75
#: Slots a call copies at least while a spread doubling runs.
STEP_MIN = 1 << 17


def doubled_capacity(in_use: int, capacity: int) -> int:
    """The new length of arrays of ``capacity`` slots that must hold ``in_use``: twice, or more if asked.

    >>> doubled_capacity(100, 80), doubled_capacity(400, 80), doubled_capacity(1, 0)
    (160, 400, 64)
    """
    return max(in_use, capacity * 2, 64)


def should_start_spread(in_use: int, capacity: int) -> bool:
    """Whether arrays of ``capacity`` slots with ``in_use`` of them used should start doubling now.

    >>> should_start_spread(800_000, 1_000_000)  # small: they double at once when full
    False
    >>> should_start_spread(13 << 20, 16 << 20), should_start_spread(11 << 20, 16 << 20)
    (True, False)
    """
    return capacity >= SPREAD_MIN and in_use > START_SHARE * capacity


class SpreadGrowth:
    """Doubled copies of ``arrays`` (same names and dtypes, ``capacity`` slots), filled a share per step."""

    def __init__(self, arrays: dict[str, np.ndarray], capacity: int, step_min: int | None = None) -> None:
        self.new = {name: np.zeros(capacity, dtype=a.dtype) for name, a in arrays.items()}
        self.old_capacity = min((len(a) for a in arrays.values()), default=0)
        self.copied = 0  # slots [0, copied) of ``new`` equal the old arrays'
        self.step_min = STEP_MIN if step_min is None else step_min
        self._in_use_seen: int | None = None

    def step(self, arrays: dict[str, np.ndarray], in_use: int) -> bool:
        """Copy the next share of the ``in_use`` slots; True once all of them are copied.

        The share is the used slots left to copy times the slots taken since the last step
        over the room the old arrays still have (so the copy ends before they are full), and
        at least ``step_min``.
        """
        added = 0 if self._in_use_seen is None else max(0, in_use - self._in_use_seen)
        self._in_use_seen = in_use
        in_use = min(in_use, self.old_capacity)
        left = in_use - self.copied
        room = max(1, self.old_capacity - in_use)
        hi = min(in_use, self.copied + max(self.step_min, -(-left * added // room)))
        for name, a in arrays.items():
            self.new[name][self.copied:hi] = a[self.copied:hi]
        self.copied = max(self.copied, hi)
        return self.copied >= in_use

    def finish(self, arrays: dict[str, np.ndarray], in_use: int) -> dict[str, np.ndarray]:
        """Copy what is left of the ``in_use`` slots; the doubled arrays, ready to replace the old.

        Slots past the old arrays' end (``in_use`` above their capacity: a batch brought more
        keys than they had room for) hold nothing yet and stay zero.
        """
        in_use = min(in_use, self.old_capacity)
        for name, a in arrays.items():
            self.new[name][self.copied:in_use] = a[self.copied:in_use]
        self.copied = max(self.copied, in_use)
        return self.new

    def mirror(self, arrays: dict[str, np.ndarray], slots: np.ndarray) -> None:
        """Repeat the caller's writes at ``slots`` (already made in ``arrays``) in the doubled arrays.

        Only slots already copied: the copy takes the others as they are then. Writing those
        too would touch the doubled arrays' zero pages all over at once (a first batch of
        46,000 slots among 12 M: 165 ms of page faults).
        """
        copied = slots[slots < self.copied]
        if len(copied):
            for name, a in arrays.items():
                self.new[name][copied] = a[copied]


#: A group's arena stays under this many bytes: a rebuild (a member outgrew its stretch, or
#: the group changed) copies all of it inside one epoch.
ARENA_MAX_BYTES = 64 << 20


class SlotArena:
    """Several slices' slot arrays back to back: one array per name, each slice's arrays views of its stretch.

    A group of slices then reads and writes every slice's values with one gather and one
    scatter per array, at ``offsets[member] + slot``, where one per slice cost a few numpy
    calls each (64 slices: half a millisecond an epoch). The members' own arrays are the
    views (``views[i]``): whatever reads or writes a member alone (a checkpoint, a restore,
    a batch outside the group) sees the same values. A member that replaces an array
    (grown, restored) has left the arena: the caller checks that its arrays are still
    the views, else builds a new arena. Each stretch has room for ``capacities[i]``
    slots; the values past a member's arrays are zero.

    >>> arena = SlotArena([{"count": np.array([1, 2])}, {"count": np.array([5])}], capacities=[4, 2])
    >>> arena.offsets.tolist(), arena.views[1]["count"].tolist()
    ([0, 4], [5, 0])
    >>> arena.arrays["count"][arena.offsets[[0, 1]] + [1, 0]].tolist()
    [2, 5]
    >>> arena.views[0]["count"][3] = 7; arena.arrays["count"].tolist()
    [1, 2, 0, 7, 5, 0]
    """

    def __init__(self, members: list[dict[str, np.ndarray]], capacities: list[int]) -> None:
        caps = np.asarray(capacities, dtype=np.int64)
        self.capacities = caps
        self.offsets = np.concatenate((np.zeros(1, np.int64), np.cumsum(caps)[:-1]))
        total = int(caps.sum())
        dtypes = {name: a.dtype for m in members for name, a in m.items()}
        self.arrays = {name: np.zeros(total, dtype=dtype) for name, dtype in dtypes.items()}
        self.views: list[dict[str, np.ndarray]] = []
        for m, lo, cap in zip(members, self.offsets.tolist(), caps.tolist()):
            view = {name: a[lo:lo + cap] for name, a in self.arrays.items()}
            for name, a in m.items():
                n = min(len(a), cap)
                view[name][:n] = a[:n]
            self.views.append(view)

    @staticmethod
    def bytes_for(capacities: list[int], itemsizes: list[int]) -> int:
        """The bytes an arena of these stretches and arrays of these item sizes holds.

        >>> SlotArena.bytes_for([4, 2], [8, 1])
        54
        """
        return sum(capacities) * sum(itemsizes)
