"""How long a cell is expected to run, from its axes alone: what balances the parts of a
sharded run (:mod:`parity.matrix.shard`) and interleaves a run's rank pools
(:mod:`parity.matrix.order`).

The coefficients are seconds, fitted to the per-cell run times (training, observation and
judging, nothing overlapped) of 1,047 cells of ``smoke``, ``default``, ``configs``,
``knobs``, ``compile`` and ``topologies`` on the 2-core reference machine
(``fixtures/measured_cell_seconds.csv``, remade by ``fixtures/measure_cell_seconds.py``);
they matter only relative to each other. A model's size is not known before it is built, so every
model counts the same.
"""

from __future__ import annotations

from parity.matrix.cell import Cell

#: Seconds every cell costs whatever it trains: building, the judge's bookkeeping, the records.
BASE = 0.04
#: Seconds of one optimizer step (one micro-batch) on one rank; ``ranks`` ranks sharing the
#: machine's cores take ``ranks ** 1.6`` times as long (their collectives on top of the compute).
STEP = 0.02
#: What each micro-batch after the first adds to a step, relative to the step.
MICROBATCH = 0.5
#: 2-D meshes: tensor-parallel and expert-parallel exchanges, and HSDP's replica reduction.
MESH = {"fsdp": 1.0, "hsdp": 1.2, "fsdp+tp": 2.0, "ep": 2.0}
#: The checkpoint lifecycle (train to the save, save, load into each path, one step more),
#: in steps of the cell's rank count, plus its fixed cost.
LIFECYCLE_STEPS, LIFECYCLE_BASE = 4.0, 0.1
#: A cell that also moves its checkpoint to another layout (ranks, micro-batches or mesh):
#: lifecycle and move together, measured as one (a second layout's model, its load and steps).
MOVE_STEPS, MOVE_BASE = 12.0, 0.2
#: Compiling the blocks: per model built (the lifecycle builds about twice as many; a compiled
#: cell that moves its checkpoint was not measured and counts as a lifecycle).
COMPILE = 0.7


def step_seconds(cell: Cell) -> float:
    """Expected seconds of one of ``cell``'s optimizer steps with one micro-batch."""
    return STEP * cell.ranks ** 1.6 * MESH.get(cell.mesh, 2.0)


def expected_cost(cell: Cell) -> float:
    """Expected seconds ``cell`` takes on the 2-core reference machine (a relative figure)."""
    step = step_seconds(cell)
    cost = BASE + cell.steps * step * (1.0 + MICROBATCH * (cell.microbatches - 1))
    if cell.move != "none":
        cost += MOVE_BASE + MOVE_STEPS * step
    elif cell.lifecycle:
        cost += LIFECYCLE_BASE + LIFECYCLE_STEPS * step
    if cell.compile != "none":
        cost += COMPILE * (2 if cell.lifecycle else 1)
    return cost
