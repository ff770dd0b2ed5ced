"""Contract checks beyond numerics, one record per parameter/module/stage.

Numbers can agree while a contract is broken (an FP32 parameter that happens to round the
same in BF16), so each contract is observed directly (see :mod:`parity.execute.probes` and
:mod:`parity.execute.lifecycle`) and compared with the plan, the reference or the unsharded model.
A contract record has ``observed`` 1 (broken) or 0 (held) against ``allowed`` 0.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
from torch.distributed.tensor import Shard

from parity.execute.knobs import kept_out_of_backward, post_forward_state, shard_dim
from parity.execute.observation import Observation
from parity.judge import checkpoint_entries, moved, recompute, resumed, schedule, unshard
from parity.judge import compiled as compiled_graphs
from parity.judge.record import SEVERITY, Record, Verdict
from parity.judge.reference import ReferenceRun
from parity.matrix.cell import Cell
from parity.model.compiling import compiled_names, inside
from parity.model.dtypes import dtype_name
from parity.model.plan import PrecisionPlan
from parity.paths import PER_PARAMETER
from parity.judge.checkpoint_collectives import checkpoint_checks, moved_checks
from parity.judge.collectives import collective_checks
from parity.judge.rows import contract_row as _row
from parity.judge.rows import skipped as _skip


def _holds_across_microbatches(cell: Cell) -> bool:
    """Gradients are held between micro-batches: unsharded (sync off) or, under HSDP with
    the replica all-reduce deferred, as reduce-scattered partial sums."""
    return cell.microbatches > 1 and cell.sync in ("last", "replicas-last")


def _grad_dtype_row(obs: Observation, t, base: dict) -> Record:
    """``dtype.grad``: the gradient the optimizer stepped with, on this rank, at every step it
    had one, against the plan's gradient dtype (the model's ``grad_dtype``, else storage)."""
    want = dtype_name(t.grad)
    seen = sorted({dtype_name(g[t.fqn].dtype) for g in obs.grads if t.fqn in g})
    got = ",".join(seen) or "<no gradient seen>"
    return _row(base, "dtype.grad", t.fqn, got == want, want, got, "the gradient the optimizer steps with", want)


def _compute_row(base: dict, c, t, alias: str, compiled: tuple[str, ...], read: set[str] | None = None) -> Record:
    """``dtype.compute``: the dtype ``alias``'s module reads inside forward, in whichever forward
    of the loop first read it. One no forward of this rank read is SKIP where the reference's
    forwards of the same batches (``read``: :attr:`ReferenceRun.read`) did not read it either (a
    routed expert no token reached), a FAIL otherwise. Inside a compiled block no hook runs
    eagerly (:mod:`parity.model.compiling`): what the first forward's all-gathers produced for it
    is read instead; one FSDP does not manage (ignored) is SKIP, a managed one nothing gathered
    there is a FAIL."""
    want = dtype_name(t.compute)
    if not inside(alias.rpartition(".")[0], compiled):
        if alias not in c.compute and read is not None and alias not in read:
            return _skip(base, "dtype.compute", alias, "no forward read it, in the reference either (its batches "
                         "never reached its module, e.g. an expert no token was routed to): nothing to observe")
        seen = c.compute.get(alias, "<not used in forward>")
        return _row(base, "dtype.compute", alias, seen == want, want, seen, "as all-gathered, read inside forward", want)
    first = c.all_gathers.get(min(c.all_gathers, default=0), {}).get("mb0/forward", {})
    gathered = first.get(alias, first.get(t.fqn))
    if gathered is None and t.ownership != "managed":
        return _skip(base, "dtype.compute", alias, f"inside a compiled block and {t.ownership} (FSDP gathers it not): "
                     "no eager read of it")
    if gathered is None:
        return _row(base, "dtype.compute", alias, False, want, "<not all-gathered in the first forward>",
                    "inside a compiled block: as the first forward's all-gathers produced it", want)
    seen = ",".join(sorted({g[0] for g in gathered}))
    return _row(base, "dtype.compute", alias, seen == want, want, seen,
                "inside a compiled block: as the first forward's all-gathers produced it", want)


def dtype_checks(cell: Cell, obs: Observation, plan: PrecisionPlan, base: dict,
                 ref: ReferenceRun | None = None) -> list[Record]:
    c = obs.contracts
    compiled = compiled_names(cell)
    data_rank = cell.topology().data_rank(obs.rank)
    read = ref.read[data_rank] if ref is not None and data_rank < len(ref.read) else None
    rows = []
    for t in plan.params:
        storage = dtype_name(t.storage)
        for stage, label in (("sharded", "after sharding"), ("trained", "after training")):
            seen = getattr(c, stage).storage.get(t.fqn, "<missing>")
            rows.append(_row(base, "dtype.storage", f"{t.fqn}@{stage}", seen == storage, storage, seen, label, storage))
        for alias in t.tie_group or (t.fqn,):  # each module using a tied weight reads it itself
            rows.append(_compute_row(base, c, t, alias, compiled, read))
        if t.grad is not None and t.trainable_from < cell.steps:
            rows.append(_grad_dtype_row(obs, t, base))
        if not t.trainable:
            continue
        if t.trainable_from >= cell.steps:
            rows.append(_skip(base, "dtype.reduce", t.fqn, f"unfrozen at step {t.trainable_from}, after this cell's "
                              f"{cell.steps} steps"))
            continue
        want = dtype_name(t.reduce)
        if not c.reduce_observable:  # a probe that cannot observe is an error, never a pass by absence
            rows.append(Record(**base, check="dtype.reduce", name=t.fqn, verdict=Verdict.ERROR,
                               detail="the reduction probe could not hook FSDP's reduction in this torch build "
                                      "(torch.distributed.fsdp._fully_shard._fsdp_param_group.foreach_reduce)"))
        else:
            got = ",".join(c.reduce.get(t.fqn, ["<no reduction seen>"]))
            how = "reduce-scatter input" if cell.ranks > 1 else "reduce buffer (no collective on 1 rank)"
            rows.append(_row(base, "dtype.reduce", t.fqn, got == want, want, got, how, want))
        if _holds_across_microbatches(cell):
            got = ",".join(c.accum.get(t.fqn, ["<no accumulation seen>"]))
            how = ("unsharded gradient while sync is off" if cell.accumulating
                   else "reduce-scattered sums held until the replica all-reduce")
            rows.append(_row(base, "dtype.accum", t.fqn, got == want, want, got, how, want))
    if not _holds_across_microbatches(cell):
        rows.append(_skip(base, "dtype.accum", "*", "no accumulation without sync in this cell"))
    return rows


def buffer_checks(observations: list[Observation], ref: ReferenceRun, plan: PrecisionPlan, base: dict) -> list[Record]:
    """Every floating buffer of the sharded model, on every rank, after sharding and after
    training: its planned dtype and, bitwise, the unsharded model's value (FSDP never casts
    or moves buffers between dtypes; a helper that does would round, e.g., ``inv_freq``)."""
    rows = []
    for t in plan.tensors:
        if t.kind != "buffer" or not t.storage.is_floating_point:
            continue
        want_dtype = dtype_name(t.storage)
        for stage, ref_stage in (("sharded", "initial"), ("trained", "trained")):
            want = ref.buffers.get(ref_stage, {}).get(t.fqn)
            problems = []
            for o in observations:
                seen = o.contracts.buffers.get(stage, {}).get(t.fqn)
                if seen is None:
                    problems.append(f"rank {o.rank}: missing")
                elif seen.dtype != want_dtype:
                    problems.append(f"rank {o.rank}: {seen.dtype}")
                elif want is not None and not torch.equal(seen.value.to(want.dtype), want):
                    diff = float((seen.value.double() - want.double()).abs().max())
                    problems.append(f"rank {o.rank}: value differs by {diff:.3g}")
            rows.append(_row(base, "buffer", f"{t.fqn}@{stage}", not problems, f"{want_dtype}, the unsharded value",
                             "held on every rank" if not problems else "; ".join(problems), dtype=want_dtype))
    return rows


def boundary_checks(cell: Cell, obs: Observation, ref: ReferenceRun, plan: PrecisionPlan, base: dict) -> list[Record]:
    """Module-visible floating input/output dtypes at every unit boundary and FP32 holder,
    against the reference (same code, planned dtypes, the report's boundary casts)."""
    modules = {m for u in obs.report.units for m in u.modules}
    modules |= {t.fqn.rpartition(".")[0] for t in plan.params if t.compute != plan.config.param_dtype and t.kind == "param"}
    rows = []
    seen = obs.contracts.boundaries
    variants = obs.contracts.boundary_variants
    compiled = compiled_names(cell)
    for mod in sorted(modules):
        if inside(mod, compiled):
            rows.append(_skip(base, "dtype.boundary", mod or "<root>", "inside a compiled block: a hook there would "
                              "run inside the graph (its outputs and gradients are judged)"))
            continue
        want, got = ref.boundaries.get(mod), seen.get(mod)
        if want is None and got is None:
            continue
        # every later forward (micro-batches, evaluations, recomputes) sees the module the same way
        other = [f"{d} {v}" for d in ("in", "out") for v in variants.get(mod, {}).get(d, [])
                 if want is not None and v != want.get(d)]
        observed = got if not other else f"{got}; in another forward: {', '.join(other)}"
        rows.append(_row(base, "dtype.boundary", mod or "<root>", want == got and not other, want, observed,
                         "every forward of this rank"))
    natural = dtype_name(ref.outputs[0][0].dtype)
    expected = cell.axes()["output_dtype"]
    expected = natural if expected == "natural" else expected
    outputs = [*obs.outputs, *(e.output for e in obs.evals)]
    # a requested dtype holds for every floating tensor the root returns, not only the one the loss reads
    root = [] if cell.output_dtype == "natural" else [
        *seen.get("", {}).get("out", []), *(d for v in variants.get("", {}).get("out", []) for d in v)]
    got = ",".join(sorted({dtype_name(o.dtype) for o in outputs} | set(root))) or "<no output>"
    rows.append(_row(base, "dtype.output", "<root>", got == expected, expected, got,
                     f"requested {cell.output_dtype}, every forward of this rank (evaluation forwards included), "
                     "every floating tensor of the output; parameter and reduction dtypes are checked per parameter"))
    return rows


def _prefetch_plan(cell: Cell, obs: Observation) -> dict[str, tuple[str, str]]:
    """Unit root -> (forward, backward) prefetch list FSDP must hold: under ``explicit``, each of
    the fixture's block units names the next block unit (forward) and the previous (backward)."""
    from parity.model.registry import get_fixture

    if cell.prefetch != "explicit":
        return {}
    roots = {u.root for u in obs.report.units}
    blocks = [b for b in get_fixture(cell.fixture, cell.source).blocks if b in roots]
    return {b: (",".join(blocks[i + 1:i + 2]), ",".join(blocks[i - 1:i] if i else [])) for i, b in enumerate(blocks)}


def placement_checks(cell: Cell, obs: Observation, plan: PrecisionPlan, ref: ReferenceRun, base: dict) -> list[Record]:
    """``placement``: under a recipe's shard placement, every FSDP-managed parameter's DTensor
    placement after sharding on this rank, against the dimension the recipe asks for
    (:func:`parity.execute.knobs.shard_dim`, from the reference model's shapes). Nothing under
    FSDP's own dimension 0 (the sharded shapes the other checks concatenate hold it)."""
    if cell.placement == "dim0":
        return []
    shapes = {f: p.shape for f, p in ref.params[0].items()} if ref.params else {}
    rows = []
    for t in (t for t in plan.params if t.ownership == "managed"):
        want = str(Shard(shard_dim(cell, shapes.get(t.fqn, ()))))
        got = obs.contracts.sharded.placements.get(t.fqn, "<not a DTensor>") if obs.contracts.sharded else "<missing>"
        rows.append(_row(base, "placement", t.fqn, got == want, want, got, f"shard_placement_fn of placement {cell.placement}"))
    return rows


def unit_policy_checks(obs: Observation, plan: PrecisionPlan, base: dict, cell: Cell) -> list[Record]:
    """Each unit's policy as FSDP holds it, against the contract derived from the plan and
    the taken path's declared contract (not from the report's policy fields): a
    per-parameter unit always computes in ``param_dtype`` (overrides keep the rest) and
    casts its inputs; a dtype-split unit computes in ``param_dtype`` if any member does,
    else in its members' dtype, and casts inputs only then; every unit reduces in its
    trainable members' planned reduce dtype (a None ``reduce_dtype`` reduces in the
    gradients' storage dtype, torch >= 2.15); only the outermost unit casts outputs. A unit
    holding parameters keeps the cell's reduction knobs: no divide factor and FSDP's own
    collectives under ``mean``; factor 1.0 and sum-only collectives under ``sum``. Each unit
    prefetches what the cell's ``prefetch`` sets (:func:`_prefetch_plan`), nothing otherwise; no
    unit casts its inputs when the model does (``cast_inputs = "model"``); every parameter FSDP
    manages offloads to the CPU exactly when the cell's ``offload`` says so, reshards after
    forward as ``reshard`` and ``reshard_to`` say (off, over every rank, over half of them), and
    is unsharded in backward unless ``unshard_in_backward = "needed"`` and the model declares
    no backward reads it (``Fixture.backward_free``)."""
    config = plan.config
    prefetch = _prefetch_plan(cell, obs)
    rows = []
    native = obs.report.contract == PER_PARAMETER
    for unit in obs.report.units:
        members = [plan[p] for p in unit.params]
        computes = {t.compute for t in members}
        param = config.param_dtype if (native or not members or config.param_dtype in computes) else computes.pop()
        want = {"param_dtype": dtype_name(param),
                "cast_forward_inputs": param == config.param_dtype and cell.cast_inputs == "fsdp",
                "output_dtype": dtype_name(config.output_dtype if unit.modules == ("",) else None)}
        if unit.params:
            summed = cell.reduction == "sum"
            want["gradient_divide_factor"] = "1.0" if summed else "None"
            want["force_sum_reduction_for_comms"] = str(summed)
            want["offload"] = cell.offload
            want["unshard_in_backward"] = str(not kept_out_of_backward(cell, unit.modules))
            want["reshard_after_forward"] = ("off" if not cell.reshard else f"{cell.ranks // 2} ranks"
                                             if cell.reshard_to == "half" else "on")
        want["forward_prefetch"], want["backward_prefetch"] = prefetch.get(unit.root, ("", ""))
        reduces = {t.reduce for t in members if t.trainable}
        if len(reduces) == 1:
            want["reduce_dtype"] = dtype_name(reduces.pop())
        got = dict(obs.contracts.policies.get(unit.root, {}))
        kept = {dtype_name(t.kept_grad) for t in members if t.trainable}
        if config.reduce_dtype is None and got.get("reduce_dtype") == "natural" and len(kept) == 1:
            got["reduce_dtype"] = kept.pop()  # None reduces in each gradient's dtype (grad_dtype, else storage)
        bad = {k: (v, got.get(k)) for k, v in want.items() if got.get(k) != v}
        rows.append(_row(base, "unit.policy", unit.root, not bad, want,
                         "as planned" if not bad else "; ".join(f"{k}={g} (want {w})" for k, (w, g) in bad.items())))
    return rows


def identity_checks(obs: Observation, plan: PrecisionPlan, base: dict) -> list[Record]:
    """``names`` and ``identity``: the parameter and state-dict names at each stage are the
    unsharded model's, every parameter stays the object sharding made it, every module keeps its
    class. The plan's parameters and the root module are owed by name: snapshots that hold
    nothing are missing evidence, not a model whose nothing stayed the same."""
    c = obs.contracts
    un = c.unsharded
    owed = set(un.params) | {t.fqn for t in plan.params}
    sharded = c.sharded.ids if c.sharded is not None else {}
    rows = []
    for stage in ("sharded", "lazy_init", "trained"):
        snap = getattr(c, stage)
        if snap is None:  # a snapshot that never arrived is missing evidence
            rows.append(_row(base, "names", f"named_parameters@{stage}", False, "a snapshot", "none taken"))
            continue
        for key, label in (("params", "named_parameters"), ("state_dict", "state_dict")):
            want, got = getattr(un, key), getattr(snap, key)
            if got is None:  # not read at this stage (it would have resharded the units)
                continue
            diff = sorted(set(want) ^ set(got))
            rows.append(_row(base, "names", f"{label}@{stage}", want == got, "unsharded model's names",
                             "identical" if want == got else f"differs: {', '.join(diff[:4]) or 'order'}"))
        if stage != "sharded":
            moved = sorted(f for f, i in snap.ids.items() if sharded.get(f) != i)
            unseen = sorted(f for f in owed if f not in snap.ids or f not in sharded)
            problems = ([f"replaced: {', '.join(moved[:4])}"] if moved else []) + (
                [f"not seen: {', '.join(unseen[:4])}"] if unseen else [])
            rows.append(_row(base, "identity", f"parameters@{stage}", not problems, "same objects as after sharding",
                             "; ".join(problems) or "same"))
    trained = c.trained.modules if c.trained is not None else {}
    lost = sorted(m for m, cls in un.modules.items() if cls[0] not in trained.get(m, []))
    if "" not in un.modules:  # every model has its root: a snapshot without it recorded nothing to keep
        lost.insert(0, "the root module, not in the unsharded snapshot")
    rows.append(_row(base, "identity", "modules@trained", not lost, "every module keeps its class (holders too)",
                     "kept" if not lost else f"lost: {', '.join(lost[:4])}"))
    return rows


@functools.lru_cache(maxsize=64)
def declared_marks(fixture: str, source: str, seed: int) -> tuple[tuple[str, str], ...]:
    """(name, kind) of every tensor the model marks FP32, read in this process from a fresh
    build: what each rank's marker report must account for."""
    from parity.model.markers import fp32_marked
    from parity.model.registry import get_fixture

    model = get_fixture(fixture, source).make(seed)
    buffers = dict(model.named_buffers())
    return tuple(sorted((name, "buffer" if name in buffers else "param") for name in fp32_marked(model)))


def marker_checks(obs: Observation, base: dict, declared: tuple[tuple[str, str], ...] = ()) -> list[Record]:
    """Each marked tensor's fate on this rank; a tensor the model marks that the rank did not
    report is a FAIL (an empty report is not a pass), a SKIP only when the model marks nothing."""
    marks = obs.contracts.markers
    if not marks and not declared:
        return [_skip(base, "marker", "*", "fixture marks no tensor FP32")]
    rows = []
    for name, m in marks.items():
        ok = m.after_move and m.dtype == "float32"
        rows.append(_row(base, "marker", f"{m.kind}:{name}", ok, "marked after the move, float32 after conversion",
                         f"marked={m.after_move}, {m.dtype}", dtype="float32"))
    for name, kind in declared:
        if name not in marks:
            rows.append(_row(base, "marker", f"{kind}:{name}", False, "reported (the model marks it)",
                             "no report from this rank", dtype="float32"))
    return rows


def on_every_rank(per_rank: list[list[Record]]) -> list[Record]:
    """One record per (check, name) from the same check run on each rank's observation: every
    rank is a witness. The worst rank's verdict wins and the detail names each rank that
    broke the contract; a record one rank produced and another did not is a FAIL for the
    rank that is silent."""
    keyed = [{(r.check, r.name, r.step): r for r in rows} for rows in per_rank]
    order = list(dict.fromkeys(k for rows in keyed for k in rows))
    merged = []
    for key in order:
        seen = [(rank, rows.get(key)) for rank, rows in enumerate(keyed)]
        present = [r for _, r in seen if r is not None]
        worst = max(present, key=lambda r: SEVERITY[r.verdict])
        silent = [rank for rank, r in seen if r is None]
        bad = [(rank, r) for rank, r in seen if r is not None and r.verdict != Verdict.PASS and r.verdict != Verdict.SKIP]
        if not bad and not silent:
            n = len(per_rank)
            skipped = [(rank, r) for rank, r in seen if r.verdict == Verdict.SKIP]
            if skipped and worst.verdict != Verdict.SKIP:  # witnessed by some ranks: say which skipped, and why
                detail = "; ".join([worst.detail] + [f"rank {rank}: {r.detail}" for rank, r in skipped])
            else:
                detail = f"{worst.detail}; on all {n} ranks" if n > 1 else worst.detail
            merged.append(replace(worst, detail=detail[:1000]))
            continue
        detail = "; ".join([f"rank {rank}: {r.detail}" for rank, r in bad] + [f"rank {rank}: no record" for rank in silent])
        verdict = worst.verdict if bad else Verdict.FAIL
        merged.append(replace(worst, verdict=verdict, detail=detail[:1000],
                              observed=worst.observed if bad else 1.0, ratio=worst.ratio if bad else float("inf")))
    return merged


def eval_checks(cell: Cell, obs: Observation, base: dict) -> list[Record]:
    """``eval.reshard``: right after each evaluation forward, every unit's parameters are in the
    state ``reshard_after_forward`` gives any forward (torch 2.15, passed explicitly to every
    unit, root included): sharded with reshard on, unsharded with it off -- a no_grad forward
    has no backward to reshard after (``reshard_to = "half"``: sharded over the smaller group,
    ``sharded_post_forward``). Under ``unshard = "explicit"`` the recipe turned it off for
    the evaluation: every unit is unsharded after the forward, sharded after its ``reshard()``,
    and holds the cell's ``reshard_after_forward`` again. A forward the cell owes and this rank
    did not run is missing, and so is a unit it did not report."""
    explicit = cell.unshard == "explicit"
    want = "unsharded" if explicit else post_forward_state(cell)
    expected = (f"every unit unsharded after the forward, sharded after reshard(), reshard_after_forward "
                f"{'on' if cell.reshard else 'off'} again" if explicit else f"every unit {want}")
    seen = {(e.step, e.label): e for e in obs.evals}
    owed = {u.state_name for u in obs.report.units if u.params}
    rows = []
    for step in range(cell.steps):
        for label in cell.eval_labels(step):
            e = seen.get((step, label))
            if e is None:
                rows.append(replace(_row(base, "eval.reshard", label, False, expected, "no evaluation forward"),
                                    step=step))
                continue
            phases = [("after the forward", e.units, want)]
            if explicit:
                phases += [("after reshard()", e.resharded, "sharded"),
                           ("reshard_after_forward", e.restored, "on" if cell.reshard else "off")]
            problems = []
            for when, states, should in phases:
                wrong = {u: st for u, st in (states or {}).items() if st != should}
                problems += ([f"{when}: no unit"] if not states else
                             [f"{when}: {u}: {st}" for u, st in wrong.items()]
                             + [f"{when}: {u}: not reported" for u in sorted(owed - set(states))]
                             + [f"{when}: {u}: not a unit" for u in sorted(set(states) - owed)])
            setting = "explicit phase" if explicit else f"reshard {'on' if cell.reshard else 'off'}"
            row = _row(base, "eval.reshard", label, not problems, expected, "; ".join(problems) or expected, setting)
            rows.append(replace(row, step=step))
    return rows


def state_dict_checks(cell: Cell, obs: Observation, plan: PrecisionPlan, base: dict) -> list[Record]:
    """``state_dict``: at every point the cell takes one, each API's entry for every parameter is
    the master parameter at that moment -- same type (DTensor / Tensor), placements and values
    (bitwise), in the planned storage dtype. A point, an API or an entry that is missing fails."""
    taken = {(sd.step, sd.point): sd for sd in obs.state_dicts}
    rows = []
    for step in range(cell.steps):
        for point in cell.state_dict_points(step):
            sd = taken.get((step, point))
            for api in cell.state_dict_apis(point):
                problems = ["not taken"] if sd is None else _entry_problems(sd.masters, sd.entries.get(api), plan)
                row = _row(base, "state_dict", f"{api}@{point}", not problems,
                           "every parameter as its master (type, placements, storage dtype, bitwise values)",
                           "; ".join(problems[:3]) + (f"; {len(problems) - 3} more" if len(problems) > 3 else "")
                           if problems else f"{len(sd.masters)} parameters as their masters")
                rows.append(replace(row, step=step))
    return rows


def _entry_problems(masters: dict, entries: dict | None, plan: PrecisionPlan) -> list[str]:
    if entries is None:
        return ["no state dict"]
    problems = [f"{t.fqn}: no master recorded" for t in plan.params if t.fqn not in masters]
    for fqn, m in masters.items():
        e = entries.get(fqn)
        want = dtype_name(plan.get(fqn).storage) if plan.get(fqn) is not None else m.dtype
        if e is None:
            problems.append(f"{fqn}: missing")
        elif (e.kind, e.placements) != (m.kind, m.placements):
            problems.append(f"{fqn}: {e.kind}({e.placements}), the parameter is {m.kind}({m.placements})")
        elif e.dtype != want:
            problems.append(f"{fqn}: {e.dtype}, planned storage {want}")
        elif e.value.shape != m.value.shape or not torch.equal(e.value, m.value):
            problems.append(f"{fqn}: values differ from the parameter's")
    return problems


def per_rank_checks(cell: Cell, obs: Observation, plan: PrecisionPlan, ref: ReferenceRun, base: dict) -> list[Record]:
    """The contracts each rank witnesses on its own (its dtypes, boundaries, unit policies,
    names, identities, markers and learning rates), against one plan: rank 0's, which the ranks agreed on."""
    return (dtype_checks(cell, obs, plan, base, ref) + boundary_checks(cell, obs, ref, plan, base)
            + unit_policy_checks(obs, plan, base, cell) + identity_checks(obs, plan, base)
            + schedule.check(cell, obs, base)
            + marker_checks(obs, base, declared_marks(cell.fixture, cell.source, cell.seed))
            + eval_checks(cell, obs, base) + state_dict_checks(cell, obs, plan, base) + recompute.check(cell, obs, base)
            + unshard.check(cell, obs, base) + unshard.reshard_check(cell, obs, base)
            + unshard.forward_check(cell, obs, base) + unshard.freed_check(cell, obs, plan, base)
            + unshard.flagged_check(cell, obs, base)
            + placement_checks(cell, obs, plan, ref, base)
            + collective_checks(cell, obs, plan, base, ref) + checkpoint_checks(cell, obs, base)
            + compiled_graphs.check(cell, obs, plan, base, len(compiled_names(cell)), ref.graph_runs))


def check(cell: Cell, observations: list[Observation], ref: ReferenceRun, base: dict) -> list[Record]:
    obs = observations[0]
    plan = obs.plan
    rows = on_every_rank([per_rank_checks(cell, o, plan, ref, base) for o in observations])
    rows += buffer_checks(observations, ref, plan, base)
    if obs.contracts.resume is not None:
        rows += resumed.optimizer_checks(cell, observations, plan, base)
        scales = ref.terms_scale(obs.contracts.resume_step, clipped=bool(cell.clip))  # the runs hold clipped gradients
        rows += resumed.resume_checks(cell, observations, plan, base, scales)
        rows += checkpoint_entries.checks(cell, observations, base)
    if cell.move != "none":
        rows += moved.checks(cell, observations, plan, base, ref.terms_scale(cell.resume_step))
        rows += moved_checks(cell, observations, base)
    return rows
