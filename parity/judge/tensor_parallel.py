"""``tp.partial``: what each tensor-parallel all-reduce takes, per layer, step and rank.

``dtype.tp_reduce`` judges the dtype of TP's Partial -> Replicate all-reduces; the layer's
output and the gradients judge what came out of them. This check judges what went in: on
every rank, the local partial sum the first all-reduce of each TP layer took in every
micro-batch of every step -- a rowwise layer's partial output (its slice of the input times its
columns of the weight), a colwise layer's partial input gradient (its rows of the weight
times its slice of the output gradient) -- against the emulated chunk of the same data rank and
micro-batch (:class:`parity.judge.emulate.Partials`; a later step's reference starts from the
run's own weights, so each step is judged on its own), with the last-rounding allowance the
outputs get in the layer's planned compute dtype (a partial handed over in a coarser dtype fails).
A fault in one rank's local computation or in what it hands the collective is named at the
layer, direction, step, micro-batch and rank; one that only the reduction itself makes (its
dtype, its order) passes here and fails after it. One record per layer, direction and step, the
worst micro-batch and rank's; a rank that recorded nothing where the reference has a partial
FAILs (missing evidence).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch

from parity.judge import tolerance
from parity.judge.compare import Comparison, amax, max_abs
from parity.judge.record import Record, Verdict
from parity.matrix.cell import Cell
from parity.model.plan import PrecisionPlan, tp_reductions

if TYPE_CHECKING:
    from parity.execute.observation import Observation
    from parity.judge.reference import ReferenceRun

CHECK = "tp.partial"


def check(cell: Cell, observations: list[Observation], ref: ReferenceRun, plan: PrecisionPlan,
          base: dict) -> list[Record]:
    topo = cell.topology()
    if topo.tp <= 1:
        return []
    return [_record(cell, observations, ref, key, t, step, base)
            for step in range(cell.steps) for key, t in sorted(tp_reductions(plan).items())]


def _record(cell: Cell, observations: list[Observation], ref: ReferenceRun, key: str, t, step: int,
            base: dict) -> Record:
    """The worst micro-batch and rank of one layer's reduction at ``step``: worst by error over
    its own allowance (each micro-batch's partial has its own size), not by raw error, so a
    small partial far off is not hidden behind a large one slightly off."""
    topo = cell.topology()
    worst = None  # (error / allowance, mb, rank, got, want)
    for mb in range(cell.microbatches):
        for o in observations:
            want = ref.tp_partials.get((step, mb, topo.data_rank(o.rank)), {}).get(key, {}).get(o.rank % topo.tp)
            got = o.contracts.tp_partials.get((step, mb), {}).get(key)
            if want is None and got is None:
                continue
            got, want = (torch.zeros(0) if x is None else x for x in (got, want))
            err = max_abs(got, want) if got.numel() and want.numel() else math.inf
            err = math.inf if err != err else err
            allowed = tolerance.last_rounding(t.compute, amax(want)).allowed if want.numel() else 0.0
            ratio = err / allowed if allowed > 0 else (0.0 if err == 0 else math.inf)
            if worst is None or ratio > worst[0]:
                worst = (ratio, mb, o.rank, got, want)
    if worst is None:  # neither side reduced: nothing before the layer needs its gradient
        return Record(**base, step=step, check=CHECK, name=key, verdict=Verdict.SKIP,
                      detail="no all-reduce here on any rank nor in the reference (no gradient flows into it)")
    _, mb, rank, got, want = worst
    allow = tolerance.last_rounding(t.compute, amax(want))  # the plan's dtype, never the observed one
    row = Comparison(step, CHECK, key, got, want, allow).record(base)
    where = "no partial recorded" if not got.numel() else "no emulated partial" if not want.numel() else \
        f"tp chunk {rank % topo.tp} of data rank {topo.data_rank(rank)}"
    return dataclasses.replace(row, detail=f"rank {rank}, {where}, micro-batch {mb}: {row.detail}")
