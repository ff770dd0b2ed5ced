"""Generated models: the spec -> fixture builder, the strategy, reproducers, the campaign."""

import json
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings

from parity.errors import IsolationError
from parity.model.plan import PrecisionConfig, resolve_plan
from parity.model.spec import validate
from parity.paths import plan_sharding
from parity_fixtures.generated import fixture_from_spec, reproducer, source_for, specs


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=specs())
def test_every_generated_spec_is_a_valid_model_with_its_declared_outcomes(spec):
    fixture = validate(fixture_from_spec(spec), "generated")
    model = fixture.make(0)
    plan = resolve_plan(model, PrecisionConfig(), fixture.ignored(model), fixture.keep_fp32)
    gains = sorted(f"blocks.{i}.lin.gain" for i, b in enumerate(spec["blocks"]) if b["kind"] == "gain")
    try:
        plan_sharding(model, fixture.unit_roots, plan, "legacy", fixture.ignored(model))
        raised = []
    except IsolationError as exc:
        raised = sorted(p for p in gains if p in str(exc))
        assert raised, str(exc)
    assert raised == gains  # legacy fails exactly when a gain exists, naming every one
    assert plan_sharding(model, fixture.unit_roots, plan, "native", fixture.ignored(model)).taken == "native"


def test_a_generated_model_loads_from_its_source_and_from_a_reproducer_file(tmp_path):
    spec = {"dim": 5, "tokens": True, "vocab": 7, "blocks": [{"kind": "holder", "heads": 3, "buffer": True}],
            "tie": True, "roots": "blocks", "name": ""}
    path = tmp_path / "repro.py"
    path.write_text(reproducer(spec))
    proc = subprocess.run([sys.executable, "-m", "parity", "run", "--model", f"{path}:parity_model", "--matrix", "smoke",
                           "--list"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "8 cells" in proc.stdout, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "parity", "plan", "--model", source_for(spec)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "holder.A_log" in proc.stdout, proc.stderr


@pytest.mark.slow
@pytest.mark.xdist_group("fuzz")
def test_the_fixed_seed_campaign_passes_on_unmodified_torch(tmp_path):
    """The CI budget: 25 generated models, both paths, pools reused across examples."""
    proc = subprocess.run([sys.executable, "-m", "parity", "fuzz", "--examples", "25", "--seed", "0",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fuzz: 25 runs" in proc.stdout and "FAIL" not in proc.stdout.split("records by verdict")[1].split("\n")[0]
    manifest = json.loads((tmp_path / "fuzz.json").read_text())  # what parity merge joins parts by
    assert (manifest["ran"], manifest["asked"], manifest["code"], manifest["index"], manifest["count"]) == (25, 25, 0, 1, 1)
    assert manifest["status"] == "complete"
    assert (manifest["device"], manifest["timeout"]) == ("cpu", 120.0)


@pytest.mark.slow
@pytest.mark.xdist_group("fuzz")
def test_the_campaign_catches_a_deliberate_fault(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "parity", "fuzz", "--examples", "4", "--seed", "0", "--fault",
                           "perturb_grad", "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert "fault perturb_grad flagged in 4 of 4 examples" in proc.stdout, proc.stdout[-2000:]
    assert proc.returncode == 0  # flagged: the checks can fail under it (none flagged would be exit 1)
    assert "replay both paths: python -m parity run --matrix " in proc.stdout and "--fault perturb_grad" in proc.stdout
    # the first failing example's reproducer, in `parity repro`'s format, finds the same first stage
    repro = next(tmp_path.glob("repro_*.py"))
    header = repro.read_text()
    assert "CELL = Cell(" in header and "perturb_grad" in header and "From the fuzz campaign (seed 0" in header
    stage = header.split("First divergent stage: ")[1].split("\n")[0]
    rerun = subprocess.run([sys.executable, str(repro)], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "TMPDIR": str(tmp_path)})  # the results it keeps: not in /tmp
    assert rerun.returncode == 1 and f"first divergent stage: {stage}" in rerun.stdout, rerun.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.xdist_group("fuzz")
def test_the_saved_reproducer_passes_after_its_fix(run_matrix):
    """Three same-shape ignored scales on 2 ranks: reduced in set order before the fix."""
    import os

    from parity.matrix.cell import Cell

    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "reproducers", "fuzz_ignored_order.py")
    source = f"{path}:parity_model"
    cells = [Cell(fixture="gen_229b03b0f4", path=p, ranks=2, source=source) for p in ("legacy", "native")]
    code, records = run_matrix(cells)
    assert code == 0, [r for r in records if r["verdict"] not in ("PASS", "SKIP")][:3]


def test_a_reproducer_comes_with_a_matrix_replaying_the_failing_axes(tmp_path):
    from parity.matrix import load
    from parity_fixtures.generated import replay_matrix

    spec = {"dim": 6, "tokens": False, "vocab": 0, "blocks": [{"kind": "gain"}], "tie": False, "roots": "root",
            "name": ""}
    (tmp_path / "r.py").write_text(reproducer(spec))
    values = {"ranks": 2, "microbatches": 3, "sync": "last", "checkpointing": "outer", "reshard": False,
              "output_dtype": "float32", "seed": 3}
    (tmp_path / "r.toml").write_text(replay_matrix(spec, values, "r.py"))
    cells = load(str(tmp_path / "r.toml")).cells
    assert [c.path for c in cells] == ["legacy", "native"]
    assert all((c.ranks, c.microbatches, c.sync, c.checkpointing, c.reshard, c.output_dtype, c.seed)
               == (2, 3, "last", "outer", False, "float32", 3) for c in cells)


def test_a_fuzz_reproducer_carries_the_campaigns_timeout(tmp_path):
    """A reproducer re-runs under the campaign's ``--timeout`` (fuzz defaults to 120 s, run to 60 s)."""
    from parity.fuzz import _write_reproducer
    from parity.matrix.cell import Cell
    from parity_fixtures.generated import replay_matrix

    spec = {"dim": 6, "tokens": False, "vocab": 0, "blocks": [{"kind": "gain"}], "tie": False, "roots": "root",
            "name": "gen_t"}
    values = {"ranks": 1, "microbatches": 1, "sync": "every", "checkpointing": "none", "reshard": True,
              "output_dtype": "none", "seed": 0}
    cell = Cell(fixture="gen_t", path="native", ranks=1, source=source_for(spec))
    for timeout, carried in ((7.0, "timeout=7.0"), (120.0, "timeout=120.0"), (60.0, "")):
        files = _write_reproducer(str(tmp_path), spec, values, cell, [], reproducer, replay_matrix, "test", timeout)
        script = (tmp_path / files[0]).read_text()
        run = script.split("raise SystemExit(")[1]
        assert (carried in run if carried else "timeout" not in run), run


def test_an_example_failing_only_its_cross_path_comparison_gets_a_reproducer_of_the_pair(tmp_path):
    """Both paths passing alone and disagreeing with each other -- the case parity exists for --
    wrote no reproducer: the pair's records name the pair, not a cell (review)."""
    from parity.fuzz import _failing_cell, _write_reproducer
    from parity.judge.cell import base_fields
    from parity.judge.record import Record, Verdict
    from parity.matrix.cell import Cell
    from parity_fixtures.generated import replay_matrix

    spec = {"dim": 6, "tokens": False, "vocab": 0, "blocks": [{"kind": "gain"}], "tie": False, "roots": "root",
            "name": "gen_x"}
    cells = [Cell(fixture="gen_x", path=p, ranks=2, source=source_for(spec)) for p in ("legacy", "native")]
    cross = Record(**{**base_fields(cells[1]), "cell": cells[0].pair_id, "path": "legacy~native"}, check="grad",
                   name="blocks.0.gain", verdict=Verdict.FAIL, detail="the paths disagree")
    assert _failing_cell(cells, [cross]) == (cells, [cross])
    values = {"ranks": 2, "microbatches": 1, "sync": "every", "checkpointing": "none", "reshard": True,
              "output_dtype": "none", "seed": 0}
    files = _write_reproducer(str(tmp_path), spec, values, cells, [cross], reproducer, replay_matrix, "test", 60.0)
    script = (tmp_path / files[0]).read_text()
    assert "Cell(fixture='gen_x', path='legacy'" in script and "Cell(fixture='gen_x', path='native'" in script


def test_the_parts_of_a_split_campaign_draw_models_of_their_own():
    """Hypothesis draws its simplest example first whatever the seed: every part of an 8-part
    nightly ran it (review, 2026-12-06). Parts after the first skip it."""
    from parity.fuzz import examples_of, part_seed

    drawn = []
    for index in (1, 2, 3):
        def body(spec, values):
            drawn.append((index, spec["name"]))
        examples_of(2, part_seed(0, index, 3), later_part=index > 1)(body)()
    assert len(drawn) == 6 and len({name for _, name in drawn}) == 6, drawn


def test_an_example_whose_cells_were_all_skipped_checked_nothing_and_fails_the_campaign(tmp_path, monkeypatch):
    import parity.runner
    from parity.fuzz import campaign

    monkeypatch.setattr(parity.runner, "_skip_reason", lambda cell, *a, **k: "needs 2 GPUs; 1 visible")
    assert campaign(examples=2, seed=0, out_dir=str(tmp_path), device="cpu") == 1  # no rank ever started
    assert "nothing was checked (needs 2 GPUs; 1 visible)" in (tmp_path / "fuzz.md").read_text()


def test_a_campaign_on_one_gpu_draws_one_rank_only(monkeypatch):
    import torch

    from parity.fuzz import hostable_ranks

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert hostable_ranks("cuda") == (1,) and hostable_ranks("cpu") == (1, 2)
