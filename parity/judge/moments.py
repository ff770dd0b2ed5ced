"""``optim.moments``: the optimizer's state after every step, per parameter and state tensor.

``param`` judges what an optimizer step wrote into the parameters, against the reference
optimizer stepped on the run's own gradients from the run's own parameters
(:func:`parity.judge.reference.replay_optimizer`). The state it keeps for the next step --
AdamW's first and second moments, SGD's momentum buffer -- only shows in the parameters one
step later, and then as a parameter error. This check reads that state itself, after every
step, on every rank (each rank's shard, reassembled), against the replayed optimizer's, which
sees the same gradients and so holds the same state: a moment stored coarser, updated twice or
filed under another parameter is named at the step and tensor where it happened.

The allowance is one last rounding in the state's own dtype per step so far (the same
element-wise update, on a shard or on the whole tensor, may differ by a rounding where vectorized
and scalar code paths fuse differently, and the replay carries its own state: differences add
up, at most one rounding per update; :func:`parity.judge.tolerance.carried_roundings`). On this
machine every such record has been exact. The allowance is weighed against what the step changed
in the state (:func:`_change`), the size a state not updated would be off by: where it is half of
that or more the record is INCONCLUSIVE. A state tensor the reference holds and the run does
not, or the other way round, FAILs (missing or unexpected evidence), and so does a moment the
reference owes that neither holds (:func:`owed`: the optimizer never stepped the parameter), and a
moment held in another dtype than the replay's (an FP32 moment passes a BF16 one's allowance; the
ranks' shards joined, any rank's finer dtype shows).
Scalars (``step``) are the checkpoint's to judge (``optim.state``).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from parity.judge import tolerance
from parity.judge.compare import Assembled, Comparison, amax
from parity.judge.record import Record, Verdict, badness
from parity.matrix.cell import Cell
from parity.model.dtypes import dtype_name
from parity.model.plan import PrecisionPlan
from parity.model.recipe import owed_moments

CHECK = "optim.moments"


def owed(cell: Cell, plan: PrecisionPlan, ref_grads: list[dict[str, torch.Tensor]]) -> set[tuple[int, str, str]]:
    """(step, state key, fqn) the optimizer must hold after each step, from the reference, not
    from the run: every moment the optimizer recipe keeps, of every parameter the reference
    differentiated at that step or before (a moment, once made, stays); none by name on a
    loss-scaled cell (:func:`parity.model.recipe.owed_moments`)."""
    keys, seen, out = owed_moments(cell.optimizer, plan.config.param_dtype), set(), set()
    for step, grads in enumerate(ref_grads):
        seen |= set(grads)
        out |= {(step, key, f) for f in seen for key in keys}
    return out


def check(run: Assembled, replayed: list[dict[str, dict[str, torch.Tensor]]], owed_state: set[tuple[int, str, str]],
          base: dict) -> list[Record]:
    """One record per step and parameter that the reference owes a moment, the replayed optimizer
    holds one or the run holds one: its worst state tensor's (the key opens the detail)."""
    rows = []
    for step in range(max(len(replayed), 1 + max((s for s, _, _ in owed_state), default=-1))):
        want_step = replayed[step] if step < len(replayed) else {}
        got_step = run.moments[step] if step < len(run.moments) else {}
        names = {(f, key) for s, key, f in owed_state if s == step}
        names |= {(f, key) for key, per in want_step.items() for f in per}
        names |= {(f, key) for key, per in got_step.items() for f in per}
        before = replayed[step - 1] if 0 < step <= len(replayed) else {}
        worst: dict[str, Record] = {}
        for f, key in sorted(names):
            row = _record(step, f, key, got_step.get(key, {}).get(f), want_step.get(key, {}).get(f), base,
                          before.get(key, {}).get(f))
            if f not in worst or badness(row) > badness(worst[f]):
                worst[f] = row
        rows += worst.values()
    return rows


def _change(want: torch.Tensor, before: torch.Tensor | None) -> float:
    """What this step did to the state (the replayed optimizer's): a moment not updated, or
    updated twice, is off by about this much, so it is the signal the allowance is weighed
    against -- not the moment's own size, which a late step changes by a small fraction
    (AdamW's second moment by about 1 - beta2 of itself: below one BF16 rounding of it)."""
    if before is None or before.shape != want.shape:
        return amax(want)  # made at this step: all of it is the step's
    change = amax(want.double() - before.double())
    # a step that left it alone (no gradient reached the parameter, a loss-scaled step skipped):
    # no change to weigh against; the state's size, as before it was made
    return change if change > 0 else amax(want)


def _record(step: int, f: str, key: str, got: torch.Tensor | None, want: torch.Tensor | None, base: dict,
            before: torch.Tensor | None = None) -> Record:
    if got is None and want is None:
        return Record(**base, step=step, check=CHECK, name=f, observed=math.inf, allowed=0.0, ratio=math.inf,
                      verdict=Verdict.FAIL, detail=f"{key}: none after step {step}, in the run or in the optimizer "
                                                   "replayed on its gradients: the optimizer never stepped a "
                                                   "parameter the reference trains")
    got, want = (torch.zeros(0) if x is None else x for x in (got, want))
    allow = tolerance.carried_roundings(want.dtype if want.numel() else got.dtype, amax(want), step + 1)
    row = Comparison(step, CHECK, f, got, want, allow, signal=_change(want, before) if want.numel() else None).record(base)
    if got.numel() and want.numel() and got.dtype != want.dtype:  # a finer moment passes a coarser one's allowance
        return dataclasses.replace(row, verdict=Verdict.FAIL, ratio=math.inf, detail=(
            f"{key}: held in {dtype_name(got.dtype)} (on some rank), the optimizer replayed on the plan keeps "
            f"{dtype_name(want.dtype)}; {row.detail}")[:1000])
    return dataclasses.replace(row, detail=f"{key}: {row.detail}")
