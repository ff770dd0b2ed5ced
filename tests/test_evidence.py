"""The evidence contract (issue 19): absence is a finding, never a pass."""

import os
from dataclasses import replace

import pytest
import torch

from parity.errors import UsageError
from parity.judge import coverage
from parity.judge.record import Record, Verdict
from parity.matrix.cell import Cell
from parity.model.plan import PrecisionConfig, resolve_plan
from parity.model.registry import get_fixture

BASE = dict(cell="c", fixture="kda", path="native")


def _owed(cell: Cell, **kw):
    fixture = get_fixture(cell.fixture)
    plan = resolve_plan(fixture.make(0), PrecisionConfig(), fixture.ignored(fixture.make(0)), fixture.keep_fp32)
    return coverage.owed(cell, plan, token_input=fixture.token_input, quantizable=fixture.quantizable, **kw), plan


def _present(owed_rows):
    return [Record(**BASE, check=c, name=n if n is not None else "x", step=s if s is not None else "")
            for c, n, s in owed_rows]


def test_every_owed_record_present_passes_and_any_absent_one_fails_by_name():
    rows, _ = _owed(Cell(fixture="kda", path="native", ranks=2, microbatches=3, sync="last"))
    assert {"output", "input_grad", "grad", "param", "grad_norm", "trajectory", "dtype.reduce",
            "checkpoint.same"} - {"checkpoint.same"} <= {c for c, _, _ in rows}
    assert coverage.record(rows, _present(rows), BASE).verdict == Verdict.PASS
    present = [r for r in _present(rows) if not (r.check == "input_grad" and r.name == "rank1/mb2" and r.step == 1)]
    bad = coverage.record(rows, present, BASE)
    assert bad.verdict == Verdict.FAIL and "input_grad rank1/mb2 @step 1" in bad.detail


def test_a_skip_without_a_reason_is_not_evidence():
    rows, _ = _owed(Cell(fixture="kda", path="native"))
    present = _present(rows)
    target = next(r for r in present if r.check == "dtype.reduce")
    target.verdict, target.detail = Verdict.SKIP, ""
    assert coverage.record(rows, present, BASE).verdict == Verdict.FAIL
    target.detail = "unfrozen after this cell's steps"
    assert coverage.record(rows, present, BASE).verdict == Verdict.PASS


def test_owed_records_follow_the_cell_and_model():
    lm, _ = _owed(Cell(fixture="lm", path="native"))
    assert not [r for r in lm if r[0] == "input_grad"]  # token input: no input gradient is owed
    fp8, plan = _owed(Cell(fixture="fp8", path="native", ranks=2, weights="mxfp8"))
    quant = {(c, n) for c, n, _ in fp8 if c.startswith("quant.")}
    assert {c for c, _ in quant} == {"quant.gather", "quant.refresh", "quant.blocks", "quant.values"}
    assert {n for _, n in quant} == {f"{m}.weight" for m in get_fixture("fp8").quantizable}
    kda, _ = _owed(Cell(fixture="kda", path="native", steps=2))
    assert ("checkpoint.same", None, None) in kda and ("checkpoint.cross", None, None) in kda


def test_a_declaration_that_names_nothing_is_refused():
    from parity.model.spec import validate  # noqa: F401 - the validator the registry applies

    import dataclasses

    fixture = dataclasses.replace(get_fixture("kda"), expect={"dtype-split": "isolation-error:"})
    with pytest.raises(UsageError, match="isolation-error:PARAMS"):
        validate(fixture, "test")


def test_an_empty_declared_fallback_reason_matches_nothing():
    from parity.judge.cell import _fallback_kind

    assert _fallback_kind("unit x mixes trainable storage dtypes", "fallback", "") == "undeclared"
    assert _fallback_kind("unit x mixes trainable storage dtypes", "fallback", "mixes trainable") == "declared"


@pytest.mark.slow
@pytest.mark.xdist_group("evidence")
def test_a_parameter_without_gradient_is_a_model_finding_not_a_dtype_defect(run_matrix):
    source = os.path.join(os.path.dirname(__file__), "plugins", "argmax_router.py") + ":parity_model"
    cells = [Cell(fixture="argmax_router", path=p, ranks=2, source=source) for p in ("legacy", "native")]
    code, records = run_matrix(cells)
    assert code == 1
    own = [r for r in records if "~" not in r["path"]]
    # DCP cannot restore an AdamW state the router never got: the lifecycle's ERROR stands beside
    # the cell's numeric evidence instead of replacing it
    lifecycle = [r for r in own if r["check"].startswith("checkpoint.") and r["verdict"] == "ERROR"]
    assert lifecycle and all("failed" in r["detail"] for r in lifecycle)
    assert {r["check"] for r in own if r["verdict"] == "PASS"} >= {"grad", "param", "output", "coverage"}
    findings = [r for r in own if r["check"] == "no-gradient"]
    assert len(findings) == 2 and all("router" in r["detail"] and r["verdict"] == "FAIL" for r in findings)
    assert all("gain" in r["detail"] for r in findings)  # exact zeros at every step test nothing either (review)
    about_router = [r for r in own if r["name"] == "router" and r["check"] in ("dtype.reduce", "trajectory")]
    assert about_router and {r["verdict"] for r in about_router} == {"SKIP"}
    assert {r["check"] for r in own if r["verdict"] == "FAIL"} == {"no-gradient", "stage"}
    assert {r["name"] for r in own if r["check"] == "stage"} == {"checkpoint-load"}  # where it went wrong first
    assert {r["check"] for r in own if r["verdict"] == "ERROR"} <= {"checkpoint.same", "checkpoint.cross"}
    assert {r["verdict"] for r in own if r["check"] == "coverage"} == {"PASS"}


@pytest.mark.slow
@pytest.mark.xdist_group("evidence")
def test_zeros_filled_in_or_underflowed_are_not_a_no_gradient_finding(run_matrix):
    """Only what autograd computed, in FP64, decides "exact zeros": an expert no token reaches in a
    whole cell (routed, seed 1, one step: its zeros are filled in for the reduction) and a gradient
    that only a low precision rounds to zero are evidence as before, not a model finding (review)."""
    import parity

    _, cells, _ = parity.select(matrix="configs", filter="fixture == 'routed' and ranks == 1", seed=1, steps=1)
    code, records = run_matrix(cells)
    assert code == 0 and not [r for r in records if r["check"] == "no-gradient"]


def test_a_rank_that_reports_no_marked_tensor_fails_when_the_model_marks_some():
    from parity.execute.observation import MarkerSeen, Observation
    from parity.judge.contracts import declared_marks, marker_checks

    declared = declared_marks("kda", "", 0)
    assert declared and all(kind == "buffer" for _, kind in declared)
    silent = Observation(rank=1)
    rows = marker_checks(silent, BASE, declared)
    assert rows and {r.verdict for r in rows} == {Verdict.FAIL} and "no report from this rank" in rows[0].detail
    full = Observation(rank=0)
    full.contracts.markers = {n: MarkerSeen(kind=k, after_move=True, dtype="float32") for n, k in declared}
    assert {r.verdict for r in marker_checks(full, BASE, declared)} == {Verdict.PASS}
    assert [r.verdict for r in marker_checks(Observation(rank=0), BASE, ())] == [Verdict.SKIP]


def test_a_sharded_gradient_is_judged_slice_by_slice_and_a_rank_without_one_fails():
    """``grad.shard``: each rank's shard against the same slice of the emulated gradient; a rank
    that recorded nothing where the reference has a gradient is missing evidence. Owed on
    every mesh for every FSDP-managed parameter at every step it trains."""
    import torch

    from parity.execute.observation import Observation
    from parity.judge import shards
    from parity.judge.reference import ReferenceRun

    cell = Cell(fixture="kda", path="native", ranks=2)
    rows, plan = _owed(cell)
    fqn = "blocks.0.q_proj.weight"
    assert ("grad.shard", fqn, 0) in rows
    whole = torch.arange(32 * 32, dtype=torch.float32).reshape(32, 32) / 1024
    ref = ReferenceRun(shards={(0, 0): {fqn: (whole, 1.0)}})
    obs = [Observation(rank=r) for r in range(2)]
    for r, o in enumerate(obs):
        o.contracts.shards = {(0, 0): {fqn: ((16 * r, 0), whole[16 * r:16 * (r + 1)].clone())}}
    [ok] = shards.check(cell, obs, ref, plan, BASE)
    assert ok.verdict == Verdict.PASS and ok.observed == 0.0 and ok.check == "grad.shard"
    obs[1].contracts.shards[(0, 0)][fqn][1][3, 4] += 1e-3  # one element of rank 1's shard
    [bad] = shards.check(cell, obs, ref, plan, BASE)
    assert bad.verdict == Verdict.FAIL and "rank 1 after micro-batch 0, shard at [16, 0]" in bad.detail
    zero_half = whole.clone()
    zero_half[16:] = 0  # rank 1's rows got no gradient: judged against the whole gradient's size
    obs[1].contracts.shards = {(0, 0): {fqn: ((16, 0), zero_half[16:].clone())}}
    obs[0].contracts.shards = {(0, 0): {fqn: ((0, 0), zero_half[:16].clone())}}
    [quiet] = shards.check(cell, obs, ReferenceRun(shards={(0, 0): {fqn: (zero_half, 1.0)}}), plan, BASE)
    assert quiet.verdict == Verdict.PASS
    obs[1].contracts.shards = {}
    [missing] = shards.check(cell, obs, ref, plan, BASE)
    assert missing.verdict == Verdict.FAIL and "rank 1" in missing.detail and "no shard recorded" in missing.detail
    tp_rows, _ = _owed(Cell(fixture="composed", path="native", ranks=4, mesh="fsdp+tp"))
    assert any(c == "grad.shard" for c, _, _ in tp_rows)  # a tensor-parallel shard is a slice like any other


def test_a_cell_in_which_no_parameter_trains_fails_coverage():
    """A model whose every trainable parameter unfreezes at or after the cell's last step owes
    no gradient, reduction or optimizer record: its cell must not pass on what is left."""
    fixture = get_fixture("kda")
    model = fixture.make(0)
    model.requires_grad_(False)
    tops = [name for name, _ in model.named_children()]
    cell = Cell(fixture="kda", path="native", steps=2)
    late = resolve_plan(model, PrecisionConfig(), unfreeze=dict.fromkeys(tops, 2))
    bad = coverage.untrained_record(cell, late, BASE)
    assert bad.verdict == Verdict.FAIL and "unfreezes at step 2" in bad.detail
    assert coverage.untrained_record(cell, resolve_plan(model, PrecisionConfig(), unfreeze=dict.fromkeys(tops, 1)),
                                     BASE) is None
    frozen = coverage.untrained_record(cell, resolve_plan(model, PrecisionConfig()), BASE)
    assert frozen.verdict == Verdict.FAIL and "every parameter is frozen" in frozen.detail


def test_a_load_that_ran_on_another_path_than_its_target_fails_naming_the_ranks():
    """A cross load that ran on the saving path would pass as a same-path one under the target's
    name; the path a fresh build in the parent takes for the target is the other witness (review,
    2026-12-06: a lifecycle building the cell's own path for every load passed 1350 records)."""
    from parity.judge.resumed import load_path_rows

    base = dict(cell="kda/legacy/r2", fixture="kda", path="legacy")
    [row] = load_path_rows(base, "cross", "native", ["native", "legacy"], "native")
    assert row.verdict == Verdict.FAIL and row.check == "checkpoint.cross" and row.name == "native:path"
    assert "rank 1: legacy" in row.detail and "rank 0" not in row.detail
    assert load_path_rows(base, "cross", "native", ["legacy", "legacy"], "legacy") == []  # a fallback the build takes
    assert load_path_rows(base, "same", "legacy", ["legacy"], "") == []  # unknown here (tensor parallel): no claim


def _witness(rank: int, moment: float, clipped: float, reduced: float):
    from parity.execute.observation import Observation
    o = Observation(rank=rank)
    o.grad_norms, o.clipped_norms = [1.0], [clipped]
    o.grads, o.params = [{"w": torch.ones(4)}], [{"w": torch.ones(4)}]
    o.moments = [{"exp_avg": {"w": torch.full((4,), moment)}, "step": {"w": torch.tensor(1.0)}}]
    o.reduced = [{"w": torch.full((4,), reduced)}]
    return o


@pytest.mark.parametrize("other", [dict(moment=9.0), dict(clipped=7.0), dict(reduced=-5.0)],
                         ids=["moment", "clipped_norm", "reduced"])
def test_every_replicated_observation_of_another_rank_is_held_to_rank_0s(other):
    """What is replicated is judged from rank 0's copy, so another rank's optimizer moment,
    clipped norm or reduced gradient that differs is a ``ranks`` FAIL naming it."""
    from types import SimpleNamespace

    from parity.judge.compare import agreement_records
    plan = {"w": SimpleNamespace(ownership="ignored")}
    same = dict(moment=0.1, clipped=0.5, reduced=2.0)
    rows = agreement_records([_witness(0, **same), _witness(1, **same)], plan, BASE)
    assert [r.verdict for r in rows if r.name == "replicated"] == [Verdict.PASS]
    rows = agreement_records([_witness(0, **same), _witness(1, **{**same, **other})], plan, BASE)
    assert [r.verdict for r in rows if r.name == "replicated"] == [Verdict.FAIL]
    assert next(iter(other)).replace("moment", "moment ('w', 'exp_avg')") in rows[0].detail


def test_snapshots_and_state_dicts_that_recorded_nothing_fail_by_name(one_rank, monkeypatch):
    """A real 1-rank run whose probes record no parameter and no module: ``state_dict`` said
    "0 parameters as their masters" and ``identity`` "same" / "kept" -- PASS on nothing (review,
    twenty-third stop). The plan's parameters and the root module are owed by name."""
    from parity.execute import probes, state_dicts
    from parity.execute.worker import run_rank
    from parity.judge.contracts import identity_checks, state_dict_checks

    cell = Cell(fixture="kda", path="native", steps=1)

    def judged():
        obs = run_rank(cell, rank=0, world=1, mesh=one_rank, device=torch.device("cpu"))
        return {(r.check, r.name): r for r in identity_checks(obs, obs.plan, BASE)
                + state_dict_checks(cell, obs, obs.plan, BASE)}

    assert {r.verdict for r in judged().values()} == {Verdict.PASS}
    taken, named, unsharded = state_dicts.take, probes.names_snapshot, probes.before_sharding

    def blank(model):
        snap = unsharded(model)
        snap.modules = {}
        return snap

    monkeypatch.setattr(state_dicts, "take", lambda model, params, *a, **k: taken(model, params[:0], *a, **k))
    monkeypatch.setattr(probes, "names_snapshot", lambda model: replace(named(model), ids={}))
    monkeypatch.setattr(probes, "before_sharding", blank)
    rows = judged()
    sd = [r for (check, _), r in rows.items() if check == "state_dict"]
    assert sd and all(r.verdict == Verdict.FAIL and "no master recorded" in r.detail for r in sd)
    assert "the root module" in rows[("identity", "modules@trained")].detail
    for stage in ("lazy_init", "trained"):
        row = rows[("identity", f"parameters@{stage}")]
        assert row.verdict == Verdict.FAIL and "not seen: " in row.detail, row.detail


def test_comparisons_over_nothing_are_not_matches():
    """Gathered sums missing or truncated, every rank's shard of a non-empty gradient empty, a
    saving rank that reported no save: each compared nothing and passed (review, twenty-third
    stop)."""
    from types import SimpleNamespace

    from parity.execute.observation import Resumed
    from parity.judge.checkpoint_entries import _left_alone
    from parity.judge.gathered import close as _close
    from parity.judge.shards import worst_shard

    assert not _close((), (1.0, 2.0)) and not _close((1.0,), (1.0, 2.0)) and _close((1.0, 2.0), (1.0, 2.0))
    whole = torch.ones(8, 4)
    ranks = [SimpleNamespace(rank=r, offset=(4 * r, 0)) for r in range(2)]
    worst = worst_shard(ranks, lambda o: (o.offset, torch.zeros(0, 4)), lambda o: whole, "no shard")
    assert worst is not None and worst[0] == float("inf") and "cover 0 of 32" in worst[4]
    assert worst_shard(ranks, lambda o: (o.offset, torch.zeros(0)), lambda o: torch.zeros(0), "-") is None
    row = _left_alone(BASE, [(0, Resumed()), (1, None)])
    assert row.verdict == Verdict.FAIL and "rank 1: no report of its save" in row.detail
    assert _left_alone(BASE, [(0, Resumed()), (1, Resumed())]).verdict == Verdict.PASS


def test_a_load_target_the_ranks_did_not_report_fails_by_name(one_rank, monkeypatch):
    """The lifecycle loads a checkpoint into the cell's path and its cross-load targets, a moving
    one into the same: a target the ranks left out of their report was judged by nothing (its
    records are named after what was reported), and coverage owes ``checkpoint.cross`` once for
    all targets (review, twenty-third stop). Each target is owed by name."""
    from parity.execute import lifecycle
    from parity.execute.observation import Observation
    from parity.execute.worker import run_rank
    from parity.judge import moved, resumed

    cell = Cell(fixture="kda", path="native", steps=2)
    assert cell.lifecycle and cell.load_targets == ["native", "legacy"]
    resume = lifecycle.resume
    monkeypatch.setattr(lifecycle, "resume", lambda c, **k: {t: r for t, r in resume(c, **k).items() if t == c.path})
    obs = run_rank(cell, rank=0, world=1, mesh=one_rank, device=torch.device("cpu"))
    rows = resumed.resume_checks(cell, [obs], obs.plan, BASE, {})
    lost = [r for r in rows if r.name == "legacy"]
    assert [(r.check, r.verdict) for r in lost] == [("checkpoint.cross", Verdict.FAIL)], lost
    assert "reported no load of the checkpoint into legacy" in lost[0].detail
    monkeypatch.undo()
    full = run_rank(Cell(fixture="kda", path="native", steps=2), rank=0, world=1, mesh=one_rank,
                    device=torch.device("cpu"))
    quiet = replace(full, rank=1, contracts=replace(full.contracts, resume={"native": full.contracts.resume["native"]}))
    rows = resumed.resume_checks(cell, [full, quiet], full.plan, BASE, {})  # rank 1 lacks one (once a KeyError)
    assert [(r.verdict, r.detail) for r in rows if r.name == "legacy"] == [
        (Verdict.ERROR, "checkpoint from native: rank 1: no report of this load")]
    silent = Observation(rank=0)
    silent.contracts.moved = {}
    moving = Cell(fixture="kda", path="native", ranks=2, move="shrink")
    rows = moved.checks(moving, [silent], obs.plan, BASE, {})
    assert [(r.name, r.verdict) for r in rows] == [("native", Verdict.FAIL), ("legacy", Verdict.FAIL)]


def test_optimizer_state_some_rank_lacks_is_named_not_a_judge_error():
    """Every rank holds a shard (or copy) of each trained parameter's optimizer state; an entry
    one rank lacks gathers empty and is named by rank, whichever rank it is (the FQNs were once
    taken from rank 0's state alone: a rank-0-only entry was a KeyError, a rank-1-only one unseen).
    The fault ``rank1_step_passes_over_param`` shows it end to end."""
    from parity.judge.resumed import _full_state, _unheld

    plan = resolve_plan(get_fixture("kda").build(), PrecisionConfig())
    fqn = plan.params[0].fqn
    rank0 = {fqn: {"step": torch.tensor(1.0), "exp_avg": torch.ones(2)}}
    rank1 = {fqn: {"step": torch.tensor(1.0)}, "extra": {"step": torch.tensor(1.0)}}
    assert _unheld([rank0, rank1]) == ["rank 0 lacks optim extra.step", f"rank 1 lacks optim {fqn}.exp_avg"]
    state = _full_state([rank0, rank1], plan, whole=False)
    assert state[fqn]["exp_avg"].numel() == 0 and set(state) == {fqn, "extra"}
    assert _unheld([rank0, rank0]) == []


def test_a_checkpoint_failure_says_each_rank_s_error_not_its_traceback():
    """DCP's CheckpointException prints every rank's traceback; the record keeps each rank's error."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from parity.errors import brief

    exc = CheckpointException("save", {0: (ValueError("Failed to validate global plan"), traceback.StackSummary())})
    assert brief(exc) == "CheckpointException: rank 0: ValueError: Failed to validate global plan"
    assert brief(KeyError("x")) == "KeyError: 'x'"


def test_an_entry_one_rank_lacks_is_named_and_left_out_of_what_the_reference_reads():
    """Every rank observes the same gradients, parameters and moments (its shard or copy). A
    gradient rank 1 lacks once reached the reference empty and crashed the judge (naming no
    rank); one only rank 1 held was never read. Each is a ``ranks`` ``held:KIND`` FAIL naming
    the rank, placed where that kind comes from, and :func:`assemble` holds only what every
    rank holds, so the checks that expect the rest report it missing."""
    from parity.execute.observation import Observation
    from parity.judge.compare import agreement_records, assemble
    from parity.judge.stages import stage_of

    plan = resolve_plan(get_fixture("kda").build(), PrecisionConfig())
    a, b = plan.params[0].fqn, plan.params[1].fqn
    ranks = [Observation(rank=r, grad_norms=[1.0], clipped_norms=[], params=[{a: torch.ones(2), b: torch.ones(2)}],
                         moments=[{"exp_avg": {a: torch.ones(2)}}]) for r in range(2)]
    ranks[0].grads, ranks[1].grads = [{a: torch.ones(2)}], [{b: torch.ones(2)}]
    ranks[1].moments[0]["exp_avg"][b] = torch.ones(2)
    rows = {r.name: r for r in agreement_records(ranks, plan, BASE)}
    assert rows["held:grad"].verdict == Verdict.FAIL and rows["held:grad"].detail == \
        f"rank 0 lacks grad {b}; rank 1 lacks grad {a}"
    assert rows["held:moment"].detail == f"rank 0 lacks moment {b}.exp_avg" and stage_of(rows["held:moment"]) == "optimizer"
    assert stage_of(rows["held:grad"]) == "collectives"
    assert rows["held:param"].verdict == rows["held:reduced"].verdict == rows["replicated"].verdict == Verdict.PASS
    run = assemble(ranks, plan)
    assert run.grads == [{}] and set(run.params[0]) == {a, b} and set(run.moments[0]["exp_avg"]) == {a}
