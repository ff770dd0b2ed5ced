"""The checkpoint lifecycle's resumed runs, judged against the uninterrupted run: the optimizer
state the run holds at the resume point (keys, dtypes, shapes per the plan), and the step after
loading into each path (gradients, parameters, moments), bitwise on the saving path and within
the gradient / one-step / moment allowances across paths. Checkpoints that move to another
layout are :mod:`parity.judge.moved`'s."""

from __future__ import annotations

from dataclasses import replace

import torch

from parity.execute import dcp_files
from parity.execute.observation import Observation
from parity.judge import gathered, schedule, tolerance
from parity.judge.checkpoint_entries import missing
from parity.judge.compare import Comparison, amax, differing, gather_full, moment_change, unheld
from parity.judge.plan import path_taken
from parity.judge.record import Record, Verdict
from parity.matrix.cell import Cell
from parity.model.dtypes import dtype_name
from parity.model.plan import PrecisionPlan
from parity.model.recipe import optimizer_recipe
from parity.judge.rows import contract_row as _row
from parity.judge.rows import skipped as _skip


def _full_state(per_rank: list[dict], plan: PrecisionPlan, whole: bool) -> dict:
    """Local optimizer-state shards -> full tensors, per FQN and state key, over what any rank
    holds: an FQN or key some rank lacks gathers empty (:func:`_unheld` names the rank)."""
    return {f: {k: gather_full(plan, f, [{f: r[f][k]} if k in r.get(f, {}) else {} for r in per_rank], whole)
                for k in dict.fromkeys(k for r in per_rank for k in r.get(f, {}))}
            for f in dict.fromkeys(f for r in per_rank for f in r)}


def _unheld(per_rank: list[dict]) -> list[str]:
    """Optimizer-state entries (FQN.key) some rank lacks that another holds: every rank holds a
    shard (or a copy) of each trained parameter's state, so each must hold the same entries."""
    return unheld([dict.fromkeys((f, k) for f, st in r.items() for k in st) for r in per_rank], "optim", ".".join)


def optimizer_checks(cell: Cell, observations: list[Observation], plan: PrecisionPlan, base: dict) -> list[Record]:
    """Optimizer state per FQN: keys, dtypes and shapes follow the plan, in any parameter order."""
    recipe = optimizer_recipe(cell.optimizer)
    whole = observations[0].whole
    state = _full_state([o.contracts.optim for o in observations], plan, whole)
    step = observations[0].contracts.resume_step
    lacking = _unheld([o.contracts.optim for o in observations])
    rows = [] if len(observations) < 2 else [
        _row(base, "optim.state", "ranks", not lacking, "the same state entries on every rank",
             "; ".join(lacking) if lacking else f"the same on {len(observations)} ranks")]
    for t in plan.params:
        if not t.requires_grad or t.trainable_from > step:
            ok = t.fqn not in state
            rows.append(_row(base, "optim.state", t.fqn, ok, "no state (frozen)", "none" if ok else "state"))
            continue
        st = state.get(t.fqn)
        if st is None:
            rows.append(_row(base, "optim.state", t.fqn, False, f"{recipe.name} state", "missing"))
            continue
        shape = list(gather_full(plan, t.fqn, [o.params[step] for o in observations], whole).shape)
        dtype = recipe.moment_dtype(t)
        moments = [st.get(k, torch.zeros(0)) for k in recipe.moments]  # every moment, not the first alone
        seen = sorted({(dtype_name(m.dtype), str(list(m.shape))) for m in moments})
        taken, counted = step + 1 - t.trainable_from, _counted(recipe.counter, t.fqn, observations)
        want = f"keys {','.join(sorted(recipe.state_keys))}; {dtype_name(dtype)}; shape {shape}"
        got = f"keys {','.join(sorted(st))}; " + " / ".join(f"{d}; shape {sh}" for d, sh in seen)
        wrong = {r: n for r, n in counted.items() if n != taken}
        if counted:
            want += f"; {recipe.counter} {taken} on every rank"
            got += "; " + (", ".join(f"{recipe.counter} {n:g} on rank {r}" for r, n in wrong.items()) if wrong
                           else f"{recipe.counter} {taken}")
        ok = sorted(st) == sorted(recipe.state_keys) and all(m.dtype == dtype and list(m.shape) == shape
                                                             for m in moments) and not wrong
        rows.append(_row(base, "optim.state", t.fqn, ok, want, got, dtype=dtype_name(dtype)))
    return rows


def _counted(counter: str, fqn: str, observations: list[Observation]) -> dict[int, float]:
    """Rank -> the step counter its optimizer state holds for ``fqn`` (where it holds the key; a
    None there is NaN, never equal to a count: ``ranks`` names a rank lacking the key). What
    it must be is counted from the cell -- the steps since the parameter trains -- not read from
    the optimizer: a counter shared between parameters, or one advanced twice, shows here by name
    (the scaler skips no step in parity's cells: its loss scale fits)."""
    if not counter:
        return {}
    held = {r: o.contracts.optim.get(fqn, {}) for r, o in enumerate(observations)}
    return {r: float("nan") if st[counter] is None else float(st[counter]) for r, st in held.items() if counter in st}


def _resumed_state_dtype(base: dict, tag: str, name: str, got: torch.Tensor | None, want: torch.dtype) -> list[Record]:
    """A FAIL naming the cause when a resumed optimizer keeps a moment in another dtype than
    training does (nothing otherwise: the moment's values are compared beside it). torch's
    ``Optimizer.load_state_dict`` casts floating-point state to the parameter's dtype, so a
    moment that follows a ``grad_dtype`` other than the parameter's comes back narrowed."""
    if got is None or not got.numel() or got.dtype == want:
        return []
    return [_row(base, f"checkpoint.{tag}", f"{name}:dtype", False, dtype_name(want), dtype_name(got.dtype),
                 "the resumed optimizer state's dtype; torch.optim.Optimizer.load_state_dict casts floating-point "
                 "state to the parameter's dtype", dtype_name(want))]


def load_path_rows(base: dict, tag: str, target: str, taken: list[str], expected: str) -> list[Record]:
    """A FAIL when a rank's load into ``target`` ran on another path than ``expected`` (the path a
    fresh build in the parent takes for ``target``; '' unknown): its records would be that path's
    under ``target``'s name -- a cross load that ran on the saving path passes as a same-path one.
    Nothing when they agree (the records say where the step resumed)."""
    wrong = [f"rank {r}: {t}" for r, t in enumerate(taken) if expected and t != expected]
    if not wrong:
        return []
    return [_row(base, f"checkpoint.{tag}", f"{target}:path", False, f"the load into {target} on {expected} (a fresh "
                 f"build in the parent shards so)", "; ".join(wrong))]


def _witnesses(base: dict, tag: str, target: str, per_rank: list, plan: PrecisionPlan, whole: bool) -> list[Record]:
    """Every rank is a witness of the resumed step: what is replicated (FSDP-ignored parameters,
    their gradients and moments, scalars; every tensor on a 2-D mesh, whose ranks record whole
    tensors) is judged from rank 0's copy, so each other rank's must be rank 0's, bitwise; and
    each rank holds the same gradients, parameters and optimizer-state entries."""
    if len(per_rank) < 2:
        return []
    problems = [f"rank {r}: {kind[:-1]} {fqn}" for kind in ("grads", "params")
                for r, fqn in differing(plan, whole, [getattr(x, kind) for x in per_rank])]
    moments = [{(fqn, key): v for fqn, state in x.optim.items() for key, v in state.items()} for x in per_rank]
    problems += [f"rank {r}: optim {fqn}.{key}" for r, (fqn, key) in differing(plan, whole, moments, lambda k: k[0])]
    problems += [*unheld([x.grads for x in per_rank], "grad"), *unheld([x.params for x in per_rank], "param"),
                 *_unheld([x.optim for x in per_rank])]
    return [_row(base, f"checkpoint.{tag}", f"{target}:ranks", not problems,
                 "the same gradients, parameters and optimizer-state entries on every rank, and the replicated "
                 "tensors of the resumed step bitwise rank 0's",
                 ("differ from rank 0's: " + ", ".join(problems[:6])) if problems
                 else f"held on {len(per_rank)} ranks", f"resumed on {per_rank[0].taken}")]


def _checkpointed(own) -> dict:
    """The checkpoint's entries, whole, as its files hold them (the state the resumed step starts
    from); empty where they cannot be read (``checkpoint.saved`` says so)."""
    try:
        return dcp_files.read(own.written) if own is not None and own.written else {}
    except Exception:  # noqa: BLE001 -- an unreadable checkpoint is checkpoint.saved's finding
        return {}


def resume_checks(cell: Cell, observations: list[Observation], plan: PrecisionPlan, base: dict,
                  scales: dict[str, float]) -> list[Record]:
    """Resumed runs against the uninterrupted run's same step: gradients, parameters and
    optimizer state. Resuming on the same path must be bitwise equal (same kernels, same
    collectives); resuming on another path gets the gradient / one-step parameter / moment
    allowances, since another unit layout may reduce in another order on some backends
    (bitwise on gloo). A gradient's summation allowance takes ``scales`` (the reference's
    :meth:`~parity.judge.reference.ReferenceRun.terms_scale` of that step) as ``grad`` does,
    its own largest element where the reference has none."""
    recipe = optimizer_recipe(cell.optimizer)
    rows = []
    whole = observations[0].whole
    main_state = _full_state([o.contracts.optim for o in observations], plan, whole)
    step = observations[0].contracts.resume_step

    def full(per_rank: list[dict], f: str):
        return gather_full(plan, f, per_rank, whole)

    own = observations[0].contracts.resume.get(cell.path)
    before = _checkpointed(own)
    failed = own is not None and own.save_failed  # nothing loads after a failed save: its ERROR says why
    rows += [missing(base, f"checkpoint.{'same' if t == cell.path else 'cross'}", t,
                     f"no load of the checkpoint into {t} was judged: the lifecycle stopped first (checkpoint.same says "
                     "where)" if failed else
                     f"rank 0 reported no load of the checkpoint into {t}: that load is not judged")
             for t in cell.load_targets if t not in observations[0].contracts.resume]
    for target, r0 in observations[0].contracts.resume.items():
        tag = "same" if target == cell.path else "cross"
        errors = [f"rank {o.rank}: {o.contracts.resume[target].error}" if target in o.contracts.resume
                  else f"rank {o.rank}: no report of this load" for o in observations
                  if target not in o.contracts.resume or o.contracts.resume[target].error]
        if errors:  # against the path that failed, beside the cell's other evidence
            failed = base if target == cell.path else {
                **base, "cell": replace(cell, path=target, crossload="").id, "path": target, "path_taken": target}
            rows.append(Record(**failed, check=f"checkpoint.{tag}", name=target, verdict=Verdict.ERROR,
                               detail=f"checkpoint from {cell.path}: " + "; ".join(errors)[:1000]))
            continue
        if r0.skip:
            rows.append(_skip(base, f"checkpoint.{tag}", target, r0.skip))
            continue
        per_rank = [o.contracts.resume[target] for o in observations]
        rows += load_path_rows(base, tag, target, [r.taken for r in per_rank],
                               path_taken(cell, observations[0].plan, target))
        rows += _witnesses(base, tag, target, per_rank, plan, whole)
        state = _full_state([r.optim for r in per_rank], plan, whole)
        comps = []
        grads = [o.grads[step] for o in observations]
        for f in (f for f in grads[0] if plan.get(f)):  # every tensor of the uninterrupted run must reappear
            want, t = full(grads, f), plan[f]
            allow = tolerance.gradient(t.sum_dtype, t.kept_grad, cell.ranks * cell.microbatches,
                                       scales.get(f, amax(want)))
            comps.append(Comparison(step, tag, f"grad:{f}", full([r.grads for r in per_rank], f), want, allow))
        params, previous = [o.params[step] for o in observations], [o.params[step - 1] for o in observations]
        for f in (f for f in params[0] if plan.get(f)):
            want = full(params, f)
            update = want - full(previous, f)
            allow = tolerance.parameter(plan[f].storage, want, update, cell.optimizer)
            comps.append(Comparison(step, tag, f"param:{f}", full([r.params for r in per_rank], f), want, allow,
                                    signal=amax(update)))
        for f, st in ((f, st) for f, st in main_state.items() if plan.get(f)):
            for k in recipe.moments:
                want = st[k]
                rows += _resumed_state_dtype(base, tag, f"{target}:optim:{f}.{k}", state.get(f, {}).get(k),
                                             recipe.moment_dtype(plan[f]))
                comps.append(Comparison(step, tag, f"optim:{f}.{k}", state.get(f, {}).get(k, torch.zeros(0)), want,
                                        tolerance.moment(recipe.moment_dtype(plan[f]), amax(want)),
                                        signal=moment_change(want, before.get(f"optim/{f}/{k}"))))
        loading = list(zip(observations, per_rank))
        after = [schedule.resumed_row(base, f"checkpoint.{tag}", target, loading, step),
                 *gathered.regathered(base, f"checkpoint.{tag}", target, [(o.rank, r) for o, r in loading], plan,
                                      lambda f: full([r.params for r in per_rank], f))]
        for row in after:  # as every record of the step
            row.detail = f"{row.detail}; resumed on {per_rank[0].taken}"
        rows += after
        if tag == "cross" and cell.compile != "none":  # the moments' dtypes above stand; the load is judged
            rows.append(_skip(base, "checkpoint.cross", target, f"compile {cell.compile!r}: {target}'s graphs split its "
                              f"blocks at its own units, so its step is not {cell.path}'s within the allowances; the "
                              "load itself is judged entry by entry (checkpoint.loaded)"))
            continue
        for c in comps:
            if tag == "same":
                c.allowance = tolerance.Allowance(0.0, c.allowance.dtype, "bitwise")
            row = c.record({**base})
            row.check, row.name, row.step = f"checkpoint.{tag}", f"{target}:{c.name}", ""
            row.detail = "; ".join(x for x in (row.detail, f"resumed on {per_rank[0].taken}") if x)
            rows.append(row)
    return rows
