"""``gathered``: each parameter as FSDP all-gathered it for compute, against the master it was
gathered from.

A rank records, in the first forward of every step, each parameter its module's forward
reads: its dtype and three FP64 sums of its values, one weighted by position
(:attr:`ContractsSeen.gathered`); and the same
of every all-gather's output in the loop's forwards and backwards, once FSDP copied it out
(:attr:`ContractsSeen.all_gathers`: later micro-batches, backward re-gathers). The
expectation is the run's *own* master before that step (the initial model before step 0, the
parameters the ranks recorded after the previous step otherwise) cast to the dtype the forward
read: gathering is copying and casting, both exact, so the sums must agree to the last bit of
their FP64 accumulation (relative 1e-12). The dtype itself is ``dtype.compute``'s; a wrong
update is the optimizer's. What only this check sees: a gather that hands compute something
other than the current master -- a stale unsharded copy kept across an optimizer step, a
copy-in reading the wrong buffer, shards concatenated in the wrong order.

Parameters FSDP manages, unquantized (``quant.values`` judges quantized copies), on every mesh:
a tensor-parallel weight, which FSDP's all-gather hands over as this rank's TP shard, is read
as that piece with its offset and judged against the same piece of the master. A parameter ``dtype.compute`` saw read
in forward is owed: judged in every step and on every rank whose first forward read it (a
routed expert may go unread), at least once, and every rank records some gather every step.
"""

from __future__ import annotations

import math
from dataclasses import replace


from parity.execute.observation import Observation, value_sums
from parity.judge.compare import piece
from parity.judge.record import Record
from parity.judge.rows import contract_row
from parity.matrix.cell import Cell
from parity.model.dtypes import dtype_name, parse_dtype
from parity.model.plan import PrecisionPlan

_REL = 1e-12


def close(got: tuple[float, ...], want: tuple[float, ...]) -> bool:
    """Every sum as the expected one; sums missing or extra are not close (nothing compared is
    not a match)."""
    return len(got) == len(want) and all(math.isclose(g, w, rel_tol=_REL, abs_tol=0.0) for g, w in zip(got, want))


def check(cell: Cell, observations: list[Observation], plan: PrecisionPlan, befores: list[dict],
          base: dict) -> list[Record]:
    """``befores[k]``: the run's masters before step ``k`` -- the initial model, then every parameter
    as the ranks recorded it after step ``k - 1`` (frozen ones included)."""
    if not befores:
        return []
    owed = {f for o in observations for f in o.contracts.compute}  # read in forward (``dtype.compute``)
    gathered = {f for o in observations for segments in o.contracts.all_gathers.values()
                for reads in segments.values() for f in reads}
    rows = []
    for t in plan.params:
        if t.ownership != "managed" or t.format != "none" or t.fqn not in owed | gathered:
            continue
        problems, judged, first_bad = [], 0, None
        for step, before in enumerate(befores):
            master = before.get(t.fqn)
            for o in observations:
                for where, dtype, got in _reads(o, step, t.fqn, t.fqn in owed, problems):
                    if master is None:
                        problems.append(f"step {step} rank {o.rank}: no master recorded before the step")
                        continue
                    judged += 1
                    got, region = got[:3], (got[3] if len(got) > 3 else ())
                    want = value_sums(piece(master, region).to(parse_dtype(dtype)))
                    if not close(tuple(got), want):
                        problems.append(f"step {step} rank {o.rank} {where}: |values| sum {got[0]:.9g}, the master "
                                        f"before the step gives {want[0]:.9g} in {dtype}")
                        first_bad = step if first_bad is None else first_bad
        if t.fqn in owed and not judged:
            problems.append("never read as gathered on any rank, although dtype.compute saw it in forward")
        row = contract_row(base, "gathered", t.fqn, not problems,
                           "every step's gather = the master before the step, cast (FP64 sums, rel 1e-12): as the "
                           "first forward's modules read it and as every all-gather of the step's forwards and "
                           "backwards handed it over", "; ".join(problems[:4]) or "as expected",
                           dtype=dtype_name(t.compute))
        rows.append(row if first_bad is None else replace(row, step=first_bad))  # the stage's step
    return rows + _absent(cell, observations, len(befores), base)


def _reads(o: Observation, step: int, fqn: str, owed: bool, problems: list[str]):
    """(where, dtype, sums) of each read of ``fqn`` on rank ``o`` in ``step``: the first forward's
    module read (owed where ``dtype.compute`` saw it; a rank that recorded no read at all that
    step is missing evidence) and each distinct value an all-gather handed over."""
    step_seen = o.contracts.gathered.get(step)
    if owed and not step_seen:
        problems.append(f"step {step} rank {o.rank}: no parameter recorded as gathered")
    elif owed and fqn in step_seen:  # not read this step on this rank (routing, a branch): nothing to judge
        dtype, *got = step_seen[fqn]
        yield "first forward", dtype, got
    for segment, reads in sorted(o.contracts.all_gathers.get(step, {}).items()):
        for dtype, *got in reads.get(fqn, ()):
            yield f"{segment} all-gather", dtype, got


def _absent(cell: Cell, observations: list[Observation], steps: int, base: dict) -> list[Record]:
    """Every step's first forward all-gathers (the previous step's backward resharded every unit),
    except after an evaluation forward between steps with reshard off, which leaves the units
    gathered for the next step: a rank with no all-gather read in a step that must gather is
    missing evidence, one ``gathered`` row naming it."""
    gathers = [step for step in range(steps) if step == 0 or cell.reshard or cell.eval != "between-steps"]
    missing = [f"step {step} rank {o.rank}" for step in gathers for o in observations
               if not o.contracts.all_gathers.get(step)]
    if not missing:
        return []
    return [contract_row(base, "gathered", "all-gathers", False, "every step's all-gathers read on every rank",
                         "no all-gather output read at " + ", ".join(missing[:4]), dtype="")]


def regathered(base: dict, check: str, target: str, per_rank: list[tuple[int, object]], plan: PrecisionPlan,
               stepped) -> list[Record]:
    """A checkpoint's resumed step, gathered once more (``TARGET:regather:FQN`` records of
    ``check``): on every loading rank (``(rank, report)``, each report's ``regathered``), each
    parameter FSDP manages unquantized as an explicit all-gather handed it to compute, against the
    parameter the resumed step left (``stepped(fqn)``, whole) cast to the dtype read -- this
    module's rule, exact. A load that left FSDP's all-gather input apart from the parameter the
    optimizer steps gathers right once, in the resumed step, and stale from then on."""
    rows = []
    for t in (t for t in plan.params if t.ownership == "managed" and t.format == "none"):
        master, problems = stepped(t.fqn), []
        for rank, report in per_rank:
            read = report.regathered.get(t.fqn)
            if read is None or not master.numel():
                problems.append(f"rank {rank}: " + ("not read as gathered" if read is None
                                                     else "no parameter recorded after the resumed step"))
                continue
            dtype, *got = read
            got, region = tuple(got[:3]), (got[3] if len(got) > 3 else ())
            want = value_sums(piece(master, region).to(parse_dtype(dtype)))
            if not close(got, want):
                problems.append(f"rank {rank}: |values| sum {got[0]:.9g}, the stepped parameter gives {want[0]:.9g} "
                                f"in {dtype}")
        rows.append(contract_row(base, check, f"{target}:regather:{t.fqn}", not problems,
                                 "the next all-gather = the parameter the resumed step left, cast (FP64 sums, rel 1e-12)",
                                 "; ".join(problems[:4]) or "as expected", dtype=dtype_name(t.compute)))
    return rows
