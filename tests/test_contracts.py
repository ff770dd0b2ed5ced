"""Contract checks on real gloo ranks (their faults: tests/test_faults.py)."""

import pytest
import torch

from parity_fixtures import FIXTURES
from parity.matrix.cell import Cell
from parity.errors import UsageError
from parity.paths import plan_sharding
from parity.model.plan import PrecisionConfig, resolve_plan

@pytest.mark.slow
@pytest.mark.xdist_group("contracts")
def test_contract_rows_pass_on_both_paths_and_resume_across_paths(run_matrix):
    # three steps: the resumed run must match the uninterrupted run's step 2, not its last
    cells = [Cell(fixture=fx, path=p, ranks=2, output_dtype="bfloat16", steps=3)
             for fx in ("kda", "frozen") for p in ("legacy", "native")]
    code, records = run_matrix(cells)
    assert code == 0
    checks = {r["check"] for r in records}
    assert {"dtype.storage", "dtype.compute", "dtype.reduce", "dtype.boundary", "dtype.output", "names", "identity",
            "marker", "optim.state", "checkpoint.same", "checkpoint.cross", "unit.policy"} <= checks
    cross = [r for r in records if r["check"] == "checkpoint.cross"]
    assert {r["detail"].rsplit("resumed on ", 1)[1] for r in cross} == {"legacy", "native"}
    holder = [r for r in records if r["check"] == "dtype.compute" and "holder" in r["name"]]
    assert holder and all("expected float32, observed float32" in r["detail"] for r in holder)


def test_output_dtype_changes_only_outputs():
    fx = FIXTURES["kda"]
    model = fx.make(0)
    plans = {o: resolve_plan(model, PrecisionConfig(output_dtype=o)) for o in (None, torch.float32, torch.bfloat16, torch.float16)}
    base = plans[None]
    for plan in plans.values():
        assert [(t.fqn, t.compute, t.reduce, t.storage) for t in plan.tensors] == \
               [(t.fqn, t.compute, t.reduce, t.storage) for t in base.tensors]
    for path in ("legacy", "native"):
        reports = {o: plan_sharding(model, fx.unit_roots, p, path) for o, p in plans.items()}
        for o, rep in reports.items():
            strip = [(u.modules, u.params, u.param_dtype, u.reduce_dtype, u.cast_forward_inputs) for u in rep.units]
            assert strip == [(u.modules, u.params, u.param_dtype, u.reduce_dtype, u.cast_forward_inputs)
                             for u in reports[None].units]
            assert [u.output_dtype for u in rep.units][-1] == o


def test_output_dtype_that_a_path_would_ignore_raises():
    fx = FIXTURES["kda"]
    model = fx.make(0)
    plan = resolve_plan(model, PrecisionConfig(output_dtype=torch.float32))
    with pytest.raises(UsageError, match="would be silently ignored"):
        plan_sharding(model, ("blocks.0", "blocks.1"), plan, "native")


def test_gathered_sums_see_the_same_values_in_another_order():
    """Shards concatenated in the wrong order hold the same values: the sums of values and of
    their magnitudes cannot tell, the position-weighted one must (``gathered``'s docstring claims it)."""
    import torch

    from parity.execute.observation import value_sums
    from parity.judge.gathered import close as _close

    w = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    swapped = torch.cat([w[4:], w[:4]])
    assert _close(value_sums(w.clone()), value_sums(w))
    assert not _close(value_sums(swapped), value_sums(w))
    assert value_sums(swapped)[:2] == value_sums(w)[:2] or all(
        abs(a - b) < 1e-9 for a, b in zip(value_sums(swapped)[:2], value_sums(w)[:2]))


def test_optim_state_holds_every_moment_to_the_plans_dtype(monkeypatch):
    """AdamW's second moment kept in BF16 beside an FP32 first moment was read as right: only
    the first moment's dtype was checked."""
    from types import SimpleNamespace

    import torch

    from parity.judge import resumed
    from parity.judge.record import Verdict
    from parity.matrix.cell import Cell

    w = SimpleNamespace(fqn="w", requires_grad=True, trainable_from=0, storage=torch.float32, kept_grad=torch.float32)
    plan = SimpleNamespace(params=[w])
    obs = [SimpleNamespace(whole=True, params={1: {"w": torch.zeros(4)}},
                           contracts=SimpleNamespace(optim={}, resume_step=1))]
    monkeypatch.setattr(resumed, "gather_full", lambda plan, fqn, per_rank, whole: torch.zeros(4))
    cell = Cell(fixture="kda", path="native", ranks=1)
    for second, verdict in ((torch.float32, Verdict.PASS), (torch.bfloat16, Verdict.FAIL)):
        state = {"w": {"exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4, dtype=second), "step": torch.tensor(1.0)}}
        monkeypatch.setattr(resumed, "_full_state", lambda *a, state=state: state)
        [row] = resumed.optimizer_checks(cell, obs, plan, dict(cell=cell.id, fixture="kda", path="native"))
        assert row.verdict == verdict, row


@pytest.mark.xdist_group("contracts")
def test_an_expert_no_token_reaches_is_skipped_only_where_the_reference_agrees(run_matrix):
    """``routed`` at seed 1: expert 3 is first reached after the first forward on one rank and
    never on the other. ``dtype.compute`` notes every forward of the loop, and a rank whose
    forwards never read it is SKIP only because the reference's forwards of its batches did not
    either -- a correct torch is not NO-GO (review, 2026-12-06)."""
    from types import SimpleNamespace

    from parity.judge.contracts import _compute_row

    code, records = run_matrix([Cell(fixture="routed", path="native", ranks=2, seed=1)])
    assert code == 0, [(r["check"], r["name"], r["detail"][:200]) for r in records if r["verdict"] not in ("PASS", "SKIP")]
    expert = [r for r in records if r["check"] == "dtype.compute" and "experts.3" in r["name"]]
    assert expert and all(r["verdict"] == "PASS" and "in the reference either" in r["detail"] for r in expert), expert
    # the reference read it on this rank's batches but the rank's forwards did not: FAIL, as ever
    base = dict(cell="c", fixture="routed", path="native")
    t, unread = SimpleNamespace(compute=torch.bfloat16), SimpleNamespace(compute={})
    alias = "blocks.0.moe.experts.3.weight"
    assert _compute_row(base, unread, t, alias, (), {alias}).verdict == "FAIL"
    assert _compute_row(base, unread, t, alias, (), None).verdict == "FAIL"  # no reference word: never a skip
    assert _compute_row(base, unread, t, alias, (), set()).verdict == "SKIP"


def test_the_references_forward_readers_stay_out_of_compiled_blocks():
    """A pre-hook inside a compiled block runs in the graph: dynamo guarded on the rank it noted
    and recompiled the block per emulated rank until its limit, running it eagerly after (a
    ``compile.graphs`` FAIL on correct torch; review, 2026-12-06)."""
    from torch import nn

    from parity.judge.reference import _readers

    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    model[1].compile(backend="eager")
    read = [set()]
    handles = _readers(model, read, [0])
    try:
        assert model[0]._forward_pre_hooks and not model[1]._forward_pre_hooks and not model[1][0]._forward_pre_hooks
        model(torch.ones(1, 2))
        assert read == [{"0.weight", "0.bias"}]
    finally:
        for h in handles:
            h.remove()


def _base(cell):
    from parity.judge.cell import base_fields

    return base_fields(cell, cell.path, "")


def test_collectives_counted_outside_the_cells_steps_fail_naming_them():
    """Between steps and around the loop nothing may issue a collective, and no step's row read
    what was counted there: such calls passed unseen (review)."""
    from parity.judge.collectives import _outside

    cell = Cell(fixture="kda", path="native", ranks=2)
    assert _outside(cell, {(0, "mb0/forward", "all-gather"): [8], (1, "optimizer", "all-reduce"): [4]}, _base(cell)) == []
    (row,) = _outside(cell, {(-1, "outside", "all-gather"): [8, 8], (2, "mb0/forward", "all-gather"): [8]}, _base(cell))
    assert (row.check, row.name, row.verdict.value) == ("collectives", "outside", "FAIL")
    assert row.detail == ("expected no collective outside the cell's steps, observed 2 all-gather at no step (outside); "
                          "1 all-gather at step 2 (mb0/forward)")


def test_an_evaluation_state_that_leaves_out_a_unit_or_names_another_fails():
    """``eval.reshard`` judged only the units a rank reported: one unit of three, or a unit the
    model does not have, passed as "every unit sharded" (review)."""
    from types import SimpleNamespace

    from parity.execute.observation import EvalSeen
    from parity.judge.contracts import eval_checks

    cell = Cell(fixture="kda", path="native", ranks=2, eval="between-steps")
    from parity.paths.base import UnitSpec

    def unit(m, params):
        return UnitSpec(modules=(m,), params=params, param_dtype=None, reduce_dtype=None, output_dtype=None,
                        cast_forward_inputs=True)
    units = [unit(m, ("w",)) for m in ("blocks.0", "blocks.1", "")]
    units.append(unit("empty", ()))  # no parameter: FSDP holds no state to report

    def judged(states):
        evals = [EvalSeen(step=s, label="after-step", output=torch.zeros(1), units=dict(states)) for s in range(2)]
        obs = SimpleNamespace(evals=evals, report=SimpleNamespace(units=units))
        return [(r.verdict.value, r.detail) for r in eval_checks(cell, obs, _base(cell))]

    every = {"blocks.0": "sharded", "blocks.1": "sharded", "<root>": "sharded"}
    assert {v for v, _ in judged(every)} == {"PASS"}
    verdict, detail = judged({"blocks.0": "sharded"})[0]
    assert verdict == "FAIL" and "after the forward: <root>: not reported; after the forward: blocks.1: not reported" in detail
    verdict, detail = judged({**every, "ghost": "sharded"})[0]
    assert verdict == "FAIL" and detail.endswith("after the forward: ghost: not a unit; reshard on")


def test_shards_that_leave_part_of_the_tensor_uncompared_are_missing_evidence():
    """``grad.shard`` / ``grad.partial`` judged each rank's piece against its slice and skipped
    empty pieces: a rank's piece lost, or every rank recording the same rows, passed (review)."""
    from types import SimpleNamespace as NS

    from parity.judge import partials, shards

    whole = torch.tensor([[1.0, 2.0], [3.0, 4.0]])

    class Topo:
        data_world = 4

        def replica_groups(self):
            return [[0, 1], [2, 3]]

        def data_rank(self, r):
            return r

    cell = NS(topology=lambda: Topo())
    entry = NS(sum_dtype=torch.float32, kept_grad=torch.float32)
    plan = NS(get=lambda f: entry)
    ref = NS(partials={(0, 0): {"w": ({0: whole, 1: whole}, 4.0, 2)}}, shards={(0, 0): {"w": (whole, 4.0)}})

    def judged(pieces):
        observations = [NS(rank=r, contracts=NS(partials={(0, 0): {"w": p}}, shards={(0, 0): {"w": p}}))
                        for r, p in enumerate(pieces)]
        return [(r.verdict.value, r.detail.split(":")[0]) for m in (partials, shards)
                for r in m.check(cell, observations, ref, plan, {"cell": "c", "fixture": "f", "path": "p"})]

    rows = [((r % 2, 0), whole[r % 2:r % 2 + 1]) for r in range(4)]
    assert {v for v, _ in judged(rows)} == {"PASS"}
    lost = [p if r % 2 == 0 else ((1, 0), torch.zeros(0, 2)) for r, p in enumerate(rows)]
    assert judged(lost) == [
        ("FAIL", "rank 1 after micro-batch 0, replica group 0, the ranks' shards cover 2 of 4 elements"),
        ("FAIL", "rank 1 after micro-batch 0, the ranks' shards cover 2 of 4 elements")]
    assert {v for v, _ in judged([rows[0]] * 4)} == {"FAIL"}  # row 1 never compared
