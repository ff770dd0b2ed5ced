"""How long a cell is expected to run, from its axes alone: what balances the parts of a
sharded run (:mod:`parity.matrix.shard`) and interleaves a run's rank pools
(:mod:`parity.matrix.order`)."""

from __future__ import annotations

from parity.matrix.cell import Cell


def expected_cost(cell: Cell) -> float:
    """Relative run time of a cell: per optimizer step, each micro-batch's forward/backward on
    ``ranks`` ranks sharing the machine's cores; the checkpoint lifecycle (save, load, resume
    and cross-loads) costs about as much as the steps again; 2-D meshes add their collectives."""
    work = cell.steps * cell.microbatches * (1.0 + 0.25 * cell.ranks)
    if cell.lifecycle:
        work *= 2.0
    if cell.mesh != "fsdp":
        work *= 1.5
    return 1.0 + work
