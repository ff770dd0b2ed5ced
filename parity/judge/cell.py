"""Turn one cell's observations into records: expected outcomes, numerics, contracts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from parity.errors import IncompleteObservation
from parity.execute.observation import Observation
from parity.judge import (accumulation, composition, contracts, coverage, gathered, moments, partials, quantized,
                          shards, stages, tensor_parallel)
from parity.judge import plan as plan_check
from parity.judge.compare import Assembled, Comparison, agreement_records, assemble, input_casts, plan_comparisons
from parity.judge.record import Record, Verdict
from parity.judge.reference import replay_optimizer, run_reference
from parity.judge.trajectory import trajectory_records
from parity.matrix.cell import Cell
from parity.model.registry import get_fixture
from parity.paths import get_path


def base_fields(cell: Cell, taken: str = "", reason: str = "") -> dict:
    axes = cell.axes()
    return dict(
        cell=cell.id, fixture=cell.fixture, path=cell.path, path_taken=taken, fallback_reason=reason,
        ranks=cell.ranks, microbatches=cell.microbatches, sync=cell.sync,
        checkpointing=cell.checkpointing, reshard=axes["reshard"], output_dtype=axes["output_dtype"],
        seed=cell.seed, param_dtype=cell.param_dtype, reduce_dtype=axes["reduce_dtype"], optimizer=cell.optimizer,
        init=cell.init, mesh=cell.mesh, weights=cell.weights,
    )


def failure_record(cell: Cell, verdict: Verdict, reason: str) -> Record:
    return Record(**base_fields(cell), check="run", name="cell", verdict=verdict, detail=reason.replace("\n", " | "))


@dataclass
class Judged:
    records: list[Record]
    comparisons: list[Comparison] = field(default_factory=list)
    run: Assembled | None = None


def _fallback_kind(reason: str, expect: str, expected_reason: str) -> str:
    """``declared`` (the fixture says this path falls back for this reason), ``unsupported
    build`` (the API is missing here), or ``undeclared``."""
    if reason.startswith("unsupported build"):  # never what a model declares
        return "unsupported build"
    return "declared" if expect == "fallback" and expected_reason and expected_reason in reason else "undeclared"


def _expected_error_records(cell: Cell, observations: list[Observation], fixture, expect: str,
                            expected_reason: str, require_native: bool) -> list[Record]:
    """The path (or the one it fell back to) raised the isolation error the fixture declares:
    legitimate only if this path raised it itself or reached it by a declared fallback (or
    for lack of the API, unless native is required), and only if every rank's error names
    exactly the parameters the fixture declares (the error's own list, not its text)."""
    rep = observations[0].report
    base = base_fields(cell, rep.taken, rep.fallback_reason)
    kind = _fallback_kind(rep.fallback_reason, expect, expected_reason) if rep.taken != cell.path else ""
    legit = rep.taken == cell.path or kind == "declared" or (kind == "unsupported build" and not require_native)
    first = observations[0].expected_error
    if not legit:
        why = "native not exercised: " if kind == "unsupported build" else ""
        return [Record(**base, check="expected_error", name="isolation", verdict=Verdict.FAIL,
                       detail=f"{why}{cell.path} was expected to shard this fixture: {first}")]
    declared = sorted({p.strip() for p in fixture.expects(rep.taken, get_path(rep.taken).contract)[1].split(",")} - {""})
    if not declared:  # a declaration naming nothing would accept any error
        return [Record(**base, check="expected_error", name="isolation", verdict=Verdict.FAIL,
                       detail=f"{rep.taken} raised an isolation error the fixture does not declare for it: {first}")]
    wrong = [f"rank {o.rank}'s error names {', '.join(sorted(o.expected_params)) or 'no parameter'}"
             for o in observations if sorted(set(o.expected_params)) != declared]
    if wrong:
        detail = "; ".join(wrong) + f"; the fixture declares {', '.join(declared)} (rank 0: {first})"
        return [Record(**base, check="expected_error", name="isolation", verdict=Verdict.FAIL, detail=detail[:1000])]
    return [Record(**base, check="expected_error", name="isolation", verdict=Verdict.PASS,
                   detail=f"on all {len(observations)} rank(s): {first}")]


def _outcome_records(cell: Cell, report, expect: str, expected_reason: str, require_native: bool,
                     base: dict) -> list[Record]:
    """What the path did against what the fixture declares for it: sharded where an isolation
    error was expected (FAIL), or fell back -- declared, for an unsupported build (a FAIL with
    ``require_native``), or undeclared (FAIL)."""
    records = []
    if expect == "isolation-error":
        records.append(Record(**base, check="expected_error", name="isolation", verdict=Verdict.FAIL,
                              detail=f"expected {cell.path} to raise IsolationError; it sharded instead"))
    if expect == "fallback" or report.fallback_reason:
        reason = report.fallback_reason
        kind = _fallback_kind(reason, expect, expected_reason) if reason else "none"
        ok = kind == "declared" or (kind == "unsupported build" and not require_native)
        detail = reason or f"expected a fallback ({expected_reason}); {cell.path} was taken"
        if kind == "unsupported build":
            detail = f"native not exercised: {detail}"
        records.append(Record(**base, check="fallback", name=kind, verdict=Verdict.PASS if ok else Verdict.FAIL,
                              detail=detail))
    return records


def _declared(cell: Cell):
    """The cell's model and what it declares for the cell's path: (fixture, outcome, reason)."""
    fixture = get_fixture(cell.fixture, cell.source)
    return (fixture, *fixture.expects(cell.path, get_path(cell.path).contract, cell.weights))


def reference_free(cell: Cell, fixture, observations: list[Observation], base: dict) -> list[Record]:
    """The checks that read only the ranks' observations and the plan they reported -- the plan,
    the ranks' agreement, each unit's composition (ownership, placement) -- and no reference:
    what a cell whose numeric judging crashed can still say (a parameter FSDP sharded that the
    model ignores is an ``ownership`` FAIL, not only the shape error it causes downstream)."""
    plan = observations[0].plan
    records = plan_check.check(cell, fixture, observations, base)
    if cell.ranks > 1:
        records += agreement_records(observations, plan, base)
    return records + composition.check(cell, observations, plan, base)


def still_judged(cell: Cell, observations: list[Observation], require_native: bool = False) -> list[Record]:
    """The outcome records (fallback, expected error) and :func:`reference_free`'s for a cell whose
    judging raised; nothing when those raise too (or the ranks reported no plan): the cell's
    ERROR record stands alone."""
    first = observations[0] if observations else None
    if first is None or first.plan is None or first.report is None or first.expected_error:
        return []
    try:
        base = base_fields(cell, first.report.taken, first.report.fallback_reason)
        fixture, expect, reason = _declared(cell)
        return (_outcome_records(cell, first.report, expect, reason, require_native, base)
                + reference_free(cell, fixture, observations, base))
    except Exception:  # noqa: BLE001 - the judging error is the finding; these are extra evidence
        return []


def judge_cell(cell: Cell, observations: list[Observation], *, fp64: bool = False, device="cpu",
               require_native: bool = False) -> Judged:
    """Records for one cell. ``require_native``: a fallback the fixture does not declare
    (an unsupported build included) is a FAIL, not a legacy run that passed."""
    fixture, expect, expected_reason = _declared(cell)
    first = observations[0]
    if any(o.expected_error for o in observations):
        return Judged(_expected_error_records(cell, observations, fixture, expect, expected_reason, require_native))
    gap = coverage.missing_observations(cell, observations)
    if gap:
        raise IncompleteObservation(gap)
    report, plan = first.report, first.plan
    base = base_fields(cell, report.taken, report.fallback_reason)
    records = _outcome_records(cell, report, expect, expected_reason, require_native, base)
    run = assemble(observations, plan)
    ref = run_reference(cell, fixture, plan, report, device=device, resync=run.params, clip_norms=run.grad_norms)
    truth = _fp64_reference(cell, fixture, plan, report, device)
    own = _own_trajectory(cell, fixture, plan, report, device, ref, run)
    replayed_moments: list = []
    replayed = replay_optimizer(cell, fixture, plan, run.grads, run.params, device=device, moments=replayed_moments)
    topo = cell.topology()
    comps = plan_comparisons(run, ref, plan, micro=cell.microbatches,
                             replayed=replayed, world=cell.ranks, truth=truth if fp64 else None,
                             optimizer=cell.optimizer, data_ranks=[topo.data_rank(r) for r in range(cell.ranks)],
                             input_casts=input_casts(report.units))
    records += [c.record(base) for c in comps]
    records += trajectory_records(run.params, own, truth, replayed[0][0], plan, base)
    records += moments.check(run, replayed_moments, moments.owed(cell, plan, ref.grads), base)
    if fixture.token_input:
        records.append(Record(**base, check="input_grad", name="tokens", verdict=Verdict.SKIP,
                              detail="integer token input has no gradient"))
    records += reference_free(cell, fixture, observations, base)
    records += contracts.check(cell, observations, ref, base)
    records += accumulation.check(cell, observations, ref, base)
    records += shards.check(cell, observations, ref, plan, base)
    records += partials.check(cell, observations, ref, plan, base)
    records += tensor_parallel.check(cell, observations, ref, plan, base)
    befores = [before for before, _ in replayed]
    records += quantized.check(cell, observations, plan, befores, base)
    # what each step gathered from: the initial model, then the masters the ranks held after each step
    records += gathered.check(cell, observations, plan, [befores[0], *run.params][:len(befores)], base)
    silent = _no_gradient(cell, plan, ref, truth)
    if silent:
        records = [_as_finding(r, silent) for r in records] + [coverage.no_gradient_record(sorted(silent), base)]
    # owed by the parent's own plan of the model, not by the plan the ranks reported
    fresh = plan_check.fresh_plan(cell, plan)
    owed = coverage.owed(cell, fresh, token_input=fixture.token_input, quantizable=fixture.quantizable,
                         no_gradient=silent)
    records.append(coverage.record(owed, records, base))
    untrained = coverage.untrained_record(cell, fresh, base)
    records += [untrained] if untrained else []
    located = stages.first_stage(records, cell.steps, base, cell.resume_step if cell.lifecycle else 0)
    return Judged(records + ([located] if located else []), comps, run)


def _own_trajectory(cell: Cell, fixture, plan, report, device, ref, run: Assembled):
    """The emulation's own trajectory (no resync). When the run's masters after every step but the
    last equal the resynced reference's bitwise (and a clipping cell's norms are the reference's
    own), resyncing changed nothing: that trajectory is the reference itself, not computed twice."""
    if _resync_was_a_no_op(cell, ref, run):
        return ref
    return run_reference(cell, fixture, plan, report, device=device)


def _resync_was_a_no_op(cell: Cell, ref, run: Assembled) -> bool:
    for k in range(min(cell.steps - 1, len(run.params))):
        for f, want in ref.params[k].items():
            got = run.params[k].get(f)  # a tensor the run does not hold is not resynced
            if got is not None and (got.shape != want.shape or not torch.equal(got.to(want.dtype), want)):
                return False
    return not cell.clip or all(a == b for a, b in zip(run.grad_norms, ref.grad_norms))


#: FP64 references of the last few pair groups (see :func:`_fp64_reference`).
_FP64: dict[tuple, object] = {}


def _fp64_reference(cell: Cell, fixture, plan, report, device):
    """The FP64 trajectory, computed once per pair group: it reads no unit boundary, no
    tensor-parallel emulation and no compute dtype, only the model, the cell's axes besides its
    path and which tensors train when, so every path of a group shares it (a path whose plan
    differs there gets its own)."""
    key = (cell.pair_id, cell.steps, cell.source, str(device),  # steps: not in the id
           tuple((t.fqn, t.requires_grad, t.trainable_from, t.tie_group) for t in plan.params))
    if key not in _FP64:
        if len(_FP64) >= 4:
            _FP64.pop(next(iter(_FP64)))
        _FP64[key] = run_reference(cell, fixture, plan, report, device=device, mode="fp64")
    return _FP64[key]


#: Checks that judge a parameter's gradient; for a parameter without any they say nothing.
_GRADIENT_CHECKS = ("dtype.reduce", "dtype.accum", "dtype.grad", "trajectory", "trajectory.emulation", "optim.state")


def _no_gradient(cell: Cell, plan, ref, truth) -> set[str]:
    """Trainable parameters the reference (no FSDP) never differentiates within the cell's steps, or
    whose every gradient autograd computed is exactly zero in the FP64 reference (a branch that never
    fires, a factor of 0; not an underflow of a low precision, nor an expert no token reached, whose
    zeros are filled in): a zero passes every allowance, so no step would test their precision."""
    return {t.fqn for t in plan.params if t.requires_grad and t.trainable_from < cell.steps
            and (all(t.fqn not in ref.grads[s] for s in range(t.trainable_from, cell.steps))
                 or truth.nonzero.get(t.fqn) is False)}


def _as_finding(r: Record, silent: set[str]) -> Record:
    """A gradient check of a parameter without gradient is not a dtype defect: SKIP, pointing at
    the ``no-gradient`` finding that reports it."""
    if r.check in _GRADIENT_CHECKS and r.name in silent:
        return dataclasses.replace(r, verdict=Verdict.SKIP, ratio="", detail="no gradient (or only exact zeros) "
                                   "in the reference either: reported by the no-gradient record, not a dtype defect")
    return r
