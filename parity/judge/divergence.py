"""Where a failing cell diverges first: per-module outputs (forward order) and input
gradients (backward order) of every rank and micro-batch of the step its records diverged at
first (:attr:`Cell.trace_step`), against the reference's emulated rank from the same weights.

Only failing cells pay for this: the runner re-runs them with ``trace`` on, up to that step;
the reference starts every step from the run's own parameters after the previous one, so a
later step's modules are compared on the weights the run had. Each module's tensor gets the
last-rounding allowance the cell's outputs get (two computations agreeing up to a final
rounding in the coarser dtype). The first module over it is named, in execution order: the
earliest micro-batch, its forward before its backward, and among the ranks (which run that
phase side by side) the one whose divergent module comes first, the lowest rank on a tie.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch
from torch.distributed.tensor import DTensor

from parity.execute.observation import Observation
from parity.judge import tolerance
from parity.judge.compare import amax, assemble, max_abs
from parity.judge.record import Record, Verdict
from parity.judge.reference import run_reference
from parity.matrix.cell import Cell
from parity.model.registry import get_fixture
from parity.model.trace import Trace

#: Checks whose failure asks where the cell diverged first.
NUMERIC = ("output", "input_grad", "grad", "grad.clipped", "grad_norm", "param", "trajectory")


def traced_step(records: list[Record]) -> int:
    """The step a traced re-run reads: the first whose outputs or input gradients failed (what a
    module trace can narrow down), else the step the cell's ``stage`` record puts its first
    divergence at (:mod:`parity.judge.stages`), else step 0."""
    failed = [r.step for r in records if r.check in ("output", "input_grad") and r.verdict == Verdict.FAIL
              and isinstance(r.step, int)]
    if failed:
        return min(failed)
    stage = next((r for r in records if r.check == "stage"), None)
    return stage.step if stage is not None and isinstance(stage.step, int) else 0


def _compared(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float] | None:
    """A traced tensor against the reference's: (largest difference, the last-rounding allowance
    of the coarser dtype), judged on the rank's whole tensor; None for a shard (not judged)."""
    whole = _whole(got)
    if whole is None or whole.shape != want.shape:
        return None
    allow = tolerance.last_rounding(tolerance.coarser(got.dtype, want.dtype), amax(want)).allowed
    return max_abs(whole, want), allow


def _first_over(actual: dict, expected: dict, skipped: set[str]) -> tuple[int, str, float, float, float] | None:
    """The first module over its allowance, with its position in ``actual``'s order; modules whose
    tensor is not the reference's whole tensor (a tensor-parallel shard of an activation) are
    added to ``skipped``, not judged."""
    for order, (fqn, got) in enumerate(actual.items()):
        want = expected.get(fqn)
        if want is None:
            continue
        judged = _compared(got, want)
        if judged is None:
            skipped.add(fqn)
            continue
        observed, allow = judged
        if observed > allow:
            return order, fqn, observed, allow, observed / allow if allow > 0 else float("inf")
    return None


#: One located module: (micro-batch, phase 0 forward / 1 backward, order, rank, fqn, observed, allowed, ratio).
Located = tuple[int, int, int, int, str, float, float, float]


def _pairs(cell: Cell, observations: list[Observation], ref: dict) -> list[tuple[int, int, Trace, Trace]]:
    """(micro-batch, rank, the rank's trace, its emulated data rank's reference trace), in order."""
    topo = cell.topology()
    return [(mb, o.rank, o.traces[mb], ref.get((topo.data_rank(o.rank), mb), Trace()))
            for mb in range(cell.microbatches) for o in sorted(observations, key=lambda o: o.rank) if mb in o.traces]


def _first(pairs, phase: int, skipped: set[str]) -> Located | None:
    """The first divergent module of ``phase`` (0 outputs, 1 input gradients) in execution order."""
    found = []
    for mb, rank, got, want in pairs:
        side = (got.outputs, want.outputs) if phase == 0 else (got.input_grads, want.input_grads)
        hit = _first_over(*side, skipped)
        if hit is not None:
            found.append((mb, phase, hit[0], rank, *hit[1:]))
    return min(found, default=None)


#: The ``format`` of a trace document (:func:`trace_document`).
TRACE_FORMAT = "parity-trace/2"


def _summary(t: torch.Tensor) -> dict:
    """What a trace keeps of a tensor: dtype, shape, a SHA-256 of its bytes (bitwise identity) and
    FP64 statistics; of a DTensor (a tensor-parallel activation), this rank's local shard and
    its placements."""
    placements = {}
    if isinstance(t, DTensor):
        placements = {"placements": [str(p) for p in t.placements]}
        t = t.to_local()
    data = t.detach().contiguous().cpu()
    raw = data.view(-1).view(torch.uint8) if data.numel() else data.view(torch.uint8)
    d = data.double()
    stats = {"min": d.min().item(), "max": d.max().item(), "mean": d.mean().item(), "l2": d.norm().item()} \
        if data.numel() else {}
    return {"dtype": str(data.dtype).removeprefix("torch."), "shape": list(data.shape),
            "sha256": hashlib.sha256(raw.numpy().tobytes()).hexdigest(), **stats, **placements}


def _whole(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as a whole tensor on this rank: itself, a replicated DTensor's local copy; None for
    a shard."""
    if not isinstance(t, DTensor):
        return t
    return t.to_local() if all(p.is_replicate() for p in t.placements) else None


def trace_document(cell: Cell, pairs) -> dict:
    """Every rank's micro-batches of the traced step, module by module (forward order, then
    backward order): each tensor's summary on the sharded run and in the reference, their largest
    difference and the allowance it was judged against. Written as ``traces/<cell>.json``
    beside ``cells.csv``."""
    entries = []
    for mb, rank, sharded, reference in pairs:
        for kind, got_all, want_all in (("output", sharded.outputs, reference.outputs),
                                        ("input_grad", sharded.input_grads, reference.input_grads)):
            for order, (fqn, got) in enumerate(got_all.items()):
                want = want_all.get(fqn)
                entry = {"rank": rank, "microbatch": mb, "kind": kind, "order": order, "module": fqn,
                         "sharded": _summary(got)}
                if want is not None:
                    entry["reference"] = _summary(want)
                    judged = _compared(got, want)
                    if judged is not None:  # a shard is not judged
                        entry["max_abs_diff"], entry["allowed"] = judged
                entries.append(entry)
    return {"format": TRACE_FORMAT, "cell": cell.id, "scope": f"every rank and micro-batch of step {cell.trace_step}",
            "tensors": entries}


def _said(hit: Located | None, phase: str) -> str:
    if hit is None:
        return f"{phase}: no module over"
    mb, _, _, rank, fqn, _, _, ratio = hit
    return f"first in {phase} order: {fqn} (rank {rank}, micro-batch {mb}, ratio {ratio:.3g})"


def locate(cell: Cell, observations: list[Observation], base: dict, device="cpu",
           document: dict | None = None) -> Record:
    """One ``divergence`` record naming the first module over its allowance (:data:`Located`),
    with the first of each order; ``document``, when given, receives the cell's trace
    (:func:`trace_document`)."""
    first = observations[0]
    fixture = get_fixture(cell.fixture, cell.source)
    ref: dict[tuple[int, int], Trace] = {}
    step = cell.trace_step
    run = assemble(observations, first.plan) if step else None  # the run's weights before the traced step
    run_reference(dataclasses.replace(cell, steps=step + 1), fixture, first.plan, first.report, device=device,
                  trace=ref, trace_step=step, resync=run.params if run else None,
                  clip_norms=run.grad_norms if run else None)
    pairs = _pairs(cell, observations, ref)
    if document is not None:  # a trace that cannot be summarized must not cost the located record
        try:
            document.update(trace_document(cell, pairs))
        except Exception as exc:  # noqa: BLE001
            document.update({"format": TRACE_FORMAT, "cell": cell.id, "error": f"{type(exc).__name__}: {exc}"})
    skipped: set[str] = set()
    fwd, bwd = _first(pairs, 0, skipped), _first(pairs, 1, skipped)
    where = min((h for h in (fwd, bwd) if h is not None), default=None)
    unjudged = (f"; {len(skipped)} tensor(s) not judged: the ranks hold shards of them on this mesh "
                f"(e.g. {sorted(skipped)[0]})") if skipped else ""
    scope = f"every rank and micro-batch of step {step}"
    if where is None:
        return Record(**base, step=step, check="divergence", name="-", verdict=Verdict.PASS,
                      detail=f"no module's output or input gradient differs beyond its allowance in {scope}: the "
                             "difference arises after backward (reduction, optimizer) or later" + unjudged)
    detail = f"{_said(fwd, 'forward')}; {_said(bwd, 'backward')}{unjudged}; traced: {scope}"
    *_, name, observed, allowed, ratio = where
    return Record(**base, step=step, check="divergence", name=name, observed=observed, allowed=allowed, ratio=ratio,
                  verdict=Verdict.FAIL, detail=detail)
