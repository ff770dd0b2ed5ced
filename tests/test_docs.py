"""Every command the README and docs/ show is one parity accepts: each ``python -m parity ...``
(and ``torchrun ... -m parity ...``) parses with the CLI's own parser, each ``run`` / ``gate``
over a matrix selects cells (its matrix, models and options resolve), and each ``nox -s``
session exists. Templates (``OLD NEW [--factor 2]``, ``DIR...``, ``<name>``) are skipped."""

import csv
import glob
import os
import re
import shlex

import pytest

from parity import api
from parity.cli import _parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
TEMPLATE = re.compile(r"\[|\.\.\.|<|\bOLD\b|\bNEW\b|\bDIR\b")


def _commands() -> list[tuple[str, str]]:
    found = []
    for path in DOCS:
        text = open(path, encoding="utf-8").read()
        inline = re.findall(r"`((?:python -m parity|torchrun|nox -s) [^`]+)`", text)
        blocks = [line for block in re.findall(r"```bash\n(.*?)```", text, re.S) for line in block.splitlines()]
        for line in inline + blocks:
            for part in line.split("&&"):
                command = " ".join(part.split("  #")[0].split(" # ")[0].split())  # one line, however wrapped
                if re.match(r"(python -m parity|torchrun .*-m parity|nox -s) ", command) and not TEMPLATE.search(command):
                    found.append((os.path.relpath(path, ROOT), command))
    return sorted(set(found))


COMMANDS = _commands()


def _parity_argv(command: str) -> list[str]:
    words = shlex.split(command)
    return words[words.index("parity") + 1:]


def test_the_docs_show_commands():
    assert len([c for _, c in COMMANDS if not c.startswith("nox")]) > 30 and any(c.startswith("nox") for _, c in COMMANDS)


@pytest.mark.parametrize("where, command", [c for c in COMMANDS if not c[1].startswith("nox")], ids=lambda v: v[:80])
def test_each_parity_command_parses_and_selects(where, command, monkeypatch):
    from parity.paths import path_names

    if "owner_split" in command and "owner_split" not in path_names():
        pytest.skip("the example path is not installed here (pip install ./examples/external_path, as the docs say)")
    monkeypatch.chdir(ROOT)
    argv = _parity_argv(command)
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # pragma: no cover - the failure message is the point
        pytest.fail(f"{where}: `{command}` does not parse (exit {exc.code})")
    if args.command in ("run", "gate") and not getattr(args, "resume", None) and not getattr(args, "from_dir", None):
        options = {k: v for k, v in vars(args).items()
                   if k not in ("command", "list", "out", "overwrite", "resume", "from_dir", "candidate", "compare_to",
                                "junit", "timeout", "fp64", "require_native", "device", "baseline", "shard", "op_log")
                   and v not in (None, [], False)}
        _, cells, _ = api.select(**options)
        assert cells, f"{where}: `{command}` selects no cells"


def test_each_nox_session_exists():
    noxfile = open(os.path.join(ROOT, "noxfile.py"), encoding="utf-8").read()
    sessions = set(re.findall(r"@nox\.session[^\n]*\n(?:@[^\n]*\n)*def (\w+)\(", noxfile))
    for where, command in (c for c in COMMANDS if c[1].startswith("nox -s")):
        name = shlex.split(command)[2].split("(")[0]
        assert name in sessions, f"{where}: `{command}`: no nox session {name!r} ({sorted(sessions)})"


#: Commands that read no results and run no cell: each is run as written, in this process.
READ_ONLY = [(w, c) for w, c in COMMANDS if not c.startswith("nox")
             and (_parity_argv(c)[0] in ("plan", "fixtures") or "--list" in _parity_argv(c))]


@pytest.mark.parametrize("where, command", READ_ONLY, ids=lambda v: v[:80])
def test_each_command_that_runs_nothing_runs_as_written(where, command, monkeypatch, capsys):
    from parity.cli import main

    monkeypatch.chdir(ROOT)
    assert main(_parity_argv(command)) == 0, f"{where}: `{command}`: {capsys.readouterr().err[-500:]}"
    assert capsys.readouterr().out.strip(), f"{where}: `{command}` printed nothing"


#: README's use block, the commands that train or read results: each run as written, in order, in
#: a fresh workspace (the repository's examples, fixtures and baselines beside an empty
#: ``results/``), the ones after the first reading what it wrote. The rest train far more
#: (``full``, ``fuzz``, ``bench``, the real model classes) or need GPUs; cheaper forms of them
#: run elsewhere in the suite.
WALK = [
    ["python -m parity run --matrix smoke",
     "python -m parity compare results/baselines/smoke-torch-2.15.0-cpu results/latest",
     "python -m parity report results/latest",
     "python -m parity gate --from results/latest",
     "python -m parity gate --from results/latest --junit gate.xml",
     "python -m parity run --resume results/latest"],
    ["python -m parity run --matrix default -k \"fixture == 'kda' and ranks == 2\" --paths native"],
    # "Check your model": plan, run and gate the README's own model (examples/own_model)
    ["python -m parity plan --model examples/own_model/my_model.py:parity_model",
     "python -m parity run --model examples/own_model/my_model.py:parity_model",
     "python -m parity gate --from results/latest"],
]


def _fresh_workspace(tmp_path) -> str:
    """The repository's examples, fixtures and baselines beside an empty ``results/``."""
    for name in ("examples", "fixtures"):
        (tmp_path / name).symlink_to(os.path.join(ROOT, name))
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "baselines").symlink_to(os.path.join(ROOT, "results", "baselines"))
    return str(tmp_path)


@pytest.mark.slow
@pytest.mark.xdist_group("docs-walk")
@pytest.mark.parametrize("commands", WALK, ids=lambda c: c[0][:60])
def test_the_readme_commands_that_train_or_read_results_run_as_written(commands, tmp_path, monkeypatch, capsys):
    from parity.cli import main

    monkeypatch.chdir(_fresh_workspace(tmp_path))
    shown = {c for w, c in COMMANDS if w == "README.md"}
    for command in commands:
        assert command in shown, f"`{command}` is no longer in README.md: update WALK"
        assert main(_parity_argv(command)) == 0, f"`{command}`: {capsys.readouterr().err[-500:]}"
    assert os.path.isfile(tmp_path / "results" / "latest" / "cells.csv")
    if "--model" in commands[0]:
        _own_model_went_through(tmp_path / "results" / "latest", capsys.readouterr().out)


def _own_model_went_through(out, printed: str) -> None:
    """What README's walkthrough says its own model shows: the plan names its strict FP32 decay
    parameter and native taken as asked, every cell and pair passes, and the gate says GO."""
    assert "layers.0.gate.A_log" in printed and "strict" in printed
    assert "path requested=native taken=native" in printed
    with open(out / "cells.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert {r["fixture"] for r in rows} == {"my_model"}
    assert {r["path"] for r in rows} == {"legacy", "native", "legacy~native"}
    assert {r["verdict"] for r in rows} <= {"PASS", "SKIP"} and len(rows) > 100
    assert any(line.split()[:2] == ["my_model", "GO"] for line in printed.splitlines())
    assert (out / "gate.md").exists() and (out / "gate.json").exists()


#: The rest train far more (``default``, ``full``, ``fuzz``, ``bench``, the real model classes),
#: install nox sessions or need GPUs. ``pytest --doc-commands`` (the nightly job) runs each
#: exactly as written, in a fresh workspace, and checks the exit code the docs give it (0 unless
#: :data:`DOCUMENTED_EXIT` says otherwise). ``nox -s tests`` is this suite.
COSTLY = sorted({c for _, c in COMMANDS} - {c for group in WALK for c in group} - {c for _, c in READ_ONLY}
                - {"nox -s tests"})

#: Commands the docs show ending other than 0 on correct torch 2.15: the code and what their
#: output says (so a crash cannot pass for the documented verdict), and where the docs say so.
DOCUMENTED_EXIT = {
    "python -m parity run --matrix grad-dtype": (1, "checkpoint."),  # docs/findings.md: grad_dtype and checkpoints
    "nox -s \"gate(torch='2.13.0')\"": (1, "native not exercised"),  # no native API: every model NO-GO
    "nox -s gate": (1, "native not exercised"),  # the gate under each torch version: 2.13.0's as above
    # as written every cell is skipped ("nothing was checked"): the finding needs its [[skip]] removed
    "python -m parity run --matrix configs -k \"fixture == 'ignored' and param_dtype == 'float16'\"":
        (1, "every cell was skipped"),
    # docs/findings.md's reproducer of a torch finding: selective checkpointing around nested units
    "python -m parity run --matrix default -k \"fixture == 'kda' and path == 'legacy' and checkpointing == 'selective' "
    "and reshard == 'off'\" --eval between-steps --steps 3": (1, "ERROR 6"),
}

#: Named in a sentence, not a command to run as it stands (the docs show it with its arguments).
NAMED_ONLY = {"nox -s merge": "needs the parts' folders: docs/ci.md shows it with them"}

#: Commands that read what others wrote: those run first, in the same workspace.
BEFORE = {
    "python -m parity merge results/part-* --out results/full --gate":
        [f"python -m parity run --matrix full --shard {i}/8 --out results/part-{i}" for i in range(1, 9)],
}


def _needs_skip(command: str) -> str | None:
    """Why ``command`` cannot run here, or None."""
    import importlib.util
    import shutil

    import torch

    from parity.paths import path_names

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nproc = re.search(r"--nproc-per-node (\d+)", command)
    if ("cuda" in command or command == "nox -s device") and gpus < (int(nproc.group(1)) if nproc else 1):
        return f"needs {nproc.group(1) if nproc else 1} GPU(s), {gpus} visible"
    if "owner_split" in command and "owner_split" not in path_names():
        return "the example path is not installed (pip install ./examples/external_path)"
    if command.startswith("nox") and shutil.which("nox") is None:
        return "nox is not installed"
    if "--plot" in command and not command.startswith("nox") and importlib.util.find_spec("matplotlib") is None:
        return "needs the plot extra (pip install 'parity[plot]'); nox -s bench installs it"
    if command == "nox -s report" and not any(map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))):
        return "needs Chromium (apt-get install chromium)"
    if command.startswith("torchrun") and shutil.which("torchrun") is None:
        return "torchrun is not on PATH"
    return None


def _workspace(tmp_path, command: str) -> str:
    """A fresh workspace: for a nox session a copy of the source tree (nox installs it), else
    :func:`_fresh_workspace`."""
    import shutil
    import tempfile

    if command.startswith("nox"):
        def ignore(folder, names):  # the tree as a fresh clone has it: no venvs, builds or results
            if folder == ROOT:
                return [n for n in names if n in (".git", ".nox", "build") or n.endswith(".egg-info")]
            if folder == os.path.join(ROOT, "results"):
                return [n for n in names if n != "baselines"]
            return [n for n in names if n == "__pycache__"]
        # a fresh folder name each time: uv caches a local project's build by its path, and a
        # reused path (pytest's --basetemp) would install an earlier copy's build
        src = os.path.join(tempfile.mkdtemp(dir=tmp_path), "src")
        shutil.copytree(ROOT, src, ignore=ignore, symlinks=True)
        return src
    return _fresh_workspace(tmp_path)


@pytest.mark.doc_commands
@pytest.mark.parametrize("command", COSTLY, ids=lambda c: c[:80])
def test_each_costly_command_runs_as_written(command, tmp_path):
    import subprocess
    import sys

    reason = NAMED_ONLY.get(command) or _needs_skip(command)
    if reason:
        pytest.skip(reason)
    cwd = _workspace(tmp_path, command)
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    for step in [*BEFORE.get(command, []), command]:
        proc = subprocess.run(["bash", "-c", " ".join(step.split())], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=5400)
        want, says = DOCUMENTED_EXIT.get(step, (0, ""))
        said = f"{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}"
        assert proc.returncode == want, f"`{step}` exited {proc.returncode}, the docs give {want}: {said}"
        assert says in proc.stdout + proc.stderr, f"`{step}` exited {want} without saying {says!r}: {said}"


def test_the_costly_commands_exit_codes_and_prerequisites_name_commands_the_docs_show():
    """A command the docs stop showing leaves no stale exit code or prerequisite behind."""
    assert len(COSTLY) > 20
    assert set(DOCUMENTED_EXIT) | set(BEFORE) | set(NAMED_ONLY) <= set(COSTLY)
    assert all(step in {c for _, c in COMMANDS} for steps in BEFORE.values() for step in steps[2:3])


def _python_blocks(path: str) -> list[str]:
    """The ``python`` code blocks of a doc, dedented (a block inside a list item is indented)."""
    import textwrap

    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    return [textwrap.dedent(b) for b in re.findall(r"^[ \t]*```python\n(.*?)^[ \t]*```", text, re.S | re.M)]


def test_the_findings_python_reproducers_show_what_they_say(tmp_path):
    """``docs/findings.md``'s Python reproducers of torch findings run as written, in a fresh
    process, and still show the behaviour the finding states (when a torch release fixes one,
    this test says so and the finding is updated)."""
    import subprocess
    import sys

    [divide] = [b for b in _python_blocks("docs/findings.md") if "set_gradient_divide_factor" in b]
    script = tmp_path / "divide.py"
    script.write_text(divide)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "0.5000" in done.stdout and "1.0000" not in done.stdout, done.stdout


def test_the_readme_field_tables_callable_examples_run_as_written():
    """The Fixture field table's ``lambda`` examples are what users paste: each evaluates with
    the names a model file imports (a positional ``Batch(...)`` once failed: it is keyword-only)."""
    import torch
    import torch.nn.functional as F

    from parity.model import Batch

    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    rows = dict(re.findall(r"^\| `(make_batch|loss)` \|[^|]*\| `([^`]+)` \|$", text, re.M))
    assert set(rows) == {"make_batch", "loss"}, rows
    scope = {"torch": torch, "F": F, "Batch": Batch}
    batch = eval(rows["make_batch"], scope)(torch.Generator().manual_seed(0))
    assert isinstance(batch, Batch)
    assert eval(rows["loss"], scope)(batch.inputs[0], batch.target).ndim == 0
    # the ignored example returns what Fixture.ignored must: the model's own parameters
    from types import SimpleNamespace

    from torch import nn

    from parity.model.spec import _check_ignored

    ignored = re.search(r"^\| `ignored`, `ignored_reduction` \|[^|]*\| `([^`]+)`", text, re.M).group(1)
    model = nn.Sequential()
    model.experts = nn.Linear(2, 2)
    _check_ignored(SimpleNamespace(ignored=eval(ignored, scope)), model, "README")


def test_the_documented_cells_csv_columns_are_the_files_columns():
    """docs/ci.md listed 22 of the 30 columns, in an order a positional reader would misread (review)."""
    from parity.judge.record import COLUMNS

    text = " ".join(open(os.path.join(ROOT, "docs", "ci.md"), encoding="utf-8").read().split())
    listed = re.search(r"with the columns `([^`]*)`", text).group(1)
    assert [c.strip() for c in listed.split(",")] == list(COLUMNS)
