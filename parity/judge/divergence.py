"""Where a failing cell diverges first: per-module outputs (forward order) and input
gradients (backward order) of rank 0's first micro-batch, against the reference's.

Only failing cells pay for this: the runner re-runs them with ``trace`` on. Each module's
tensor gets the last-rounding allowance the cell's outputs get (two computations agreeing
up to a final rounding in the coarser dtype); the first module over it is named.
"""

from __future__ import annotations

import dataclasses

from parity.execute.observation import Observation
from parity.judge import tolerance
from parity.judge.compare import amax, max_abs
from parity.judge.record import Record, Verdict
from parity.judge.reference import run_reference
from parity.matrix.cell import Cell
from parity.model.registry import get_fixture
from parity.model.trace import Trace

#: Checks whose failure asks where the cell diverged first.
NUMERIC = ("output", "input_grad", "grad", "grad_norm", "param", "trajectory")


def _first_over(actual: dict, expected: dict, skipped: list[str]) -> tuple[str, float, float, float] | None:
    """The first module over its allowance; modules whose tensor is not the reference's whole
    tensor (a tensor-parallel shard of an activation) are listed in ``skipped``, not judged."""
    for fqn, got in actual.items():
        want = expected.get(fqn)
        if want is None:
            continue
        if got.shape != want.shape:
            skipped.append(fqn)
            continue
        allow = tolerance.last_rounding(tolerance.coarser(got.dtype, want.dtype), amax(want)).allowed
        observed = max_abs(got, want)
        if observed > allow:
            return fqn, observed, allow, observed / allow if allow > 0 else float("inf")
    return None


def locate(cell: Cell, observations: list[Observation], base: dict, device="cpu") -> Record:
    """One ``divergence`` record naming the first module over its allowance in each order."""
    first = observations[0]
    fixture = get_fixture(cell.fixture, cell.source)
    ref = Trace()
    run_reference(dataclasses.replace(cell, steps=1), fixture, first.plan, first.report, device=device, trace=ref)
    skipped: list[str] = []
    fwd = _first_over(first.trace.outputs, ref.outputs, skipped)
    bwd = _first_over(first.trace.input_grads, ref.input_grads, skipped)
    where = fwd or bwd
    unjudged = (f"; {len(skipped)} tensor(s) not judged: rank 0 holds a shard of them on this mesh "
                f"(e.g. {skipped[0]})") if skipped else ""
    if where is None:
        return Record(**base, step=0, check="divergence", name="-", verdict=Verdict.PASS,
                      detail="no module's output or input gradient differs beyond its allowance in rank 0's first "
                             "micro-batch: the difference arises after backward (reduction, optimizer) or later"
                             + unjudged)
    parts = [f"first in forward order: {fwd[0]} (ratio {fwd[3]:.3g})" if fwd else "forward: no module over",
             f"first in backward order: {bwd[0]} (ratio {bwd[3]:.3g})" if bwd else "backward: no module over"]
    parts[-1] += unjudged
    name, observed, allowed, ratio = where
    return Record(**base, step=0, check="divergence", name=name, observed=observed, allowed=allowed, ratio=ratio,
                  verdict=Verdict.FAIL, detail="; ".join(parts))
