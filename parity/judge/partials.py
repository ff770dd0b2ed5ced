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

import torch

from parity.judge import tolerance
from parity.judge.compare import Comparison, amax
from parity.judge.record import Record
from parity.judge.shards import shard_error, shard_slice
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
    rows = []
    for (step, mb), wants in sorted(ref.partials.items()):
        for fqn, (partials, scale, terms) in sorted(wants.items()):
            entry = plan.get(fqn)
            if entry is None:
                continue
            worst = None  # (error, rank, got, want, where, whole)
            for o in observations:
                group = next(i for i, g in enumerate(groups) if topo.data_rank(o.rank) in g)
                whole = partials[group]
                read = o.contracts.partials.get((step, mb), {}).get(fqn)
                if read is None:
                    got, want, where = torch.zeros(0), whole, "no replica all-reduce input recorded"
                else:
                    offset, got = read
                    if not got.numel():  # an empty shard (uneven sharding)
                        continue
                    want, where = shard_slice(whole, offset, got.shape), f"shard at {list(offset)}"
                err = shard_error(got, want)
                if worst is None or err > worst[0]:
                    worst = (err, o.rank, got, want, f"replica group {group}, {where}", whole)
            if worst is None:
                continue
            _, rank, got, want, where, whole = worst
            allow = tolerance.gradient(entry.sum_dtype, entry.sum_dtype, terms, scale)
            row = Comparison(step, CHECK, fqn, got, want, allow, signal=amax(whole)).record(base)
            rows.append(dataclasses.replace(row, detail=f"rank {rank} after micro-batch {mb}, {where}: {row.detail}"))
    return rows
