"""Every contract check fails on a deliberate fault (real gloo ranks)."""

import pytest
import torch

from parity_fixtures import FIXTURES
from parity.matrix.cell import Cell
from parity.errors import UsageError
from parity.paths import plan_sharding
from parity.model.plan import PrecisionConfig, resolve_plan

# fault -> (fixture, path, extra axes, the contract check that must FAIL)
CONTRACT_FAULTS = {
    "drop_override": ("kda", "native", {}, "dtype.compute"),
    "bf16_reduce": ("kda", "native", {"microbatches": 3, "sync": "last"}, "dtype.reduce"),
    "cast_storage": ("kda", "native", {}, "dtype.storage"),
    "cast_child_inputs": ("kda", "legacy", {}, "dtype.boundary"),
    "drop_output_dtype": ("kda", "native", {"output_dtype": "float32"}, "dtype.output"),
    "rename_param": ("kda", "native", {}, "names"),
    "replace_param": ("kda", "native", {}, "identity"),
    "lose_buffer_marker": ("kda", "native", {}, "marker"),
    "swap_optimizer_state": ("frozen", "native", {}, "checkpoint.same"),
    "misfile_optimizer_state": ("frozen", "legacy", {}, "optim.state"),
}


@pytest.mark.slow
@pytest.mark.xdist_group("contracts")
def test_every_contract_check_fails_on_its_fault(run_matrix):
    cells = [Cell(fixture=fx, path=p, ranks=2, faults=(f,), **axes) for f, (fx, p, axes, _) in CONTRACT_FAULTS.items()]
    cells.append(Cell(fixture="kda", path="legacy", ranks=2, microbatches=3, sync="last", faults=("bf16_reduce",)))
    code, records = run_matrix(cells)
    assert code == 1
    for fault, (_, _, _, check) in CONTRACT_FAULTS.items():
        failing = {r["check"] for r in records if r["cell"].endswith(f"fault-{fault}") and r["verdict"] == "FAIL"}
        assert check in failing, (fault, failing)
    accum = {r["check"] for r in records if "legacy" in r["cell"] and "bf16_reduce" in r["cell"] and r["verdict"] == "FAIL"}
    assert "dtype.accum" in accum
    # the applied unit policies are checked against the plan, independently of the report
    for fault in ("cast_child_inputs", "drop_output_dtype", "bf16_reduce"):
        failing = {r["check"] for r in records if r["cell"].endswith(f"fault-{fault}") and r["verdict"] == "FAIL"}
        assert "unit.policy" in failing, (fault, failing)


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
