"""How a run orders its cells and pairs their checkpoints (one rule for a whole run and for
each part of a sharded one)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from parity.matrix.cell import Cell
from parity.matrix.cost import expected_cost


def order_cells(cells: list[Cell]) -> list[Cell]:
    """Pair groups in the order their rank pools would reach them working side by side.

    A run keeps one pool of ranks per rank count and lets every pool work on its next cell
    while the parent judges (:mod:`parity.runner`), but it judges cells in this order. Each
    rank count's pair groups keep their first-appearance order; a group's place is when its
    pool would start it if every pool ran its own groups back to back, by
    :func:`~parity.matrix.cost.expected_cost` -- so the 1-rank cells interleave with the
    2-rank ones instead of leaving a pool idle until the other is done. Within a group the
    baseline comes first. The order depends only on the cells: ``--resume`` relies on that,
    and ``merge`` writes a sharded run's records in the order of its whole selection (a part
    runs its own cells in their own order, which need not be the whole one's restricted)."""
    first: dict[str, int] = {}
    cost: Counter = Counter()
    world: dict[str, int] = {}
    for i, c in enumerate(cells):
        first.setdefault(c.pair_id, i)
        cost[c.pair_id] += expected_cost(c)
        world[c.pair_id] = c.ranks
    start: dict[str, float] = {}
    clock: Counter = Counter()
    for group in sorted(first, key=lambda g: (world[g], first[g])):
        start[group] = clock[world[group]]
        clock[world[group]] += cost[group]
    return sorted(cells, key=lambda c: (start[c.pair_id], c.ranks, first[c.pair_id], c.path != c.baseline))


def with_crossload(cells: list[Cell]) -> list[Cell]:
    """Each baseline cell cross-loads its checkpoint into every other path of ``cells`` (a part
    of a sharded run is given its whole selection's paths this way, before it is split)."""
    paths = list(dict.fromkeys(c.path for c in cells))
    return [replace(c, crossload=",".join(p for p in paths if p != c.baseline))
            if c.path == c.baseline and not c.crossload else c for c in cells]
