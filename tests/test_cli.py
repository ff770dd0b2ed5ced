import os
import subprocess
import sys

import pytest
import torch

from parity.cli import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--fixture", "nope"], "unknown fixture 'nope'; valid: kda, lm, frozen"),
        (["bench", "--fixtures", "nope"], "--fixtures: unknown value 'nope'"),
        (["compare", "/nonexistent", "/nonexistent"], "compare /nonexistent: no such directory"),
        (["report", "/tmp"], "report: no cells.csv in /tmp"),
        (["run", "--param-dtype", "float32"], "argument --param-dtype: invalid choice"),
        (["run", "--matrix", "nope"], "unknown matrix 'nope'; valid: backward-free, cast-inputs, compile, configs, default, fp8, fp8-models, full, grad-dtype, knobs, models, schedules, smoke, topologies"),
        (["run", "--paths", "legacy,fast"], "--paths: unknown value 'fast'; valid: legacy, native"),
        (["run", "--ranks", "3"], "--ranks: unknown value '3'"),
        (["plan", "--fixture", "kda", "--output-dtype", "float8"], "unknown value 'float8'; valid: natural, float32"),
        (["run", "--fault", "gremlin"], "--fault: unknown value 'gremlin'"),
        (["run", "-k", "fixture == 'nope'"], "no cells selected"),
        (["run", "-k", "ranks > 'x'"], "-k: cannot evaluate"),
        (["run", "-k", "1/0 == 1"], "-k: cannot evaluate"),
        (["run", "--seed", "abc"], "argument --seed: must be an integer, got 'abc'"),
        (["run", "--device", "tpu"], "invalid choice: 'tpu' (choose from 'auto', 'cpu', 'cuda')"),
        (["run", "--timeout", "0"], "argument --timeout: must be a positive number of seconds, got '0'"),
        (["run", "--timeout", "-5"], "must be a positive number of seconds"),
        (["run", "--out", "/proc/version/x"], "--out /proc/version/x: cannot write there"),
        (["run", "--bogus"], "unrecognized arguments: --bogus"),
        ([], "required: {plan,run,gate,merge,repro,bench,compare,report,fuzz,fixtures}"),
        (["run", "--resume", "/nonexistent-parity-dir"], "no run.json there"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_plan_prints_the_table_and_both_paths(capsys):
    assert main(["plan", "--fixture", "kda"]) == 0
    out = capsys.readouterr().out
    assert "blocks.0.holder.A_log" in out and "strict" in out
    assert "path requested=legacy taken=legacy" in out and "path requested=native taken=native" in out


EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples", "own_model", "my_model.py")


def _beside_example(path, body: str):
    """A model file that imports examples/own_model/my_model.py as ``mod`` and adds ``body``."""
    path.write_text(f"import dataclasses, importlib.util, torch\n"
                    f"spec = importlib.util.spec_from_file_location('their_model', {EXAMPLE!r})\n"
                    "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n" + body)
    return path


def test_plan_exits_1_when_a_model_declares_fp32_tensors_other_than_its_plan(tmp_path, capsys):
    """``expect_fp32`` is the model's own word on what computes in FP32: a plan that disagrees
    would fail every cell's ``plan`` check, and a CI step gating on ``plan`` must see it."""
    model = _beside_example(tmp_path / "declared.py", "def wrong():\n"
                            "    return dataclasses.replace(mod.parity_model(), expect_fp32=('layers.0.norm.norm_weight',))\n")
    assert main(["plan", "--model", f"{model}:wrong"]) == 1
    assert "(the plan check fails)" in capsys.readouterr().out
    assert main(["plan", "--model", f"{EXAMPLE}:parity_model"]) == 0  # nothing declared: nothing to disagree with


def test_plan_of_a_model_its_source_does_not_have_is_refused(capsys):
    """``--fixture kda --model SRC`` planned the built-in kda, exit 0, ``--model`` unread (review)."""
    example = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples", "own_model", "my_model.py")
    assert main(["plan", "--fixture", "kda", "--model", f"{example}:parity_model"]) == 2
    err = capsys.readouterr().err
    assert "--model " in err and "describes no model named 'kda' (it has: my_model); drop --fixture or name one" in err
    assert main(["plan", "--fixture", "my_model", "--model", f"{example}:parity_model"]) == 0


def test_plan_shows_fallback_and_isolation_error(capsys):
    main(["plan", "--fixture", "mixed_storage"])
    assert "fallback: unit blocks.0 mixes trainable storage dtypes" in capsys.readouterr().out
    main(["plan", "--fixture", "unisolatable"])
    assert "cannot isolate blocks.0.lin.gain, blocks.1.lin.gain" in capsys.readouterr().out


def test_plan_shows_legacys_refusal_of_a_parameter_read_outside_its_unit(tmp_path, capsys):
    """A cell's legacy run refuses a holder parameter its parent's forward reads; ``plan`` shows
    the same refusal, not a plan whose cells would all be ERROR (review, twenty-first stop)."""
    model = _beside_example(tmp_path / "reads.py", "class Block(mod.Block):\n"
                            "    def forward(self, x):\n"
                            "        return super().forward(x) + self.gate.A_log.float().sum().to(x.dtype)\n"
                            "class Model(mod.MyModel):\n"
                            "    def __init__(self):\n"
                            "        super().__init__()\n"
                            "        self.layers = torch.nn.ModuleList([Block() for _ in range(2)])\n"
                            "def reads():\n"
                            "    return dataclasses.replace(mod.parity_model(), name='reads', build=Model)\n")
    main(["plan", "--model", f"{model}:reads"])
    out = capsys.readouterr().out
    assert "path requested=legacy: error: legacy dtype-split cannot isolate layers.0.gate.A_log" in out
    assert "layers.0.gate.A_log is read by layers.0's forward" in out
    assert "path requested=native taken=native" in out


def test_list_prints_cells_without_running(capsys):
    assert main(["run", "--matrix", "default", "--list", "-k", "fixture == 'kda' and path == 'native'"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == f"{len(out) - 1} cells" and all(line.startswith("kda/native/") for line in out[:-1])


def test_module_entry_point():
    proc = subprocess.run([sys.executable, "-m", "parity", "fixtures"], capture_output=True, text=True)
    assert proc.returncode == 0 and "smoke" in proc.stdout and "kda" in proc.stdout


def test_an_out_dir_that_is_a_file_or_holds_another_run_is_refused(capsys, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["run", "--out", str(afile), "-k", "ranks == 1"]) == 2
    assert "is a file; give a directory" in capsys.readouterr().err
    old = tmp_path / "old"
    old.mkdir()
    (old / "cells.csv").write_text("cell\n")
    (old / "summary.md").write_text("48 PASS\n")
    assert main(["run", "--out", str(old), "-k", "ranks == 1"]) == 2
    err = capsys.readouterr().err
    assert "holds another run's results (cells.csv, summary.md); pass --overwrite" in err and err.count("\n") == 1


def test_overwrite_removes_only_parity_files(tmp_path):
    from parity.report import outdir

    d = tmp_path / "out"
    d.mkdir()
    for name in ("cells.csv", "summary.md", "timings.json", "notes.txt"):
        (d / name).write_text("old")
    outdir.prepare(str(d), {"options": {}}, overwrite=True)
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt", "run.json"]


def test_resume_refuses_changed_options_naming_them(capsys, tmp_path):
    from parity.report import outdir

    d = tmp_path / "run"
    d.mkdir()
    from parity.cli import RUN_DEFAULTS, RUN_IDENTITY

    options = {k: RUN_DEFAULTS[k] for k in RUN_IDENTITY}
    outdir.write_manifest(str(d), {"options": options, "cells": [], "status": "interrupted", "torch": "2.14.1",
                                   "device": "cpu"})
    assert main(["run", "--resume", str(d), "--seed", "3"]) == 2
    assert "seed differs from the interrupted run's (None recorded, 3 given)" in capsys.readouterr().err
    assert main(["run", "--resume", str(d), "--timeout", "30"]) == 2  # TIMEOUT verdicts are the timeout's
    assert "timeout differs from the interrupted run's (60.0 recorded, 30.0 given)" in capsys.readouterr().err
    assert main(["run", "--resume", str(d), "--overwrite"]) == 2
    assert "give only one of them" in capsys.readouterr().err
    assert main(["run", "--resume", str(d)]) == 2
    assert "the interrupted run used torch '2.14.1', this one would use" in capsys.readouterr().err
    outdir.write_manifest(str(d), {"options": options, "cells": [], "status": "interrupted",
                                   "torch": torch.__version__, "device": "cpu"})
    assert main(["run", "--resume", str(d)]) == 2  # the smoke matrix selects cells; none were recorded
    assert "selects different cells than the interrupted run" in capsys.readouterr().err


def test_a_closed_stdout_is_not_a_traceback():
    proc = subprocess.run(f"{sys.executable} -m parity fixtures | head -1", shell=True, capture_output=True, text=True)
    assert proc.stdout.startswith("kda") and proc.stderr == ""


SMALL = ["--matrix", "smoke", "-k", "fixture == 'frozen' and ranks == 1"]
HOLD = "import sys\nfrom parity.report import outdir\nwith outdir.locked(sys.argv[1]):\n    print('held', flush=True)\n" \
       "    sys.stdin.read()\n"


def test_a_directory_in_use_is_refused_naming_its_holder_and_a_dead_holder_does_not_block(capsys, tmp_path):
    import os

    from parity.report import outdir

    d = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(d)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    assert holder.stdout.readline() == "held\n"
    assert main(["run", *SMALL, "--out", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"parity: --out {d} is in use by another parity run (pid {holder.pid}); ")
    assert len(err.strip().splitlines()) == 1
    assert os.listdir(d) == [outdir.LOCK]  # nothing of a second run was written
    holder.kill()
    holder.wait()
    assert (d / outdir.LOCK).read_text().strip() == str(holder.pid)  # a stale lock file...
    with outdir.locked(str(d)):  # ...does not block: the kernel released the dead holder's lock
        assert (d / outdir.LOCK).read_text().strip() == str(os.getpid())
    assert os.listdir(d) == []


def test_resume_refuses_a_changed_model_file_or_parity_version(capsys, tmp_path):
    import pathlib
    import shutil

    from parity.cli import RUN_DEFAULTS, RUN_IDENTITY, _select
    from parity.report import outdir
    from parity.report.identity import identity, parity_version
    from parity.runner import resolve_device

    src = tmp_path / "my_model.py"
    shutil.copy(pathlib.Path(__file__).parents[1] / "examples" / "own_model" / "my_model.py", src)
    opts = {**RUN_DEFAULTS, "model": [f"{src}:parity_model"]}
    matrix, cells = _select(opts)
    d = tmp_path / "run"
    d.mkdir()
    manifest = {"options": {k: opts[k] for k in RUN_IDENTITY}, "torch": torch.__version__,
                "device": resolve_device("auto"), "cells": [c.id for c in cells], **identity(matrix.path, cells),
                "status": "interrupted"}
    assert str(src) in manifest["sources"] and matrix.path in manifest["sources"]
    src.write_text(src.read_text() + "\n# edited after the run was interrupted\n")
    outdir.write_manifest(str(d), manifest)
    from parity.model import registry

    assert main(["run", "--resume", str(d)]) == 2  # this process imported the file before the edit
    assert f"{src} changed since this process imported it" in capsys.readouterr().err
    registry._imported_digests.pop(str(src))  # as a new process resuming the run finds it
    assert main(["run", "--resume", str(d)]) == 2
    err = capsys.readouterr().err
    assert f"{src} changed since; resume with the parity, model and matrix files it ran with" in err
    assert len(err.strip().splitlines()) == 1
    outdir.write_manifest(str(d), {**manifest, "parity": {"version": "0.0.1"}})
    assert main(["run", "--resume", str(d)]) == 2
    assert f"it was written by parity 0.0.1, this is parity {parity_version()['version']}" in capsys.readouterr().err



def test_a_model_file_imports_the_modules_beside_it_from_any_folder(tmp_path):
    """``--model dir/model.py:f`` finds ``dir``'s other modules as ``python dir/model.py`` would,
    whatever the working folder: the ranks and a reproducer load the file from elsewhere (review)."""
    import pathlib
    import subprocess
    import sys

    model_dir, elsewhere = tmp_path / "team_model", tmp_path / "elsewhere"
    model_dir.mkdir()
    elsewhere.mkdir()
    text = (pathlib.Path(__file__).parents[1] / "examples" / "own_model" / "my_model.py").read_text()
    (model_dir / "model.py").write_text(text.replace("from __future__ import annotations\n",
                                                     "from __future__ import annotations\nimport team_helpers\n", 1))
    (model_dir / "team_helpers.py").write_text("WIDTH = 1\n")
    proc = subprocess.run([sys.executable, "-m", "parity", "run", "--model", f"{model_dir / 'model.py'}:parity_model",
                           "--matrix", "smoke", "--list"], capture_output=True, text=True, cwd=elsewhere, timeout=120)
    assert proc.returncode == 0 and "8 cells" in proc.stdout, proc.stderr[-2000:]
