"""``grad.accum``: what each rank has accumulated inside a no-sync window, micro-batch by micro-batch.

With ``set_requires_gradient_sync(False)`` FSDP keeps each parameter's unsharded gradient on
every rank and adds the next micro-batch's into it; only the last micro-batch reduces. The
gradient the optimizer steps with (``grad``) shows a fault in that window only after the
reduction, mixed with every rank's; this check reads the window itself. On FSDP and HSDP meshes
(:func:`judged`), after every micro-batch but the last, each rank's unsharded gradient (recorded
by :meth:`parity.execute.probes.Recorder.after_backward`), and at the last what the window's
reductions take as input (read as ``foreach_reduce`` begins), is compared with the emulated rank's
accumulation in the reduce dtype (:attr:`parity.judge.reference.ReferenceRun.accumulated`),
with the allowance of a sum of that many terms. One record per step, micro-batch and
parameter: the worst rank's, every rank judged. A rank that recorded nothing where the
reference accumulated is missing evidence (FAIL).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from parity.execute.observation import Observation
from parity.judge import tolerance
from parity.judge.compare import Comparison
from parity.judge.record import Record, Verdict
from parity.judge.reference import ReferenceRun
from parity.matrix.cell import Cell


def _badness(r: Record) -> tuple[bool, float]:
    ratio = r.ratio if isinstance(r.ratio, float) and not math.isnan(r.ratio) else math.inf
    return r.verdict != Verdict.PASS, ratio


def judged(cell: Cell) -> bool:
    """Cells whose window is judged: accumulating, on a mesh where every rank's unsharded gradient
    is the whole parameter's (FSDP, HSDP; a tensor-parallel or expert-parallel rank holds a part)."""
    return cell.accumulating and cell.mesh in ("fsdp", "hsdp")


def check(cell: Cell, observations: list[Observation], ref: ReferenceRun, base: dict) -> list[Record]:
    if not judged(cell):
        return []
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
                got = o.contracts.accumulated.get((step, mb), {}).get(fqn, torch.zeros(0))
                allow = tolerance.gradient(want.dtype, want.dtype, mb + 1, scale)
                row = Comparison(step, "grad.accum", fqn, got, want, allow).record(base)
                where = "the reduce-scatter's input after micro-batch" if mb == cell.microbatches - 1 else "after micro-batch"
                row = dataclasses.replace(row, detail=f"rank {o.rank} {where} {mb}: {row.detail}")
                if worst is None or _badness(row) > _badness(worst):
                    worst = row
            if worst is not None:
                rows.append(worst)
    return rows
