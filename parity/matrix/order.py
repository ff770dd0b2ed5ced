"""How a run orders its cells and pairs their checkpoints (one rule for a whole run and for
each part of a sharded one)."""

from __future__ import annotations

from dataclasses import replace

from parity.matrix.cell import Cell


def order_cells(cells: list[Cell]) -> list[Cell]:
    """By rank count, then pair group in first-appearance order, the baseline first."""
    first: dict[str, int] = {}
    for i, c in enumerate(cells):
        first.setdefault(c.pair_id, i)
    return sorted(cells, key=lambda c: (c.ranks, first[c.pair_id], c.path != c.baseline))


def with_crossload(cells: list[Cell]) -> list[Cell]:
    """Each baseline cell cross-loads its checkpoint into every other path of ``cells`` (a part
    of a sharded run is given its whole selection's paths this way, before it is split)."""
    paths = list(dict.fromkeys(c.path for c in cells))
    return [replace(c, crossload=",".join(p for p in paths if p != c.baseline))
            if c.path == c.baseline and not c.crossload else c for c in cells]
