"""The evidence contract of a cell: which records it must produce, derived before looking.

Every other check judges what arrived; this one judges whether everything that should have
arrived did. From the cell's axes, the model's declaration and the precision plan (never from
the observations) it derives the records the cell owes:

- ``output`` and, unless the model's input is integer tokens, ``input_grad`` for every step,
  rank and micro-batch;
- ``grad`` and ``param`` for every trainable parameter at every step it trains (and
  ``grad.clipped`` where clipping or a loss scale changes the gradient after its reduction),
  ``grad_norm`` and ``lr`` at every step, ``trajectory`` for every parameter trained by the last step;
- ``dtype.reduce`` for every trainable FSDP-managed parameter trained within the cell's steps,
  ``dtype.grad`` for every parameter trained within them (ignored ones too),
  ``plan`` for every parameter;
- ``quant.gather``, ``quant.refresh``, ``quant.values`` and ``quant.scale`` (tensorwise) or
  ``quant.blocks`` (MX) for every quantized weight;
- ``grad.accum`` (the reductions' inputs, the no-sync window's accumulation);
- ``grad.shard`` for every trainable FSDP-managed parameter at every step it trains, on every
  mesh (each rank's shard as the reductions left it), and on HSDP ``grad.partial`` (what the
  all-reduce across replicas took); on FSDP x TP ``tp.partial`` for every TP layer's reduction
  (what each rank's all-reduce took, every step);
- ``optim.moments`` for every parameter at every step it trains, when the optimizer recipe keeps
  moments (AdamW's two, SGD's momentum; any one on a loss-scaled cell, whose first steps may be
  skipped);
- ``grad.freed`` every step, when FSDP manages a parameter that trains;
- ``checkpoint.same`` and, where a cross-load is due, ``checkpoint.cross`` when the cell runs
  the checkpoint lifecycle (and ``checkpoint.collectives``); ``checkpoint.moved`` when its checkpoint also moves (``move``).

A ``coverage`` record FAILs, naming what is missing, when any owed record is absent or is a
SKIP without a stated reason. A parameter that gets no gradient in the reference either, or only
exact zeros at every step (a property of the model, e.g. behind an ``argmax``) owes no ``grad``/``param``/``trajectory``
records; it is reported as a ``no-gradient`` finding instead. A cell in which no parameter
trains at all (each unfreezes at or after its last step) owes none of those, and FAILs on that
(``coverage`` ``training``): what is left would pass on a path that breaks every gradient.
"""

from __future__ import annotations

from parity.judge import recompute, unshard
from parity.judge.record import Record, Verdict
from parity.matrix.cell import Cell
from parity.model.formats import layout
from parity.model.plan import PrecisionPlan, tp_reductions
from parity.model.recipe import optimizer_recipe, owed_moments, rescales_gradients

#: Owed records a cell's coverage row names at most (the count says how many more).
NAMED = 8


def owed(cell: Cell, plan: PrecisionPlan, *, token_input: bool, quantizable: tuple[str, ...] = (),
         no_gradient: set[str] = frozenset()) -> list[tuple]:
    """``(check, name, step)`` triples the cell must produce; ``step`` None: any step,
    ``name`` None: any name. Quantized weights come from the model's declared ``quantizable``
    layers and the cell's ``weights`` axis, not from the plan the worker resolved."""
    out: list[tuple] = []
    trained = [t for t in plan.params if t.requires_grad and t.fqn not in no_gradient]
    # the optimizer's state after each step: a record per parameter it stepped, or, where a
    # loss-scaled step may be skipped (no state yet), any such record
    by_name = bool(owed_moments(cell.optimizer, plan.config.param_dtype))
    for step in range(cell.steps):
        for r in range(cell.ranks):
            for mb in range(cell.microbatches):
                out.append(("output", f"rank{r}/mb{mb}", step))
                if not token_input:
                    out.append(("input_grad", f"rank{r}/mb{mb}", step))
        out.append(("grad_norm", "global", step))
        out.append(("lr", cell.schedule, step))
        out += [("collectives", label, step) for label in cell.segments(step)]
        out += [("state_dict", f"{api}@{point}", step) for point in cell.state_dict_points(step)
                for api in cell.state_dict_apis(point)]
        for label in cell.eval_labels(step):
            out += [("eval", f"rank{r}/{label}", step) for r in range(cell.ranks)] + [("eval.reshard", label, step)]
        if cell.clip:
            out.append(("clip", "global", step))
        if recompute.owed(cell):
            out.append(("recompute", cell.checkpointing, step))
        if unshard.owed(cell):
            out.append(("unshard", "explicit", step))
        if unshard.reshard_owed(cell):
            out.append(("reshard.backward", "last", step))
        out.append(("reshard.forward", unshard.forward_name(cell), step))
        if unshard.flagged_owed(cell):
            out.append(("finalize.flagged", "is_last_backward", step))
        staged = rescales_gradients(cell.clip, plan.config.param_dtype)  # reduced, then unscaled/clipped
        for t in trained:
            if t.trainable_from <= step:
                out += [("grad", t.fqn, step), ("param", t.fqn, step)] + ([("grad.clipped", t.fqn, step)] if staged else [])
                out += [("optim.moments", t.fqn, step)] if by_name else []
                if t.ownership == "managed":
                    out.append(("grad.shard", t.fqn, step))
                    if cell.mesh == "hsdp":
                        out.append(("grad.partial", t.fqn, step))
    out += [("trajectory", t.fqn, cell.steps - 1) for t in trained if t.trainable_from < cell.steps]
    out += [("plan", t.fqn, None) for t in plan.params]
    out += [("dtype.reduce", t.fqn, None) for t in plan.params
            if t.trainable and t.trainable_from < cell.steps and t.fqn not in no_gradient]
    out += [("dtype.grad", t.fqn, None) for t in trained if t.grad is not None and t.trainable_from < cell.steps]
    for fqn, fmt in layout(quantizable, cell.weights).items():
        if fmt != "none":
            kind = "quant.scale" if fmt == "fp8-tensorwise" else "quant.blocks"
            out += [(check, fqn, None) for check in ("quant.gather", "quant.refresh", kind, "quant.values")]
    if any(t.ownership == "managed" and t.trainable_from == 0 for t in trained):
        out.append(("grad.accum", None, None))
    if any(t.ownership == "managed" for t in trained):
        out += [("grad.freed", "unsharded", step) for step in range(cell.steps)]
    if not by_name and optimizer_recipe(cell.optimizer).moments and trained:
        out.append(("optim.moments", None, None))
    if cell.topology().tp > 1:
        out += [("tp.partial", key, step) for key in tp_reductions(plan) for step in range(cell.steps)]
    if cell.lifecycle:
        out += [("checkpoint.same", None, None), ("checkpoint.collectives", None, None),
                ("checkpoint.saved", None, None), ("checkpoint.loaded", None, None)]
        if cell.crossload_targets:
            out.append(("checkpoint.cross", None, None))
    if cell.move != "none":
        out.append(("checkpoint.moved", None, None))
    if cell.compile != "none":
        out.append(("compile.graphs", cell.compile, None))
    return out


def _key(check: str, name: str | None, step) -> str:
    return check + (f" {name}" if name is not None else "") + (f" @step {step}" if step is not None else "")


def missing_observations(cell: Cell, observations: list) -> str:
    """What the ranks' observations of a trained cell lack ("" when nothing): one from every rank
    of the cell, and from each the step-indexed evidence every cell sends -- an output and an
    input gradient per micro-batch of every step, each step's gradients, parameters and global
    norm. Judged before anything is assembled, so an
    observation cut short is named, not an index error of the judge."""
    ranks = [o.rank for o in observations]
    if ranks != list(range(cell.ranks)):
        return f"observations of ranks {ranks} arrived where the cell runs ranks 0-{cell.ranks - 1}"
    passes = cell.steps * cell.microbatches
    owed = {"outputs": passes, "input_grads": passes, "grads": cell.steps, "params": cell.steps,
            "grad_norms": cell.steps}  # a clipped norm that is missing fails ``clip`` by name
    for o in observations:
        for name, n in owed.items():
            got = len(getattr(o, name))
            if got != n:
                per = (f"{cell.steps} steps x {cell.microbatches} micro-batches" if name in ("outputs", "input_grads")
                       else "one per step")
                return f"rank {o.rank} sent {got} {name} where the cell owes {n} ({per})"
    return ""


def record(owed_rows: list[tuple], records: list[Record], base: dict) -> Record:
    """One ``coverage`` record: PASS when every owed record is present (a SKIP counts only
    with a stated reason), else FAIL naming the first missing ones and how many."""
    present = [(r.check, r.name, r.step) for r in records if r.verdict != Verdict.SKIP or r.detail.strip()]
    exact = set(present)
    by_name = {(c, n) for c, n, _ in present}
    checks = {c for c, _, _ in present}
    missing = [_key(*o) for o in owed_rows
               if not ((o[1] is None and o[0] in checks) or (o[2] is None and (o[0], o[1]) in by_name)
                       or (o[0], o[1], o[2]) in exact)]
    if not missing:
        return Record(**base, check="coverage", name="records", observed=0.0, allowed=0.0, ratio=0.0,
                      verdict=Verdict.PASS, detail=f"all {len(owed_rows)} owed records present")
    more = f" and {len(missing) - NAMED} more" if len(missing) > NAMED else ""
    return Record(**base, check="coverage", name="records", observed=float(len(missing)), allowed=0.0,
                  ratio=float("inf"), verdict=Verdict.FAIL,
                  detail=f"missing {len(missing)} of {len(owed_rows)} owed records: " + "; ".join(missing[:NAMED]) + more)


def untrained_record(cell: Cell, plan: PrecisionPlan, base: dict) -> Record | None:
    """A FAIL when no parameter trains within the cell's steps (every trainable one unfreezes at
    or after the last): its gradients, their reduction and the optimizer step were never
    exercised, so the records it owes (none of those) could all be present on a path that
    breaks every one of them. ``None`` when some parameter trains."""
    later = [t for t in plan.params if t.requires_grad]
    if any(t.trainable_from < cell.steps for t in later):
        return None
    first = min((t.trainable_from for t in later), default=None)
    why = (f"the first unfreezes at step {first} (Fixture.unfreeze); lower it below {cell.steps} or run more steps"
           if first is not None else "every parameter is frozen")
    return Record(**base, check="coverage", name="training", observed=0.0, allowed=0.0, ratio=float("inf"),
                  verdict=Verdict.FAIL,
                  detail=f"no parameter trains within the cell's {cell.steps} steps, so no gradient, reduction or "
                         f"optimizer step was exercised: {why}")


def no_gradient_record(names: list[str], base: dict) -> Record:
    """The model finding: trainable parameters that no computation differentiates, in the
    reference as in the sharded run -- not a defect of a path."""
    shown = ", ".join(names[:NAMED]) + (f" and {len(names) - NAMED} more" if len(names) > NAMED else "")
    return Record(**base, check="no-gradient", name="model", observed=float(len(names)), allowed=0.0,
                  ratio=float("inf"), verdict=Verdict.FAIL,
                  detail=f"{len(names)} trainable parameter(s) get no gradient (or only exact zeros) in the reference "
                         f"either (a property of the model, the same on every path; freeze them or route gradients "
                         f"to them): {shown}")
