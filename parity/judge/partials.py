"""``grad.partial``: HSDP's shard-group partials, as the all-reduce across replicas takes them.

On an HSDP mesh FSDP reduces a gradient in two collectives: a reduce-scatter over the shard
group, whose output (the group's partial, already divided as FSDP divides it there) an
all-reduce then combines across replicas. ``grad.shard`` judges what both left; this check
judges the first alone, so a fault in the replica all-reduce (its op, its dtype) is told
from one in the shard group's reduction: each rank records the all-reduce's input, per
parameter, cut from FSDP's flat buffer as FSDP views it
(:func:`parity.execute.probes.replica_inputs`), unscaled; it is compared with the same slice
of its shard group's emulated sum in the reduce dtype (:attr:`ReferenceRun.partials`,
accumulated over the micro-batches whose all-reduce was deferred, ``replicas-last``) divided
by :func:`parity.judge.emulate.shard_group_divisor`, with the allowance of that sum. One record per step,
micro-batch and parameter where the all-reduce ran: the worst rank's, every rank judged; a
rank that recorded nothing where the reference has a partial is missing evidence (FAIL).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING


from parity.judge import tolerance
from parity.judge.compare import Comparison, amax
from parity.judge.record import Record
from parity.judge.shards import worst_shard
from parity.matrix.cell import Cell
from parity.model.plan import PrecisionPlan

if TYPE_CHECKING:
    from parity.execute.observation import Observation
    from parity.judge.reference import ReferenceRun

CHECK = "grad.partial"


def check(cell: Cell, observations: list[Observation], ref: ReferenceRun, plan: PrecisionPlan,
          base: dict) -> list[Record]:
    topo = cell.topology()
    groups = topo.replica_groups()

    def group_of(rank: int) -> int:
        return next(i for i, g in enumerate(groups) if topo.data_rank(rank) in g)
    rows = []
    for (step, mb), wants in sorted(ref.partials.items()):
        for fqn, (partials, scale, terms) in sorted(wants.items()):
            entry = plan.get(fqn)
            if entry is None:
                continue
            worst = worst_shard(observations, lambda o: o.contracts.partials.get((step, mb), {}).get(fqn),
                                lambda o: partials[group_of(o.rank)], "no replica all-reduce input recorded")
            if worst is None:
                continue
            _, rank, got, want, where = worst
            group = group_of(rank)
            allow = tolerance.gradient(entry.sum_dtype, entry.sum_dtype, terms, scale)
            row = Comparison(step, CHECK, fqn, got, want, allow, signal=amax(partials[group])).record(base)
            rows.append(dataclasses.replace(
                row, detail=f"rank {rank} after micro-batch {mb}, replica group {group}, {where}: {row.detail}"))
    return rows
