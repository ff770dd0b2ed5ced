"""``parity.run`` / ``parity.gate``: the command line's runs from Python, twice in one process."""

import csv
import os
import tempfile

import pytest

import parity
from parity.errors import UsageError

pytestmark = pytest.mark.xdist_group("api")

FEW = "fixture == 'kda' and ranks == 1 and microbatches == 1"


def test_run_twice_in_one_process_then_gate_from_its_directory(tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the results folder it makes and keeps
    first = parity.run(matrix="smoke", filter=FEW, quiet=True)
    assert first.out.startswith(str(tmp_path / "parity-run-"))
    assert "[1/" not in capfd.readouterr().err  # quiet: no progress lines either
    assert first.ok and first.code == 0 and first
    with open(os.path.join(first.out, "cells.csv")) as fh:
        rows = list(csv.DictReader(fh))
    assert len(first.cells) == len(rows) and set(first.cells["verdict"]) <= {"PASS", "SKIP"}
    assert first.failures().empty
    # a second call in the same process, with a fault: failures come worst first
    faulty = parity.run(matrix="smoke", filter=FEW, fault="drop_override", out=str(tmp_path / "f"), quiet=True)
    assert faulty.code == 1 and faulty.out == str(tmp_path / "f")
    assert not faulty  # `if parity.run(...)` / `assert parity.gate(...)` read the verdict, not the object
    bad = faulty.failures()
    assert len(bad) and bad.iloc[0]["verdict"] in ("ERROR", "TIMEOUT", "FAIL")
    assert list(bad["ratio"].dropna()) == sorted(bad["ratio"].dropna(), reverse=True) or \
        bad["verdict"].nunique() > 1
    # resume continues the directory it names, as the command line does (nothing left to run here)
    resumed = parity.run(resume=first.out, quiet=True)
    assert resumed.out == first.out and resumed.code == 0 and len(resumed.cells) == len(rows)
    with pytest.raises(UsageError, match="drop out="):
        parity.run(resume=first.out, out=str(tmp_path / "elsewhere"))
    # the CLI's gate reads the API's directory
    decided = parity.gate(from_dir=first.out, quiet=True)
    assert [d["model"] for d in decided.decisions] == ["kda"]
    assert decided.decisions[0]["decision"] == "PARTIAL" and decided.code == 1  # -k narrowed the matrix


def test_bad_input_raises_what_the_cli_prints():
    with pytest.raises(UsageError, match="unknown matrix"):
        parity.run(matrix="nosuch")
    with pytest.raises(TypeError, match="from_dir"):
        parity.run(from_dir="x")
    with pytest.raises(TypeError, match="colour"):
        parity.gate(colour="red")


def _made(folder) -> list[str]:
    """The folders parity made in ``folder`` (torch makes caches of its own there)."""
    return [e for e in os.listdir(folder) if e.startswith("parity-")]


@pytest.mark.parametrize("kwargs, message", [
    ({"model": 3}, r"parity.run\(model=...\): got int 3; give a string or a list of strings"),
    ({"filter": 3}, r"parity.run\(filter=...\): got int 3; give a string"),  # "-k 3" would select every cell
    ({"fp64": "yes"}, r"parity.run\(fp64=...\): got str 'yes'; give True or False"),
    ({"ranks": {2}}, r"parity.run\(ranks=...\): got set"),
    ({"out": 3}, r"parity.run\(out=...\): got int 3; give a directory path"),
    ({"list": True}, r"parity.run\(list=True\) runs nothing; list the cells with parity.select"),
    # an empty list added no --model: the built-in models ran in the user's models' place, green
    ({"model": []}, r"parity.run\(model=...\): got list \[\]; give at least one value, or leave it out"),
    ({"paths": ()}, r"parity.run\(paths=...\): got tuple \(\); give at least one value"),
    ({"quiet": "no"}, r"parity.run\(quiet=...\): got str 'no'; give True or False"),
])
def test_a_keyword_of_the_wrong_type_is_named(kwargs, message, monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(UsageError, match=message):
        parity.run(matrix="smoke", **kwargs)
    assert _made(tmp_path) == []  # a refused call leaves no empty results folder behind


@pytest.mark.parametrize("call, kwargs, message", [
    ("gate", {"from_dir": "d", "matrix": "knobs"}, r"parity.gate\(from_dir=...\) uses the matrix that run recorded; "
                                                   "drop matrix='knobs'"),
    ("run", {"resume": "d", "matrix": "knobs"}, r"parity.run\(resume=...\) uses the matrix that run recorded"),
    ("gate", {"from_dir": "d", "out": "elsewhere"}, r"from_dir='d' is judged in place .*; drop out='elsewhere'"),
    ("gate", {"shard": "1/2"}, r"parity.gate\(shard='1/2'\) decides nothing \(one part\)"),
])
def test_an_option_the_call_would_ignore_is_refused(call, kwargs, message):
    """What the command line refuses (``gate --from D --matrix M``) the API does not drop silently."""
    with pytest.raises(UsageError, match=message):
        getattr(parity, call)(**kwargs)


@pytest.mark.parametrize("call, kwargs, message", [
    ("run", {"matrix": "smoke", "filter": "fixture == 'nope'"},
     r"^no cells selected from matrix 'smoke'; loosen filter/paths/ranks$"),
    ("gate", {"from_dir": "/nonexistent-parity-dir"}, r"^from_dir /nonexistent-parity-dir: no cells.csv there; give the "
                                                       r"out directory of a parity run$"),
])
def test_a_commands_own_refusal_names_keywords(call, kwargs, message, monkeypatch, tmp_path):
    """What the command refuses after parsing is said in the call's words, not the command line's;
    the temporary results folder the call made for it is not left behind."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(UsageError, match=message):
        getattr(parity, call)(**kwargs)
    assert _made(tmp_path) == []


def test_a_quoted_command_line_keeps_its_flags():
    from parity.api import _as_keywords

    said = _as_keywords("run", "--resume d: unfinished; finish it with python -m parity run --resume d; loosen -k")
    assert said == "resume d: unfinished; finish it with python -m parity run --resume d; loosen filter"


def test_a_call_from_a_rank_importing_an_unguarded_script_exits_with_the_code_its_run_refuses(monkeypatch, capsys):
    """Ranks start as processes that import the caller's main script: a call without an
    ``if __name__ == "__main__":`` guard would start runs inside ranks. Such a rank says so in
    one line and exits with EXIT_UNGUARDED, which the run that started it turns into one
    UsageError (the test below, in real processes)."""
    import multiprocessing

    import parity.api
    from parity.errors import EXIT_UNGUARDED

    class Exited(Exception):
        pass

    def exit_(code):
        raise Exited(code)

    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    monkeypatch.setattr(parity.api.os, "_exit", exit_)
    with pytest.raises(Exited) as exited:
        parity.run(matrix="smoke")
    assert exited.value.args == (EXIT_UNGUARDED,)
    assert capsys.readouterr().err == ("parity.run(): your script calls parity when imported, and every rank process "
                                       'imports it again; put the call under `if __name__ == "__main__":`\n')


def test_a_model_file_edited_after_this_process_imported_it_is_refused(tmp_path):
    """In a notebook or a long pytest session the ranks would import the edited file and the
    parent judge with the old code: a false FAIL pointing at FSDP. Refused, naming the file."""
    import shutil

    model = tmp_path / "mm.py"
    shutil.copy(os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples", "own_model", "my_model.py"), model)
    source = f"{model}:parity_model"
    assert parity.api.select(model=source, filter="ranks == 1")[1]
    model.write_text(model.read_text() + "\n# edited\n")
    with pytest.raises(UsageError, match=f"{model} changed since this process imported it; the ranks would run the "
                                         "new code and the reference the old: restart the process"):
        parity.api.select(model=source, filter="ranks == 1")


def test_select_is_exported_and_applies_a_shard_and_empty_values_are_refused():
    """``parity.select`` is what the refusal of ``list=True`` names; it lists one part as ``run
    --shard`` runs it; ``matrix=""`` / ``out=""`` are refused, never read as the defaults."""
    _, cells, _ = parity.select(matrix="smoke")
    _, part, _ = parity.select(matrix="smoke", shard="1/4")
    assert 0 < len(part) < len(cells) and {c.id for c in part} <= {c.id for c in cells}
    with pytest.raises(UsageError, match="unknown matrix ''"):
        parity.run(matrix="", filter="ranks == 3")
    with pytest.raises(UsageError, match="unknown matrix ''"):
        parity.gate(matrix="", filter="ranks == 3")
    with pytest.raises(UsageError, match=r"parity.run\(out=''\): give a directory path"):
        parity.run(out="", filter="ranks == 3")
    with pytest.raises(UsageError, match=r"^filter: cannot parse"):  # the keyword, not -k (review)
        parity.select(filter="((")


def test_api_values_starting_with_a_dash_are_values_and_select_resumes_the_recorded_matrix(tmp_path, monkeypatch):
    """``out="-results"`` is a folder (the command line's ``--out=-results``), not a missing argument;
    ``select(resume=D)`` lists what ``run(resume=D)`` would run, with D's own matrix (review)."""
    import parity
    from parity.api import _argv

    from parity.errors import UsageError

    assert _argv("run", {"seed": -1, "fault": ["-x"], "paths": ["legacy"]})[1:] == [
        "--seed=-1", "--fault=-x", "--paths=legacy"]
    monkeypatch.chdir(tmp_path)
    found, cells, _ = parity.select(matrix="default", filter="fixture == 'kda' and ranks == 1", paths="legacy")
    assert found.name == "default" and cells
    with pytest.raises(UsageError, match=r"parity.select\(resume=...\) uses the matrix that run recorded"):
        parity.select(resume=str(tmp_path), matrix="default")


def test_out_of_the_wrong_type_beside_a_directory_option_is_a_usage_error(tmp_path):
    """``out`` was checked only without ``from_dir`` / ``resume``: a bare TypeError (review)."""
    for call in (lambda: parity.gate(from_dir=str(tmp_path), out=3), lambda: parity.run(resume=str(tmp_path), out=3)):
        with pytest.raises(UsageError, match=r"\(out=...\): got int 3; give a directory path"):
            call()


@pytest.mark.slow
def test_a_script_calling_parity_without_a_main_guard_is_one_usage_error(tmp_path):
    """Every rank re-imports the script: the ranks died with a traceback each and the run judged
    an ERROR cell, exit 1, naming no guard (review). Now the call raises the one line."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text("import parity\n"
                      f"parity.run(matrix='smoke', filter={FEW!r}, paths=['legacy'], out={str(tmp_path / 'o')!r})\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last == (
        "parity.errors.UsageError: your script calls parity when imported, and every rank process imports it again; "
        'put the call under `if __name__ == "__main__":`'), proc.stderr[-2000:]
    assert proc.stderr.count("Traceback") == 1  # the script's own; no rank's
    cells = tmp_path / "o" / "cells.csv"
    assert not cells.exists() or "ERROR" not in cells.read_text()  # no verdict judged a dead rank
