"""Contracts of mesh compositions: every reduction a gradient or activation goes through
happens in the planned dtype over the planned group, and FSDP (on either path) leaves what
another parallelism owns as that parallelism made it.

- ``dtype.reduce`` ``FQN@replicas`` (HSDP): the all-reduce across replicas, in the reduce dtype;
- ``dtype.reduce`` ``FQN@owner``: an FSDP-ignored parameter's reduction by its owner (the
  expert-parallel replicas, or an emulated owner over every rank), in its storage dtype;
- ``dtype.tp_reduce`` ``MODULE@forward|backward``: a rowwise layer's output all-reduce and a
  colwise layer's input-gradient all-reduce, in the layer's compute dtype (FP32 for an FP32
  layer: a BF16 reduction there is the reported TP bug class);
- ``ownership`` ``FQN@stage``: FSDP-managed or not, the ``tp`` / ``ep`` placements and the dtype,
  on every rank, after sharding and after training, as the plan's owner says.
"""

from __future__ import annotations

from torch.distributed.tensor import Shard

from parity.execute.observation import Observation
from parity.judge.contracts import _row, on_every_rank
from parity.judge.record import Record
from parity.matrix.cell import Cell
from parity.model.dtypes import dtype_name
from parity.model.plan import PrecisionPlan, TensorPlan, tp_reductions

_S0, _S1 = str(Shard(0)), str(Shard(1))  # as DTensor prints placements
_PLACEMENT = {"tp-colwise": (_S0, "-"), "tp-rowwise": (_S1, "-"), "ep": ("-", _S0)}


def expected_ownership(t: TensorPlan) -> str:
    tp, ep = _PLACEMENT.get(t.parallel, ("-", "-"))
    return f"{'fsdp' if t.ownership == 'managed' else 'not fsdp'}; tp={tp}; ep={ep}; {dtype_name(t.storage)}"


def ownership_checks(cell: Cell, observations: list[Observation], plan: PrecisionPlan, base: dict) -> list[Record]:
    rows = []
    for t in plan.params:
        want = expected_ownership(t)
        for stage in ("sharded", "trained"):
            problems = [f"rank {o.rank}: {o.contracts.ownership.get(stage, {}).get(t.fqn, '<missing>')}"
                        for o in observations if o.contracts.ownership.get(stage, {}).get(t.fqn) != want]
            rows.append(_row(base, "ownership", f"{t.fqn}@{stage}", not problems, want,
                             "; ".join(problems) or "held on every rank", t.parallel, dtype_name(t.storage)))
    return rows


def reduction_checks(cell: Cell, obs: Observation, plan: PrecisionPlan, base: dict) -> list[Record]:
    c, rows = obs.contracts, []
    trained = [t for t in plan.params if t.requires_grad and t.trainable_from < cell.steps]
    if cell.mesh == "hsdp":
        for t in (t for t in trained if t.ownership == "managed"):
            want = dtype_name(t.reduce)
            got = ",".join(c.replicas.get(t.fqn, ["<no all-reduce seen>"]))
            rows.append(_row(base, "dtype.reduce", f"{t.fqn}@replicas", got == want, want, got,
                             "all-reduce across replicas", want))
    if cell.ranks > 1:
        for t in (t for t in trained if t.ownership == "ignored"):
            want = f"{dtype_name(t.storage)} over {'dp' if t.parallel == 'ep' else 'world'}"
            got = ",".join(sorted(c.owner_reduce.get(t.fqn, ["<no reduction seen>"])))
            rows.append(_row(base, "dtype.reduce", f"{t.fqn}@owner", got == want, want, got,
                             "its owner's all-reduce", dtype_name(t.storage)))
    expected = {key: dtype_name(t.compute) for key, t in tp_reductions(plan).items()}
    if not expected:
        return rows
    for key in sorted(set(expected) | set(c.tp_reduce)):
        want = expected.get(key, "no reduction")
        got = ",".join(c.tp_reduce.get(key, ["<no reduction seen>"]))
        rows.append(_row(base, "dtype.tp_reduce", key, got == want, want, got,
                         "Partial -> Replicate all-reduce on tp", want))
    return rows


def check(cell: Cell, observations: list[Observation], plan: PrecisionPlan, base: dict) -> list[Record]:
    """Composition records; a 1-D cell without ignored parameters has none."""
    obs = observations[0]
    if obs.expected_error:
        return []
    owned = any(t.ownership == "ignored" or t.parallel for t in plan.params)
    if cell.mesh == "fsdp" and not owned:
        return []
    rows = on_every_rank([reduction_checks(cell, o, plan, base) for o in observations])
    return rows + ownership_checks(cell, observations, plan, base)
