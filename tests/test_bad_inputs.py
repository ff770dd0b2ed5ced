"""Issue 20: exit 0 only with evidence, one line and exit 2 for every bad input (before any work),
valid machine-readable outputs. Every case here is pure Python and takes milliseconds: a bad input
must be refused before a rank is spawned (two cases start a ``python -m parity`` process, because
only a real process shows what ``sys.exit`` at import and a closed pipe do to the exit code)."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import asdict

import pytest
import torch

from parity.cli import RUN_DEFAULTS, RUN_IDENTITY, _select, main
from parity.judge.record import Record, Verdict
from parity.report.junit import write_junit
from parity.report.records import RecordWriter
from parity.report.summary import summary_markdown
from parity.runner import resolve_device

EXIT_MODEL = "import sys\nsys.exit(0)\n"
RAISING_MODEL = "raise RuntimeError('no GPU here\\nsecond line')\n"
EXITING_FACTORY = "def model():\n    raise SystemExit\n"
EMPTY_FACTORY = "def model():\n    return []\n"
#: A model that builds on meta (registration validates it) and fails on a real device.
CPU_FAILING = ("import dataclasses\n\nimport torch\n\nfrom parity.model.registry import registered\n\n\n"
               "def _build():\n    if torch.empty(1).device.type != 'meta':\n"
               "        raise RuntimeError('needs a weights file')\n    return registered()['kda'].build()\n\n\n"
               "def model():\n    return dataclasses.replace(registered()['kda'], name='cpufails', build=_build)\n")
KEEP_AS_TEXT = ("import dataclasses\n\nfrom parity.model.registry import registered\n\n\n"
                "def model():\n    return dataclasses.replace(registered()['kda'], name='{name}', keep_fp32={keep!r})\n")
TWICE_FACTORY = ("from parity.model.registry import registered\n\n\ndef model():\n"
                 "    return [registered()['kda'], registered()['kda']]\n")
#: A Fixture without a required field.
NO_BLOCKS = ("from parity.model import Fixture\nfrom parity.model.registry import registered\n\n\n"
             "def model():\n    k = registered()['kda']\n    return Fixture(name='nob', description='d', build=k.build, "
             "unit_roots=k.unit_roots, make_batch=k.make_batch, loss=k.loss)\n")
#: ``kda`` with one thing changed: ``build`` from ``{code}``'s ``_build``, or other ``{fields}``.
ADJUSTED = ("import dataclasses\n\nimport torch\nfrom torch import nn\n\nfrom parity.model.registry import registered\n\n"
            "{code}\n\ndef model():\n    return dataclasses.replace(registered()['kda'], name='{name}', {fields})\n")
PATCHED_FORWARD = ("def _build():\n    m = registered()['kda'].build()\n    f = m.forward\n    m.forward = {forward}\n"
                   "    return m\n")
#: A small selection of the smoke matrix (its cells are never run here).
FILTER = "fixture == 'kda' and ranks == 1 and microbatches == 1"


def _records(verdicts: dict[str, str]) -> list[Record]:
    """One judged record per cell and, as a run writes it after them, a judged cell's coverage record."""
    out = []
    for cell, v in verdicts.items():
        where = dict(cell=cell, fixture=cell.split("/")[0], path=cell.split("/")[1])
        measured = (dict(observed=0.0, allowed=1.0, ratio=0.0, signal=10.0, allowed_over_signal=0.1)  # as a judge
                    if v == "PASS" else {})  # writes a PASS
        out.append(Record(**where, check="output" if v != "SKIP" else "run", name="loss", verdict=Verdict(v),
                          detail="d", **measured))
        if v != "SKIP":
            out.append(Record(**where, check="coverage", name="records", verdict=Verdict.PASS, detail="all owed",
                              observed=0.0, allowed=0.0, ratio=0.0))
    return out


def results(d, verdicts: dict[str, str], status: str = "complete", options: dict | None = None):
    """A results directory as ``run`` leaves it: ``cells.csv`` of one record per cell, ``run.json``."""
    os.makedirs(d, exist_ok=True)
    _recorded(d, _records(verdicts))
    manifest = {"options": options or {"matrix": "smoke"}, "status": status, "cells": sorted(verdicts),
                "torch": torch.__version__, "device": "cpu", "model_warnings": {}}
    with open(os.path.join(d, "run.json"), "w") as fh:
        json.dump(manifest, fh)
    return str(d)


def _recorded(d, records: list[Record]) -> None:
    """``cells.csv`` and ``progress.jsonl`` as a run leaves them (one group per cell)."""
    from parity.report.outdir import with_digests, write_progress

    writer = RecordWriter(os.path.join(d, "cells.csv"))
    progress = []
    for r in records:
        writer.write([r])
        progress.append({"group": r.cell, "bytes": writer.tell()})
    writer.close()
    write_progress(str(d), with_digests(str(d), progress))


def _write(path, text: str | bytes) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(text.encode() if isinstance(text, str) else text)
    return str(path)


def _resumable(d, progress: str, cells_csv: str | None = None) -> str:
    """An interrupted run of :data:`FILTER` that ``--resume`` accepts up to ``progress.jsonl``."""
    from parity.report.identity import identity

    opts = {**RUN_DEFAULTS, "filter": FILTER}
    matrix, cells = _select(opts)
    os.makedirs(d)
    manifest = {"options": {k: opts[k] for k in RUN_IDENTITY}, "torch": torch.__version__,
                "device": resolve_device("auto"), "cells": [c.id for c in cells], "status": "interrupted",
                **identity(matrix.path, cells)}
    _write(os.path.join(d, "run.json"), json.dumps(manifest))
    if cells_csv is not None:
        _write(os.path.join(d, "cells.csv"), cells_csv)
        progress = progress.replace("SIZE", str(len(cells_csv.encode()))).replace("SHA", _sha(cells_csv))
    _write(os.path.join(d, "progress.jsonl"), progress)
    return str(d)


def _sha(text: str | bytes) -> str:
    """The digest ``progress.jsonl`` records of a group's bytes."""
    from parity.digests import data_sha256

    return data_sha256(text.encode() if isinstance(text, str) else text)


HEADER = ",".join(asdict(Record(cell="c", fixture="f", path="p"))) + "\n"
A = "kda/legacy/r1/c0"


def _files(t) -> dict[str, str]:
    """Every bad file the table names, under ``t``."""
    f = {"exit": _write(t / "exit_model.py", EXIT_MODEL) + ":model",
         "raising": _write(t / "raising_model.py", RAISING_MODEL) + ":model",
         "exiting_factory": _write(t / "exiting_factory.py", EXITING_FACTORY) + ":model",
         "cpu_failing": _write(t / "cpu_failing.py", CPU_FAILING) + ":model",
         "keep_text": _write(t / "keep_text.py", KEEP_AS_TEXT.format(name="keeptext", keep="A_log")) + ":model",
         **{f"same_{x}": _write(t / f"same_{x}.py", KEEP_AS_TEXT.format(name="samename", keep=())) + ":model"
            for x in "ab"},
         "keep_typo": _write(t / "keep_typo.py", KEEP_AS_TEXT.format(name="keeptypo", keep=("A_log", "A_lgo"))) + ":model",
         "keep_alias": _write(t / "keep_alias.py", KEEP_AS_TEXT.replace("['kda']", "['lm']").format(
             name="keepalias", keep=("head",))) + ":model",
         "empty_factory": _write(t / "empty_factory.py", EMPTY_FACTORY) + ":model",
         "twice_factory": _write(t / "twice_factory.py", TWICE_FACTORY) + ":model",
         "no_blocks": _write(t / "no_blocks.py", NO_BLOCKS) + ":model",
         "model_class": _write(t / "model_class.py", "from torch import nn\n\n\nclass MyModel(nn.Module):\n    pass\n")
         + ":MyModel",
         "factory_factory": _write(t / "factory_factory.py", "def model():\n    return model\n") + ":model",
         **{key: _write(t / f"{key}.py", ADJUSTED.format(name=key, code=code, fields=fields)) + ":model"
            for key, code, fields in (
                ("tuple_out", PATCHED_FORWARD.format(forward="lambda *a: (f(*a), 1)"), "build=_build"),
                ("ignores_input", PATCHED_FORWARD.format(forward="lambda x, *a: f(torch.zeros_like(x), *a)"),
                 "build=_build"),
                ("frozen", PATCHED_FORWARD.format(forward="f\n    m.requires_grad_(False)"), "build=_build"),
                ("loss_shape", "", "loss=lambda out, target: (out - target) ** 2"),
                # a loss no gradient flows from: backward raises in every cell (review)
                ("loss_cut", "", "loss=lambda out, target: ((out - target) ** 2).mean().detach()"),
                ("output_cut", "", "output=lambda out: out.detach()"),
                ("compute_typo", "", "compute_dtypes={'nope.weight': 'float32'}"),
                ("expect_typo", "", "expect={'nativ': 'fallback:mixes'}"),
                ("lazy", "def _build():\n    m = registered()['kda'].build()\n    m.head = nn.LazyLinear(4)\n"
                         "    return m\n", "build=_build"),
                # what Fixture.ignored declares must be the model's parameters, or its parallelism goes untested
                ("ignores_module", "", "ignored=lambda m: {m.head}"),
                ("ignores_foreign", "", "ignored=lambda m: {nn.Parameter(torch.ones(3))}"),
                ("ignores_none", "", "ignored=lambda m: None"),
                ("builds_int", "", "build=lambda: 42"),
                ("plain", "", "description='kda under another name'"),

                # batches from torch's global generator: every cell diverged, blamed on a module (review)
                ("global_rng", "def _batch(g):\n    b = registered()['kda'].make_batch(g)\n"
                               "    return type(b)(inputs=tuple(torch.randn_like(x) for x in b.inputs), target=b.target)\n",
                 "make_batch=_batch"))},
         "afile": _write(t / "afile", "x"), "complete": results(t / "complete", {A: "PASS"}),
         "interrupted": results(t / "interrupted", {A: "PASS"}, status="interrupted"),
         "empty": str(t / "empty"), "empty_toml": _write(t / "empty.toml", "# nothing else\n")}
    os.makedirs(f["empty"])
    f["harness_clash"] = os.path.dirname(_write(t / "harness_clash" / "harness", "x"))
    matrices = {"axes": "axes = 3", "ranks": "[axes]\nranks = [true]", "reshard": "[axes]\nreshard = [1]",
                "seed": "[axes]\nseed = [1.5]", "seed_huge": "[axes]\nseed = [18446744073709551616]",
                "fixture": "[axes]\nfixture = [1]",
                "accumulation": "[axes]\naccumulation = [true]", "skip": 'skip = "never"',
                "skip_entry": "skip = [1]", "when": '[[skip]]\nwhen = 3\nreason = "r"',
                "reason": "[[skip]]\nwhen = \"ranks == 1\"\nreason = []", "steps": "steps = true",
                "steps_huge": "steps = 100000", "design": "design = [1]", "description": "description = {a = 1}",
                "exhaustive": 'design = "covering"\nexhaustive = "fixture"', "models": "models = \"x.py:m\"",
                "model_file": 'models = ["nowhere.py:m"]', "twice": "[axes]\nranks = [1, 2, 1]",
                "microbatches": '[axes]\naccumulation = ["1000000000:last"]',
                "underscore": '[axes]\naccumulation = ["1_0"]', "fullwidth": '[axes]\naccumulation = ["\uff13"]',
                "same_accumulation": '[axes]\naccumulation = ["1", "1:every"]',
                "empty_reason": '[axes]\nranks = [1, 2]\n[[skip]]\nwhen = "ranks == 1"\nreason = " "',
                "product_rotate": 'rotate = ["seed"]\n[axes]\nranks = [1]', "steps_twice": 'steps = 5\n[axes]\nsteps = [2]',
                "empty_axes": "[axes]\n", "no_models": "models = []\n[axes]\n",
                "skip_some": '[axes]\nfixture = ["kda"]\nranks = [1, 2]\n[[skip]]\nwhen = "ranks / (ranks - 2) == 1"\n'
                             'reason = "r"'}
    for name, text in matrices.items():
        f[f"matrix_{name}"] = _write(t / "matrices" / f"{name}.toml", text)
    f["matrix_latin1"] = _write(t / "matrices" / "latin1.toml", b"description = '\xff'\n[axes]\nranks = [1]\n")
    f["matrix_impossible"] = _write(t / "matrices" / "impossible.toml",
                                    "[axes]\nfixture = ['kda']\npath = ['legacy']\nranks = [1, 4]\nmesh = ['fsdp', 'hsdp']\n")
    for name, text in {"notjson": "{", "list": "[]", "options": '{"options": 3}', "binary": b"\xff\xfe",
                       "paths": '{"options": {"paths": 5}}', "steps": '{"options": {"steps": 100000}}',
                       "fault": '{"options": {"matrix": "smoke", "fault": null}, "status": "complete", "cells": []}',
                       "model": '{"options": {"matrix": "smoke", "model": null}, "status": "complete", "cells": []}',
                       "environment": '{"options": {"matrix": "smoke"}, "environment": 5, "status": "complete"}',
                       "warnings": '{"options": {"matrix": "smoke"}, "model_warnings": [1], "status": "complete"}'}.items():
        f[f"runjson_{name}"] = _write(t / f"runjson_{name}" / "run.json", text).removesuffix("/run.json")
        results(t / f"gate_runjson_{name}", {A: "PASS"})
        _write(t / f"gate_runjson_{name}" / "run.json", text)
        f[f"gate_runjson_{name}"] = str(t / f"gate_runjson_{name}")
    columns = HEADER.strip().split(",")
    forged = {"pass_ratio": ("9", "1", "9", ""), "pass_nan": ("nan", "1", "nan", ""),  # observed, allowed, ratio, share[, signal]
              "pass_blank": ("", "", "", ""), "pass_quotient": ("1", "0.001", "0.5", ""),
              "pass_vacuous": ("0.1", "1", "0.1", "5", "0.2"), "pass_unweighed": ("0.1", "1", "0.1", "", ""),
              "pass_understated": ("0.1", "1", "0.1", "0.1", "1.25")}
    for name in ("verdict", "number", "binary", *forged):
        d = results(t / f"csv_{name}", {A: "PASS"})
        with open(os.path.join(d, "cells.csv")) as fh:
            good = fh.read().splitlines()[1].split(",")
        bad = list(good)
        if name == "verdict":
            bad[bad.index("PASS")] = "MAYBE"
        elif name in forged:  # a PASS no judge writes: its numbers contradict it, or are gone
            for column, value in zip(("observed", "allowed", "ratio", "allowed_over_signal", "signal"), forged[name]):
                bad[columns.index(column)] = value
        else:
            bad[HEADER.split(",").index("ranks")] = "abc"
        text = HEADER + ",".join(bad) + "\n" + ",".join(good) + "\n"
        _write(os.path.join(d, "cells.csv"), text if name != "binary" else HEADER.encode() + b"\xff\n")
        size = os.path.getsize(os.path.join(d, "cells.csv"))  # progress.jsonl agrees: only the row is wrong
        with open(os.path.join(d, "cells.csv"), "rb") as fh:
            digest = _sha(fh.read())
        _write(os.path.join(d, "progress.jsonl"), json.dumps({"group": A, "bytes": size, "sha256": digest}) + "\n")
        f[f"csv_{name}"] = d
    for name, text in {"notjson": "{", "shape": '{"decisions": [{"model": 1}]}'}.items():
        d = results(t / f"gatejson_{name}", {A: "PASS"})
        f[f"gatejson_{name}"] = os.path.dirname(_write(os.path.join(d, "gate.json"), text))
    f["digest_notjson"] = os.path.dirname(_write(t / "digest_notjson" / "digest.json", "{"))
    f["digest_shape"] = os.path.dirname(_write(t / "digest_shape" / "digest.json", '{"cells": {"a": "GOOD"}}'))
    f["digest_failed"] = os.path.dirname(_write(t / "digest_failed" / "digest.json", '{"bench_failed": 5}'))
    f["bench_row"] = os.path.dirname(_write(t / "bench_row" / "bench.csv",
                                            "fixture,path,metric,value\nkda,legacy,units,x\n"))
    f["header_only"] = os.path.dirname(_write(t / "header_only" / "cells.csv", HEADER))
    f["bench"] = os.path.dirname(_write(t / "bench" / "bench.csv", "fixture,path,metric,value\nkda,legacy,units,5\n"))
    f["no_cells"] = results(t / "no_cells", {})  # a complete run of no cell (an empty part): no baseline
    f["digest_dir"] = _write(t / "digest_dir" / "digest.json", "{}").removesuffix("/digest.json")
    f["bench_dir"] = _write(t / "bench_dir" / "bench.json", "{}").removesuffix("/bench.json")
    return f


#: (argv, what the one line says); ``{name}`` is a file of :func:`_files`, ``{out}`` an --out that must
#: not be created (nothing may start).
CASES = [
    # plan
    (["plan"], "give --fixture NAME"),
    (["plan", "--fixture", "kda", "--param-dtype", "float8"], "float8"),
    (["plan", "--model", "{exit}"], "called sys.exit(0); a model source must not exit"),
    (["plan", "--model", "{raising}"], "RuntimeError: no GPU here; second line"),
    # run: matrix files
    (["run", "--matrix", "{matrix_axes}", "--out", "{out}"], "axes must be a table, not an integer"),
    (["run", "--matrix", "{matrix_ranks}", "--out", "{out}"], "axes.ranks has True, a boolean; write integers"),
    (["run", "--matrix", "{matrix_reshard}", "--out", "{out}"], "axes.reshard has 1, an integer; write booleans"),
    (["run", "--matrix", "{matrix_seed}", "--out", "{out}"], "axes.seed has 1.5, a float"),
    (["run", "--matrix", "{matrix_seed_huge}", "--out", "{out}"], "axes.seed has 18446744073709551616; seeds run"),
    (["run", "--seed", str(2**64), "--out", "{out}"], "--seed: must be from"),
    (["run", "--matrix", "{matrix_fixture}", "--out", "{out}"], "axes.fixture has 1, an integer; write strings"),
    (["run", "--matrix", "{matrix_accumulation}", "--out", "{out}"], "axes.accumulation has True"),
    (["run", "--matrix", "{matrix_skip}", "--out", "{out}"], "skip must be an array of tables, not a string"),
    (["run", "--matrix", "{matrix_skip_entry}", "--out", "{out}"], "skip must be an array of tables"),
    (["run", "--matrix", "{matrix_when}", "--out", "{out}"], "skip.when must be a string, not an integer"),
    (["run", "--matrix", "{matrix_reason}", "--out", "{out}"], "skip.reason must be a string"),
    (["run", "--matrix", "{matrix_steps}", "--out", "{out}"], "steps must be an integer, not a boolean"),
    (["run", "--matrix", "{matrix_steps_huge}", "--out", "{out}"], "steps must be a positive integer up to 1000"),
    (["run", "--matrix", "{matrix_design}", "--out", "{out}"], "design must be a string"),
    (["run", "--matrix", "{matrix_description}", "--out", "{out}"], "description must be a string, not a table"),
    (["run", "--matrix", "{matrix_exhaustive}", "--out", "{out}"], "exhaustive must be an array of strings"),
    (["run", "--matrix", "{matrix_models}", "--out", "{out}"], "models must be an array of strings"),
    (["run", "--matrix", "{matrix_model_file}", "--out", "{out}"],  # named where it was written, not as --model
     "model_file.toml: models entry '"),
    (["run", "--matrix", "{matrix_twice}", "--out", "{out}"], "axes.ranks has 1 twice; give each value once"),
    (["run", "--model", "{twice_factory}", "--model", "{twice_factory}", "--out", "{out}"], "is given twice"),
    (["run", "--model", "{no_blocks}", "--out", "{out}"], "missing 1 required keyword-only argument: 'blocks'; give "
     "Fixture(name=..., description=..., build=..., unit_roots=..., blocks=..., make_batch=..., loss=...)"),
    (["bench", "--model", "{twice_factory}", "--model", "{twice_factory}", "--out", "{out}"], "is given twice"),
    # run: options
    # the first would silently not run (the second replaced it) and its gate read GO
    (["gate", "--model", "{same_a}", "--model", "{same_b}", "--out", "{out}"],
     "and '{same_b}' both describe a model named 'samename'; give each model its own Fixture.name"),
    (["run", "--paths", "legacy,legacy", "--out", "{out}"], "--paths: 'legacy' is given twice"),
    (["run", "--ranks", "1,2,1", "--out", "{out}"], "--ranks: '1' is given twice"),
    (["run", "--timeout", "inf", "--out", "{out}"], "--timeout: must be a positive number of seconds, got 'inf'"),
    (["run", "--timeout", "nan", "--out", "{out}"], "got 'nan'"),
    (["run", "--steps", "1001", "--out", "{out}"], "--steps: must be at most 1000"),
    (["run", "--steps", "0", "--out", "{out}"], "--steps: must be a positive integer"),
    (["run", "--clip", "-0.5", "--out", "{out}"], "--clip: must be a finite max-norm >= 0"),
    (["run", "--clip", "inf", "--out", "{out}"], "--clip: must be a finite max-norm >= 0"),
    (["run", "--eval", "sometimes", "--out", "{out}"], "--eval: invalid choice: 'sometimes'"),
    (["run", "--matrix", "fp8", "--eval", "between-steps", "--out", "{out}"], "eval 'between-steps' runs with weights 'none'"),
    (["run", "-k", "fixture == 'kda' or " * 30 + "True", "--out", "{out}"], "more than 500"),
    (["run", "-k", "fixture == 'a' * 10**10", "--out", "{out}"], "Mult in"),
    (["run", "-k", "ranks == 9**9**9", "--out", "{out}"], "Pow in"),
    (["run", "-k", "fixture == '%0999999999d' % 1", "--out", "{out}"], "Mod in"),
    (["run", "-k", "ranks == 1 << 10**10", "--out", "{out}"], "LShift in"),
    (["run", "-k", "[x for x in path]", "--out", "{out}"], "ListComp in"),
    (["run", "-k", "ranks == \0", "--out", "{out}"], "-k: cannot parse"),
    (["run", "-k", FILTER, "--junit", "{empty}", "--out", "{out}"], "--junit {empty}: is a directory"),
    (["run", "-k", FILTER, "--junit", "/proc/parity.xml", "--out", "{out}"], "--junit /proc/parity.xml: cannot write"),
    (["run", "-k", FILTER, "--junit", "{afile}/j.xml", "--out", "{out}"], "no folder"),
    (["run", "--model", "{exit}", "--out", "{out}"], "called sys.exit(0)"),
    # a model every cell would fail on, or whose cells would judge nothing: found by building it once
    (["run", "--model", "{tuple_out}", "--out", "{out}"], "its forward returns tuple, not a tensor; set Fixture.output"),
    (["plan", "--model", "{tuple_out}"], "plan: model 'tuple_out': its forward returns tuple"),
    (["run", "--model", "{ignores_input}", "--out", "{out}"], "does not differentiate Batch.inputs[0]"),
    (["plan", "--model", "{loss_cut}"], "Fixture.loss returns a tensor cut off from the output's graph "
                                        "(requires_grad False)"),
    (["run", "--model", "{output_cut}", "--out", "{out}"], "Fixture.output returns a tensor no trainable parameter "
                                                          "reaches"),
    (["gate", "--model", "{loss_shape}", "--matrix", "smoke", "--out", "{out}"], "Fixture.loss returns (2, 8, 32), not one number"),
    (["plan", "--model", "{frozen}"], "no parameter of the model is trainable"),
    (["plan", "--model", "{compute_typo}"], "Fixture.compute_dtypes names 'nope.weight', which is not a parameter"),
    (["plan", "--model", "{expect_typo}"], "Fixture.expect key 'nativ' names no sharding path or contract; did you "
     "mean 'native'? (valid here: dtype-split, per-parameter, legacy, native)"),
    (["run", "--model", "{expect_typo}", "--list"], "Fixture.expect key 'nativ'"),
    (["plan", "--model", "{lazy}"], "'head.weight' is uninitialized (a lazy module)"),
    (["plan", "--model", "{ignores_module}"], "Fixture.ignored returned Linear among its items; return a set of "
     "the model's own parameters"),
    (["run", "--model", "{ignores_foreign}", "--out", "{out}"], "Fixture.ignored returned a parameter that is not "
     "the model's among its items"),
    (["plan", "--model", "{ignores_none}"], "Fixture.ignored returned NoneType; return a set of the model's own"),
    (["plan", "--model", "{builds_int}"], "Fixture.build returned int, not a torch.nn.Module; return the model"),
    # a model without a TP plan or EP modules on a composed mesh ran FSDP alone and passed as composed (review)
    (["run", "--model", "{plain}", "--matrix", "topologies", "-k", "mesh == 'fsdp+tp'", "--out", "{out}"],
     "model 'plain' declares no tensor parallelism (Fixture.tensor_parallel), so its cells on mesh 'fsdp+tp' would "
     "run FSDP alone and claim the composition; declare it, or leave them out (-k \"mesh != 'fsdp+tp'\")"),
    (["gate", "--model", "{plain}", "--matrix", "topologies", "--out", "{out}"],
     "model 'plain' declares no expert parallelism (Fixture.expert_parallel)"),
    (["run", "--model", "{global_rng}", "--out", "{out}"], "model 'global_rng': Fixture.make_batch returns other "
     "tensors for the same seeded torch.Generator; draw every tensor from the generator it is given"),
    (["plan", "--model", "{model_class}"], "names the model MyModel, not a parity model description"),
    (["plan", "--model", "{factory_factory}"], "returned function, not parity.model.Fixture"),
    (["run", "--model", "{exiting_factory}", "--out", "{out}"], "the factory failed: called sys.exit(None)"),
    (["run", "--model", "{empty_factory}", "--out", "{out}"], "describes no model (an empty list or mapping)"),
    (["plan", "--model", "{empty_factory}"], "describes no model"),
    (["run", "--model", "{keep_text}", "--out", "{out}"], "Fixture.keep_fp32 = 'A_log'; it is a tuple of strings, e.g. ('A_log',)"),
    # a typo keeps nothing in FP32: both paths would agree on that, and the run would be green
    (["gate", "--model", "{keep_typo}", "--out", "{out}"],
     "Fixture.keep_fp32 pattern 'A_lgo' selects no parameter or buffer of the model (rule transformers); correct it or drop it"),
    (["plan", "--model", "{keep_typo}"], "Fixture.keep_fp32 pattern 'A_lgo' selects no parameter"),
    # the tied head's alias: refused as a typo, though the name is the model's (review)
    (["plan", "--model", "{keep_alias}"], "Fixture.keep_fp32 pattern 'head' selects only 'head.weight', a tied alias "
     "of 'embed.weight' (parity names a tied parameter by its first name); give a pattern for 'embed.weight'"),
    (["plan", "--model", "{cpu_failing}"], "plan: building model 'cpufails' failed: RuntimeError: needs a weights file"),
    (["run", "--model", "{twice_factory}", "--out", "{out}"], "two models are named 'kda'"),
    # run --resume: malformed files
    (["run", "--resume", "{runjson_notjson}"], "run.json is unreadable"),
    (["run", "--resume", "{runjson_list}"], "run.json is not a JSON object"),
    (["run", "--resume", "{runjson_options}"], "options is not an object"),
    (["run", "--resume", "{runjson_binary}"], "run.json is unreadable"),
    (["run", "--resume", "{runjson_paths}"], "run.json records paths 5, which that option cannot be"),
    (["run", "--resume", "{runjson_steps}"], "run.json records steps 100000"),
    (["run", "--resume", "{resume_progress}"], "progress.jsonl line 1 is not a progress entry"),
    (["run", "--resume", "{resume_progress_shape}"], "progress.jsonl line 2 is not a progress entry"),
    (["run", "--resume", "{resume_cells}"], "cells.csv row 2: not a parity record"),
    (["run", "--resume", "{resume_claimed}"], "progress.jsonl records 2 cells as done that cells.csv holds no records"),
    # rows edited after they were recorded, or their digest gone: a resumed run would judge rows it never wrote
    (["run", "--resume", "{resume_edited}"], "cells.csv: the rows of group g (bytes 0-"),
    (["run", "--resume", "{resume_undigested}"], "progress.jsonl line 1 is not a progress entry parity writes"),
    # gate
    (["gate", "--from", "{gate_runjson_notjson}"], "run.json is unreadable"),
    (["gate", "--from", "{gate_runjson_list}"], "run.json is not a JSON object"),
    (["gate", "--from", "{gate_runjson_warnings}"], "run.json: model_warnings is not an object"),
    (["gate", "--from", "{gate_runjson_fault}"], "run.json records fault None, which that option cannot be"),
    (["gate", "--from", "{gate_runjson_model}"], "run.json records model None, which that option cannot be"),
    (["gate", "--from", "{gate_runjson_environment}"], "run.json: environment is not an object"),
    (["run", "--resume", "{runjson_model}"], "run.json records model None, which that option cannot be"),
    (["gate", "--from", "{csv_verdict}"], "cells.csv row 2: not a parity record ('MAYBE' is not a valid Verdict)"),
    (["gate", "--from", "{csv_number}"], "cells.csv row 2: not a parity record"),
    (["gate", "--from", "{csv_binary}"], "cells.csv is unreadable"),
    (["gate", "--from", "{csv_pass_ratio}"], "row 2: not a parity record (a PASS whose numbers say otherwise: observed 9"),
    (["gate", "--from", "{csv_pass_nan}"], "a PASS whose numbers say otherwise: observed nan, allowed 1, ratio nan"),
    (["gate", "--from", "{csv_pass_blank}"], "row 2: not a parity record (a PASS of output without its observed / allowed / ratio)"),
    (["gate", "--from", "{csv_pass_quotient}"], "(a PASS whose ratio 0.5 is not observed / allowed (1000))"),
    (["gate", "--from", "{csv_pass_vacuous}"], "(a PASS whose allowance is 5 of the change it judges (at least 0.5: INCONCLUSIVE))"),
    (["gate", "--from", "{csv_pass_unweighed}"],
     "(a PASS of output that allowed 1 without the size of what it judged (signal / allowed_over_signal))"),
    (["gate", "--from", "{csv_pass_understated}"], "(a PASS whose allowed_over_signal 0.1 is under allowed / signal (0.8))"),
    (["report", "{csv_pass_ratio}"], "ratio 9)"),
    (["compare", "{complete}", "{csv_pass_ratio}"], "ratio 9)"),
    (["gate", "--from", "{complete}", "--compare-to", "{interrupted}"], "that run is interrupted, not complete"),
    # results of two kinds never side by side: a run's beside a baseline digest shadowed it, a bench's
    # beside a run's read as complete when stopped (review)
    (["run", "--matrix", "smoke", "-k", FILTER, "--out", "{digest_dir}", "--overwrite"],
     "--out {digest_dir} holds a compare digest's results (digest.json); choose another --out"),
    (["run", "--matrix", "smoke", "-k", FILTER, "--out", "{bench_dir}"], "holds a bench's results (bench.json)"),
    (["bench", "--out", "{complete}"], "--out {complete} holds a run's results (cells.csv, run.json, progress.jsonl"),
    (["gate", "--from", "{complete}", "--matrix", "nope"], "judges that run as it ran (its gate files go beside it): "
     "--matrix does not apply"),
    (["gate", "--from", "{complete}", "-k", "ranks == 2"], "-k does not apply"),
    (["gate", "--from", "{complete}", "--out", "{out}"], "--out does not apply"),
    (["gate", "--from", "{complete}", "--fp64"], "--fp64 does not apply"),
    (["gate", "--from", "{complete}", "--junit", "{complete}"], "--junit {complete}: is a directory"),
    # gate --from writes beside the run: a JUnit path on one of its files would destroy it (review)
    (["gate", "--from", "{complete}", "--junit", "{complete}/cells.csv"], "is the results' own cells.csv; give "
                                                                         "another file"),
    (["run", "--matrix", "smoke", "--out", "{out}", "--junit", "{out}/run.json"], "is the results' own run.json"),
    (["run", "--shard", "1/99999999999999999999", "--out", "{out}"], "at most 1024 parts"),
    (["run", "--shard", "1/1025", "--list"], "at most 1024 parts"),
    (["run", "--shard", "1/" + "9" * 5000, "--list"], "at most 1024 parts"),  # past int()'s digit limit
    (["run", "--matrix", "{matrix_microbatches}", "--out", "{out}"], "(1 <= K <= 64)"),
    (["run", "--matrix", "{matrix_skip_some}", "--out", "{out}"], "skip_some.toml: skip.when: cannot evaluate "
     "'ranks / (ranks - 2) == 1' on cell kda/legacy/r2"),
    (["run", "-k", "ranks is 2", "--out", "{out}"], "-k: write == / != instead of is / is not in 'ranks is 2'"),
    (["gate", "--compare-to", "{interrupted}", "--out", "{out}"], "that run is interrupted, not complete"),
    (["gate", "--compare-to", "{empty}/nope", "--out", "{out}"], "--compare-to {empty}/nope: no such directory"),
    (["gate", "--compare-to", "{complete}", "--matrix", "default", "--out", "{out}"],
     "those results are of matrix 'smoke', this gate judges 'default'"),
    (["gate", "--timeout", "nan", "--out", "{out}"], "got 'nan'"),
    (["gate", "--model", "{exit}", "--out", "{out}"], "called sys.exit(0)"),
    (["gate", "-k", FILTER, "--junit", "{empty}", "--out", "{out}"], "is a directory"),
    # bench
    (["bench", "--out", "{afile}"], "--out {afile}: is a file"),
    (["bench", "--out", "{afile}/sub"], "--out {afile}/sub: cannot write there"),
    (["bench", "--paths", "legacy,legacy", "--out", "{out}"], "--paths: 'legacy' is given twice"),
    (["bench", "--steps", "5000", "--out", "{out}"], "--steps: must be at most 1000"),
    (["bench", "--warmup", "5000", "--out", "{out}"], "--warmup must be from 0 to 1000"),
    (["bench", "--timeout", "inf", "--out", "{out}"], "got 'inf'"),
    (["bench", "--model", "{exit}", "--out", "{out}"], "called sys.exit(0)"),
    # compare
    (["compare", "{interrupted}", "{complete}"], "compare {interrupted}: that run is interrupted, not complete"),
    (["compare", "{empty}", "{complete}"], "no cells.csv, bench.csv or digest.json"),
    (["compare", "{header_only}", "{complete}"], "of unknown status (no run.json beside its cells.csv)"),
    (["compare", "{no_cells}", "{complete}"], "holds no results"),
    (["compare", "{csv_verdict}", "{complete}"], "cells.csv row 2: not a parity record"),
    (["compare", "{complete}", "{csv_number}"], "cells.csv row 2: not a parity record"),
    (["compare", "{gate_runjson_notjson}", "{complete}"], "run.json is unreadable"),
    (["compare", "{digest_notjson}", "{complete}"], "digest.json is unreadable"),
    (["compare", "{digest_shape}", "{complete}"], "not a digest as parity writes it"),
    (["compare", "{bench_row}", "{bench_row}"], "bench.csv row 2: not a bench row"),
    (["compare", "{bench}", "{complete}"], "not the same kind of results; compare a run with a run"),
    (["compare", "{complete}", "{digest_failed}"], "not a digest as parity writes it"),
    (["gate", "--from", "{complete}", "--compare-to", "{bench}"], "not the same kind of results"),
    (["compare", "{complete}", "{bench}"], "holds a matrix run's cells, {bench} a bench's rows"),
    (["compare", "{complete}", "{complete}", "--factor", "inf"], "--factor: must be a finite number >= 1"),
    (["compare", "{complete}", "{complete}", "--factor", "0.5"], "--factor: must be a finite number >= 1"),  # a run regresses from itself
    (["compare", "{complete}", "{complete}", "--write-digest", "{afile}"], "--write-digest {afile}: is a file"),
    # report
    (["report", "{csv_verdict}"], "cells.csv row 2: not a parity record"),
    (["report", "{csv_binary}"], "cells.csv is unreadable"),
    (["report", "{gatejson_notjson}"], "gate.json is unreadable"),
    (["report", "{gatejson_shape}"], "gate.json: decisions are not as parity writes them"),
    (["report", "{gate_runjson_list}"], "run.json is not a JSON object"),
    # fuzz
    (["fuzz", "--out", "{afile}"], "--out {afile}: is a file"),
    (["fuzz", "--timeout", "nan", "--out", "{out}"], "got 'nan'"),
    (["fuzz", "--fault", "gremlin", "--out", "{out}"], "--fault: unknown value 'gremlin'"),
    (["fuzz", "--examples", "0", "--out", "{out}"], "--examples: must be a positive integer"),
    (["bench", "--fixtures", "kda", "--harness", "smoke", "--out", "{harness_clash}"],
     "--out {harness_clash}: {harness_clash}/harness is a file, where bench --harness writes its run"),
    (["bench", "--harness-repeats", "0", "--out", "{out}"], "--harness-repeats: must be a positive integer"),
    (["bench", "--harness-repeats", "101", "--out", "{out}"], "--harness-repeats must be at most 100"),
    (["bench", "--fixtures", "lm", "--paths", "legacy", "--harness", "fp8", "--out", "{out}"],
     "--harness fp8: no cell of that matrix has these models and paths"),
    (["run", "--list", "-k", "ranks == '2'"], "no cells selected from matrix 'smoke'"),
    (["fuzz", "--out", "{complete}"], "--out {complete} holds a run's results (cells.csv"),
    # an empty path is refused, not read as an option not given
    (["gate", "--from", ""], "argument --from: must name a file or directory, got ''"),
    (["gate", "--from", "{complete}", "--compare-to", " "], "argument --compare-to: must name a file or directory"),
    (["run", "--resume", "", "--out", "{out}"], "argument --resume: must name a file or directory"),
    (["run", "--junit", "", "--out", "{out}"], "argument --junit: must name a file or directory"),
    (["compare", "{complete}", "{complete}", "--write-digest", ""], "argument --write-digest: must name"),
    (["repro", "x", "--from", "{complete}", "--out", ""], "argument --out: must name a file or directory"),
    (["repro", "x", "--from", "{complete}", "--out", "{complete}/cells.csv"], "--out {complete}/cells.csv: is the "
     "results' own cells.csv; give another file, e.g. {complete}/repro.py"),
    (["merge", "", "--out", "{out}"], "argument DIR: must name a file or directory"),
    (["bench", "--ranks", "2000", "--out", "{out}"], "argument --ranks: invalid choice: 2000 (choose from 1, 2, 4, 8)"),
    (["run", "--matrix", "{empty_toml}", "--out", "{out}"], "the matrix names no axes and no models"),
    (["run", "--matrix", "{matrix_empty_axes}", "--out", "{out}"], "the matrix names no axes and no models"),
    (["run", "--matrix", "{matrix_no_models}", "--out", "{out}"], "the matrix names no axes and no models"),
    (["run", "--matrix", "{matrix_latin1}", "--out", "{out}"], "latin1.toml: not UTF-8 text (byte 15)"),
    # a product row no cell can be names the file and the row; an axis option, the option (review)
    (["run", "--matrix", "{matrix_impossible}", "--list"],
     "impossible.toml: the combination fixture = 'kda', path = 'legacy', ranks = 1, mesh = 'hsdp' cannot run (mesh"),
    (["run", "--mesh", "hsdp", "-k", "ranks == 1", "--list"], "--mesh hsdp cannot run kda/legacy/r1/"),
    (["run", "--matrix", "{matrix_underscore}", "--out", "{out}"], "axes.accumulation has unknown value '1_0'"),
    (["run", "--matrix", "{matrix_fullwidth}", "--out", "{out}"], "axes.accumulation has unknown value"),
    (["run", "--matrix", "{matrix_same_accumulation}", "--out", "{out}"], "axes.accumulation has '1' and '1:every', "
     "the same value"),
    (["run", "--matrix", "{matrix_empty_reason}", "--out", "{out}"], "a [[skip]] reason is empty"),
    (["run", "--matrix", "{matrix_product_rotate}", "--out", "{out}"], "rotate applies to design = \"covering\" only"),
    (["run", "--matrix", "{matrix_steps_twice}", "--out", "{out}"], "steps is given twice"),
    # fixtures
    (["fixtures", "extra"], "unrecognized arguments: extra"),
    # a GPU asked for where torch sees none: every cell would be the same ERROR
    *([([cmd, "--device", "cuda", "--out", "{out}"], "--device cuda: torch ") for cmd in ("run", "gate", "fuzz", "bench")]
      + [(["run", "--list", "--device", "cuda"], "--device cuda: torch ")]
      if not torch.cuda.is_available() else []),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Built once: no case may change them (each is refused before it touches anything)."""
    tmp_path = tmp_path_factory.mktemp("bad")
    f = _files(tmp_path)
    f["resume_progress"] = _resumable(tmp_path / "resume_progress", "not json\n")
    f["resume_progress_shape"] = _resumable(tmp_path / "resume_progress_shape",
                                            '{"group": "g", "bytes": SIZE, "sha256": "SHA"}\n{"group": 1}\n', HEADER)
    f["resume_cells"] = _resumable(tmp_path / "resume_cells", '{"group": "g", "bytes": SIZE, "sha256": "SHA"}\n',
                                   HEADER + "a,b,c\n")
    first = _select({**RUN_DEFAULTS, "filter": FILTER})[1][0]  # progress claims its group, no row of it exists
    f["resume_claimed"] = _resumable(tmp_path / "resume_claimed", f'{{"group": "{first.pair_id}", "bytes": SIZE, "sha256": "SHA"}}\n',
                                     HEADER)
    f["resume_edited"] = _resumable(tmp_path / "resume_edited", '{"group": "g", "bytes": SIZE, "sha256": "%s"}\n'
                                    % ("0" * 64), HEADER)
    f["resume_undigested"] = _resumable(tmp_path / "resume_undigested", '{"group": "g", "bytes": SIZE}\n', HEADER)
    f["out"] = str(tmp_path / "out")
    return f


@pytest.mark.parametrize("argv, message", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_bad_input_is_one_line_and_exit_2_before_any_work(capsys, files, argv, message):
    code = main([a.format(**files) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("parity: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert message.format(**files) in err
    assert not os.path.exists(files["out"])  # nothing was started: not even the output directory


def _parity(*args, **kw):
    return subprocess.run([sys.executable, "-m", "parity", *args], capture_output=True, text=True, timeout=120, **kw)


def test_a_model_exiting_at_import_is_exit_2_in_a_real_process(tmp_path):
    model = _write(tmp_path / "exit_model.py", EXIT_MODEL) + ":model"
    proc = _parity("gate", "--model", model, "--out", str(tmp_path / "gate"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "called sys.exit(0)" in proc.stderr and not os.path.exists(tmp_path / "gate")


def test_user_code_exiting_0_during_a_command_is_not_success(capsys, monkeypatch):
    import parity.cli as cli

    def exits(args):
        sys.exit(0)

    monkeypatch.setattr(cli, "cmd_fixtures", exits)
    assert main(["fixtures"]) == 2
    assert "user code (a model) called sys.exit(0)" in capsys.readouterr().err


class _ClosedPipe:
    """A stdout whose reader went away."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")


def test_user_code_raising_keyboard_interrupt_is_one_line_and_130(tmp_path, capsys):
    model = _write(tmp_path / "kb.py", "def kb():\n    raise KeyboardInterrupt\n") + ":kb"
    assert main(["run", "--list", "--model", model]) == 130
    assert capsys.readouterr().err == "parity: interrupted by KeyboardInterrupt\n"


def test_a_ctrl_c_while_torch_is_imported_is_one_line_and_130(monkeypatch, capsys):
    """The CLI (and torch) is imported in seconds before parity's handlers exist: a Ctrl-C there
    is one line too, not a traceback from inside torch's import."""
    import importlib.abc

    import parity

    class CtrlC(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "parity.cli":
                raise KeyboardInterrupt
            return None

    monkeypatch.delitem(sys.modules, "parity.cli")
    monkeypatch.setattr(sys, "meta_path", [CtrlC(), *sys.meta_path])
    assert parity.main(["fixtures"]) == 130
    assert capsys.readouterr().err == "parity: interrupted by SIGINT while starting; nothing was run\n"


def test_a_sigterm_while_torch_is_imported_is_one_line_and_143(monkeypatch, capsys):
    """SIGTERM kept its default action until the CLI was imported: the command died silently,
    its rank fork server left running (review). Parity's handler is in place from the start: the
    import below calls it as the signal would."""
    import importlib.abc
    import signal

    import parity

    class Term(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "parity.cli":
                signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # the default action is no callable
            return None

    monkeypatch.delitem(sys.modules, "parity.cli")
    monkeypatch.setattr(sys, "meta_path", [Term(), *sys.meta_path])
    assert parity.main(["fixtures"]) == 143
    assert capsys.readouterr().err == "parity: interrupted by SIGTERM while starting; nothing was run\n"


def test_a_report_that_cannot_be_written_is_one_line(tmp_path, capsys):
    d = results(tmp_path / "r", {A: "PASS"})
    os.makedirs(os.path.join(d, "report.html"))
    assert main(["report", d]) == 74
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "report.html (Is a directory)" in err, err


def test_a_closed_stdout_keeps_the_verdict(tmp_path, monkeypatch):
    old = results(tmp_path / "old", {A: "PASS"})
    new = results(tmp_path / "new", {A: "FAIL"})
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    assert main(["compare", old, new]) == 1
    assert main(["compare", old, old]) == 0
    monkeypatch.setattr(sys, "stderr", _ClosedPipe())  # parity ... 2>&1 | head -1
    assert main(["compare", old, new]) == 1
    assert main(["compare", old, str(tmp_path / "missing")]) == 2


def test_a_closed_pipe_keeps_the_verdict_in_a_real_process(tmp_path):
    old = results(tmp_path / "old", {A: "PASS"})
    new = results(tmp_path / "new", {A: "ERROR"})
    proc = subprocess.Popen([sys.executable, "-m", "parity", "compare", old, new], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before parity writes (parity ... | head -0)
    assert proc.wait(timeout=120) == 1
    assert proc.stderr.read() == b""


@pytest.mark.parametrize("old, new, line", [
    ({A: "PASS"}, {A: "PASS", "kda/native/r1/c0": "ERROR"}, "cell kda/native/r1/c0: ERROR (not in the old run)"),
    ({A: "PASS"}, {A: "PASS", "kda/native/r1/c0": "UNPAIRED"}, "UNPAIRED (not in the old run)"),
    ({A: "PASS"}, {A: "INCONCLUSIVE"}, f"cell {A}: PASS -> INCONCLUSIVE"),
    ({A: "TIMEOUT"}, {A: "ERROR"}, f"cell {A}: TIMEOUT -> ERROR"),
    ({A: "ERROR"}, {A: "FAIL"}, f"cell {A}: ERROR -> FAIL"),  # an alarm of another kind, not a fix (review)
    ({A: "FAIL"}, {A: "INCONCLUSIVE"}, f"cell {A}: FAIL -> INCONCLUSIVE"),
    ({A: "PASS", "kda/native/r1/c0": "PASS"}, {A: "PASS"}, "cell kda/native/r1/c0: PASS before, not run now"),
    ({A: "PASS"}, {A: "SKIP"}, f"cell {A}: PASS -> SKIP"),  # checked before, not now: e.g. --device cuda, no GPU
    ({A: "FAIL"}, {A: "SKIP"}, f"cell {A}: FAIL -> SKIP"),  # a failure hidden is no improvement
])
def test_compare_flags_new_alarms_and_missing_cells(capsys, tmp_path, old, new, line):
    assert main(["compare", results(tmp_path / "old", old), results(tmp_path / "new", new)]) == 1
    out = capsys.readouterr().out
    assert "REGRESSED" in out and line in out


def test_compare_flags_a_check_measured_before_and_missing_now(capsys, tmp_path):
    def rows(checks):
        return [Record(cell=A, fixture="kda", path="legacy", check=c, name="w", verdict=Verdict.PASS, observed=0.1, allowed=1.0, ratio=0.1,
                       signal=10.0, allowed_over_signal=0.1)
                for c in checks]
    old, new = results(tmp_path / "old", {A: "PASS"}), results(tmp_path / "new", {A: "PASS"})
    _recorded(old, rows(["grad", "checkpoint.same"]))
    _recorded(new, rows(["grad"]))
    assert main(["compare", old, new]) == 1
    assert "check kda / checkpoint.same: worst ratio 0.1 before, not measured now" in capsys.readouterr().out
    assert main(["compare", new, old]) == 0  # a check measured only now is not a regression


def test_compare_flags_a_cell_that_fell_back_now(capsys, tmp_path):
    """A native cell that passes as a legacy run now (a torch build without the native API) no
    longer exercises native: its verdict stays PASS, its evidence is gone."""
    cell = "kda/native/r1/c0"

    def rows(taken):
        return [Record(cell=cell, fixture="kda", path="native", path_taken=taken, check="grad", name="w",
                       verdict=Verdict.PASS, observed=0.1, allowed=1.0, ratio=0.1, signal=10.0,
                       allowed_over_signal=0.1)]
    old, new = results(tmp_path / "old", {cell: "PASS"}), results(tmp_path / "new", {cell: "PASS"})
    _recorded(old, rows("native"))
    _recorded(new, rows("legacy"))
    assert main(["compare", old, new]) == 1
    assert f"cell {cell}: ran its own path before, fell back to legacy now" in capsys.readouterr().out
    assert main(["compare", new, new]) == 0  # a fallback both runs had is no change


def test_compare_of_an_interrupted_new_run_flags_what_it_did_not_run(capsys, tmp_path):
    old = results(tmp_path / "old", {A: "PASS", "kda/native/r1/c0": "PASS"})
    new = results(tmp_path / "new", {A: "ERROR"}, status="interrupted")
    assert main(["compare", old, new]) == 1
    out = capsys.readouterr().out
    assert f"cell {A}: PASS -> ERROR" in out and "not run now" in out


def test_compare_passes_equal_runs_and_new_passing_cells(capsys, tmp_path):
    old = results(tmp_path / "old", {A: "PASS", "kda/native/r1/c0": "ERROR"})
    new = results(tmp_path / "new", {A: "PASS", "kda/native/r1/c0": "ERROR", "lm/native/r1/c0": "PASS"})
    assert main(["compare", old, new]) == 0
    assert "1 cells only in the new run" in capsys.readouterr().out


def test_a_digest_of_an_interrupted_run_is_no_baseline(capsys, tmp_path):
    new = results(tmp_path / "new", {A: "PASS"}, status="interrupted")
    assert main(["compare", results(tmp_path / "old", {A: "PASS"}), new,
                 "--write-digest", str(tmp_path / "digest")]) == 1  # partial evidence is not green either
    assert "the new run is interrupted, not complete" in capsys.readouterr().out
    assert main(["compare", str(tmp_path / "digest"), new]) == 2
    assert "that run is interrupted, not complete" in capsys.readouterr().err


HOSTILE = "boom \x1b[31mred\x1b[0m \x00nul \x08bs ]]> <tag> & \ud800 | pipe\nnext"


def test_junit_is_well_formed_whatever_a_detail_holds(tmp_path):
    rows = [Record(cell="m/native/c0", fixture="m", path="native", check="grad", name="w\x1b[1m",
                   verdict=Verdict.ERROR, detail=HOSTILE),
            Record(cell="m/native/c1", fixture="m", path="native", check="grad", name="w",
                   verdict=Verdict.SKIP, detail=HOSTILE)]
    path = tmp_path / "j.xml"
    write_junit(str(path), rows, suite="s\x07")
    suite = ET.parse(path).getroot().find("testsuite")  # parses: well-formed
    error = suite.find("testcase/error")
    for text in (error.get("message"), error.text):
        assert "red" in text and "\x1b" not in text and "[31m" not in text
        assert "#x00nul #x08bs ]]> <tag> & #xD800" in text
    assert suite.find("testcase/skipped").get("message").startswith("boom red")
    assert suite.get("name") == "parity s#x07"


def test_junit_never_passes_an_unpaired_pair(tmp_path):
    """Skipped where the run passes with the reason (declared isolation error, twin skipped or
    filtered out), a failure where the twin did not finish; never a green case."""
    def pair(i, reason):
        return Record(cell=f"m/c{i}", fixture="m", path="legacy~native", check="pair", name=reason,
                      verdict=Verdict.UNPAIRED, detail=f"because {reason}")
    path = tmp_path / "j.xml"
    write_junit(str(path), [pair(0, "skipped"), pair(1, "did-not-finish"), pair(2, "expected-isolation-error")],
                suite="s")
    suite = ET.parse(path).getroot().find("testsuite")
    outcome = {c.get("classname"): [e.tag for e in c] for c in suite.findall("testcase")}
    assert outcome == {"m/c0 [legacy~native]": ["skipped"], "m/c1 [legacy~native]": ["failure"],
                       "m/c2 [legacy~native]": ["skipped"]}
    assert (suite.get("failures"), suite.get("skipped"), suite.get("errors")) == ("1", "2", "0")


def test_summary_md_carries_no_raw_html_from_details():
    rows = [Record(cell="m/native/c0", fixture="m", path="native", check="grad", name="w|x",
                   verdict=Verdict.FAIL, detail="<script>alert(1)</script> a|b & c\nd", ratio=2.0, observed=2.0,
                   allowed=1.0)]
    md = summary_markdown(rows, title="<b>m</b>", timings={}, cells_total=1)  # a matrix file's name
    assert md.startswith("# parity run: &lt;b&gt;m&lt;/b&gt;")
    assert "<script>" not in md and "&lt;script&gt;alert(1)&lt;/script&gt; a|b &amp; c d" in md
    table_row = next(line for line in md.splitlines() if line.startswith("| grad | 2 |"))
    assert "w\\|x" in table_row


def test_gate_compare_to_turns_a_new_alarm_no_go(capsys, tmp_path):
    from tests.test_gate import healthy

    def run_dir(name, rows):
        d = tmp_path / name
        d.mkdir()
        _recorded(d, rows)
        _write(d / "run.json", json.dumps({"options": {"matrix": "smoke"}, "status": "complete",
                                           "cells": sorted({r.cell for r in rows}), "model_warnings": {}}))
        return str(d)

    old = run_dir("old", healthy())
    rows = healthy()
    rows[1].verdict = Verdict.UNPAIRED
    # two cells of smoke's 48: PARTIAL at best (exit 1), never a regression against itself
    assert main(["gate", "--from", old, "--compare-to", old]) == 1
    first = capsys.readouterr().out
    assert "PARTIAL" in first and "regressed" not in first
    assert main(["gate", "--from", run_dir("new", rows), "--compare-to", old]) == 1
    out = capsys.readouterr().out
    assert "NO-GO" in out and f"regressed against {old}: cell {rows[1].cell}: PASS -> UNPAIRED" in out
    # a model OLD had and NEW lacks: its regression concerns the decisions made without it
    both = run_dir("both", healthy() + healthy("gone"))
    assert main(["gate", "--from", run_dir("mine", healthy()), "--compare-to", both]) == 1
    out = capsys.readouterr().out
    assert "NO-GO" in out and f"regressed against {both}: cell gone/" in out


def test_gate_md_carries_no_raw_html_from_details(tmp_path):
    from parity.report import gate

    decision = gate.Decision(model="m", decision=gate.NO_GO, reasons=["native: grad: 1 ERROR (<img src=x> a|b)"])
    gate.write(str(tmp_path), [decision], [], meta={"candidate": "native", "torch": "t", "matrix": "x", "results": "r"})
    md = (tmp_path / "gate.md").read_text()
    assert "<img" not in md and "| **NO-GO** | native: grad: 1 ERROR (&lt;img src=x&gt; a\\|b) |" in md
    assert "- reason: native: grad: 1 ERROR (&lt;img src=x&gt; a|b)" in md


def test_unit_roots_out_of_bottom_up_order_are_one_line():
    """fully_shard goes bottom-up: a root listed before a root inside it is refused, naming both."""
    import dataclasses

    from parity.errors import UsageError
    from parity.model.registry import get_fixture
    from parity.model.spec import validate

    spec = get_fixture("kda")
    inner = [r for r in spec.unit_roots if r]
    with pytest.raises(UsageError, match=f'lists the root "" before {inner[0]!r}, which it contains'):
        validate(dataclasses.replace(spec, unit_roots=("", *inner)), "test")
    # a tuple of tuples (one per unit) instead of FQN strings names the expected shape
    with pytest.raises(UsageError, match=r"Fixture.unit_roots = \(\('blocks.0',\),\); it is a tuple of strings"):
        validate(dataclasses.replace(spec, unit_roots=(("blocks.0",),)), "test")
    # without the root "", a parameter outside every root would stay a plain tensor: every path refuses
    with pytest.raises(UsageError, match=r"Fixture.unit_roots \['blocks.0', 'blocks.1'\] holds no module of "
                                         r"parameter 'head.weight'; add its module, or the root \"\" last"):
        validate(dataclasses.replace(spec, unit_roots=tuple(inner)), "test")


@pytest.mark.parametrize("field, value, message", [
    ("name", 3, "Fixture.name = 3; it is a string"),
    ("expect", ["native"], "Fixture.expect = ['native']; it is a dict keyed by strings"),
    ("expect", {3: "fallback:x"}, "Fixture.expect = {3: 'fallback:x'}; it is a dict keyed by strings"),
    ("unit_roots", None, "Fixture.unit_roots = None; it is a tuple of strings"),
    ("blocks", None, "Fixture.blocks = None; it is a tuple of strings"),
    ("keep_fp32", None, "Fixture.keep_fp32 = None; it is a tuple of strings"),
    ("quantizable", 3, "Fixture.quantizable = 3; it is a tuple of strings"),
    ("unfreeze", ["a"], "Fixture.unfreeze = ['a']; it is a dict keyed by strings"),
    ("tensor_parallel", ["a"], "Fixture.tensor_parallel = ['a']; it is a dict keyed by strings"),
    ("tied", None, "Fixture.tied = None; it is a tuple of tuples of parameter FQNs"),
    ("tied", ("a.weight", "b.weight"), "Fixture.tied = ('a.weight', 'b.weight'); it is a tuple of tuples"),
    ("expect_fp32", "blocks.0.holder.A_log", "Fixture.expect_fp32 = 'blocks.0.holder.A_log'; it is a tuple of "
                                             "strings, e.g. ('blocks.0.holder.A_log',)"),
    ("token_input", "yes", "Fixture.token_input = 'yes'; it is True or False"),
    ("unit_roots", ("blocks.0", "blocks.0", ""), "Fixture.unit_roots lists 'blocks.0' twice; list each module once"),
])
def test_a_fixture_field_of_the_wrong_kind_is_one_line_naming_it(field, value, message):
    """A field holding another kind of value than its annotation (None, a list for a dict, a bare
    string for a tuple, a duplicate root) was a traceback deep in parity or accepted silently
    (review)."""
    from parity.errors import UsageError
    from parity.model.registry import get_fixture
    from parity.model.spec import validate

    with pytest.raises(UsageError) as raised:
        validate(dataclasses.replace(get_fixture("kda"), **{field: value}), "test")
    assert message in str(raised.value) and "\n" not in str(raised.value), str(raised.value)


@pytest.mark.parametrize("batch, message", [
    ("Batch(inputs=torch.zeros(2, 3), target=torch.zeros(2))", "returned Batch(inputs=Tensor)"),
    ("Batch(inputs=(torch.zeros(2, 3),), target=None)", "returned Batch(target=NoneType)"),
])
def test_a_batch_of_the_wrong_kind_is_one_line(batch, message):
    import torch

    from parity.errors import UsageError
    from parity.model import Batch
    from parity.model.registry import get_fixture
    from parity.model.spec import validate

    spec = dataclasses.replace(get_fixture("kda"), make_batch=lambda g: eval(batch, {"Batch": Batch, "torch": torch}))
    with pytest.raises(UsageError, match=re.escape(message)):
        validate(spec, "test")


def test_a_model_that_fails_to_build_on_the_ranks_is_an_error_per_cell_not_a_traceback(tmp_path, capsys):
    """It built on meta, so it is not bad input: its cells record the failure, the run goes on."""
    source = _write(tmp_path / "cpu_failing.py", CPU_FAILING) + ":model"
    out = str(tmp_path / "run")
    assert main(["run", "--model", source, "-k", "ranks == 1 and microbatches == 1", "--out", out]) == 1
    from parity.report.records import read_records

    rows = [r for r in read_records(os.path.join(out, "cells.csv")) if r.check == "run"]
    assert rows and {r.verdict for r in rows} == {"ERROR"} and all("needs a weights file" in r.detail for r in rows)
    assert "Traceback" not in capsys.readouterr().err


CLASS_TYPO = ("import dataclasses\n\nfrom parity.model.registry import registered\n\n\n"
              "def model():\n    base = registered()['kda']\n    built = base.build()\n\n"
              "    class Typo(type(built)):\n        _keep_in_fp32_modules_strict = ['A_lgo']\n\n"
              "    def build():\n        m = base.build()\n        m.__class__ = Typo\n        return m\n\n"
              "    return dataclasses.replace(base, name='classtypo', build=build)\n")


def test_a_class_declared_fp32_pattern_that_selects_nothing_is_noted_by_plan_and_warned_by_run(tmp_path, capsys):
    """A model class's ``_keep_in_fp32_modules_strict`` with a typo keeps nothing in FP32, silently
    in the framework: ``plan`` notes it and ``run`` warns, naming the class."""
    source = _write(tmp_path / "class_typo.py", CLASS_TYPO) + ":model"
    assert main(["plan", "--model", source]) == 1  # kda's expect_fp32 names A_log / dt_bias: the plan disagrees
    note = "Typo._keep_in_fp32_modules_strict pattern 'A_lgo' selects no parameter or buffer"
    assert f"note: {note}" in capsys.readouterr().out
    assert main(["run", "--model", source, "-k", "ranks == 1 and microbatches == 1 and path == 'native'",
                 "--out", str(tmp_path / "run")]) in (0, 1)
    assert f"classtypo: {note}" in capsys.readouterr().err


def test_a_class_fp32_pattern_read_under_float16_only_is_noted_under_float16(tmp_path, capsys):
    """``_keep_in_fp32_modules`` is FP32 under float16 only: its typo is noted there, not under BF16."""
    source = _write(tmp_path / "half_typo.py", CLASS_TYPO.replace("_keep_in_fp32_modules_strict", "_keep_in_fp32_modules")
                    .replace("name='classtypo'", "name='halftypo'")) + ":model"
    note = "Typo._keep_in_fp32_modules pattern 'A_lgo' selects no parameter or buffer"
    assert main(["plan", "--model", source]) == 0
    assert note not in capsys.readouterr().out
    assert main(["plan", "--model", source, "--param-dtype", "float16"]) == 0
    assert f"note: {note}" in capsys.readouterr().out
    from parity import api
    from parity.cli.run import check_models

    for param_dtype, said in (("bfloat16", False), ("float16", True)):
        _, cells, _ = api.select(model=source, filter="ranks == 1 and microbatches == 1", param_dtype=param_dtype)
        check_models(cells)
        assert (f"halftypo: {note}" in capsys.readouterr().err) is said


def test_an_expect_key_naming_no_installed_path_is_warned_by_run(tmp_path, capsys):
    """A key that is no misspelling of a path or contract may name a path plugin installed
    elsewhere: the model loads, and ``run`` warns that it applies to no cell here."""
    from parity import api
    from parity.cli.run import check_models

    fields = "expect={'fancy_split': 'fallback:x'}"
    source = _write(tmp_path / "fancy.py", ADJUSTED.format(name="fancy", code="", fields=fields)) + ":model"
    _, cells, _ = api.select(model=source, filter="ranks == 1 and microbatches == 1")
    check_models(cells)
    assert "fancy: Fixture.expect['fancy_split'] names no path installed here" in capsys.readouterr().err


def test_compare_flags_bench_rows_missing_now_and_an_interrupted_bench(capsys, tmp_path):
    """A bench key OLD measured and NEW did not is missing evidence (a path or model gone), and a
    bench its bench.json says was interrupted is no complete run: a regression as NEW, refused as OLD."""
    rows = "fixture,path,metric,value\nkda,legacy,collectives total,4\nkda,native,collectives total,2\n"

    def bench(name, text, interrupted=""):
        _write(tmp_path / name / "bench.csv", text)
        _write(tmp_path / name / "bench.json", json.dumps({"interrupted": interrupted} if interrupted else {}))
        return str(tmp_path / name)

    old, fewer = bench("old", rows), bench("fewer", rows.rsplit("kda,native", 1)[0])
    stopped = bench("stopped", rows.rsplit("kda,native", 1)[0], interrupted="SIGINT")
    assert main(["compare", old, fewer]) == 1
    assert "bench kda / native / collectives total: 2 before, not measured now" in capsys.readouterr().out
    assert main(["compare", old, stopped]) == 1
    assert "the new run is interrupted (SIGINT), not complete" in capsys.readouterr().out
    assert main(["compare", stopped, old]) == 2
    assert "that run is interrupted (SIGINT), not complete; run that bench again" in capsys.readouterr().err
    assert main(["compare", old, old]) == 0


def test_a_bench_killed_before_it_wrote_reads_as_unfinished_not_as_the_earlier_bench(capsys, tmp_path):
    """A bench wrote nothing until its end: killed (a CI timeout), its folder kept the earlier
    bench's files, which compare passed (review). Its start now removes them and records it running."""
    from parity.bench.run import _started

    rows = "fixture,path,metric,value\nkda,legacy,collectives total,4\n"
    old, killed = tmp_path / "old", tmp_path / "killed"
    for d in (old, killed):
        _write(d / "bench.csv", rows)
        _write(d / "bench.json", "{}")
        _write(d / "bench.md", "# an earlier bench\n")
    _started(str(killed))
    assert sorted(os.listdir(killed)) == ["bench.json"]
    assert main(["compare", str(old), str(killed)]) == 1
    assert "the new run is interrupted (running (or killed before it finished)), not complete" in capsys.readouterr().out
    assert main(["compare", str(killed), str(old)]) == 2


def test_compare_refuses_a_measurement_that_is_not_a_number(capsys, tmp_path):
    """NaN compares as "no change" with anything: a bench value or a digest's check ratio of NaN
    passed as NO REGRESSION (review)."""
    rows = "fixture,path,metric,value\nkda,legacy,collectives total,{}\n"
    _write(tmp_path / "old" / "bench.csv", rows.format(4))
    _write(tmp_path / "nan" / "bench.csv", rows.format("nan"))
    assert main(["compare", str(tmp_path / "old"), str(tmp_path / "nan")]) == 2
    assert "nan/bench.csv row 2: not a bench row (ValueError: value 'nan' is not a finite number)" in capsys.readouterr().err
    _write(tmp_path / "digest" / "digest.json", json.dumps({"cells": {}, "checks": {"kda|grad": float("nan")}, "bench": {}}))
    assert main(["compare", str(tmp_path / "old"), str(tmp_path / "digest")]) == 2
    assert "not a digest as parity writes it" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["bench", "--fixtures", "kda"], ["fuzz", "--examples", "1"]])
def test_a_command_that_starts_its_own_ranks_is_refused_under_torchrun(argv, monkeypatch, capsys):
    """Each torchrun rank would run the whole bench (or campaign) into the same files, its figures
    measured beside the others'."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(key, value)
    assert main(argv) == 2
    assert f"parity: {argv[0]} starts its own rank processes; run it without torchrun" in capsys.readouterr().err


FULL_LAUNCH = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("changes, said", [
    ({"RANK": "abc"}, "torchrun: RANK='abc' is not an integer; launch with torchrun"),
    ({"RANK": "2"}, "torchrun: RANK=2 LOCAL_RANK=0 with WORLD_SIZE=2: want 0 <= RANK < WORLD_SIZE"),
    ({"MASTER_PORT": None}, "torchrun: MASTER_PORT not set beside RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR;"),
    ({"LOCAL_RANK": None, "MASTER_PORT": None}, "torchrun: LOCAL_RANK, MASTER_PORT not set beside"),
])
@pytest.mark.parametrize("command", [["run", "--matrix", "smoke"], ["gate", "--matrix", "smoke"]])
def test_a_launch_whose_variables_are_partial_or_wrong_is_one_line(command, changes, said, monkeypatch, capsys, tmp_path):
    """A traceback once (RANK not an integer, a rank outside the world, no MASTER_PORT), and a
    launcher that set RANK and WORLD_SIZE but not LOCAL_RANK ran every process as a whole run of
    its own into the same --out (review, twenty-second stop)."""
    for key, value in {**FULL_LAUNCH, **changes}.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    assert main([*command, "--out", str(tmp_path / "o")]) == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_bench_on_fewer_gpus_than_its_ranks_is_refused_naming_the_ranks_that_fit(monkeypatch, capsys, tmp_path):
    """One GPU per rank: a 2-rank bench on one GPU measured nothing (every rank-1 start failed)."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    assert main(["bench", "--device", "cuda", "--fixtures", "kda", "--out", str(tmp_path / "b")]) == 2
    assert "bench --ranks 2 --device cuda needs 2 GPUs; 1 visible; give --ranks 1" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_a_batch_marking_missing_labels_with_nan_is_the_same_batch_twice():
    """The reproducibility check refused a NaN-marked target as drawn from the global generator
    (NaN != NaN under torch.equal; review)."""
    import dataclasses

    from parity.model.registry import _reproducible, get_fixture

    kda = get_fixture("kda")

    def batch(g):
        b = kda.make_batch(g)
        b.target.view(-1)[0] = float("nan")
        return b

    fixture = dataclasses.replace(kda, make_batch=batch)
    _reproducible(fixture, fixture.batch(0, 0, 0, 0), "run")  # no UsageError


def test_a_junit_file_in_the_out_folder_the_run_creates_is_accepted(tmp_path):
    """The scheduled jobs' command (``--out results/gpu --junit results/gpu/junit.xml``, docs/ci.md) on a
    fresh checkout: the folder is the run's own, created when it starts; any other missing folder is refused."""
    from parity.errors import UsageError
    from parity.report.outdir import writable_file

    out = tmp_path / "new"
    writable_file(str(out / "junit.xml"), "--junit", str(out))
    with pytest.raises(UsageError, match="no folder"):
        writable_file(str(tmp_path / "other" / "junit.xml"), "--junit", str(out))
    with pytest.raises(UsageError, match="no folder"):
        writable_file(str(out / "deeper" / "junit.xml"), "--junit", str(out))
    with pytest.raises(UsageError, match="is the --out directory"):  # the run would make it a folder (review)
        writable_file(str(out), "--junit", str(out))
