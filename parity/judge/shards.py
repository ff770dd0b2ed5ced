"""``grad.shard``: each rank's sharded gradient as the reductions left it, micro-batch by
micro-batch.

``grad.accum`` reads what the reductions take; ``grad`` reads what the optimizer steps with,
once per step and as a whole. Between them sit the reduce-scatter, HSDP's all-reduce across
replicas and FSDP's accumulation into ``.grad``, where a fault shows on one rank's shard after
one micro-batch. After every backward that synchronizes (``set_requires_gradient_sync``; a
no-sync window's reduction after its last), each rank records its shard of every FSDP-managed
parameter's gradient with the shard's offset (:func:`parity.execute.probes.sharded_grads`),
unscaled; it is compared with the same slice of the emulated gradient
(:attr:`parity.judge.reference.ReferenceRun.shards`: the ranks' gradients reduced in the reduce
dtype and accumulated in the kept dtype, as FSDP does), with the allowance of the sum it is
(:func:`parity.judge.tolerance.gradient`, over ranks x micro-batches so far). One record per
step, micro-batch and parameter: the worst rank's, every rank judged, against the whole
gradient's size (a shard is a piece of what ``grad`` judges, so a rank whose slice is all
zero is not INCONCLUSIVE for it). A rank that recorded no shard where the reference has a
gradient is missing evidence (FAIL). Judged on every mesh: the
offsets come from each gradient's own mesh and placements, so a tensor-parallel weight's shard
(FSDP's over ``dp``, TP's over ``tp``) is a slice of the whole gradient like any other; the
experts, which FSDP ignores, have none.
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
from parity.model.plan import PrecisionPlan

if TYPE_CHECKING:
    from parity.execute.observation import Observation
    from parity.judge.reference import ReferenceRun

CHECK = "grad.shard"


def _slice(whole: torch.Tensor, offset: tuple[int, ...], shape: torch.Size) -> torch.Tensor:
    """The piece of ``whole`` a rank's shard of ``shape`` at ``offset`` holds (empty if it does not fit)."""
    if len(offset) != whole.dim() or any(o + n > d for o, n, d in zip(offset, shape, whole.shape)):
        return torch.zeros(0)  # a shard that does not fit the parameter: judged as missing
    return whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    """How far a rank's shard is from its slice (inf when missing or misshapen; NaN counts as inf)."""
    if not got.numel() and want.numel():
        return math.inf
    err = max_abs(got, want)
    return math.inf if err != err else err


def worst_shard(observations: list[Observation], read, whole_of, missing: str):
    """Every rank's shard (``read(o)``: (offset, values) or None) against the same slice of the
    whole tensor it is a piece of (``whole_of(o)``): the worst as (error, rank, got, want, where),
    a rank with nothing recorded as ``missing`` (infinite error); None when every shard is empty
    (uneven sharding: nothing to compare)."""
    worst = None
    for o in observations:
        whole, got_read = whole_of(o), read(o)
        if got_read is None:
            got, want, where = torch.zeros(0), whole, missing
        else:
            offset, got = got_read
            if not got.numel():
                continue
            want, where = _slice(whole, offset, got.shape), f"shard at {list(offset)}"
        err = _error(got, want)
        if worst is None or err > worst[0]:
            worst = (err, o.rank, got, want, where)
    return worst


def check(cell: Cell, observations: list[Observation], ref: ReferenceRun, plan: PrecisionPlan,
          base: dict) -> list[Record]:
    rows = []
    for (step, mb), wants in sorted(ref.shards.items()):
        terms = cell.topology().data_world * (mb + 1)
        for fqn, (whole, scale) in sorted(wants.items()):
            entry = plan.get(fqn)
            if entry is None:
                continue
            worst = worst_shard(observations, lambda o: o.contracts.shards.get((step, mb), {}).get(fqn),
                                lambda o: whole, "no shard recorded")
            if worst is None:
                continue
            _, rank, got, want, where = worst
            # the signal is the whole gradient's, as ``grad`` judges it: a shard is a piece of it
            allow = tolerance.gradient(entry.sum_dtype, entry.kept_grad, terms, scale)
            row = Comparison(step, CHECK, fqn, got, want, allow, signal=amax(whole)).record(base)
            also = _also_over(observations, step, mb, fqn, whole, allow, rank, base) if row.verdict == Verdict.FAIL else []
            more = f"; {ALSO} {', '.join(map(str, also))}" if also else ""
            rows.append(dataclasses.replace(row, detail=f"rank {rank} after micro-batch {mb}, {where}: {row.detail}{more}"))
    return rows


#: How a ``grad.shard`` record names the other ranks over the allowance (the ``stage`` record reads it).
ALSO = "also over the allowance on rank(s)"


def _also_over(observations: list[Observation], step: int, mb: int, fqn: str, whole: torch.Tensor,
               allow, worst: int, base: dict) -> list[int]:
    """The ranks besides ``worst`` whose shard of ``fqn`` is over the allowance too (every rank
    is a witness: a fault on every rank reads differently from one on one)."""
    out = []
    for o in observations:
        got_read = o.contracts.shards.get((step, mb), {}).get(fqn)
        if o.rank == worst or got_read is None or not got_read[1].numel():
            continue
        offset, got = got_read
        comp = Comparison(step, CHECK, fqn, got, _slice(whole, offset, got.shape), allow, signal=amax(whole))
        if comp.record(base).verdict == Verdict.FAIL:
            out.append(o.rank)
    return out
