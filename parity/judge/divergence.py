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
from parity.judge.compare import amax, assemble, max_abs, piece
from parity.judge.record import Record, Verdict
from parity.judge.reference import run_reference
from parity.matrix.cell import Cell
from parity.model.registry import get_fixture
from parity.model.topology import local_region
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


@dataclasses.dataclass(frozen=True)
class Layout:
    """What each rank holds of a traced tensor on a tensor-parallel mesh: the outputs of the
    colwise layers as plain local tensors (``ColwiseParallel`` hands on its output features,
    ``torch.chunk``'s piece ``rank % tp`` of the last dimension), sharded DTensors (a rowwise
    layer's input gradient, on the tp dimension) as their local shard at the offset the rank's tp
    coordinate and the placements give (torch's own rule), and Partial DTensors (a colwise layer's
    input gradient before TP's all-reduce) as the rank's partial sum, against the reference's
    emulated partial of the same tp chunk (``partials``; where it has none, not judged)."""

    tp: int = 1
    colwise: frozenset = frozenset()
    partials: dict = dataclasses.field(default_factory=dict, compare=False)
    """(micro-batch, rank) -> colwise module -> the reference's partial input gradient of the
    rank's tp chunk, at the traced step."""

    @classmethod
    def of(cls, cell: Cell, plan, tp_partials: dict | None = None) -> "Layout":
        """``tp_partials``: the reference's :attr:`~parity.judge.reference.ReferenceRun.tp_partials`."""
        topo, partials = cell.topology(), {}
        for (step, mb, data_rank), keys in (tp_partials or {}).items():
            for rank in (r for r in range(cell.ranks) if step == cell.trace_step and topo.data_rank(r) == data_rank):
                partials[(mb, rank)] = {key.rpartition("@")[0]: chunks[rank % topo.tp] for key, chunks in keys.items()
                                        if key.endswith("@backward") and rank % topo.tp in chunks}
        return cls(topo.tp, frozenset(t.fqn.rpartition(".")[0] for t in plan.params if t.parallel == "tp-colwise"),
                   partials)

    def held(self, fqn: str, kind: str, got: torch.Tensor, want: torch.Tensor, rank: int, mb: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(what rank ``rank`` holds of ``got`` in micro-batch ``mb``, the same part of the
        reference's ``want``); None where it holds a partial sum the reference did not emulate."""
        if not isinstance(got, DTensor):
            if self.tp > 1 and kind == "output" and fqn in self.colwise:
                return got, want.chunk(self.tp, dim=-1)[rank % self.tp]
            return got, want
        if all(p.is_replicate() for p in got.placements):
            return got.to_local(), want
        if any(p.is_partial() for p in got.placements):
            part = self.partials.get((mb, rank), {}).get(fqn) if kind == "input_grad" else None
            return None if part is None else (got.to_local(), part)
        if tuple(got.shape) != tuple(want.shape):
            return None
        if len(got.placements) != 1 or self.tp <= 1:  # an activation lives on the tp dimension alone
            return None
        # the parent has no process group to ask the mesh: the rank's tp coordinate, row-major
        return got.to_local(), piece(want, local_region(want.shape, (self.tp,), [rank % self.tp], got.placements))


def _compared(held: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[float, float] | None:
    """What a rank holds of a traced tensor against the same part of the reference's
    (:meth:`Layout.held`): (largest difference, the last-rounding allowance of the reference's
    dtype -- never the observed tensor's, so a module that returns BF16 where the reference
    holds FP32 does not widen its own allowance); None where it holds a partial sum or the
    shapes differ (not judged)."""
    if held is None or held[0].shape != held[1].shape:
        return None
    mine, want = held
    return max_abs(mine, want), tolerance.last_rounding(want.dtype, amax(want)).allowed


def _first_over(actual: dict, expected: dict, skipped: set[str], held=lambda fqn, got, want: (got, want)
                ) -> tuple[int, str, float, float, float] | None:
    """The first module over its allowance, with its position in ``actual``'s order (``held``: the
    part of the reference's tensor the rank holds); modules whose tensor the rank holds neither
    whole nor as a known shard are added to ``skipped``, not judged."""
    for order, (fqn, got) in enumerate(actual.items()):
        want = expected.get(fqn)
        if want is None:
            continue
        judged = _compared(held(fqn, got, want))
        if judged is None:
            skipped.add(fqn)
            continue
        observed, allow = judged
        if not observed <= allow:  # a NaN difference is over every allowance
            return order, fqn, observed, allow, observed / allow if allow > 0 and observed == observed else float("inf")
    return None


#: One located module: (micro-batch, phase 0 forward / 1 backward, order, rank, fqn, observed, allowed, ratio).
Located = tuple[int, int, int, int, str, float, float, float]


def _pairs(cell: Cell, observations: list[Observation], ref: dict) -> list[tuple[int, int, Trace, Trace]]:
    """(micro-batch, rank, the rank's trace, its emulated data rank's reference trace), in order."""
    topo = cell.topology()
    return [(mb, o.rank, o.traces[mb], ref.get((topo.data_rank(o.rank), mb), Trace()))
            for mb in range(cell.microbatches) for o in sorted(observations, key=lambda o: o.rank) if mb in o.traces]


def _first(pairs, phase: int, skipped: set[str], layout: Layout = Layout()) -> Located | None:
    """The first divergent module of ``phase`` (0 outputs, 1 input gradients) in execution order."""
    found = []
    kind = "output" if phase == 0 else "input_grad"
    for mb, rank, got, want in pairs:
        side = (got.outputs, want.outputs) if phase == 0 else (got.input_grads, want.input_grads)
        hit = _first_over(*side, skipped, lambda fqn, g, w, rank=rank, mb=mb: layout.held(fqn, kind, g, w, rank, mb))
        if hit is not None:
            found.append((mb, phase, hit[0], rank, *hit[1:]))
    return min(found, default=None)


#: The ``format`` of a trace document (:func:`trace_document`).
TRACE_FORMAT = "parity-trace/3"


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


#: The most tensors a trace document summarizes (each is hashed whole): the first in execution
#: order are kept, and the ones the ``divergence`` record names, the rest counted in its
#: ``dropped``. The record judges them all.
TRACE_CAP = 4000


def trace_document(cell: Cell, pairs, layout: Layout = Layout(), cap: int = TRACE_CAP, keep=frozenset()) -> dict:
    """Every rank's micro-batches of the traced step, module by module (forward order, then
    backward order): each tensor's summary on the sharded run and in the reference, their largest
    difference and the allowance it was judged against, at most ``cap`` of them besides those in
    ``keep`` ((micro-batch, rank, kind, module): the located ones). Written as
    ``traces/<cell>.json`` beside ``cells.csv``."""
    entries, dropped = [], 0
    for mb, rank, sharded, reference in pairs:
        for kind, got_all, want_all in (("output", sharded.outputs, reference.outputs),
                                        ("input_grad", sharded.input_grads, reference.input_grads)):
            for order, (fqn, got) in enumerate(got_all.items()):
                if len(entries) >= cap and (mb, rank, kind, fqn) not in keep:
                    dropped += 1
                    continue
                want = want_all.get(fqn)
                entry = {"rank": rank, "microbatch": mb, "kind": kind, "order": order, "module": fqn,
                         "sharded": _summary(got)}
                if want is not None:
                    entry["reference"] = _summary(want)
                    judged = _compared(layout.held(fqn, kind, got, want, rank, mb))
                    if judged is not None:  # a partial sum is not judged
                        entry["max_abs_diff"], entry["allowed"] = judged
                entries.append(entry)
    return {"format": TRACE_FORMAT, "cell": cell.id, "scope": f"every rank and micro-batch of step {cell.trace_step}",
            "tensors": entries, "dropped": dropped}


def stage_tensors(run, emulated, step: int) -> list[dict]:
    """The traced step's tensors after backward, stage by stage, whole (every rank's shard
    reassembled): ``gradients`` (each gradient as the reduction left it, unscaled), ``clipping``
    (the gradient the optimizer stepped with, where clipping or a loss scale changed it) and
    ``optimizer`` (each parameter after the update), each against the reference's from the same
    weights. The cell's ``grad`` / ``grad.clipped`` / ``param`` records hold their allowances."""
    reduced = bool(len(run.reduced) > step and run.reduced[step])
    sides = [("gradients", run.reduced if reduced else run.grads, emulated.reduced if reduced else emulated.grads)]
    if reduced:
        sides.append(("clipping", run.grads, emulated.grads))
    sides.append(("optimizer", run.params, emulated.params))
    entries = []
    for stage, got_all, want_all in sides:
        if len(got_all) <= step or len(want_all) <= step:
            continue
        for fqn, got in got_all[step].items():
            want = want_all[step].get(fqn)
            entry = {"stage": stage, "step": step, "tensor": fqn, "sharded": _summary(got)}
            if want is not None:
                entry["reference"] = _summary(want)
                if want.shape == got.shape and got.numel():
                    entry["max_abs_diff"] = (got.double() - want.double()).abs().max().item()
            entries.append(entry)
    return entries


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
    run = assemble(observations, first.plan)  # the run's weights before the traced step, its tensors after
    emulated = run_reference(dataclasses.replace(cell, steps=step + 1), fixture, first.plan, first.report,
                             device=device, trace=ref, trace_step=step, resync=run.params if step else None,
                             clip_norms=run.grad_norms if step else None)
    pairs = _pairs(cell, observations, ref)
    layout = Layout.of(cell, first.plan, emulated.tp_partials)
    skipped: set[str] = set()
    fwd, bwd = _first(pairs, 0, skipped, layout), _first(pairs, 1, skipped, layout)
    if document is not None:  # a trace that cannot be summarized must not cost the located record
        keep = {(h[0], h[3], kind, h[4]) for h, kind in ((fwd, "output"), (bwd, "input_grad")) if h is not None}
        try:
            document.update(trace_document(cell, pairs, layout, keep=keep))
            document["stages"] = stage_tensors(run, emulated, step)
        except Exception as exc:  # noqa: BLE001
            document.update({"format": TRACE_FORMAT, "cell": cell.id, "error": f"{type(exc).__name__}: {exc}"})
    where = min((h for h in (fwd, bwd) if h is not None), default=None)
    unjudged = (f"; {len(skipped)} tensor(s) not judged (e.g. {sorted(skipped)[0]}): the ranks hold partial "
                "sums of them on this mesh the reference did not emulate") if skipped else ""
    scope = f"every rank and micro-batch of step {step}"
    if where is None:
        return Record(**base, step=step, check="divergence", name="-", verdict=Verdict.PASS,
                      detail=f"no module's output or input gradient differs beyond its allowance in {scope}: a "
                             "difference arises outside every module's forward and backward (the root's input or "
                             "output casts, before the first or after the last module) or after backward "
                             "(reduction, optimizer)" + unjudged)
    detail = f"{_said(fwd, 'forward')}; {_said(bwd, 'backward')}{unjudged}; traced: {scope}"
    *_, name, observed, allowed, ratio = where
    return Record(**base, step=step, check="divergence", name=name, observed=observed, allowed=allowed, ratio=ratio,
                  verdict=Verdict.FAIL, detail=detail)
