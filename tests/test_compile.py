"""Compiled blocks (issue 21): ``compile`` compiles every block before sharding, on both paths;
the reference compiles the same blocks and breaks them at the same units; ``compile.graphs``
bounds every forward's graphs by the reference's."""

import os

import pytest
from torch import nn

import parity
from parity.errors import UsageError
from parity.execute import knobs
from parity.judge.reference import run_reference
from parity.matrix.cell import Cell
from parity.model.boundaries import hookable_modules
from parity.model.compiling import compile_blocks, compiler_missing
from parity.model.registry import get_fixture
from parity.paths import plan_sharding


def test_compiling_is_named_and_runs_where_its_reference_can_follow():
    assert Cell(fixture="kda", path="native", compile="aot_eager").id.endswith("/cmp-aot_eager")
    assert Cell(fixture="kda", path="native").id == Cell(fixture="kda", path="native", compile="none").id
    with pytest.raises(UsageError, match="compile: unknown value 'jit'; valid: none, aot_eager, inductor"):
        Cell(fixture="kda", path="native", compile="jit")
    with pytest.raises(UsageError, match="compile 'aot_eager' runs on mesh 'fsdp'"):
        Cell(fixture="kda", path="native", ranks=4, mesh="hsdp", compile="aot_eager")
    with pytest.raises(UsageError, match="checkpointing .none."):
        Cell(fixture="kda", path="native", checkpointing="full", compile="aot_eager")


def test_inductor_without_a_cpp_compiler_is_a_skip_naming_it(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    reason = knobs.unsupported(Cell(fixture="kda", path="native", compile="inductor"))
    assert reason.startswith("compile 'inductor' needs a C++ compiler")
    assert compiler_missing("aot_eager") == "" and knobs.unsupported(Cell(fixture="kda", path="native",
                                                                           compile="aot_eager")) == ""


def test_probes_leave_compiled_blocks_and_their_modules_alone():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    compile_blocks(model, ("1",), "aot_eager")
    assert [n for n, _ in hookable_modules(model)] == ["", "0"]


def _graph_runs(path: str) -> dict:
    cell = Cell(fixture="kda", path=path, compile="aot_eager", steps=1)
    fixture = get_fixture(cell.fixture)
    model = fixture.make(cell.seed)
    plan = fixture.resolve(model, cell.precision(), fixture.ignored(model))
    return run_reference(cell, fixture, plan, plan_sharding(model, fixture.unit_roots, plan, path, set())).graph_runs


def test_the_reference_breaks_each_paths_blocks_at_its_own_units():
    """Two oracles for the graphs: the reference, without FSDP, splits a block where the path
    nests a unit (legacy's FP32 holder unit: before, inside and after it), where native's single
    unit per block leaves one graph; the sharded run's counts are bounded by these."""
    legacy, native = _graph_runs("legacy"), _graph_runs("native")
    blocks = len(get_fixture("kda").blocks)
    assert native == {(0, "mb0/forward"): blocks}
    assert legacy[(0, "mb0/forward")] > native[(0, "mb0/forward")]


@pytest.mark.slow
@pytest.mark.xdist_group("compile")
def test_compiled_blocks_train_as_their_reference_on_both_paths(tmp_path):
    result = parity.run(matrix="smoke", out=str(tmp_path / "compiled"), quiet=True, compile="aot_eager",
                        filter="fixture in ('kda', 'mixed_storage') and ranks == 2")
    assert result.code == 0, open(os.path.join(result.out, "summary.md")).read()[:3000]
    rows = result.cells
    graphs = rows[rows["check"] == "compile.graphs"]
    assert len(graphs) == 8 and set(graphs["verdict"]) == {"PASS"}
    # green is earned: the gradients of both paths were judged, the two paths compared, and the
    # modules inside the blocks were read from the all-gathers, not left unread
    grads = rows[(rows["check"] == "grad") & (rows["verdict"] == "PASS")]
    assert {"legacy", "native"} <= set(grads["path_taken"])
    assert len(rows[(rows["path"] == "legacy~native") & (rows["verdict"] == "PASS")])
    compute = rows[rows["check"] == "dtype.compute"]
    inside = compute[compute["detail"].str.contains("inside a compiled block")]
    assert len(inside) and set(inside["verdict"]) == {"PASS"}
