"""``checkpoint.moved``: a checkpoint saved on one layout and loaded on another
(:mod:`parity.execute.moves`), judged entry by entry and by the step that follows.

Per target path:

- ``entry:KEY`` -- every model and optimizer entry (``model/FQN``, ``optim/FQN/step``, the
  moments, the parameter groups' settings) read back whole after the load is bitwise the
  entry saved, in the same dtype: resharding moves bytes, never changes them;
- ``ranks`` -- every loading rank's copy of every entry, after the load and after the step
  that follows, is rank 0's (the entries above and below are judged from rank 0's copies);
- ``layout:KEY`` -- on every loading rank, the entry's type and placements after the load are
  those of the freshly built model (loading fills the target's sharding, never replaces it);
- ``grad:FQN``, ``param:FQN``, ``optim:FQN.MOMENT`` -- the loading layout's next step against
  the saving layout's next step from the same state and the same global batch: the gradient
  allowance of a reduction over the cell's ranks x micro-batches in the reduction's dtype, at
  the scale of the terms' largest elements (the reference's, as ``grad`` takes it)
  (both layouts compute every micro-batch's backward on the same numbers -- a layout on fewer
  ranks divides each loss as the full one does and averages the folded ranks after the
  reduction, :func:`parity.execute.training.train_step` -- and sum the same terms in another
  order), the one-step parameter and moment allowances; optimizer step counters exact.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from parity.execute.observation import NORM, RATES, Moved, Observation
from parity.judge import tolerance
from parity.judge.checkpoint_entries import entries, exact, missing, no_gradients
from parity.judge.gathered import regathered
from parity.judge.compare import Comparison, amax, moment_change
from parity.judge.record import Record, Verdict
from parity.judge.rows import skipped
from parity.matrix.cell import Cell
from parity.model.dtypes import coarser, unit_roundoff
from parity.model.plan import PrecisionPlan
from parity.model.recipe import BETAS, clip_coefficient, optimizer_recipe, scheduled_lr, update_sensitivity

CHECK = "checkpoint.moved"


def _layouts(base: dict, target: str, per_rank: list[tuple[int, Moved]]) -> list[Record]:
    keys = dict.fromkeys(k for _, m in per_rank for k in (*m.before, *m.after))
    rows = []
    for key in keys:
        broken = [f"rank {r}: {m.before.get(key, '<absent>')} -> {m.after.get(key, '<absent>')}"
                  for r, m in per_rank if m.before.get(key) != m.after.get(key) or key not in m.after]
        first = per_rank[0][1].after.get(key, "<absent>")
        ok = not broken
        rows.append(Record(**base, check=CHECK, name=f"{target}:layout:{key}", observed=0.0 if ok else 1.0,
                           allowed=0.0, ratio=0.0 if ok else float("inf"), verdict=Verdict.PASS if ok else Verdict.FAIL,
                           detail=(f"{first} before and after loading on {len(per_rank)} rank(s)" if ok
                                   else "loading changed the entry's layout: " + "; ".join(broken)[:600])))
    return rows


def _witnesses(base: dict, target: str, per_rank: list[tuple[int, Moved]], note: str) -> Record:
    """Every loading rank is a witness: the entries judged are rank 0's copies (after the load
    and after the resumed step), so each other rank's must be rank 0's, bitwise (by digest)."""
    if len(per_rank) < 2:  # nothing to hold rank 0's copies to: no evidence either way
        return skipped(base, CHECK, f"{target}:ranks", f"one loading rank: no other rank to hold to rank 0's ({note})")
    first = per_rank[0][1].witness
    problems = [f"rank {r}: {key.replace(':', ' ', 1)}" for r, m in per_rank[1:]
                for key in dict.fromkeys([*first, *m.witness]) if m.witness.get(key) != first.get(key)]
    if not first:
        problems.insert(0, f"rank {per_rank[0][0]}: no digests reported")
    ok = not problems
    return Record(**base, check=CHECK, name=f"{target}:ranks", observed=0.0 if ok else 1.0, allowed=0.0,
                  ratio=0.0 if ok else float("inf"), verdict=Verdict.PASS if ok else Verdict.FAIL,
                  detail=(f"every entry after the load and the resumed step bitwise rank 0's on {len(per_rank)} "
                          f"loading rank(s) ({note})" if ok else
                          "differ from rank 0's: " + "; ".join(problems[:6])[:600] + f" ({note})"))


def _step(cell: Cell, base: dict, target: str, plan: PrecisionPlan, saved: dict, straight: dict,
          resumed: dict, note: str, scales: dict[str, float]) -> list[Record]:
    recipe = optimizer_recipe(cell.optimizer)
    rows = []
    coefs = (1.0, 1.0)  # the straight and resumed steps' clipping coefficients
    if cell.clip:
        norm_row, coefs = _norms(cell, base, target, plan, straight, resumed, note, scales)
        rows.append(norm_row)

    def scale(fqn: str, grad: torch.Tensor) -> float:  # the unclipped gradient's summation scale
        return scales.get(fqn, amax(grad) / coefs[0])
    for key in dict.fromkeys([*straight, *resumed, RATES]):  # the rates owed whatever either side reported
        name = f"{target}:{key}"
        if key == NORM:
            continue
        if key not in resumed or key not in straight:
            where = "the resumed step" if key not in resumed else "the uninterrupted step"
            rows.append(missing(base, CHECK, name, f"{key} after {where} ({note})"))
            continue
        want, got = straight[key], resumed[key]
        if key == RATES:  # the step's learning rates: exact
            rows.append(exact(base, CHECK, name, want, got, note, ("straight", "resumed")))
            continue
        if key.startswith("optim/"):  # optim/FQN/state key (:func:`parity.execute.moves._flat`)
            fqn, _, state_key = key[len("optim/"):].rpartition("/")
            t = plan.get(fqn)
            if state_key not in recipe.moments or t is None:  # counters and other state: exact
                rows.append(exact(base, CHECK, name, want, got, note))
                continue
            allow = tolerance.moment(recipe.moment_dtype(t), amax(want))
            if cell.clip and f"grad:{fqn}" in straight:
                grad = straight[f"grad:{fqn}"]
                spread = float(_spread(cell, t, grad, coefs, scale(fqn, grad)).max())
                allow = _moment_spread(allow, state_key, grad, spread)
            comp = Comparison(cell.resume_step, CHECK, name, got, want, allow,
                              signal=moment_change(want, saved.get(key)))
        else:  # grad:FQN or param:FQN
            kind, _, rest = key.partition(":")
            t = plan.get(rest)
            if t is None:
                rows.append(exact(base, CHECK, name, want, got, note))
                continue
            if kind == "grad":
                allow = _clipped_grad(cell, t, coefs, scale(rest, want))
                ratio = coefs[1] / coefs[0]  # the straight gradient as the resumed step's coefficient scales it
                comp = Comparison(cell.resume_step, CHECK, name, got, want * ratio if ratio != 1.0 else want, allow)
            else:
                before = saved.get(f"model/{rest}")
                update = want - before if isinstance(before, torch.Tensor) and before.shape == want.shape \
                    else torch.zeros_like(want)
                allow = tolerance.parameter(t.storage, want, update, cell.optimizer)
                if cell.clip:
                    grad = straight.get(f"grad:{rest}")
                    spread = _spread(cell, t, grad, coefs, scale(rest, grad)) if grad is not None else None
                    allow = _propagated(cell, allow, spread,
                                        {k.rpartition("/")[2]: v for k, v in straight.items()
                                         if k.startswith(f"optim/{rest}/")})
                comp = Comparison(cell.resume_step, CHECK, name, got, want, allow, signal=amax(update))
        rows.append(_record(cell, base, name, comp, note))
    return rows


def _record(cell: Cell, base: dict, name: str, comp: Comparison, note: str) -> Record:
    """``comp``'s record under this check, at the resumed step, its detail naming the layouts."""
    row = comp.record(dict(base))
    row.check, row.name, row.step = CHECK, name, cell.resume_step
    row.detail = "; ".join(x for x in (row.detail, note) if x)
    return row


def _norms(cell: Cell, base: dict, target: str, plan: PrecisionPlan, straight: dict, resumed: dict,
           note: str, scales: dict[str, float]) -> tuple[Record, tuple[float, float]]:
    """With clipping each layout clips with its own global norm, which another layout forms
    in another order: the norms are judged against each other (as ``grad_norm`` judges a
    run's), and the gradients then against the straight step's rescaled by the ratio of the
    two clipping coefficients. Returns the norm's record and the two coefficients (straight,
    resumed; both 1.0 if a norm is missing)."""
    name = f"{target}:{NORM}"
    if NORM not in straight or NORM not in resumed:
        where = "the resumed step" if NORM not in resumed else "the uninterrupted step"
        return missing(base, CHECK, name, f"the global norm a clipping step used, after {where} ({note})"), (1.0, 1.0)
    want, got = float(straight[NORM]), float(resumed[NORM])
    grads = {k.partition(":")[2]: v for k, v in straight.items() if k.startswith("grad:")}
    spread = 0.0
    for fqn, g in grads.items():
        t = plan.get(fqn)
        if t is not None:  # the unclipped gradients may differ within their own allowances
            unclipped = g.double() / clip_coefficient(cell.clip, want)
            a = tolerance.gradient(t.sum_dtype, t.kept_grad, cell.ranks * cell.microbatches,
                                   scales.get(fqn, amax(unclipped)))
            spread += g.numel() * a.allowed ** 2
    largest = max((g.numel() for g in grads.values()), default=1)
    allow = tolerance.grad_norm(torch.float32, largest, len(grads), cell.ranks, want, spread ** 0.5)
    row = _record(cell, base, name, Comparison(cell.resume_step, CHECK, name, got, want, allow), note)
    return row, (clip_coefficient(cell.clip, want), clip_coefficient(cell.clip, got))


def _clipped_grad(cell: Cell, t, coefs: tuple[float, float], scale: float) -> tolerance.Allowance:
    """A gradient's allowance: its reduction's (of terms summing to ``scale``, unclipped); after
    clipping, that of the unclipped gradient times the resumed step's coefficient plus one
    rounding of each product (:func:`parity.judge.tolerance.clipped`)."""
    _, resumed = coefs
    before = tolerance.gradient(t.sum_dtype, t.kept_grad, cell.ranks * cell.microbatches, scale)
    return tolerance.clipped(before, resumed, t.kept_grad, scale) if cell.clip else before


def _moment_spread(allow: tolerance.Allowance, key: str, grad: torch.Tensor, spread: float) -> tolerance.Allowance:
    """A moment's allowance when the step's gradients may differ by ``spread``: the first moment
    (and SGD's buffer) takes ``(1 - b1)`` of it (all of it), the second ``(1 - b2)`` of
    ``2 |g| spread + spread^2``."""
    b1, b2 = BETAS
    extra = {"exp_avg": (1 - b1) * spread, "exp_avg_sq": (1 - b2) * (2 * amax(grad) + spread) * spread,
             "momentum_buffer": spread}.get(key, 0.0)
    if not extra:
        return allow
    return tolerance.Allowance(allow.allowed + extra, allow.dtype,
                               f"{allow.basis} + {extra:.3g} (how far the clipped gradients may differ, through the moment)")


def _spread(cell: Cell, t, grad: torch.Tensor, coefs: tuple[float, float], scale: float) -> torch.Tensor:
    """How far the two steps' clipped gradients may differ, per element: the straight one
    rescaled by the ratio of the clipping coefficients (``|g| x |ratio - 1|``), the reduction's
    summation bound (absolute, :func:`parity.judge.tolerance.gradient`, scaled by the resumed
    coefficient) and the roundings that are relative to each element -- the cast of the reduced
    gradient to a coarser kept dtype and the clipping product (``u(kept) |g|`` each). An
    element's own roundings scale with the element: a tiny gradient under AdamW, whose update
    is sensitive to it in proportion to ``1 / sqrt(v)``, moves its update by a bounded amount
    (``sqrt(v) >= sqrt(1 - b2) |g|``), where a tensor-wide bound times that sensitivity would not."""
    straight, resumed = coefs
    g = grad.detach().double().abs()
    terms = cell.ranks * cell.microbatches
    summed = tolerance.gradient(t.sum_dtype, t.sum_dtype, terms, scale).allowed * resumed
    u = unit_roundoff(t.kept_grad)
    relative = (u if coarser(t.sum_dtype, t.kept_grad) != t.sum_dtype else 0.0) \
        + (u if cell.clip and resumed < 1.0 else 0.0)
    return g * abs(resumed / straight - 1.0) + (g + summed) * relative + summed


def _propagated(cell: Cell, allow: tolerance.Allowance, spread: torch.Tensor | None, state: dict) -> tolerance.Allowance:
    """A parameter's allowance when the two steps' gradients may differ by ``spread`` per element
    (clipping with norms formed in another order, :func:`_spread`): the update's sensitivity to
    its gradient (:func:`parity.model.recipe.update_sensitivity`, from the straight step's
    optimizer state) times ``spread``, added per element."""
    if allow.per_element is None or spread is None or not spread.numel() or not float(spread.max()):
        return allow
    try:
        lr = scheduled_lr(cell.schedule, cell.resume_step)
        extra = update_sensitivity(cell.optimizer, state, lr) * spread.reshape(allow.per_element.shape)
    except KeyError:  # no optimizer state for it (frozen): nothing moved, nothing to add
        return allow
    per_element = allow.per_element + extra
    return tolerance.Allowance(float(per_element.max()) if per_element.numel() else 0.0, allow.dtype,
                               f"{allow.basis} + optimizer sensitivity x (up to {float(spread.max()):.3g}) "
                               "(how far the clipped gradients may differ)", per_element=per_element)


def checks(cell: Cell, observations: list[Observation], plan: PrecisionPlan, base: dict,
           scales: dict[str, float]) -> list[Record]:
    """Every target path's moved-checkpoint records (see the module); ``scales``: the
    reference's :meth:`~parity.judge.reference.ReferenceRun.terms_scale` of the step after the
    save, the scale of each gradient's summation allowance (as in ``grad``)."""
    moved = observations[0].contracts.moved or {}
    rows = []
    own = moved.get(cell.path, Moved())
    rows += [missing(base, CHECK, t, f"rank 0 reported no load of the moved checkpoint into {t}: that load is not judged")
             for t in cell.load_targets if t not in moved]
    for target, m0 in moved.items():
        per_rank = [(o.rank, o.contracts.moved.get(target, Moved(error="no report from this rank")))
                    if o.contracts.moved is not None else (o.rank, Moved(error="no moved-checkpoint report"))
                    for o in observations]
        at = base if target == cell.path else {
            **base, "cell": replace(cell, path=target, crossload="").id, "path": target, "path_taken": target}
        note = f"saved by {m0.save}, loaded by {m0.load}"
        errors = [f"rank {r}: {m.error}" for r, m in per_rank if m.error]
        if errors:
            rows.append(Record(**at, check=CHECK, name=target, verdict=Verdict.ERROR,
                               detail=f"{note}: " + "; ".join(errors)[:1000]))
            continue
        if m0.skip:
            rows.append(Record(**at, check=CHECK, name=target, verdict=Verdict.SKIP, detail=m0.skip))
            continue
        if not own.saved or not m0.loaded:
            rows.append(missing(at, CHECK, target, f"rank 0 reported no {'saved' if not own.saved else 'loaded'} entries "
                                             f"({note})"))
            continue
        rows += entries(at, CHECK, f"{target}:entry:", own.saved, [(None, {k: (v, ()) for k, v in m0.loaded.items()})],
                        note, ("saved", "loaded"))
        rows += _layouts(at, target, [(r, m) for r, m in per_rank if m.part])
        rows.append(_witnesses(at, target, [(r, m) for r, m in per_rank if m.part], note))
        rows += _step(cell, at, target, plan, own.saved, own.straight, m0.resumed, note, scales)
        loading = [(r, m) for r, m in per_rank if m.part]
        rows.append(no_gradients(at, CHECK, target, loading))
        rows += regathered(at, CHECK, target, loading, plan, lambda f: m0.resumed.get(f"param:{f}", torch.zeros(0)))
    return rows
