"""Covering designs: which rows of axis values a ``design = "covering"`` matrix runs.

The ``exhaustive`` axes are a full product; every other axis is assigned so that each pair of
values of two axes (one of them free at least) appears in a row that *runs* both values -- a
cell keeps every value it was given (:func:`dishonest_axes`) and no ``[[skip]]`` of the matrix
lists it. One design is shared by a matrix's fixtures and paths (every legacy cell has its native
twin); a fixture some of whose rows a skip lists gets rows of its own beside them that run
the pairs only those rows held (:func:`fixture_designs`), so a skip never silently takes a pair
away. A ``singly`` axis has each of its values in a running row, not in every pair.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable

from parity.arguments import MAX_MICROBATCHES
from parity.errors import UsageError
from parity.matrix.cell import SYNC, Cell


def accumulation(source: str, value) -> tuple[int, str]:
    k, _, sync = str(value).partition(":")
    micro = int(k) if re.fullmatch(r"[0-9]{1,4}", k) else 0  # ASCII digits: int() also reads "1_0", " 3", "３"
    sync = sync or "every"
    if not 1 <= micro <= MAX_MICROBATCHES or sync not in SYNC:
        raise UsageError(f"{source}: axes.accumulation has unknown value {value!r}; valid: 1, K:every, K:last, "
                         f"K:replicas-last (1 <= K <= {MAX_MICROBATCHES})")
    return micro, sync


def covering(axes: dict[str, list], exhaustive: list[str], dishonest=None, start: list[dict] | None = None,
             singly: tuple[str, ...] = ()) -> list[dict]:
    """Full product over ``exhaustive`` axes; the others are assigned greedily so every
    pair of values of two axes (at least one of them free) appears in some row, and each
    value of a ``singly`` axis in some row (not in every pair: a value only a few exhaustive
    combinations can run would multiply the rows, a checkpoint move costing the most).
    ``dishonest(row)`` (optional) names the axes whose value a row would not really run (a
    cell normalizes values it cannot run, e.g. evaluations between micro-batches of a
    one-micro-batch cell): free values go where they stay honest, a pair counts as covered
    only by a row that runs both values, and a pair no row can run is not covered."""
    dishonest = dishonest or (lambda row: set())
    free = [a for a in axes if a not in exhaustive]
    paired = [a for a in axes if a not in singly]

    def covers(row, skip=frozenset()):
        """What ``row`` covers: its pairs of paired axes, its values of singly ones."""
        keys = [a for a in paired if a in row and a not in skip]
        out = {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(keys, 2) if a in free or b in free}
        return out | {((a, row[a]),) for a in singly if a in row and a not in skip}

    uncovered = {
        ((a, va), (b, vb))
        for a, b in itertools.combinations(paired, 2) if a in free or b in free
        for va in axes[a] for vb in axes[b]
    } | {((a, v),) for a in singly for v in axes[a]}

    used = {a: {v: 0 for v in axes[a]} for a in free}

    def fill(row):
        # values the row runs first, then the most new pairs, then the least-used value,
        # so free axes stay balanced
        for a in free:
            if a not in row:
                row[a] = max(
                    axes[a],
                    key=lambda v: (-len(dishonest({**row, a: v})), len(covers({**row, a: v}) & uncovered),
                                   -used[a][v], -axes[a].index(v)),
                )
        return row

    rows = []

    def keep(row):
        """A row of the design: its values count as used, what it runs as covered."""
        rows.append(row)
        for a in free:
            used[a][row[a]] += 1
        uncovered.difference_update(covers(row, dishonest(row)))

    bases = [dict(zip(exhaustive, base)) for base in itertools.product(*(axes[a] for a in exhaustive))]
    for base in (bases if start is None else ()):
        keep(fill(dict(base)))
    for row in start or ():  # kept as they are
        keep(dict(row))
    while uncovered:
        key = min(uncovered, key=repr)  # a pair, or one value of a singly axis
        named = {a for a, _ in key}
        runs = [r for r in (fill({**base, **dict(key)}) for base in bases) if not named & dishonest(r)]
        # of the exhaustive combinations that run it, the one covering the most still missing
        row = max(runs, key=lambda r: len(covers(r, dishonest(r)) & uncovered), default=None)
        if row is None:  # no row runs it
            uncovered.discard(key)
            continue
        keep(row)
    return rows


def row_cell(row: dict, **fixed) -> Cell | None:
    """The cell made of ``row`` (other fields at their defaults, ``fixed`` over them); None
    where no cell can be."""
    fields = {k: v for k, v in row.items() if k in Cell.__dataclass_fields__}
    if "accumulation" in row:
        fields["microbatches"], fields["sync"] = accumulation("<row>", row["accumulation"])
    try:
        return Cell(**{"fixture": "", "path": "", **fields, **fixed})
    except UsageError:
        return None


def dishonest_axes(row: dict) -> set[str]:
    """The axes whose value a cell made of ``row`` would not keep; every axis when no cell can
    be made of it."""
    cell = row_cell(row)
    if cell is None:
        return set(row)
    out = {k for k in row if k in Cell.__dataclass_fields__ and getattr(cell, k) != row[k]}
    if "accumulation" in row and (cell.microbatches, cell.sync) != accumulation("<row>", row["accumulation"]):
        out.add("accumulation")
    return out


def rotated(rows: list[dict], rotate: dict[str, list]) -> list[dict]:
    """``rows`` with each ``rotate`` axis cycling through its values, row by row."""
    return [{**row, **{a: values[i % len(values)] for a, values in rotate.items()}} for i, row in enumerate(rows)]


def fixture_designs(axes: dict[str, list], exhaustive: list[str], fixtures: list[str],
                    skipped: Callable[[str, dict], bool], rotate: dict[str, list] | None = None,
                    singly: tuple[str, ...] = ()) -> dict[str, list[dict]]:
    """Fixture -> its design rows (``rotate``'s axes cycled over them): the shared covering,
    and, for a fixture some of whose rows ``skipped(fixture, row)`` (a ``[[skip]]`` lists the
    row's cell on some path), rows added after them that run the pairs only listed rows held,
    where some row can, each rotated axis at its first value. The listed rows stay (SKIP with
    their reason, never dropped)."""
    rotate = rotate or {}
    firsts = {a: values[0] for a, values in rotate.items()}
    shared = rotated(covering(axes, exhaustive, dishonest_axes, singly=singly), rotate)
    out = {}
    for f in fixtures:
        if not any(skipped(f, row) for row in shared):
            out[f] = shared
            continue
        listed = lambda row, f=f: skipped(f, {**firsts, **row})  # noqa: E731 - a new row takes the first values
        rows = covering(axes, exhaustive, lambda row: set(row) if listed(row) else dishonest_axes(row), start=shared,
                        singly=singly)
        out[f] = shared + [{**firsts, **row} for row in rows[len(shared):]]
    return out
