"""``grad.accum``: each rank's unsharded gradient as the reduction takes it, and inside a no-sync
window, micro-batch by micro-batch, as it accumulates.

The gradient the optimizer steps with (``grad``) shows a fault before the reduction only after
it, mixed with every rank's; this check reads each rank's side. On every mesh (a
tensor-parallel weight's gradient as the rank's TP piece, against that piece), what every
synchronizing backward's reductions take as input (read as ``foreach_reduce`` begins) and,
with ``set_requires_gradient_sync(False)``, each rank's unsharded gradient after every
micro-batch of the window (recorded by
:meth:`parity.execute.probes.Recorder.after_backward`), divided by the loss scale, are compared
with the emulated rank's (:attr:`parity.judge.reference.ReferenceRun.accumulated`: its own
gradient in the reduce dtype, or the window's accumulation), with the allowance of a sum of that
many terms. One record per step, micro-batch and parameter: the worst rank's, every rank
judged. A rank that recorded nothing where the reference had a term is missing evidence (FAIL).
"""

from __future__ import annotations

import dataclasses

import torch

from parity.execute.observation import Observation
from parity.judge import tolerance
from parity.judge.compare import Comparison, piece
from parity.judge.record import Record, badness
from parity.judge.reference import ReferenceRun
from parity.matrix.cell import Cell


def check(cell: Cell, observations: list[Observation], ref: ReferenceRun, base: dict) -> list[Record]:
    rows = []
    topo = cell.topology()
    for (step, mb), per_rank in sorted(ref.accumulated.items()):
        for fqn in sorted(set().union(*per_rank)):
            worst = None
            for o in observations:
                d = topo.data_rank(o.rank)
                if fqn not in per_rank[d]:  # this rank's data gave it nothing to accumulate yet
                    continue
                want, scale = per_rank[d][fqn]
                want = piece(want, o.contracts.accum_regions.get(fqn, ()))
                got = o.contracts.accumulated.get((step, mb), {}).get(fqn, torch.zeros(0))
                terms = mb + 1 if cell.accumulating else 1  # a window's micro-batches, or this one's
                allow = tolerance.gradient(want.dtype, want.dtype, terms, scale)
                row = Comparison(step, "grad.accum", fqn, got, want, allow).record(base)
                synced = cell.synchronizes(mb)
                where = "the reduce-scatter's input after micro-batch" if synced else "after micro-batch"
                row = dataclasses.replace(row, detail=f"rank {o.rank} {where} {mb}: {row.detail}")
                if worst is None or badness(row) > badness(worst):
                    worst = row
            if worst is not None:
                rows.append(worst)
    return rows
