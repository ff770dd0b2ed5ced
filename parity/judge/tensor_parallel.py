"""``tp.partial``: what each tensor-parallel all-reduce takes, per layer and rank.

``dtype.tp_reduce`` judges the dtype of TP's Partial -> Replicate all-reduces; the layer's
output and the gradients judge what came out of them. This check judges what went in: on
every rank, the local partial sum the first all-reduce of each TP layer took in step 0's
first micro-batch -- a rowwise layer's partial output (its slice of the input times its
columns of the weight), a colwise layer's partial input gradient (its rows of the weight
times its slice of the output gradient) -- against the emulated chunk of the same data rank
(:class:`parity.judge.emulate.Partials`), with the last-rounding allowance the outputs get in
the layer's planned compute dtype (a partial handed over in a coarser dtype fails).
A fault in one rank's local computation or in what it hands the collective is named at the
layer, direction and rank; one that only the reduction itself makes (its dtype, its order)
passes here and fails after it. One record per layer and direction, the worst rank's; a rank
that recorded nothing where the reference has a partial FAILs (missing evidence).
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
    rows = []
    for key, t in sorted(tp_reductions(plan).items()):
        worst = None  # (error, rank, got, want)
        for o in observations:
            want = ref.tp_partials.get(topo.data_rank(o.rank), {}).get(key, {}).get(o.rank % topo.tp)
            got = o.contracts.tp_partials.get(key)
            if want is None and got is None:
                continue
            got, want = (torch.zeros(0) if x is None else x for x in (got, want))
            err = max_abs(got, want) if got.numel() and want.numel() else math.inf
            err = math.inf if err != err else err
            if worst is None or err > worst[0]:
                worst = (err, o.rank, got, want)
        if worst is None:  # neither side reduced: nothing before the layer needs its gradient
            rows.append(Record(**base, step=0, check=CHECK, name=key, verdict=Verdict.SKIP,
                               detail="no all-reduce here on any rank nor in the reference (no gradient flows into it)"))
            continue
        _, rank, got, want = worst
        allow = tolerance.last_rounding(t.compute, amax(want))  # the plan's dtype, never the observed one
        row = Comparison(0, CHECK, key, got, want, allow).record(base)
        where = "no partial recorded" if not got.numel() else "no emulated partial" if not want.numel() else \
            f"tp chunk {rank % topo.tp} of data rank {topo.data_rank(rank)}"
        rows.append(dataclasses.replace(row, detail=f"rank {rank}, {where}, step 0 micro-batch 0: {row.detail}"))
    return rows
