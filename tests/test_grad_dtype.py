"""The gradient dtype in the precision plan (issue 25): a parameter's ``grad_dtype`` (torch >=
2.15) is planned, emulated by the reference and checked against the gradient the optimizer
steps with, on both paths."""

import os

import pytest
import torch

import parity
from parity.cli import main
from parity.errors import UsageError
from parity.execute import knobs
from parity.matrix.cell import Cell
from parity.model import Fixture
from parity.model.plan import PrecisionConfig
from parity.model.registry import get_fixture
from parity.model.spec import validate
from parity.paths import plan_sharding


def _plan(name: str, reduce_dtype=torch.float32):
    fixture = get_fixture(name)
    model = fixture.make(0)
    return model, fixture.resolve(model, PrecisionConfig(reduce_dtype=reduce_dtype))


@pytest.mark.parametrize("reduce_dtype", [torch.float32, None])
def test_bf16_weights_keeping_fp32_gradients_are_planned_from_the_parameters(reduce_dtype):
    """The plan reads the ``grad_dtype`` the recipe set on the built parameters; a ``reduce_dtype``
    of None reduces in it (FSDP 2.15 follows ``grad_dtype``), not in the BF16 storage."""
    model, plan = _plan("bf16_grads", reduce_dtype)
    assert all(p.grad_dtype == torch.float32 and p.dtype == torch.bfloat16 for p in model.parameters())
    assert {(t.storage, t.compute, t.reduce, t.grad) for t in plan.params} == {
        (torch.bfloat16, torch.bfloat16, torch.float32, torch.float32)}
    _, kda = _plan("kda", reduce_dtype)
    assert all(t.grad == t.storage for t in kda.params if t.requires_grad)  # no grad_dtype: storage


def test_native_leaves_a_none_reduce_dtype_to_the_gradient_dtypes():
    fixture = get_fixture("bf16_grads")
    model = fixture.make(0)
    plan = fixture.resolve(model, PrecisionConfig(reduce_dtype=None))
    report = plan_sharding(model, fixture.unit_roots, plan, "native", set())
    assert report.taken == "native" and {u.reduce_dtype for u in report.units} == {None}


def test_parity_plan_shows_the_gradient_dtype(capsys):
    main(["plan", "--fixture", "bf16_grads"])
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("fqn"))
    assert header.split()[:6] == ["fqn", "kind", "storage", "compute", "reduce", "grad"]


def test_a_gradient_dtype_pattern_must_select_a_parameter():
    spec = get_fixture("bf16_grads")
    bad = Fixture(**{**{f: getattr(spec, f) for f in spec.__dataclass_fields__}, "grad_dtypes": {"nope": "float32"}})
    with pytest.raises(UsageError, match="Fixture.grad_dtypes names 'nope'"):
        validate(bad, "test")


def test_explicit_prefetch_without_two_block_units_is_not_claimed():
    """A model with fewer than two block units has nothing to prefetch: its cell is a SKIP with
    the reason, never a PASS that prefetched nothing."""
    source = os.path.join(os.path.dirname(__file__), "plugins", "argmax_router.py") + ":parity_model"
    assert "declares 0" in knobs.unsupported(Cell(fixture="argmax_router", path="native", source=source,
                                                  prefetch="explicit"))
    assert knobs.unsupported(Cell(fixture="argmax_router", path="native", source=source)) == ""
    assert knobs.unsupported(Cell(fixture="kda", path="native", prefetch="explicit")) == ""


@pytest.mark.slow
@pytest.mark.xdist_group("grad-dtype")
def test_the_grad_dtype_matrix_trains_fp32_gradients_and_finds_the_resume_narrowing(tmp_path):
    """On both paths every gradient the optimizer steps with is FP32 (``dtype.grad``) and matches
    the reference's; the only findings are torch's: resuming narrows SGD's FP32 momentum to the
    BF16 parameter's dtype (``Optimizer.load_state_dict``), named on each lifecycle cell."""
    result = parity.run(matrix="grad-dtype", out=str(tmp_path / "gd"), quiet=True)
    rows = result.cells
    bad = rows[~rows["verdict"].isin(["PASS", "SKIP", "UNPAIRED"])]
    located = bad[bad["check"] == "stage"]  # where each failing cell went wrong first: the checkpoint
    bad = bad[bad["check"] != "stage"]
    assert result.code == 1 and set(bad["check"]) == {"checkpoint.loaded", "checkpoint.same", "checkpoint.cross",
                                                      "checkpoint.moved"}
    # the save held; the load narrowed the momentum (each loaded momentum_buffer entry is BF16)
    assert set(located["name"]) == {"checkpoint-load"} and set(located["cell"]) == set(bad["cell"])
    narrowed = bad[bad["check"] == "checkpoint.loaded"]
    assert set(narrowed["name"].str.endswith("/momentum_buffer")) == {True}
    assert set(narrowed["detail"].str.contains("written float32 .*, loaded bfloat16", regex=True)) == {True}
    named = bad[bad["name"].str.endswith(".momentum_buffer:dtype")]
    assert set(named["detail"].str.contains("expected float32, observed bfloat16")) == {True}
    own = rows[rows["path"].isin(["legacy", "native"])]  # not the cross-path pairs
    lifecycle = own[(own["microbatches"].astype(str) == "1") & (own["checkpointing"] == "none")]
    assert set(bad["cell"]) == set(lifecycle["cell"]) and len(set(named["cell"])) == len(set(bad["cell"]))
    for check in ("dtype.grad", "grad", "param", "dtype.reduce"):
        held = rows[rows["check"] == check]
        assert len(held) and set(held["verdict"]) == {"PASS"} and {"legacy", "native"} <= set(held["path_taken"])
    assert set(rows[rows["check"] == "dtype.grad"]["observed"].astype(float)) == {0.0}
