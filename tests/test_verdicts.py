"""The expected-outcome checks can fail: judge real 1-rank observations against altered expectations."""

import dataclasses

import pytest
import torch

from parity.model import registry
from parity.execute.worker import run_rank
from parity.matrix.cell import Cell
from parity.judge.cell import judge_cell


def _observe(mesh, cell):
    return [run_rank(cell, rank=0, world=1, mesh=mesh, device=torch.device("cpu"))]


def _expecting(monkeypatch, name, expect):
    models = registry.registered()  # the cached registry every lookup copies
    monkeypatch.setitem(models, name, dataclasses.replace(models[name], expect=expect))


def _verdicts_expecting(mesh, monkeypatch, cell, expect, check):
    """Observe ``cell`` as it really runs, then judge it against an altered expectation."""
    obs = _observe(mesh, cell)
    assert judge_cell(cell, obs).records  # sanity: judged normally first
    _expecting(monkeypatch, cell.fixture, expect)
    return [r.verdict for r in judge_cell(cell, obs).records if r.check == check]


def test_expected_isolation_error_that_does_not_happen_fails(one_rank, monkeypatch):
    cell = Cell(fixture="kda", path="legacy", steps=1)
    assert _verdicts_expecting(one_rank, monkeypatch, cell, {"legacy": "isolation-error"}, "expected_error") == ["FAIL"]


def test_expected_fallback_that_does_not_happen_fails(one_rank, monkeypatch):
    cell = Cell(fixture="kda", path="native", steps=1)
    expect = {"native": "fallback:mixes trainable storage dtypes"}
    assert _verdicts_expecting(one_rank, monkeypatch, cell, expect, "fallback") == ["FAIL"]


def test_expected_outcomes_pass_when_they_happen(one_rank):
    legacy = Cell(fixture="unisolatable", path="legacy", steps=1)
    rows = judge_cell(legacy, _observe(one_rank, legacy)).records
    assert [(r.check, r.verdict) for r in rows] == [("expected_error", "PASS")]
    native = Cell(fixture="mixed_storage", path="native", steps=1)
    rows = judge_cell(native, _observe(one_rank, native)).records
    fallback = [r for r in rows if r.check == "fallback"]
    assert [r.verdict for r in fallback] == ["PASS"] and "mixes trainable storage dtypes" in fallback[0].detail


def test_an_unexpected_fallback_into_an_isolation_error_fails(one_rank, monkeypatch):
    from parity.paths import native

    monkeypatch.setattr(native, "eligibility", lambda members, plan: ["unit blocks.0 looks ineligible (a bug)"])
    cell = Cell(fixture="unisolatable", path="native", steps=1)
    rows = judge_cell(cell, _observe(one_rank, cell)).records
    assert [(r.check, r.verdict) for r in rows] == [("expected_error", "FAIL")]
    assert rows[0].path_taken == "legacy" and "a bug" in rows[0].fallback_reason


def test_a_fallback_for_another_reason_than_expected_fails(one_rank, monkeypatch):
    cell = Cell(fixture="mixed_storage", path="native", steps=1)
    expect = {"native": "fallback:no common reduce dtype"}
    assert _verdicts_expecting(one_rank, monkeypatch, cell, expect, "fallback") == ["FAIL"]


def test_an_expected_error_must_name_the_declared_parameters_on_every_rank(one_rank, monkeypatch):
    """The error's own parameter list must be the declared set, on every rank: not words of its
    text (a declared ``native`` or ``bias`` matched the message), not a subset."""
    cell = Cell(fixture="unisolatable", path="legacy", steps=1)
    obs = _observe(one_rank, cell)
    assert [r.verdict for r in judge_cell(cell, obs).records] == ["PASS"]
    quiet = dataclasses.replace(obs[0], rank=1, expected_params=("something.else",))
    rows = judge_cell(dataclasses.replace(cell, ranks=2), [obs[0], quiet]).records
    assert rows[0].verdict == "FAIL" and "rank 1's error names something.else" in rows[0].detail
    for declared in ("blocks.0.lin.gain,blocks.7.lin.gain", "blocks.0.lin.gain", "native", "gain"):
        _expecting(monkeypatch, "unisolatable", {"dtype-split": f"isolation-error:{declared}"})
        rows = judge_cell(cell, obs).records
        assert rows[0].verdict == "FAIL" and "rank 0's error names blocks.0.lin.gain, blocks.1.lin.gain" in rows[0].detail


def test_an_unsupported_build_is_no_evidence_for_native(one_rank, monkeypatch):
    from parity.paths import native
    from parity.report.gate import NO_GO, decide

    monkeypatch.setattr(native, "native_api_available", lambda: False)  # what torch <= 2.14 reports
    cell = Cell(fixture="kda", path="native", steps=1)
    obs = _observe(one_rank, cell)
    rows = judge_cell(cell, obs).records
    fallback = [r for r in rows if r.check == "fallback"]
    assert [(r.name, r.verdict) for r in fallback] == [("unsupported build", "PASS")]  # a fine legacy run...
    d = decide(rows, "kda", "native")
    assert d.decision == NO_GO and d.reasons[0].startswith("native not exercised")  # ...but no evidence
    strict = judge_cell(cell, obs, require_native=True).records
    assert [r.verdict for r in strict if r.check == "fallback"] == ["FAIL"]


def _clip_rows(records):
    return [(r.step, r.verdict) for r in records if r.check == "clip"]


def test_clipping_is_judged_after_the_clip_and_must_clip_something(one_rank):
    clipping = Cell(fixture="kda", path="native", steps=2, clip=0.01)
    obs = _observe(one_rank, clipping)
    judged = judge_cell(clipping, obs).records
    assert _clip_rows(judged) == [(0, "PASS"), (1, "PASS")]
    assert all(r.signal > 0 for r in judged if r.check == "clip")  # it removed part of the norm
    # grad judges each gradient as reduced, grad.clipped what the optimizer stepped with
    assert {r.verdict for r in judged if r.check in ("grad", "grad.clipped")} == {"PASS"}
    assert {r.name for r in judged if r.check == "grad"} == {r.name for r in judged if r.check == "grad.clipped"}
    unclipped = _observe(one_rank, dataclasses.replace(clipping, clip=0.0))
    clipped = [o.grads for o in obs]
    for o, u in zip(obs, unclipped):
        o.grads = u.grads  # an optimizer fed unclipped gradients: unclipped ones are far from them
    rows = judge_cell(clipping, obs).records
    assert {r.verdict for r in rows if r.check == "grad"} == {"PASS"}
    assert "FAIL" in {r.verdict for r in rows if r.check == "grad.clipped"}
    for o, c in zip(obs, clipped):
        o.reduced = c  # a reduction that delivered the clipped values before clipping ran
    assert "FAIL" in {r.verdict for r in judge_cell(clipping, obs).records if r.check == "grad"}
    # a max-norm above the norm clips nothing: its PASS would be vacuous
    loose = dataclasses.replace(clipping, clip=1e6)
    assert _clip_rows(judge_cell(loose, _observe(one_rank, loose)).records) == [(0, "INCONCLUSIVE"), (1, "INCONCLUSIVE")]


def test_a_clipping_cell_without_its_clipped_norms_fails(one_rank):
    cell = Cell(fixture="kda", path="native", steps=1, clip=0.01)
    obs = _observe(one_rank, cell)
    obs[0].clipped_norms = []
    records = judge_cell(cell, obs).records
    assert _clip_rows(records) == [(0, "FAIL")]


def test_a_step_after_an_evaluation_with_reshard_off_owes_no_all_gather(one_rank):
    """An evaluation forward between steps with reshard off leaves the units gathered, so the next
    step may gather nothing (found in review: step 2 of a four-step cell was reported missing)."""
    cell = Cell(fixture="kda", path="native", steps=4, reshard=False, eval="between-steps")
    obs = _observe(one_rank, cell)
    assert not obs[0].contracts.all_gathers.get(2)  # what made it a false alarm
    assert {r.verdict for r in judge_cell(cell, obs).records if r.check == "gathered"} == {"PASS"}


def test_gradients_as_reduced_and_all_gathers_are_owed(one_rank):
    """A clipping cell whose ranks recorded no gradient before clipping, or no all-gather's output,
    is missing evidence: FAIL, not a pass by absence."""
    cell = Cell(fixture="kda", path="native", steps=1, clip=0.01)
    obs = _observe(one_rank, cell)
    obs[0].reduced = []
    obs[0].contracts.all_gathers = {}
    records = judge_cell(cell, obs).records
    grads = [r for r in records if r.check == "grad"]
    assert grads and all(r.verdict == "FAIL" and "missing" in r.detail for r in grads)
    assert {r.verdict for r in records if r.check == "grad.clipped"} == {"PASS"}
    gathers = [r for r in records if r.check == "gathered" and r.name == "all-gathers"]
    assert [r.verdict for r in gathers] == ["FAIL"] and "step 0 rank 0" in gathers[0].detail


def test_evaluation_forwards_are_judged_and_owed(one_rank):
    cell = Cell(fixture="kda", path="native", steps=2, microbatches=2, sync="last", eval="between-microbatches",
                reshard=False)
    obs = _observe(one_rank, cell)
    records = judge_cell(cell, obs).records
    rows = sorted((r.check, r.name, r.step, r.verdict) for r in records if r.check.startswith("eval"))
    assert rows == [("eval", "rank0/mb0", 0, "PASS"), ("eval", "rank0/mb0", 1, "PASS"),
                    ("eval.reshard", "mb0", 0, "PASS"), ("eval.reshard", "mb0", 1, "PASS")]
    assert all("unsharded" in r.detail for r in records if r.check == "eval.reshard")  # reshard off
    obs[0].evals = obs[0].evals[1:]  # the first evaluation forward is missing: a finding, never a pass
    verdicts = {(r.check, r.step): r.verdict for r in judge_cell(cell, obs).records if r.check.startswith("eval")}
    assert verdicts[("eval", 0)] == verdicts[("eval.reshard", 0)] == "FAIL"
    assert verdicts[("eval", 1)] == verdicts[("eval.reshard", 1)] == "PASS"


def test_state_dicts_are_judged_by_value_and_a_missing_one_fails(one_rank):
    cell = Cell(fixture="kda", path="native", steps=2, reshard=False)
    obs = _observe(one_rank, cell)
    rows = sorted((r.name, r.step, r.verdict) for r in judge_cell(cell, obs).records if r.check == "state_dict")
    assert rows == [("get_model_state_dict@after-forward", 1, "PASS"), ("state_dict@after-forward", 1, "PASS"),
                    ("state_dict@after-step", 0, "PASS")]
    obs[0].state_dicts = obs[0].state_dicts[1:]  # the after-step state dict was never taken
    failed = {r.name for r in judge_cell(cell, obs).records if r.check == "state_dict" and r.verdict == "FAIL"}
    assert failed == {"state_dict@after-step"}


def test_an_observation_cut_short_is_named_not_an_index_error(one_rank):
    """A rank's observation missing a step's gradients, an output or a whole rank raised an
    IndexError in the judge, written as an unnamed "judging failed" (review): what is missing is
    named before anything is assembled."""
    from parity.errors import IncompleteObservation

    cell = Cell(fixture="kda", path="native", steps=2)
    obs = _observe(one_rank, cell)
    for field, message in (("grads", "rank 0 sent 1 grads where the cell owes 2 (one per step)"),
                           ("outputs", "rank 0 sent 1 outputs where the cell owes 2 (2 steps x 1 micro-batches)")):
        cut = [dataclasses.replace(obs[0], **{field: getattr(obs[0], field)[:1]})]
        with pytest.raises(IncompleteObservation, match=message.replace("(", r"\(").replace(")", r"\)")):
            judge_cell(cell, cut)
    with pytest.raises(IncompleteObservation, match=r"observations of ranks \[0\] arrived where the cell runs ranks 0-1"):
        judge_cell(dataclasses.replace(cell, ranks=2), obs)
    assert judge_cell(cell, obs).records  # whole, it is judged
