"""Where a failing cell diverges first: per-module outputs (forward order) and input
gradients (backward order) of rank 0's first micro-batch of the step its records diverged at
first (:attr:`Cell.trace_step`), against the reference's from the same weights.

Only failing cells pay for this: the runner re-runs them with ``trace`` on, up to that step;
the reference starts every step from the run's own parameters after the previous one, so a
later step's modules are compared on the weights the run had. Each module's tensor gets the
last-rounding allowance the cell's outputs get (two computations agreeing up to a final
rounding in the coarser dtype); the first module over it is named.
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


#: The ``format`` of a trace document (:func:`trace_document`).
TRACE_FORMAT = "parity-trace/1"


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


def trace_document(cell: Cell, sharded: Trace, reference: Trace) -> dict:
    """Rank 0's first micro-batch of the traced step, module by module (forward order, then backward order): each
    tensor's summary on the sharded run and in the reference, their largest difference and the
    allowance it was judged against. Written as ``traces/<cell>.json`` beside ``cells.csv``."""
    entries = []
    for kind, got_all, want_all in (("output", sharded.outputs, reference.outputs),
                                    ("input_grad", sharded.input_grads, reference.input_grads)):
        for order, (fqn, got) in enumerate(got_all.items()):
            want = want_all.get(fqn)
            entry = {"kind": kind, "order": order, "module": fqn, "sharded": _summary(got)}
            if want is not None:
                entry["reference"] = _summary(want)
                whole = _whole(got)
                if whole is not None and whole.shape == want.shape:  # a shard is not judged
                    entry["max_abs_diff"] = max_abs(whole, want)
                    entry["allowed"] = tolerance.last_rounding(tolerance.coarser(got.dtype, want.dtype),
                                                               amax(want)).allowed
            entries.append(entry)
    return {"format": TRACE_FORMAT, "cell": cell.id, "scope": f"rank 0, step {cell.trace_step}, micro-batch 0",
            "tensors": entries}


def locate(cell: Cell, observations: list[Observation], base: dict, device="cpu",
           document: dict | None = None) -> Record:
    """One ``divergence`` record naming the first module over its allowance in each order;
    ``document``, when given, receives the cell's trace (:func:`trace_document`)."""
    first = observations[0]
    fixture = get_fixture(cell.fixture, cell.source)
    ref = Trace()
    step = cell.trace_step
    run = assemble(observations, first.plan) if step else None  # the run's weights before the traced step
    run_reference(dataclasses.replace(cell, steps=step + 1), fixture, first.plan, first.report, device=device,
                  trace=ref, trace_step=step, resync=run.params if run else None,
                  clip_norms=run.grad_norms if run else None)
    if document is not None:  # a trace that cannot be summarized must not cost the located record
        try:
            document.update(trace_document(cell, first.trace, ref))
        except Exception as exc:  # noqa: BLE001
            document.update({"format": TRACE_FORMAT, "cell": cell.id, "error": f"{type(exc).__name__}: {exc}"})
    skipped: list[str] = []
    fwd = _first_over(first.trace.outputs, ref.outputs, skipped)
    bwd = _first_over(first.trace.input_grads, ref.input_grads, skipped)
    where = fwd or bwd
    unjudged = (f"; {len(skipped)} tensor(s) not judged: rank 0 holds a shard of them on this mesh "
                f"(e.g. {skipped[0]})") if skipped else ""
    if where is None:
        return Record(**base, step=step, check="divergence", name="-", verdict=Verdict.PASS,
                      detail="no module's output or input gradient differs beyond its allowance in rank 0's first "
                             f"micro-batch of step {step}: the difference arises after backward (reduction, "
                             "optimizer) or later" + unjudged)
    parts = [f"first in forward order: {fwd[0]} (ratio {fwd[3]:.3g})" if fwd else "forward: no module over",
             f"first in backward order: {bwd[0]} (ratio {bwd[3]:.3g})" if bwd else "backward: no module over"]
    parts[-1] += unjudged + f"; traced: rank 0's first micro-batch of step {step}"
    name, observed, allowed, ratio = where
    return Record(**base, step=step, check="divergence", name=name, observed=observed, allowed=allowed, ratio=ratio,
                  verdict=Verdict.FAIL, detail="; ".join(parts))
