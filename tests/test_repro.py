"""Issue 22.3: a reproducer for a failing cell, run in a fresh process, finds what the run found."""

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parity.cli import main
from parity.matrix.cell import Cell

CELL = Cell(fixture="kda", path="native", ranks=1, faults=("perturb_output",))


@pytest.fixture(scope="module")
def failing_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("repro") / "run"
    code = main(["run", "--matrix", "smoke", "-k", "fixture == 'kda' and path == 'native' and ranks == 1 and "
                 "microbatches == 1", "--fault", "perturb_output", "--out", str(out)])
    assert code == 1
    return out


def _located(path, check: str = "divergence") -> str:
    from parity.report.records import read_records

    rows = [r for r in read_records(str(path / "cells.csv")) if r.check == check]
    assert rows and rows[0].verdict == "FAIL"
    return rows[0].detail


@pytest.mark.slow
def _run(script, tmp_path, *args) -> subprocess.CompletedProcess:
    """Run a reproducer as a user would, its results folder (a new temporary one, which it keeps
    for the user to read) under this test's ``tmp_path``."""
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TMPDIR": str(tmp_path)})


def test_a_reproducer_re_runs_the_cell_and_finds_the_same_first_divergence(failing_run, tmp_path):
    script = tmp_path / "repro.py"
    assert main(["repro", CELL.id, "--from", str(failing_run), "--out", str(script)]) == 0
    text = script.read_text()
    assert "faults=('perturb_output',)" in text and _located(failing_run)[:80] in text
    ops = tmp_path / "ops.json"
    done = _run(script, tmp_path, "--op-log", str(ops))
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"first divergence: {_located(failing_run)}" in done.stdout
    stage = _located(failing_run, "stage").removeprefix("first divergent stage: ")
    assert f"first divergent stage: {stage}\n" in done.stdout and f"First divergent stage: {stage[:600]}" in text
    from torch.utils._debug_mode import DebugMode

    assert DebugMode.load_logs(str(ops))  # the failing step, op by op, for the bug report
    usage = subprocess.run([sys.executable, str(script), "--verbose"], capture_output=True, text=True, timeout=300)
    assert usage.returncode == 2 and usage.stderr.count("\n") == 1 and "--op-log FILE" in usage.stderr


def test_a_cell_the_run_did_not_have_is_a_one_line_error(failing_run, capsys):
    assert main(["repro", "kda/native/r9", "--from", str(failing_run)]) == 2
    err = capsys.readouterr().err
    assert "is not a cell or a pair of the run" in err and CELL.id in err and err.count("\n") == 1


def test_a_reproducer_of_a_model_file_carries_the_file(tmp_path):
    """A cell of ``--model path/to/file.py:factory`` re-runs where that file is not: the script
    holds its text and points the cell at a fresh copy."""
    import dataclasses
    import runpy

    from parity.report.repro import render

    model = tmp_path / "their_model.py"
    model.write_text("FACTORY = 'their model'\n")
    cell = dataclasses.replace(CELL, source=f"{model}:FACTORY")
    script = tmp_path / "repro.py"
    script.write_text(render(cell, [], "a run"))
    model.unlink()  # the reader of a bug report has only the script
    moved = runpy.run_path(str(script))["with_model"](cell)
    path, _, attr = moved.source.rpartition(":")
    assert attr == "FACTORY" and path != str(model) and open(path).read() == "FACTORY = 'their model'\n"
    assert moved.id == cell.id
    plain = render(CELL, [], "a run")  # a registered model needs nothing embedded
    assert "MODEL_SOURCE" not in plain and "rerun(CELL, sys.argv[1:])" in plain


@pytest.mark.slow
def test_a_pair_id_re_runs_both_cells_and_their_cross_path_comparison(tmp_path, capsys):
    """A cross-path record's ``cell`` is the pair's id: ``repro`` takes it (and suggests only ids it
    takes), and the script re-runs both cells so the comparison runs again, not UNPAIRED."""
    out = tmp_path / "run"
    assert main(["run", "--matrix", "smoke", "-k", "fixture == 'kda' and ranks == 1 and microbatches == 1",
                 "--out", str(out)]) == 0
    cells = (out / "cells.csv").read_bytes().decode()
    row = next(line for line in cells.splitlines() if ",legacy~native," in line and ",PASS," in line)
    pair = row.split(",")[0]
    # as a pair's failure, in a run marked interrupted (one marked complete is read only as it recorded it)
    (out / "cells.csv").write_bytes(cells.replace(row, row.replace(",PASS,", ",FAIL,", 1), 1).encode())
    (out / "run.json").write_text((out / "run.json").read_text().replace('"status": "complete"', '"status": "interrupted"'))
    capsys.readouterr()
    assert main(["repro", "kda/r9", "--from", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"a failing one: {pair}" in err and err.count("\n") == 1, err
    script = tmp_path / "repro.py"
    assert main(["repro", pair, "--from", str(out), "--out", str(script)]) == 0
    text = script.read_text()
    assert f"the pair {pair}" in text and "nothing failed there" not in text
    assert "CELLS = [" in text and text.count("Cell(fixture='kda'") == 2 and "rerun(CELLS, sys.argv[1:])" in text
    done = _run(script, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "cross-path pairs: PASS 1," in done.stdout and "UNPAIRED 0" in done.stdout, done.stdout[-2000:]


def test_a_reproducer_re_runs_with_the_runs_timeout_and_require_native(failing_run, tmp_path):
    """A TIMEOUT under ``--timeout 0.2`` re-run under the default 60 s would pass: the script
    passes the run's ``--timeout`` and ``--require-native`` to ``rerun``."""
    import json
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(failing_run, copy)
    manifest = json.loads((copy / "run.json").read_text())
    manifest["options"].update(timeout=0.2, require_native=True)
    (copy / "run.json").write_text(json.dumps(manifest))
    script = tmp_path / "repro.py"
    assert main(["repro", CELL.id, "--from", str(copy), "--out", str(script)]) == 0
    assert "rerun(CELL, sys.argv[1:], require_native=True, timeout=0.2)" in script.read_text()


def test_a_changed_model_file_is_refused_and_a_relative_one_found_from_anywhere(tmp_path, monkeypatch):
    """The script embeds the model file: one whose digest is not the run's would re-run another
    model, so ``repro`` refuses it; a file the run named relative to where it ran is found through
    the absolute path ``run.json`` records."""
    import dataclasses
    import hashlib
    import os

    from parity.errors import UsageError
    from parity.report.repro import _located, render

    model = tmp_path / "their_model.py"
    model.write_text("FACTORY = 'their model'\n")
    cell = dataclasses.replace(CELL, source=f"{model}:FACTORY")
    recorded = {os.path.realpath(model): hashlib.sha256(model.read_bytes()).hexdigest()}
    assert "MODEL_SOURCE" in render(cell, [], "a run", sources=recorded)
    model.write_text("FACTORY = 'their model, edited'\n")
    with pytest.raises(UsageError, match="their_model.py changed since the run"):
        render(cell, [], "a run", sources=recorded)
    monkeypatch.chdir(tmp_path.parent)  # elsewhere: 'their_model.py' does not resolve from here
    assert _located("their_model.py:FACTORY", recorded) == f"{os.path.realpath(model)}:FACTORY"
    assert _located("pkg.module:FACTORY", recorded) == "pkg.module:FACTORY"


def test_a_pairs_reproducer_names_each_cells_stage_and_path_and_no_heading_twice():
    """A pair's two cells fail alike: their records are told apart by path, and each cell's first
    divergent stage is named by its cell, said once ("First divergent stage: first divergent..." before)."""
    from parity.judge.record import Record, Verdict
    from parity.matrix.cell import Cell
    from parity.report.repro import render

    cells = [Cell(fixture="kda", path=p, ranks=1) for p in ("legacy", "native")]
    bad = []
    for c in cells:
        base = dict(cell=c.id, fixture="kda", path=c.path)
        bad += [Record(**base, check="grad", name="head.weight", step=0, verdict=Verdict.FAIL, observed=2.0, allowed=1.0,
                       ratio=2.0),
                Record(**base, check="stage", name="gradients", verdict=Verdict.FAIL,
                       detail="first divergent stage: gradients at step 0: grad head.weight")]
    text = render(cells, bad, "a test")
    assert "first divergent stage: first" not in text.lower()
    for c in cells:
        assert f"First divergent stage: gradients at step 0: grad head.weight (in {c.id})" in text
        assert f"  [{c.path}] FAIL grad head.weight step 0" in text


def test_a_reproducer_says_what_located_each_cell_and_when_a_cell_did_not_finish():
    """A passing ``divergence`` record (no module differs: look after backward) was dropped as
    "not located", a pair named one cell's divergence without its cell, and a cell that crashed
    read "first divergent stage: none" (review)."""
    from parity.judge.record import Record, Verdict
    from parity.matrix.cell import Cell
    from parity.report.repro import render

    cells = [Cell(fixture="kda", path=p, ranks=1) for p in ("legacy", "native")]
    bad = [Record(cell=c.id, fixture="kda", path=c.path, check="divergence", name=n, verdict=v, detail=d)
           for c, n, v, d in ((cells[0], "-", Verdict.PASS, "no module differs"),
                              (cells[1], "blocks.0", Verdict.FAIL, "forward: blocks.0 first"))]
    text = render(cells, bad, "a test")
    assert f"First divergence: no module differs (in {cells[0].id})" in text
    assert f"First divergence: forward: blocks.0 first (in {cells[1].id})" in text
    crashed = [Record(cell=cells[1].id, fixture="kda", path="native", check="run", name="cell", verdict=Verdict.ERROR,
                      detail="rank 1 died")]
    text = render(cells[1], crashed, "a test")
    assert "#   ERROR run cell: rank 1 died" in text and "step" not in text.split("ERROR run cell")[1][:8]
    assert "First divergent stage: not located: the cell did not finish (ERROR)" in text
    assert "First divergent stage: none: nothing failed" in render(cells[1], [], "a test")


def test_the_run_the_registry_and_the_reproducer_name_a_file_by_one_digest(tmp_path):
    """``run.json``'s ``sources``, the registry's edited-since-import check and the reproducer's
    changed-since-the-run check read one digest rule: a file over one read block names the same."""
    import hashlib

    from parity.digests import data_sha256, file_sha256
    from parity.report.identity import identity

    big = tmp_path / "big.py"
    data = b"# padding\n" * 200_000  # 2 MB: more than one 1 MiB block
    big.write_bytes(data)
    expected = hashlib.sha256(data).hexdigest()
    assert file_sha256(str(big)) == data_sha256(data) == expected
    assert identity(str(big), [])["sources"] == {str(big.resolve()): expected}


def test_a_hand_edited_reproducer_asking_for_what_no_run_can_do_is_one_line_exit_2(capsys):
    """A reproducer is meant to be edited down for a bug report; an edit no run can honour was a
    traceback deep in the runner (``ranks=0``, ``microbatches='x'``) or an ERROR cell and a fault
    summary claiming a cell that never trained (an unknown model or fault). Found by review."""
    import dataclasses

    from parity.errors import UsageError
    from parity.matrix.cell import Cell
    from parity.report.repro import rerun

    cell = Cell(fixture="kda", path="native")
    for edit, said in (({"ranks": 0}, "ranks 0: write an integer >= 1"),
                       ({"microbatches": "x"}, "microbatches 'x': write an integer"),
                       ({"steps": 1.5}, "steps 1.5: write an integer")):
        with pytest.raises(UsageError, match=said):
            dataclasses.replace(cell, **edit)
    for edit, said in (({"fixture": "nope"}, "nope"), ({"faults": ("nope",)}, "unknown value 'nope'")):
        assert rerun(dataclasses.replace(cell, **edit)) == 2
        err = capsys.readouterr().err
        assert err.startswith("parity: ") and err.count("\n") == 1 and said in err, err
    assert rerun("kda") == 2 and "is not a parity Cell" in capsys.readouterr().err
    assert rerun(dataclasses.replace(cell, path="nope")) == 2 and "unknown path 'nope'" in capsys.readouterr().err


def test_a_reproducer_script_edited_to_a_cell_no_run_can_take_exits_2_in_one_line(tmp_path):
    """The script builds its cell at import: the edit fails there, before ``rerun`` could say it."""
    from parity.matrix.cell import Cell
    from parity.report.repro import render

    script = tmp_path / "repro.py"
    script.write_text(render(Cell(fixture="kda", path="native"), [], "here").replace("ranks=1,", "ranks=0,"))
    proc = _run(script, tmp_path)
    assert proc.returncode == 2 and proc.stderr == "parity: reproducer: ranks 0: write an integer >= 1\n", proc.stderr


@settings(max_examples=200, deadline=None)
@given(detail=st.text(), origin=st.text())
def test_a_reproducer_is_python_whatever_its_records_say(detail, origin):
    """A record's detail carries a user's exception text (quotes, backslashes, control characters);
    the reproducer's header is comment lines, so the script always parses and names the cell."""
    import ast

    from parity.judge.record import Record, Verdict
    from parity.report.repro import render

    bad = [Record(cell=CELL.id, fixture="kda", path="native", check="run", name="cell", verdict=Verdict.ERROR,
                  detail=detail)]
    text = render(CELL, bad, origin)
    tree = ast.parse(text)
    assert ast.get_docstring(tree) is None and text.startswith(f"# parity reproducer: {CELL.id}\n")


@pytest.mark.slow
def test_a_reproducer_reads_the_run_as_report_and_gate_do(failing_run, tmp_path, capsys):
    """A cut or missing ``cells.csv`` of a complete run, or a hand-edited ``run.json``, is exit 2 naming it,
    not a reproducer saying nothing failed there (or a traceback)."""
    import json
    import shutil

    def damaged(name: str, edit) -> int:
        copy = tmp_path / name
        shutil.copytree(failing_run, copy)
        edit(copy)
        capsys.readouterr()
        return main(["repro", CELL.id, "--from", str(copy)])

    def cut(d):
        text = (d / "cells.csv").read_bytes()
        (d / "cells.csv").write_bytes(text[:-100])

    def manifest(**changes):
        def edit(d):
            run = json.loads((d / "run.json").read_text())
            for key, value in changes.items():
                if key == "fault":
                    run["options"]["fault"] = value
                else:
                    run[key] = value
            (d / "run.json").write_text(json.dumps(run))
        return edit

    assert damaged("cut", cut) == 2 and "cells.csv" in capsys.readouterr().err
    assert damaged("gone", lambda d: (d / "cells.csv").unlink()) == 2
    assert damaged("cells", manifest(cells=[[1]])) == 2 and "cells holds" in capsys.readouterr().err
    assert damaged("fault", manifest(fault=5)) == 2 and "records fault 5" in capsys.readouterr().err
