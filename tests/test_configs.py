"""The configurations real recipes use (matrix ``configs``) and real model classes (``models``)."""

import json
import subprocess
import sys

import pytest

from parity.matrix import load
from parity.errors import UsageError
from parity.matrix.cell import Cell
from parity.model.plan import PrecisionConfig, resolve_plan
from parity.model.registry import get_fixture


def test_configs_matrix_covers_every_configuration():
    m = load("configs")
    cells = m.cells
    assert {"uneven", "routed", "staged", "residual_fp32"} <= {c.fixture for c in cells}
    for axis, value in (("init", "meta"), ("checkpointing", "outer"), ("param_dtype", "float16"),
                        ("optimizer", "sgd"), ("reduce_dtype", "natural"), ("clip", 0.01),
                        ("eval", "between-steps"), ("eval", "between-microbatches"), ("steps", 4)):
        assert any(getattr(c, axis) == value for c in cells), axis
    assert {c.checkpointing for c in cells if c.fixture == "residual_fp32"} >= {"outer"}
    skipped = [c for c in cells if m.skip_reason(c)]
    assert skipped and all(c.param_dtype == "float16" and c.fixture in ("frozen", "ignored") for c in skipped)


def test_new_axes_keep_old_cell_ids_and_tag_new_values():
    assert Cell(fixture="kda", path="native").id == "kda/native/r1/mb1-every/ac-none/reshard-on/out-natural/s0"
    cell = Cell(fixture="kda", path="native", param_dtype="float16", optimizer="sgd", init="meta", reduce_dtype="natural",
                clip=0.01, eval="between-steps")
    assert cell.id.endswith("/s0/pd-float16/rd-natural/opt-sgd/init-meta/clip-0.01/eval-between-steps")
    # one micro-batch has nothing to evaluate between: the same cell as no evaluation
    assert Cell(fixture="kda", path="native", eval="between-microbatches").id == Cell(fixture="kda", path="native").id
    assert cell.precision().reduce_dtype is None


def test_a_checkpoint_moves_only_where_the_cell_runs_its_lifecycle():
    two = dict(fixture="kda", path="native", ranks=2)
    assert Cell(**two, move="shrink").id.endswith("/s0/mv-shrink")
    for cell in (Cell(fixture="kda", path="native", move="shrink"), Cell(**two, move="grow", microbatches=3),
                 Cell(**two, move="shrink", checkpointing="full"), Cell(**two, move="grow", seed=1),
                 Cell(**two, move="mesh"), Cell(fixture="composed", path="native", ranks=4, mesh="ep", move="mesh")):
        assert cell.move == "none", cell  # nothing moves there: the cell does not claim it
    save, load_on = Cell(**two, move="shrink").move_layouts()
    assert (save.ranks, save.microbatches, load_on.ranks, load_on.microbatches) == (2, 1, 1, 2)
    save, load_on = Cell(**two, move="grow").move_layouts()
    assert (save.ranks, load_on.ranks) == (1, 2) and save.move == load_on.move == "none"
    save, load_on = Cell(fixture="composed", path="native", ranks=4, mesh="hsdp", move="mesh").move_layouts()
    assert (save.mesh, load_on.mesh) == ("hsdp", "fsdp")
    with pytest.raises(UsageError, match="move: unknown value"):
        Cell(**two, move="sideways")


def test_matrices_place_moves_where_they_run():
    for name, moves in (("default", {"shrink", "grow"}), ("configs", {"shrink", "grow"})):
        cells = load(name).cells
        moved = [c for c in cells if c.move != "none"]
        assert {c.move for c in moved} == moves, name
        assert all(c.lifecycle and c.ranks == 2 for c in moved)
        assert {c.fixture for c in moved} == {c.fixture for c in cells}, name  # every fixture moves somewhere


def test_a_recipe_unfreeze_plans_the_parameter_trainable_from_its_step():
    fixture = get_fixture("staged")
    plan = resolve_plan(fixture.make(0), PrecisionConfig(), unfreeze=fixture.unfreeze)
    t = plan["blocks.0.adapter.down.weight"]
    assert t.requires_grad and t.trainable_from == 1 and t.reduce is not None
    assert plan["blocks.0.proj.weight"].trainable_from == 0


@pytest.mark.slow
@pytest.mark.xdist_group("configs")
def test_configs_matrix_passes_on_both_paths(tmp_path):
    out = tmp_path / "configs"
    proc = subprocess.run([sys.executable, "-m", "parity", "run", "--matrix", "configs", "--out", str(out)],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from tests.conftest import read_records

    records = read_records(str(out))
    assert {r["verdict"] for r in records} <= {"PASS", "SKIP", "UNPAIRED"}
    unpaired = [r for r in records if r["verdict"] == "UNPAIRED"]
    assert all("was skipped" in r["detail"] for r in unpaired)
    # green is earned: every configuration ran cells that passed, on both paths as taken
    ran = {(r["fixture"], r["path_taken"]) for r in records if r["check"] == "grad" and r["verdict"] == "PASS"}
    for fixture in ("uneven", "routed", "staged", "residual_fp32"):
        assert {(fixture, "legacy"), (fixture, "native")} <= ran
    for column, value in (("init", "meta"), ("checkpointing", "outer"), ("param_dtype", "float16")):
        assert any(r[column] == value and r["check"] == "grad" and r["verdict"] == "PASS" for r in records), column
    # checkpoints moved 2 -> 1 and 1 -> 2 ranks, read back entry by entry and trained a step after
    moved = {(r["cell"].rsplit("/mv-", 1)[-1], r["name"].split(":")[1]) for r in records
             if r["check"] == "checkpoint.moved" and r["verdict"] == "PASS"}
    assert {(m, k) for m in ("shrink", "grow") for k in ("entry", "layout", "grad", "param")} <= moved
    # unused parameters were really unused somewhere: a zero gradient judged PASS
    assert any(r["fixture"] == "routed" and r["check"] == "grad" and "experts.3" in r["name"]
               and float(r["signal"]) == 0.0 for r in records)


@pytest.mark.slow
@pytest.mark.xdist_group("models")
def test_real_model_classes_go_through_the_gate(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "models"
    proc = subprocess.run([sys.executable, "-m", "parity", "gate", "--matrix", "models", "-k", "ranks == 2",
                           "--out", str(out)], capture_output=True, text=True, timeout=1200)
    # a filtered gate is PARTIAL (exit 1) whatever ran; each model would be GO on what ran
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = {line.split()[0]: line.split()[1] for line in proc.stdout.splitlines() if line.startswith("hf_")}
    assert lines == {m: "PARTIAL" for m in ("hf_kimi_linear", "hf_qwen3_next", "hf_deepseek_v3", "hf_llama")}
    decisions = json.load(open(out / "gate.json"))["decisions"]
    assert all(d["reasons"] == [d["reasons"][0]] and "would be GO on what ran" in d["reasons"][0] for d in decisions)


@pytest.mark.slow
@pytest.mark.xdist_group("configs")
def test_an_owner_that_sums_ignored_gradients_is_emulated_as_summing(tmp_path, run_matrix):
    """``Fixture.ignored_reduction = "sum"``: the reference once averaged regardless (review finding)."""
    plugin = tmp_path / "sum_owner.py"
    plugin.write_text("import dataclasses\nfrom parity_fixtures import FIXTURES\n"
                      "parity_model = dataclasses.replace(FIXTURES['ignored'], name='ignored_sum', "
                      "ignored_reduction='sum')\n")
    source = f"{plugin}:parity_model"
    cells = [Cell(fixture="ignored_sum", path=p, ranks=2, source=source) for p in ("legacy", "native")]
    code, records = run_matrix(cells)
    assert code == 0, [r for r in records if r["verdict"] not in ("PASS", "SKIP")][:3]


def test_longer_cells_resume_in_the_middle_and_keep_older_ids():
    assert Cell(fixture="kda", path="native").resume_step == 1
    four = Cell(fixture="kda", path="native", steps=4)
    assert four.resume_step == 2 and four.lifecycle and four.id.endswith("/s0/st-4")


@pytest.mark.slow
@pytest.mark.xdist_group("configs")
def test_a_clipped_step_after_a_moved_checkpoint_is_judged_with_each_layouts_norm(run_matrix):
    """Each layout clips with the global norm it forms itself, in its own order (they differ by
    about an ulp): the norms are judged against each other, the gradients against the straight
    step's rescaled by the coefficients' ratio, and the step's parameters and moments with the
    optimizer's sensitivity to that difference. Before, ``lm`` failed here at 1.2-2.4x of
    allowances derived for identical gradients: a false alarm on correct torch.

    Two more false alarms of ``full`` on correct torch: with a float16 output, the layout on one
    rank halved each micro-batch's loss before its backward, which rounds the output's float16
    gradient where it is subnormal (gradients a BF16 ulp apart, 3.5e4 x their FP32 allowance);
    it now divides each loss as two ranks do and averages after the reduction. And
    ``mixed_storage``'s LoRA weights (BF16 gradients, tiny second moments) were INCONCLUSIVE: a
    tensor-wide gradient spread times AdamW's per-element sensitivity ``1/sqrt(v)``; the spread
    is per element now."""
    cells = [Cell(fixture="lm", path="legacy", ranks=2, clip=0.01, move="grow"),
             Cell(fixture="lm", path="native", ranks=2, clip=0.01, move="shrink", output_dtype="float16"),
             Cell(fixture="mixed_storage", path="native", ranks=2, clip=0.01, move="shrink", steps=4)]
    code, records = run_matrix(cells)
    assert code == 0 and {r["verdict"] for r in records} <= {"PASS", "SKIP", "UNPAIRED"}  # one path per cell
    norms = [r for r in records if r["check"] == "checkpoint.moved" and r["name"].endswith(":norm:global")]
    assert len(norms) == 6 and all(r["verdict"] == "PASS" for r in norms)
    assert any(0 < float(r["observed"]) for r in norms)


@pytest.mark.slow
@pytest.mark.xdist_group("configs")
def test_a_moved_checkpoint_is_loaded_without_collectives_and_a_regathering_load_is_seen(run_matrix):
    """``checkpoint.collectives`` also holds a checkpoint that moves (1 -> 2 ranks): a load that
    all-gathers every unit (fault ``load_regathers``, numerically invisible) fails each
    ``moved:PATH:load`` record, and only those records with the lifecycle's own loads. A resumed step whose
    uninterrupted twin began with units an evaluation kept gathered (reshard off, saved after
    step 1) gathers them in its first forward: no false alarm."""
    clean = Cell(fixture="kda", path="native", ranks=2, move="grow")
    kept = Cell(fixture="kda", path="native", ranks=2, reshard=False, eval="between-steps", steps=4)
    faulty = Cell(fixture="kda", path="native", ranks=2, move="grow", faults=("load_regathers",))
    code, records = run_matrix([clean, kept, faulty])
    rows = {(r["cell"], r["name"]): r["verdict"] for r in records if r["check"] == "checkpoint.collectives"}
    assert {v for (c, n), v in rows.items() if c in (clean.id, kept.id)} == {"PASS"}
    moved = {n: v for (c, n), v in rows.items() if c == faulty.id and n.startswith("moved:")}
    assert moved == {"moved:native:save": "PASS", "moved:native:load": "FAIL",
                     "moved:legacy:save": "PASS", "moved:legacy:load": "FAIL"}
    bad = {r["check"] for r in records if r["cell"] == faulty.id and r["verdict"] not in ("PASS", "SKIP")}
    assert bad == {"checkpoint.collectives", "stage"} and code == 1
