"""``--shard I/N``: one part of a matrix, so N CI jobs each run a part and ``parity merge`` joins them.

The unit of partition is the *pair group* (every path of one set of axis values): a group's
cells are compared with each other, so they always run in the same part.

Assignment is consistent hashing with bounded loads. Groups are taken in the order of a hash
of their id (not the matrix's order), each with its own order of preference over the parts
(rendezvous hashing: the parts sorted by a hash of group id and part number), and each goes to
the first part it prefers whose load stays under ``(1 + SLACK) x total / N`` (one that fits
in none goes to the least loaded part, so no part passes ``total / N + max_cost`` by it). A
group's part therefore depends on its own id and only weakly on the rest of the matrix: adding
or removing groups elsewhere moves few others (``tests/test_shard.py`` measures how few), and
the loads stay within the bound. Loads are :func:`~parity.matrix.cost.expected_cost`, a cell's
expected seconds from its axes (ranks, steps, micro-batches, mesh, checkpoint lifecycle or
move, compilation; a model's size is not known before it is built, so every model counts the
same).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from parity.errors import UsageError
from parity.matrix.cell import Cell
from parity.matrix.cost import expected_cost

#: How far above an even share a part's load may go before a group takes its next choice.
SLACK = 0.10


@dataclass(frozen=True)
class Shard:
    """Part ``index`` (1-based) of ``count``."""

    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


#: The most parts a matrix splits into: CI job matrices stop at a few hundred jobs (GitHub's at
#: 256), and every part is a job.
MAX_PARTS = 1024


def _number(digits: str) -> int:
    """``digits`` as an int; past 9 significant digits, one more than :data:`MAX_PARTS` (all that
    matters then is that it is too large, and thousands of digits hit ``int()``'s limit)."""
    significant = digits.lstrip("0") or "0"
    return int(significant) if len(significant) <= 9 else MAX_PARTS + 1


def parse_shard(text: str) -> Shard:
    """``"I/N"`` with 1 <= I <= N <= :data:`MAX_PARTS`; anything else is a one-line usage error."""
    found = re.fullmatch(r"([0-9]+)/([0-9]+)", str(text))  # ASCII digits: int() also reads "1_0", "+1", " 1"
    index, count = (_number(g) for g in found.groups()) if found else (0, 0)
    if not 1 <= index <= count:
        raise UsageError(f"{text!r} is not a part: give I/N with 1 <= I <= N, e.g. 2/8")
    if count > MAX_PARTS:
        raise UsageError(f"{text!r}: at most {MAX_PARTS} parts; split into fewer (each part is a CI job)")
    return Shard(index, count)


def _hash(*parts) -> int:
    return int.from_bytes(hashlib.sha256("\0".join(map(str, parts)).encode()).digest()[:8], "big")


def assign(cells: list[Cell], count: int) -> dict[str, int]:
    """``{pair group id: part index (1-based)}`` for every group of ``cells``."""
    costs: dict[str, float] = {}
    for c in cells:
        costs[c.pair_id] = costs.get(c.pair_id, 0.0) + expected_cost(c)
    bound = (1.0 + SLACK) * sum(costs.values()) / count
    loads = [0.0] * count
    parts: dict[str, int] = {}
    for group in sorted(costs, key=lambda g: (_hash("order", g), g)):
        prefs = sorted(range(count), key=lambda p: (_hash(group, p), p))
        part = next((p for p in prefs if loads[p] + costs[group] <= bound), min(range(count), key=loads.__getitem__))
        loads[part] += costs[group]
        parts[group] = part + 1
    return parts


def select_part(cells: list[Cell], shard: Shard) -> list[Cell]:
    """The cells of ``shard``'s part, in their order in ``cells``."""
    parts = assign(cells, shard.count)
    return [c for c in cells if parts[c.pair_id] == shard.index]


def selection_digest(cells: list[Cell]) -> str:
    """Names a matrix selection (its cell ids, in run order): parts of one selection share it."""
    return ids_digest([c.id for c in cells])


def ids_digest(cell_ids: list[str]) -> str:
    """:func:`selection_digest` of cells by their ids (a part's ``run.json`` lists them)."""
    return hashlib.sha256("\n".join(cell_ids).encode()).hexdigest()[:16]


def part_of(cells: list[Cell], shard: Shard, title: str) -> tuple[list[Cell], dict]:
    """The cells of ``shard``'s part and the ``shard`` entry its ``run.json`` records of the whole
    selection (:mod:`parity.report.merge` reads it): index, count, the selection's digest, cells and
    pair groups in a single run's order, and each of the part's cells' pair group."""
    from parity.matrix.order import order_cells, with_crossload

    cells = with_crossload(cells)  # the whole selection's paths, as one run would give them
    part = select_part(cells, shard)
    groups = list(dict.fromkeys(c.pair_id for c in order_cells(cells)))
    return part, {"index": shard.index, "count": shard.count, "digest": selection_digest(cells), "title": title,
                  "selection": [c.id for c in cells], "groups": groups, "cell_groups": [c.pair_id for c in part]}
