"""Recipe knobs (issue 25): the ``sum`` reduction (the recipe normalizes its loss over the
data-parallel ranks, FSDP sums), checked against a reference that agrees with the mean
reduction's, and explicit prefetching; both on both paths, read back from every unit."""

import dataclasses
import os

import pytest
import torch

import parity
from parity.errors import UsageError
from parity.judge.reference import run_reference
from parity.matrix.cell import Cell
from parity.model.registry import get_fixture
from parity.paths import plan_sharding


def _reference(cell: Cell):
    fixture = get_fixture(cell.fixture)
    model = fixture.make(cell.seed)
    ignored = fixture.ignored(model)
    plan = fixture.resolve(model, cell.precision(), ignored)
    return run_reference(cell, fixture, plan, plan_sharding(model, fixture.unit_roots, plan, cell.path, ignored))


@pytest.mark.parametrize("fixture", ["kda", "ignored", "lm"])
@pytest.mark.parametrize("ranks, accumulation", [(2, {}), (2, {"microbatches": 3, "sync": "last"}), (4, {})])
def test_the_summed_reference_is_the_mean_reference_on_power_of_two_ranks(fixture, ranks, accumulation):
    """Two oracles: the reference's ``sum`` emulation (loss / ranks, summed reduction, owner sums)
    agrees bit for bit with its ``mean`` emulation, derived before the knob existed -- dividing
    by a power of two commutes with every rounding -- and derives the same allowances."""
    cells = [Cell(fixture=fixture, path="native", ranks=ranks, reduction=r, **accumulation) for r in ("mean", "sum")]
    mean, summed = (_reference(c) for c in cells)
    for got, want in ((summed.grads, mean.grads), (summed.params, mean.params)):
        assert [sorted(s) for s in got] == [sorted(s) for s in want]
        assert all(torch.equal(g[k], w[k]) for g, w in zip(got, want) for k in w)
    assert summed.grad_scale == mean.grad_scale and summed.grad_norms == mean.grad_norms


def test_a_reduction_is_named_and_runs_on_1d_fsdp_only():
    with pytest.raises(UsageError, match="reduction: unknown value 'max'; valid: mean, sum"):
        Cell(fixture="kda", path="native", reduction="max")
    with pytest.raises(UsageError, match="reduction 'sum' runs on mesh 'fsdp'"):
        Cell(fixture="kda", path="native", ranks=4, mesh="hsdp", reduction="sum")
    assert Cell(fixture="kda", path="native", reduction="sum").id.endswith("/red-sum")
    assert Cell(fixture="kda", path="native").id == Cell(fixture="kda", path="native", reduction="mean").id
    with pytest.raises(UsageError, match="prefetch: unknown value 'all'; valid: none, explicit"):
        Cell(fixture="kda", path="native", prefetch="all")
    with pytest.raises(UsageError, match="reshard_backward: unknown value 'never'; valid: every, last"):
        Cell(fixture="kda", path="native", reshard_backward="never")
    kept = Cell(fixture="kda", path="native", microbatches=3, sync="last", reshard_backward="last")
    assert kept.id.endswith("/rb-last")
    # one micro-batch: its backward is the last, which reshards; the cell does not claim the knob
    assert Cell(fixture="kda", path="native", reshard_backward="last").reshard_backward == "every"
    with pytest.raises(UsageError, match="placement 'dim1' runs on mesh 'fsdp' with weights 'none'"):
        Cell(fixture="kda", path="native", ranks=4, mesh="hsdp", placement="dim1")
    assert Cell(fixture="kda", path="native", ranks=2, placement="dim1").whole_tensors


def test_a_shard_placement_reaches_only_a_path_that_takes_it(monkeypatch):
    """Dimension 1 where it splits evenly over the ranks (FSDP raises on an uneven one); a
    sharding path whose apply() takes no shard_placement_fn runs the cell as a SKIP naming why."""
    from parity.execute import knobs
    from parity.paths import registry

    cell = Cell(fixture="uneven", path="native", ranks=2, placement="dim1")
    assert [knobs.shard_dim(cell, s) for s in ((32, 65), (65, 32), (32,))] == [0, 1, 0]
    assert knobs.unsupported(cell) == ""

    class External:
        name, contract, fallback = "external", "dtype-split", None

        def apply(self, model, report, mesh, reshard_after_forward, ignored):
            raise AssertionError("not called")

    monkeypatch.setattr(registry, "get_path", lambda name: External())
    assert "takes no shard_placement_fn" in knobs.unsupported(cell)


def test_each_knob_is_an_axis_and_a_run_option():
    from parity.cli import KNOB_HELP
    from parity.matrix.cell import KNOB_VALUES, RECIPE_AXES

    assert tuple(KNOB_HELP) == tuple(KNOB_VALUES) and set(KNOB_VALUES) <= set(RECIPE_AXES)
    assert all(getattr(Cell, k) == v[0] for k, v in KNOB_VALUES.items())  # the first value is FSDP's default


def test_a_new_axis_leaves_the_matrices_that_do_not_declare_it_as_they_were():
    """Covering designs span the axes a matrix declares (and those every design always spanned):
    ``default`` keeps its cells, none of them turns a knob."""
    from parity.matrix.load import DESIGN_AXES, load

    assert not {"reduction", "prefetch", "reshard_backward", "placement"} & set(DESIGN_AXES)
    cells = load("default").cells
    assert len(cells) == 444
    assert {(c.reduction, c.prefetch, c.reshard_backward, c.placement) for c in cells} == {
        ("mean", "none", "every", "dim0")}


@pytest.mark.slow
@pytest.mark.xdist_group("knobs")
def test_the_knobs_matrix_passes_with_every_unit_holding_its_knobs(tmp_path):
    result = parity.run(matrix="knobs", out=str(tmp_path / "knobs"), quiet=True)
    assert result.code == 0, open(os.path.join(result.out, "summary.md")).read()[:3000]
    rows = result.cells
    assert set(rows["verdict"]) <= {"PASS", "SKIP", "UNPAIRED"}
    skipped = rows[rows["verdict"] == "SKIP"]
    assert set(skipped[skipped["check"] == "run"]["param_dtype"]) == {"float16"}  # the declared skips only
    # green is earned: on two ranks every unit holding parameters was read back summing, and the
    # gradients (a mean would halve them) passed on both paths, as taken
    policy = rows[(rows["check"] == "unit.policy") & (rows["ranks"].astype(str) == "2")]
    held = policy[policy["detail"].str.contains("'gradient_divide_factor': '1.0'")]
    assert len(held) and set(held["verdict"]) == {"PASS"} and {"legacy", "native"} <= set(held["path_taken"])
    grads = rows[(rows["check"] == "grad") & (rows["ranks"].astype(str) == "2") & (rows["verdict"] == "PASS")]
    assert {"legacy", "native"} <= set(grads["path_taken"]) and set(grads["sync"]) == {"every", "last"}
    # the block units prefetched each other as set, on both paths
    prefetching = policy[policy["detail"].str.contains("'forward_prefetch': 'blocks.1'")]
    assert len(prefetching) and set(prefetching["verdict"]) == {"PASS"}
    assert {"legacy", "native"} <= set(prefetching["path_taken"])
    # units kept gathered across micro-batches on both paths: the forwards after the first gathered
    # nothing that trains (collectives), and the gradients passed
    kept = rows[(rows["check"] == "collectives") & rows["cell"].str.contains("/rb-last")
                & (rows["ranks"].astype(str) == "2")]
    assert len(kept) and set(kept["verdict"]) == {"PASS"} and {"legacy", "native"} <= set(kept["path_taken"])
    # parameters sharded on dimension 1 on both paths, read back from every rank
    placed = rows[(rows["check"] == "placement") & (rows["detail"].str.startswith("expected S(1)"))]
    assert len(placed) and set(placed["verdict"]) == {"PASS"} and {"legacy", "native"} <= set(placed["path_taken"])
    # every managed parameter offloaded to the CPU (FSDP's offload branches), read back, both paths
    offloaded = policy[policy["detail"].str.contains("'offload': 'cpu'")]
    assert len(offloaded) and set(offloaded["verdict"]) == {"PASS"} and {"legacy", "native"} <= set(offloaded["path_taken"])
    # a summed run's checkpoint moved 2 -> 1 ranks and trained on
    moved = rows[(rows["check"] == "checkpoint.moved") & (rows["verdict"] == "PASS")]
    assert {n.split(":")[1] for n in moved["name"]} >= {"entry", "grad", "param"}


def test_input_casting_by_the_model_runs_only_on_a_model_that_casts():
    from parity.execute import knobs

    assert "does not cast its own inputs" in knobs.unsupported(Cell(fixture="kda", path="native", cast_inputs="model"))
    assert knobs.unsupported(Cell(fixture="self_cast", path="native", cast_inputs="model")) == ""
    with pytest.raises(UsageError, match="cast_inputs: unknown value 'both'; valid: fsdp, model"):
        Cell(fixture="self_cast", path="native", cast_inputs="both")


@pytest.mark.slow
@pytest.mark.xdist_group("cast-inputs")
def test_a_model_casting_its_own_inputs_trains_without_fsdps_casts(tmp_path):
    """cast_forward_inputs=False on every unit, both paths: each unit holds the flag and sees
    the input dtypes the reference's units (no cast) give it, and the numbers pass."""
    result = parity.run(matrix="cast-inputs", out=str(tmp_path / "ci"), quiet=True)
    assert result.code == 0, open(os.path.join(result.out, "summary.md")).read()[:3000]
    rows = result.cells
    own = rows["cell"].str.contains("/ci-model")
    policy = rows[own & (rows["check"] == "unit.policy")]
    assert len(policy) and set(policy["verdict"]) == {"PASS"}
    assert policy["detail"].str.contains("'cast_forward_inputs': False").all()
    for check in ("dtype.boundary", "grad", "output"):
        held = rows[own & (rows["check"] == check)]
        assert len(held) and set(held["verdict"]) == {"PASS"} and {"legacy", "native"} <= set(held["path_taken"])


def test_a_unit_kept_out_of_backward_must_be_declared():
    from parity.execute import knobs

    assert "declares no unit" in knobs.unsupported(Cell(fixture="lm", path="native", unshard_in_backward="needed"))
    assert knobs.unsupported(Cell(fixture="untied_lm", path="native", unshard_in_backward="needed")) == ""
    spec = get_fixture("untied_lm")
    fields = {f: getattr(spec, f) for f in spec.__dataclass_fields__}
    from parity.model import Fixture
    from parity.model.spec import validate

    with pytest.raises(UsageError, match="Fixture.backward_free names 'rotary', which is not one of unit_roots"):
        validate(Fixture(**{**fields, "backward_free": ("rotary",)}), "test")


@pytest.mark.slow
@pytest.mark.xdist_group("backward-free")
def test_an_embedding_kept_out_of_backward_gathers_only_in_forward(tmp_path):
    """set_unshard_in_backward(False) on the embedding's unit, both paths: every backward gathers
    at most the other units (collectives), and the numbers pass."""
    result = parity.run(matrix="backward-free", out=str(tmp_path / "bf"), quiet=True)
    assert result.code == 0, open(os.path.join(result.out, "summary.md")).read()[:3000]
    rows = result.cells
    own = rows["cell"].str.contains("/ub-needed") & (rows["ranks"].astype(str) == "2")
    for check in ("collectives", "grad", "output"):
        held = rows[own & (rows["check"] == check)]
        assert len(held) and set(held["verdict"]) == {"PASS"} and {"legacy", "native"} <= set(held["path_taken"])


@pytest.mark.slow
@pytest.mark.xdist_group("backward-free")
def test_an_embedding_no_backward_gathers_is_gathered_again_with_the_others_kept(tmp_path):
    """Units kept gathered across micro-batches (``rb-last``) beside one no backward gathers
    (``ub-needed``): the embedding, resharded by its forward, stays sharded after every backward
    and is gathered again by the next forward -- neither ``reshard.backward`` nor ``collectives``
    may call that a fault (review, twenty-first stop: both did)."""
    matrix = tmp_path / "ubrb.toml"
    matrix.write_text('description = "ub-needed beside rb-last"\nsteps = 2\n[axes]\nfixture = ["untied_lm"]\n'
                      'path = ["native"]\nranks = [2]\nunshard_in_backward = ["needed"]\nreshard_backward = ["last"]\n'
                      'accumulation = ["3:last"]\nreshard = [true]\n')
    result = parity.run(matrix=str(matrix), out=str(tmp_path / "out"), quiet=True)
    assert result.code == 0, open(os.path.join(result.out, "summary.md")).read()[:3000]
    held = result.cells[result.cells["check"].isin(["reshard.backward", "collectives"])]
    assert len(held) and set(held["verdict"]) == {"PASS"}


def test_a_schedule_knob_is_named_and_runs_on_1d_fsdp_only():
    with pytest.raises(UsageError, match="finalize: unknown value 'never'; valid: auto, flagged, manual"):
        Cell(fixture="kda", path="native", finalize="never")
    with pytest.raises(UsageError, match="unshard 'explicit' runs on mesh 'fsdp'"):
        Cell(fixture="kda", path="native", ranks=4, mesh="hsdp", unshard="explicit")
    with pytest.raises(UsageError, match="finalize 'manual' runs on mesh 'fsdp'"):
        Cell(fixture="composed", path="native", ranks=4, mesh="fsdp+tp", finalize="manual")
    assert Cell(fixture="kda", path="native", unshard="explicit", finalize="manual").id.endswith("/un-explicit/fin-manual")


@pytest.mark.slow
@pytest.mark.xdist_group("schedules")
def test_units_gathered_and_backwards_ended_by_the_recipe_train_as_fsdps_hooks_do(tmp_path):
    """unshard(async_op=True) before each forward, evaluation as a phase of its own (reshard off,
    reshard(), the setting restored), set_is_last_backward per micro-batch and manual backward
    finalization, FSDP's per-micro-batch flags set only where they change, on both paths: the numbers pass, every forward gathers each unit once, and the
    evaluation phase left the units as the recipe asked -- earned on two ranks, both paths."""
    result = parity.run(matrix="schedules", out=str(tmp_path / "sched"), quiet=True)
    assert result.code == 0, open(os.path.join(result.out, "summary.md")).read()[:3000]
    rows = result.cells
    two = rows["ranks"].astype(str) == "2"
    # no cell skipped; only checks a cell has nothing for (no no-sync window, token inputs)
    assert set(rows[rows["verdict"] == "SKIP"]["check"]) <= {"dtype.accum", "input_grad"}
    assert set(rows["verdict"]) <= {"PASS", "SKIP"}
    for tag, checks in (("/un-explicit", ("collectives", "eval.reshard", "output", "grad")),
                        ("/fin-flagged", ("collectives", "grad", "param")), ("/fin-manual", ("collectives", "grad", "param")),
                        ("/fl-changed", ("collectives", "grad.accum", "grad.freed", "grad"))):
        for check in checks:
            held = rows[two & rows["cell"].str.contains(tag) & (rows["check"] == check)]
            assert len(held) and {"legacy", "native"} <= set(held["path_taken"]), (tag, check)
    phase = rows[rows["cell"].str.contains("/un-explicit") & (rows["check"] == "eval.reshard")]
    assert phase["detail"].str.contains("sharded after reshard()", regex=False).all()
    # accumulation inside both no-sync windows and per-micro-batch reductions was exercised
    manual = rows[two & rows["cell"].str.contains("/fin-manual") & (rows["check"] == "grad")]
    assert manual["microbatches"].astype(int).max() > 1


def test_the_reduce_scatter_divide_factor_is_the_gradient_divide_factor():
    """torch 2.15 keeps ``set_reduce_scatter_divide_factor`` as a deprecated alias: it sets the
    gradient divide factor the ``sum`` reduction turns (and ``unit.policy`` reads back), so the
    knob covers both spellings."""
    import warnings

    from torch.distributed.fsdp import FSDPModule

    calls = []

    class Unit:
        def set_gradient_divide_factor(self, factor):
            calls.append(factor)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        FSDPModule.set_reduce_scatter_divide_factor(Unit(), 1.0)
    assert calls == [1.0]


def test_offloading_reaches_only_a_path_that_takes_it(monkeypatch):
    from parity.execute import knobs
    from parity.paths import registry

    cell = Cell(fixture="kda", path="native", ranks=2, offload="cpu")
    assert knobs.unsupported(cell) == "" and set(knobs.sharding_options(cell)) == {"offload_policy"}
    assert not knobs.sharding_options(Cell(fixture="kda", path="native", ranks=2))

    class External:
        name, contract, fallback = "external", "dtype-split", None

        def apply(self, model, report, mesh, reshard_after_forward, ignored, *, shard_placement_fn=None):
            raise AssertionError("not called")

    monkeypatch.setattr(registry, "get_path", lambda name: External())
    assert "offload 'cpu': path 'native' takes no offload_policy" in knobs.unsupported(cell)
    with pytest.raises(UsageError, match="offload 'cpu' runs on mesh 'fsdp'"):
        Cell(fixture="kda", path="native", ranks=4, mesh="hsdp", offload="cpu")


def test_a_step_with_no_unit_to_read_is_no_evidence():
    """``unshard`` and ``reshard.backward`` read each unit's state: a path that reported no unit
    fails naming the absence, a cell whose units no backward gathers is a SKIP saying why --
    neither is a PASS over nothing."""
    from parity.execute.observation import Observation
    from parity.judge import unshard
    from parity.judge.record import Verdict
    from parity.paths.base import ShardReport

    base = {"cell": "c", "fixture": "kda", "path": "native"}
    explicit = Cell(fixture="kda", path="native", unshard="explicit")
    empty = Observation(rank=0, report=ShardReport(requested="native", taken="native"))
    assert {r.verdict for r in unshard.check(explicit, empty, base)} == {Verdict.FAIL}
    kept = Cell(fixture="kda", path="native", microbatches=2, sync="last", reshard_backward="last")
    rows = unshard.reshard_check(kept, empty, base)
    assert {r.verdict for r in rows} == {Verdict.FAIL} and len(rows) == kept.steps
    assert "no unit holding parameters reported" in rows[0].detail
    model = get_fixture("kda").make(0)
    plan = get_fixture("kda").resolve(model, kept.precision(), ())
    report = plan_sharding(model, get_fixture("kda").unit_roots, plan, "native", ())
    frozen = Observation(rank=0, report=report, plan=dataclasses.replace(
        plan, tensors=tuple(dataclasses.replace(t, requires_grad=False) for t in plan.tensors), _by_fqn={}))
    rows = unshard.reshard_check(kept, frozen, base)
    assert {r.verdict for r in rows} == {Verdict.SKIP} and "gathered in backward" in rows[0].detail


def test_a_summed_float16_recipe_moves_its_checkpoint_onto_one_rank(run_matrix):
    """The one-rank side of a moved checkpoint divided a summed recipe's loss by its own data
    world (1) and halved the reduced gradients after, where every rank of the two-rank layout
    halves its float16 loss before the backward: ``checkpoint.moved`` failed on both paths
    (ratio ~200), found once the covering design ran the pair (review, twenty-second stop)."""
    from parity.model.recipe import folded_divisors

    assert folded_divisors("sum", 1, 2) == (2, 1) and folded_divisors("mean", 1, 2) == (1, 2)
    cells = [Cell(fixture="kda", path=p, ranks=2, param_dtype="float16", move=m, reduction="sum")
             for p in ("legacy", "native") for m in ("shrink", "grow")]
    code, records = run_matrix(cells, timeout=120)
    bad = [(r["cell"], r["check"], r["name"]) for r in records if r["verdict"] not in ("PASS", "SKIP")]
    assert code == 0 and not bad, bad[:5]
    assert sum(r["check"] == "checkpoint.moved" for r in records) > 20
