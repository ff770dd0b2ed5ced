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
    a rank with nothing recorded as ``missing`` (infinite error); every shard empty where the
    whole is not is a gap (:func:`_uncovered`); None only when there is nothing to compare."""
    worst = None
    for rank, got, want, where in _pieces(observations, read, whole_of, missing):
        err = _error(got, want)
        if worst is None or err > worst[0]:
            worst = (err, rank, got, want, where)
    gap = _uncovered(observations, read, whole_of)
    if gap is not None and (worst is None or worst[0] < math.inf):
        worst = gap
    return worst


def _uncovered(observations: list[Observation], read, whole_of):
    """Where the ranks' shards of one whole tensor (those ``whole_of`` hands the same tensor)
    leave part of it out -- a piece lost or recorded at another's offset is then never compared,
    every piece lost when all are empty -- as worst_shard's tuple naming a rank with an empty
    piece (else the first); None when every part of each whole is some rank's (an empty whole
    needs none)."""
    wholes: dict[int, list] = {}  # id(whole) -> [whole, covered mask, ranks, ranks with an empty piece]
    for o in observations:
        whole, got_read = whole_of(o), read(o)
        entry = wholes.setdefault(id(whole), [whole, torch.zeros(whole.shape, dtype=torch.bool), [], []])
        entry[2].append(o.rank)
        offset, got = got_read if got_read is not None else ((), torch.zeros(0))
        if not got.numel() or _slice(whole, offset, got.shape).shape != got.shape:
            entry[3].append(o.rank)
            continue
        entry[1][tuple(slice(a, a + n) for a, n in zip(offset, got.shape))] = True
    for whole, mask, ranks, empty in wholes.values():
        if not bool(mask.all()):
            rank = (empty or ranks)[0]
            return (math.inf, rank, torch.zeros(0), whole,
                    f"the ranks' shards cover {int(mask.sum())} of {mask.numel()} elements")
    return None


def _pieces(observations: list[Observation], read, whole_of, missing: str):
    """(rank, its shard, the slice of the whole it must equal, where) for every rank: a rank with
    nothing recorded as an empty shard against the whole, ``missing``; empty shards skipped."""
    for o in observations:
        whole, got_read = whole_of(o), read(o)
        if got_read is None:
            yield o.rank, torch.zeros(0), whole, missing
            continue
        offset, got = got_read
        if got.numel():
            yield o.rank, got, _slice(whole, offset, got.shape), f"shard at {list(offset)}"


def check(cell: Cell, observations: list[Observation], ref: ReferenceRun, plan: PrecisionPlan,
          base: dict) -> list[Record]:
    rows = []
    for (step, mb), wants in sorted(ref.shards.items()):
        terms = cell.topology().data_world * (mb + 1)
        for fqn, (whole, scale) in sorted(wants.items()):
            entry = plan.get(fqn)
            if entry is None:
                continue
            read = lambda o: o.contracts.shards.get((step, mb), {}).get(fqn)  # noqa: E731
            worst = worst_shard(observations, read, lambda o: whole, "no shard recorded")
            if worst is None:
                continue
            _, rank, got, want, where = worst
            # the signal is the whole gradient's, as ``grad`` judges it: a shard is a piece of it
            allow = tolerance.gradient(entry.sum_dtype, entry.kept_grad, terms, scale)
            row = Comparison(step, CHECK, fqn, got, want, allow, signal=amax(whole)).record(base)
            also = _also_over(_pieces(observations, read, lambda o: whole, ""), rank, lambda got, want: Comparison(
                step, CHECK, fqn, got, want, allow, signal=amax(whole)).record(base)) if row.verdict == Verdict.FAIL else []
            more = f"; {ALSO} {', '.join(map(str, also))}" if also else ""
            rows.append(dataclasses.replace(row, detail=f"rank {rank} after micro-batch {mb}, {where}: {row.detail}{more}"))
    return rows


#: How a ``grad.shard`` record names the other ranks over the allowance (the ``stage`` record reads it).
ALSO = "also over the allowance on rank(s)"


def _also_over(pieces, worst: int, judged) -> list[int]:
    """The ranks besides ``worst`` whose shard (of :func:`_pieces`) ``judged`` finds over the
    allowance too (every rank is a witness: a fault on every rank reads differently from one on one)."""
    return [rank for rank, got, want, _ in pieces
            if rank != worst and got.numel() and judged(got, want).verdict == Verdict.FAIL]
