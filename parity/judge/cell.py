"""Turn one cell's observations into records: expected outcomes, numerics, contracts."""

from __future__ import annotations

from dataclasses import dataclass, field

from parity.execute.observation import Observation
from parity.judge import contracts
from parity.judge.compare import Assembled, Comparison, assemble, plan_comparisons
from parity.judge.record import Record, Verdict
from parity.judge.reference import replay_optimizer, run_reference
from parity.matrix.cell import Cell
from parity.model.registry import get_fixture
from parity.paths import get_path


def base_fields(cell: Cell, taken: str = "", reason: str = "") -> dict:
    axes = cell.axes()
    return dict(
        cell=cell.id, fixture=cell.fixture, path=cell.path, path_taken=taken, fallback_reason=reason,
        ranks=cell.ranks, microbatches=cell.microbatches, sync=cell.sync,
        checkpointing=cell.checkpointing, reshard=axes["reshard"], output_dtype=axes["output_dtype"],
        seed=cell.seed,
    )


def failure_record(cell: Cell, verdict: Verdict, reason: str) -> Record:
    return Record(**base_fields(cell), check="run", name="cell", verdict=verdict, detail=reason.replace("\n", " | "))


@dataclass
class Judged:
    records: list[Record]
    comparisons: list[Comparison] = field(default_factory=list)
    run: Assembled | None = None


def judge_cell(cell: Cell, observations: list[Observation], *, fp64: bool = False, device="cpu") -> Judged:
    fixture = get_fixture(cell.fixture, cell.source)
    expect, expected_reason = fixture.expects(cell.path, get_path(cell.path).contract)
    first = observations[0]
    if first.expected_error:
        rep = first.report
        base = base_fields(cell, rep.taken, rep.fallback_reason)
        # the path raised itself, or fell back as declared (or for lack of the API) into one that raises
        legit = rep.taken == cell.path or expect == "fallback" or rep.fallback_reason.startswith("unsupported build")
        verdict = Verdict.PASS if legit else Verdict.FAIL
        detail = first.expected_error if legit else f"{cell.path} was expected to shard this fixture: {first.expected_error}"
        return Judged([Record(**base, check="expected_error", name="isolation", verdict=verdict, detail=detail)])
    report, plan = first.report, first.plan
    base = base_fields(cell, report.taken, report.fallback_reason)
    records = []
    if expect == "isolation-error":
        records.append(Record(**base, check="expected_error", name="isolation", verdict=Verdict.FAIL,
                              detail=f"expected {cell.path} to raise IsolationError; it sharded instead"))
    if expect == "fallback" or report.fallback_reason:
        reason = report.fallback_reason
        ok = bool(reason) and (
            reason.startswith("unsupported build") or (expect == "fallback" and expected_reason in reason)
        )
        records.append(Record(**base, check="fallback", name=cell.path, verdict=Verdict.PASS if ok else Verdict.FAIL,
                              detail=reason or f"expected a fallback ({expected_reason}); {cell.path} was taken"))
    run = assemble(observations, plan)
    ref = run_reference(cell, fixture, plan, report, device=device, resync=run.params)
    truth = run_reference(cell, fixture, plan, report, device=device, mode="fp64") if fp64 else None
    replayed = replay_optimizer(cell, fixture, plan, run.grads, device=device)
    accumulating = cell.sync == "last" and cell.microbatches > 1
    comps = plan_comparisons(run, ref, plan, micro=cell.microbatches, accumulating=accumulating,
                             replayed=replayed, truth=truth)
    records += [c.record(base) for c in comps]
    if fixture.token_input:
        records.append(Record(**base, check="input_grad", name="tokens", verdict=Verdict.SKIP,
                              detail="integer token input has no gradient"))
    records += contracts.check(cell, observations, ref, base)
    return Judged(records, comps, run)
