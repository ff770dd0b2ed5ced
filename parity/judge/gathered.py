"""``gathered``: each parameter as FSDP all-gathered it for compute, against the master it was
gathered from.

A rank records, in the first forward of every step, each parameter its module's forward
reads: its dtype and two FP64 sums of its values (:attr:`ContractsSeen.gathered`). The
expectation is the run's *own* master before that step (the initial model before step 0, the
parameters the ranks recorded after the previous step otherwise) cast to the dtype the forward
read: gathering is copying and casting, both exact, so the sums must agree to the last bit of
their FP64 accumulation (relative 1e-12). The dtype itself is ``dtype.compute``'s; a wrong
update is the optimizer's. What only this check sees: a gather that hands compute something
other than the current master -- a stale unsharded copy kept across an optimizer step, a
copy-in reading the wrong buffer, shards concatenated in the wrong order.

Parameters FSDP manages, unquantized (``quant.values`` judges quantized copies), on 1-D FSDP
and HSDP (whose unsharded parameters are whole tensors). A parameter ``dtype.compute`` saw read
in forward is owed: judged in every step and on every rank whose first forward read it (a
routed expert may go unread), at least once, and every rank records some gather every step.
"""

from __future__ import annotations

import math

import torch

from parity.execute.observation import Observation
from parity.judge.record import Record
from parity.judge.rows import contract_row
from parity.matrix.cell import Cell
from parity.model.dtypes import dtype_name, parse_dtype
from parity.model.plan import PrecisionPlan

_REL = 1e-12


def _sums(t: torch.Tensor) -> tuple[float, float]:
    values = t.detach().double()
    return float(values.abs().sum()), float(values.sum())


def _close(got: tuple[float, float], want: tuple[float, float]) -> bool:
    return all(math.isclose(g, w, rel_tol=_REL, abs_tol=0.0) for g, w in zip(got, want))


def check(cell: Cell, observations: list[Observation], plan: PrecisionPlan, befores: list[dict],
          base: dict) -> list[Record]:
    """``befores[k]``: the run's masters before step ``k`` -- the initial model, then every parameter
    as the ranks recorded it after step ``k - 1`` (frozen ones included)."""
    if cell.mesh not in ("fsdp", "hsdp") or not befores:
        return []
    owed = {f for o in observations for f in o.contracts.compute}  # read in forward (``dtype.compute``)
    rows = []
    for t in plan.params:
        if t.ownership != "managed" or t.format != "none" or t.fqn not in owed:
            continue
        problems, judged = [], 0
        for step, before in enumerate(befores):
            master = before.get(t.fqn)
            for o in observations:
                step_seen = o.contracts.gathered.get(step)
                if not step_seen:
                    problems.append(f"step {step} rank {o.rank}: no parameter recorded as gathered")
                    continue
                seen = step_seen.get(t.fqn)
                if seen is None:  # not read this step on this rank (routing, a branch): nothing gathered to judge
                    continue
                if master is None:
                    problems.append(f"step {step} rank {o.rank}: no master recorded before the step")
                    continue
                judged += 1
                dtype, *got = seen
                want = _sums(master.to(parse_dtype(dtype)))
                if not _close(tuple(got), want):
                    problems.append(f"step {step} rank {o.rank}: |values| sum {got[0]:.9g}, the master before the "
                                    f"step gives {want[0]:.9g} in {dtype}")
        if not judged:
            problems.append("never read as gathered on any rank, although dtype.compute saw it in forward")
        rows.append(contract_row(base, "gathered", t.fqn, not problems,
                                 "every step's gather = the master before the step, cast (FP64 sums, rel 1e-12)",
                                 "; ".join(problems[:4]) or "as expected", dtype=dtype_name(t.compute)))
    return rows
