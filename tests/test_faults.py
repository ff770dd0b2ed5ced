"""Generated from the fault registry: each fault is flagged by exactly the checks it declares."""

import fnmatch
import pathlib
import re
from dataclasses import replace

import pytest

from parity.faults import ACTS_ON, FAULTS
from parity.matrix.cell import Cell

#: The hang is judged by silence, with a timeout measured on this machine (test_integration).
RUN_HERE = [name for name in FAULTS if name != "hang"]
#: Two halves of the registry, each run once per session in its own xdist group, so the two
#: test workers share the fault cells instead of one running all of them.
HALVES = {"a": RUN_HERE[0::2], "b": RUN_HERE[1::2]}


def _failing(records, name: str, cell: dict | None = None) -> set[str]:
    """The checks that flagged the fault's cell (``stage`` says where the others failed first:
    it flags nothing of its own)."""
    target = Cell(**(cell or FAULTS[name].cell), faults=(name,)).id
    return {r["check"] for r in records
            if r["cell"] == target and r["verdict"] in ("FAIL", "ERROR", "TIMEOUT", "INCONCLUSIVE")
            and r["check"] != "stage"}


#: Faults also run on a second configuration, for a test of what only that one shows (below).
ALSO = {"backward_gather_stale": dict(fixture="composed", path="native", ranks=4, mesh="fsdp+tp", microbatches=2),
        "owner_reduces_to_rank0": dict(fixture="ignored", path="native", ranks=2, move="grow"),
        "load_splits_gather_input": dict(fixture="kda", path="native", ranks=2, move="shrink"),
        "load_keeps_zero_grads": dict(fixture="kda", path="native", ranks=2, move="grow"),
        "scheduler_load_ignored": dict(fixture="kda", path="native", ranks=2, move="shrink", schedule="decay")}


def _run_faults(names: list[str], out: str) -> list[dict]:
    """Each fault's cell, and for a fault only one configuration reveals, the cell with that
    configuration turned off (which must flag nothing)."""
    from parity.runner import RunOptions, run_cells
    from tests.conftest import read_records

    cells = [Cell(**FAULTS[name].cell, faults=(name,)) for name in names]
    cells += [Cell(**{**FAULTS[name].cell, **FAULTS[name].quiet}, faults=(name,)) for name in names
              if FAULTS[name].quiet]
    cells += [Cell(**ALSO[name], faults=(name,)) for name in names if name in ALSO]
    code = run_cells(cells, RunOptions(out_dir=out, timeout=120, progress=False))
    assert code == 1
    return read_records(out)


# session scope: a module-scoped fixture is torn down (and its cells rerun) whenever xdist hands
# this worker a test of another module in between
@pytest.fixture(scope="session")
def faults_a(tmp_path_factory):
    return _run_faults(HALVES["a"], str(tmp_path_factory.mktemp("faults") / "a"))


@pytest.fixture(scope="session")
def faults_b(tmp_path_factory):
    return _run_faults(HALVES["b"], str(tmp_path_factory.mktemp("faults") / "b"))


def _records_of(request, name: str) -> list[dict]:
    return request.getfixturevalue("faults_a" if name in HALVES["a"] else "faults_b")


def _check_flagged(records, name: str) -> None:
    flagged, declared = _failing(records, name), set(FAULTS[name].flags)
    target = Cell(**FAULTS[name].cell, faults=(name,)).id
    unexpected = [f"{r['check']} {r['name']} {r['verdict']}: {r['detail'][:300]}" for r in records
                  if r["cell"] == target and r["check"] in flagged - declared and r["verdict"] != "PASS"]
    assert flagged == declared, f"{FAULTS[name].where}; unexpected: {unexpected[:4]}"


def _check_quiet(records, name: str) -> None:
    fault = FAULTS[name]
    quiet = {**fault.cell, **fault.quiet}
    assert any(r["cell"] == Cell(**quiet, faults=(name,)).id for r in records)
    assert _failing(records, name, quiet) == set(), f"{name} flagged with {dict(fault.quiet)}"


@pytest.mark.slow
@pytest.mark.xdist_group("faults-a")
@pytest.mark.parametrize("name", HALVES["a"])
def test_fault_is_flagged_by_exactly_its_declared_checks(faults_a, name):
    _check_flagged(faults_a, name)


@pytest.mark.slow
@pytest.mark.xdist_group("faults-b")
@pytest.mark.parametrize("name", HALVES["b"])
def test_fault_of_the_second_half_is_flagged_by_exactly_its_declared_checks(faults_b, name):
    _check_flagged(faults_b, name)


@pytest.mark.slow
@pytest.mark.xdist_group("faults-a")
@pytest.mark.parametrize("name", [n for n in HALVES["a"] if FAULTS[n].quiet])
def test_a_configuration_fault_is_silent_without_its_configuration(faults_a, name):
    _check_quiet(faults_a, name)


@pytest.mark.slow
@pytest.mark.xdist_group("faults-b")
@pytest.mark.parametrize("name", [n for n in HALVES["b"] if FAULTS[n].quiet])
def test_a_configuration_fault_of_the_second_half_is_silent_without_it(faults_b, name):
    _check_quiet(faults_b, name)


#: Faults the stage record cannot place where they act, and why (the rest: :data:`FAULTS`' stages).
UNLOCALIZED = {
    "meta_init_misplaced_shard": "acts while the full state dict is loaded after meta init (setup), but no setup "
                                 "check reads parameter values: step 0's gather (the values against the initial "
                                 "model) is the first to differ",
}


def _located_stage(records, name: str) -> list[str]:
    target = Cell(**FAULTS[name].cell, faults=(name,)).id
    return [r["name"] for r in records if r["cell"] == target and r["check"] == "stage"]


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xdist_group("faults-a" if n in HALVES["a"] else "faults-b"))
    for n in RUN_HERE if n not in UNLOCALIZED])
def test_a_fault_is_located_at_the_stage_it_acts_in(request, name):
    """Top-1: the ``stage`` record names the stage the fault declares (none for a fault that stops
    the cell: no stage of a run that did not finish is judged)."""
    want = [] if FAULTS[name].stage == "run" else [FAULTS[name].stage]
    assert _located_stage(_records_of(request, name), name) == want, FAULTS[name].where


def test_localization_accuracy_over_the_registry():
    """What README and docs/usage.md state: of the faults that let a cell finish, how many the
    ``stage`` record places where they act (each one held to it above, top-1)."""
    assert set(UNLOCALIZED) <= set(FAULTS)
    finishing = [n for n, f in FAULTS.items() if f.stage != "run"]
    located = [n for n in finishing if n not in UNLOCALIZED]
    assert len(located) / len(finishing) >= 0.95
    stopping = len(FAULTS) - len(finishing)
    root = pathlib.Path(__file__).resolve().parents[1]
    for doc in ("README.md", "docs/usage.md"):
        text = " ".join((root / doc).read_text().split())
        assert f"{len(located)} of the {len(finishing)} faults that let a cell finish" in text, doc
        assert f"the {stopping} that stop a cell" in text, doc


#: Faults confined to some tensors whose ``stage`` record names none of them, and why.
TENSOR_UNNAMED = {
    "tp_shards_swapped_on_load": "its first divergence is the load's own all-gather (a collective, no one tensor's); "
                                 "the load's checkpoint.loaded records name the weight next",
}


def _located_tensor(records, name: str) -> list[str]:
    target = Cell(**FAULTS[name].cell, faults=(name,)).id
    return [m.group(1) if (m := re.search(r"; tensor (\S+);", r["detail"])) else ""
            for r in records if r["cell"] == target and r["check"] == "stage"]


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xdist_group("faults-a" if n in HALVES["a"] else "faults-b"))
    for n in ACTS_ON if n not in TENSOR_UNNAMED])
def test_a_fault_confined_to_some_tensors_is_located_at_one_of_them(request, name):
    """Top-1 by tensor: the ``stage`` record names a tensor the fault acts on (:data:`ACTS_ON`)."""
    (tensor,) = _located_tensor(_records_of(request, name), name)
    assert any(fnmatch.fnmatchcase(tensor, p) for p in ACTS_ON[name]), (tensor, ACTS_ON[name])


@pytest.mark.slow
@pytest.mark.xdist_group("faults-a" if "tp_shards_swapped_on_load" in HALVES["a"] else "faults-b")
def test_a_tensor_the_stage_record_cannot_name_is_named_by_the_stage_s_next_records(request):
    name = "tp_shards_swapped_on_load"
    target = Cell(**FAULTS[name].cell, faults=(name,)).id
    rows = [r for r in _records_of(request, name) if r["cell"] == target]
    assert _located_tensor(rows, name) == [""] and [r["name"] for r in rows if r["check"] == "stage"] == \
        ["checkpoint-load"]
    loaded = {r["name"].split("/")[1] for r in rows if r["check"] == "checkpoint.loaded" and r["verdict"] == "FAIL"}
    assert loaded and all(any(fnmatch.fnmatchcase(t, p) for p in ACTS_ON[name]) for t in loaded), loaded


def test_tensor_localization_over_the_registry():
    """What README and docs/usage.md state: of the faults confined to some tensors, how many the
    ``stage`` record names one of (each held to it above)."""
    assert set(TENSOR_UNNAMED) <= set(ACTS_ON) <= set(FAULTS)
    named = len(ACTS_ON) - len(TENSOR_UNNAMED)
    root = pathlib.Path(__file__).resolve().parents[1]
    for doc in ("README.md", "docs/usage.md"):
        text = " ".join((root / doc).read_text().split())
        assert f"{named} of the {len(ACTS_ON)} faults confined to some tensors" in text, doc


def test_every_check_kind_has_a_fault():
    flagged = set().union(*(f.flags for f in FAULTS.values()))
    assert {"output", "input_grad", "grad", "grad_norm", "param", "unit.policy", "dtype.storage", "dtype.compute",
            "dtype.reduce", "dtype.accum", "dtype.boundary", "dtype.output", "names", "identity", "marker",
            "optim.state", "optim.moments", "lr", "checkpoint.same", "checkpoint.cross", "run", "buffer", "trajectory",
            "divergence",
            "dtype.tp_reduce", "ownership", "quant.gather", "quant.refresh", "quant.scale", "quant.blocks",
            "quant.values", "plan", "ranks", "clip", "eval", "eval.reshard", "state_dict", "collectives",
            "checkpoint.moved", "gathered", "placement", "dtype.grad", "grad.accum", "grad.clipped",
            "grad.shard", "checkpoint.saved", "checkpoint.loaded", "compile.graphs", "recompute", "unshard", "reshard.backward", "finalize.flagged",
            "grad.freed"} <= flagged


def test_no_fault_name_appears_in_production_modules():
    root = pathlib.Path(__file__).resolve().parents[1] / "parity"
    for path in root.rglob("*.py"):
        if "faults" in path.parts:
            continue
        text = path.read_text()
        named = [n for n in FAULTS if f'"{n}"' in text or f"'{n}'" in text]
        assert not named, (path, named)


#: Faults confined to one module, and the module the traced re-run must name first (forward order).
LOCATED = {"holder_dt_bias_bf16": "blocks.1.holder",
           # DTensor reduces FP32 Partial activations in BF16: block 1's strict-FP32 rowwise layer
           # (block 0's MLP computes in BF16, where BF16 is the right reduction)
           "tp_partial_reduce_bf16": "blocks.1.mlp.down",
           # rank 1 alone computes with a wrong weight: found on rank 1 (rank 0 holds nothing over)
           "rank1_gather_corrupt": "blocks.1.q_proj"}
#: The rank whose trace shows the located module first, where it is not rank 0.
LOCATED_ON = {"rank1_gather_corrupt": 1}


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xdist_group("faults-a" if n in HALVES["a"] else "faults-b")) for n in LOCATED])
def test_a_fault_confined_to_one_module_is_located_there(request, name):
    fault_records = _records_of(request, name)
    rows = [r for r in fault_records if r["cell"].endswith(f"fault-{name}") and r["check"] == "divergence"]
    assert [(r["name"], r["verdict"]) for r in rows] == [(LOCATED[name], "FAIL")]
    assert rows[0]["detail"].startswith(f"first in forward order: {LOCATED[name]} (rank {LOCATED_ON.get(name, 0)}, ")


@pytest.mark.slow
@pytest.mark.xdist_group("faults-a" if "backward_gather_stale" in HALVES["a"] else "faults-b")
def test_tp_partial_reads_every_step_and_microbatch(request):
    """A backward all-gather that hands compute step 0's weights again is wrong from step 1 on, in
    backward only: on FSDP x TP, ``tp.partial`` fails each colwise layer's partial input gradient at
    step 1 (every micro-batch read), and passes step 0 and every rowwise layer's partial output."""
    cell = Cell(**ALSO["backward_gather_stale"], faults=("backward_gather_stale",)).id
    everything = [r for r in _records_of(request, "backward_gather_stale") if r["cell"] == cell]
    rows = [r for r in everything if r["check"] == "tp.partial"]
    failed = {(r["step"], r["name"]) for r in rows if r["verdict"] == "FAIL"}
    backward = {r["name"] for r in rows if r["name"].endswith("@backward")}
    assert backward and failed == {("1", name) for name in backward}, rows
    assert {r["step"] for r in rows} == {"0", "1"}
    assert all(r["verdict"] == "PASS" for r in rows if (r["step"], r["name"]) not in failed)
    # the gather handed over stale TP shards too: each judged against its own piece of the master
    stale = {r["name"] for r in everything if r["check"] == "gathered" and r["verdict"] == "FAIL" and r["step"] == "1"}
    assert {"blocks.0.mlp.up.weight", "blocks.1.mlp.down.weight"} <= stale
    # and each rank's TP piece of their gradients, as the reduce-scatter takes it, is off at step 1
    reduced = {r["name"] for r in everything
               if r["check"] == "grad.accum" and r["verdict"] == "FAIL" and r["step"] == "1"}
    assert {"blocks.0.mlp.up.weight", "blocks.1.mlp.down.weight"} <= reduced
    assert [(r["name"], r["step"]) for r in everything if r["check"] == "stage"] == [("gather", "1")]


@pytest.mark.slow
@pytest.mark.xdist_group("faults-a" if "moments_held_bf16" in HALVES["a"] else "faults-b")
def test_a_moment_kept_wrong_is_found_at_the_step_that_kept_it(request):
    """Moments held at BF16 precision: each update is right, the state kept is not. ``param``
    first fails a step later; ``optim.moments`` names step 0, and so does the ``stage`` record."""
    cell = Cell(**FAULTS["moments_held_bf16"].cell, faults=("moments_held_bf16",)).id
    rows = [r for r in _records_of(request, "moments_held_bf16") if r["cell"] == cell and r["verdict"] == "FAIL"]
    assert {r["step"] for r in rows if r["check"] == "param"} == {"1"}
    assert {r["step"] for r in rows if r["check"] == "optim.moments"} == {"0", "1"}
    assert [(r["name"], r["step"]) for r in rows if r["check"] == "stage"] == [("optimizer", "0")]


@pytest.mark.slow
@pytest.mark.xdist_group("faults-a" if "crash_cross_load" in HALVES["a"] else "faults-b")
def test_a_rank_lost_in_the_checkpoint_lifecycle_leaves_the_training_judged(request):
    """Each rank sends its training evidence before the lifecycle: a rank that dies loading the
    checkpoint into the other path costs the lifecycle's records, not the cell's training ones, and
    the ERROR names the rank and what it reported last."""
    cell = Cell(**FAULTS["crash_cross_load"].cell, faults=("crash_cross_load",)).id
    rows = [r for r in _records_of(request, "crash_cross_load") if r["cell"] == cell]
    (lost,) = [r for r in rows if r["verdict"] == "ERROR"]
    assert lost["check"] == "checkpoint.same"
    assert "rank 1 died with exit code 17 after it reported 'checkpoint lifecycle: loading into legacy'" in lost["detail"]
    judged = {r["check"] for r in rows if r["verdict"] == "PASS"}
    assert {"output", "input_grad", "grad", "param", "grad_norm", "optim.state", "marker"} <= judged


@pytest.mark.slow
@pytest.mark.xdist_group("faults-a" if "owner_reduces_to_rank0" in HALVES["a"] else "faults-b")
def test_a_moved_checkpoint_holds_every_loading_rank_to_rank_0(request):
    """After a grown checkpoint is loaded, rank 1 steps its ignored parameters with an unreduced
    gradient while rank 0's copies, which the entries and the step are judged by, stay right:
    only each target's ``ranks`` record of ``checkpoint.moved`` sees rank 1 part."""
    cell = Cell(**ALSO["owner_reduces_to_rank0"], faults=("owner_reduces_to_rank0",)).id
    rows = [r for r in _records_of(request, "owner_reduces_to_rank0") if r["cell"] == cell and r["check"] == "checkpoint.moved"]
    failed = [(r["name"], r["detail"].startswith("differ from rank 0's: rank 1: resumed ")) for r in rows
              if r["verdict"] != "PASS"]
    assert failed == [("native:ranks", True)], failed
    assert len(rows) > 100  # every entry and the step were judged, and held


@pytest.mark.slow
@pytest.mark.parametrize("name, kind", [
    pytest.param(n, k, marks=pytest.mark.xdist_group("faults-a" if n in HALVES["a"] else "faults-b"))
    for n, k in (("load_splits_gather_input", "regather"), ("load_keeps_zero_grads", "grads"))])
def test_a_moved_checkpoint_is_held_to_the_same_load_rules(request, name, kind):
    """A checkpoint moved to another layout gets the same-layout loads' ``regather`` and
    ``grads`` records: the fault that fails them there fails them in ``checkpoint.moved`` too,
    for every path loaded into, and nothing else of it."""
    cell = Cell(**ALSO[name], faults=(name,))
    ids = {cell.id, replace(cell, path="legacy").id}  # records of the other path loaded into are filed under it
    rows = [r for r in _records_of(request, name) if r["cell"] in ids and r["check"] == "checkpoint.moved"]
    failed = {r["name"].split(":")[0] for r in rows if r["verdict"] != "PASS" and f":{kind}" in r["name"]}
    assert failed == {"native", "legacy"}, failed
    others = [r["name"] for r in rows if r["verdict"] not in ("PASS", "SKIP") and f":{kind}" not in r["name"]]
    assert not others, others[:4]



@pytest.mark.slow
@pytest.mark.xdist_group("faults-a" if "scheduler_load_ignored" in HALVES["a"] else "faults-b")
def test_a_moved_checkpoint_s_scheduler_is_held_to_the_straight_run(request):
    """A scheduler the load leaves fresh, on a checkpoint moved 2 -> 1 ranks: for both paths loaded
    into, ``checkpoint.moved`` fails exactly the scheduler's entries (as the files hold them) and the
    rate the resumed step left for the next one; the step itself, which the optimizer's param
    groups carried across, passes."""
    name = "scheduler_load_ignored"
    cell = Cell(**ALSO[name], faults=(name,))
    ids = {cell.id, replace(cell, path="legacy").id}
    rows = [r for r in _records_of(request, name) if r["cell"] in ids and r["check"] == "checkpoint.moved"]
    failed = {r["name"] for r in rows if r["verdict"] not in ("PASS", "SKIP")}
    for path in ("native", "legacy"):
        assert f"{path}:lr:rates" in failed and f"{path}:entry:scheduler/last_epoch" in failed, failed
    assert all(n.endswith(":lr:rates") or ":entry:scheduler/" in n for n in failed), failed
    assert any(r["name"] == "native:param:" + "blocks.0.q_proj.weight" and r["verdict"] == "PASS" for r in rows)
