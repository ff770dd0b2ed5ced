"""The Python API: :func:`run` and :func:`gate` for programs, notebooks and test suites.

Each call runs what the command line runs with the same options (``python -m parity run`` /
``gate``): the same cells, the same results directory and the same exit code, so the API, the
CLI and ``gate --from`` read each other's output. Bad input raises
:class:`~parity.errors.UsageError` (the CLI's one-line message; the CLI exits 2 with it); an
option the command does not have raises ``TypeError``. Each call cleans up its own rank
pools, so calls can follow each other in one process.

    import parity
    result = parity.run(model="my_pkg.models:parity_model", matrix="smoke", paths=["legacy", "native"])
    result.ok            # exit code 0: every cell passed
    result.cells         # pandas DataFrame, the rows of cells.csv
    result.failures()    # the failing records, worst first
    decision = parity.gate(model="my_pkg.models:parity_model")   # result.decisions: GO / NO-GO ...
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from dataclasses import dataclass

#: keyword -> command-line flag; a list value repeats (``model``, ``fault``) or joins (``paths``, ``ranks``).
_FLAGS = {
    "matrix": "--matrix", "model": "--model", "paths": "--paths", "baseline": "--baseline", "ranks": "--ranks",
    "filter": "-k", "seed": "--seed", "steps": "--steps", "param_dtype": "--param-dtype",
    "reduce_dtype": "--reduce-dtype", "optimizer": "--optimizer", "init": "--init", "mesh": "--mesh",
    "weights": "--weights", "device": "--device", "timeout": "--timeout", "fault": "--fault", "junit": "--junit",
    "shard": "--shard", "candidate": "--candidate", "compare_to": "--compare-to", "from_dir": "--from",
}
_REPEATED = ("model", "fault")
_SWITCHES = {"fp64": "--fp64", "require_native": "--require-native", "overwrite": "--overwrite"}
_GATE_ONLY = ("candidate", "compare_to", "from_dir")


@dataclass(frozen=True)
class Result:
    """What a call left in ``out`` (a parity results directory) and its exit code."""

    out: str
    code: int

    @property
    def ok(self) -> bool:
        """Exit code 0: complete evidence, nothing wrong (for a gate: every model GO)."""
        return self.code == 0

    @property
    def cells(self):
        """Every record as a pandas DataFrame (the rows and columns of ``cells.csv``)."""
        import pandas as pd

        return pd.read_csv(os.path.join(self.out, "cells.csv"), keep_default_na=False, dtype=str).pipe(_numeric)

    def failures(self):
        """FAIL / ERROR / TIMEOUT / INCONCLUSIVE / UNPAIRED records, worst first (by verdict, then
        ratio), with each failing cell's first divergence (``divergence`` rows) where it was located."""
        from parity.judge.record import SEVERITY, Verdict

        rank = {str(v): s for v, s in SEVERITY.items()}
        df = self.cells
        bad = df[df["verdict"].map(rank) > SEVERITY[Verdict.PASS]]
        order = bad["verdict"].map(rank)
        return bad.assign(_s=order).sort_values(["_s", "ratio"], ascending=[False, False]).drop(columns="_s")

    @property
    def decisions(self) -> list[dict]:
        """The gate's decisions (``gate.json``): model, decision, reasons, notes; [] without a gate."""
        path = os.path.join(self.out, "gate.json")
        if not os.path.isfile(path):
            return []
        with open(path) as fh:
            return json.load(fh)["decisions"]


def _numeric(df):
    import pandas as pd

    for col in ("observed", "allowed", "ratio", "fp64_observed", "signal", "allowed_over_signal"):
        df[col] = pd.to_numeric(df[col].replace({"": None}), errors="coerce")
    return df


def _argv(command: str, options: dict) -> list[str]:
    argv = [command]
    for key, value in options.items():
        if key in _SWITCHES:
            argv += [_SWITCHES[key]] if value else []
            continue
        if key not in _FLAGS or (command == "run" and key in _GATE_ONLY):
            raise TypeError(f"parity.{command}() got an unexpected keyword argument {key!r}")
        if value is None:
            continue
        if key in _REPEATED:
            for v in [value] if isinstance(value, str) else value:
                argv += [_FLAGS[key], str(v)]
        elif isinstance(value, (list, tuple)):
            argv += [_FLAGS[key], ",".join(map(str, value))]
        else:
            argv += [_FLAGS[key], str(value)]
    return argv


def _call(command: str, out: str | None, quiet: bool, options: dict) -> Result:
    from parity.cli import _command, _parser

    argv = _argv(command, options)
    if command == "gate" and options.get("from_dir"):  # judges that directory, writes the gate there
        out = options["from_dir"]
    else:
        out = out or tempfile.mkdtemp(prefix=f"parity-{command}-")
        argv += ["--out", out]
    sink = io.StringIO() if quiet else None
    with contextlib.redirect_stdout(sink) if quiet else contextlib.nullcontext():
        code = _command(_parser().parse_args(argv))
    return Result(out=out, code=max(0, code))


def run(*, matrix: str = "smoke", out: str | None = None, quiet: bool = False, **options) -> Result:
    """Run a matrix (``python -m parity run``). ``out``: the results directory (default: a new
    temporary one); ``options``: the command's options as keywords (``model``, ``paths``,
    ``ranks``, ``filter`` for ``-k``, ``seed``, ``steps``, ``fault``, ``fp64``, ``shard`` ...);
    ``quiet`` drops the table the command prints."""
    return _call("run", out, quiet, {"matrix": matrix, **options})


def gate(*, matrix: str = "default", out: str | None = None, quiet: bool = False, **options) -> Result:
    """GO / NO-GO per model (``python -m parity gate``): runs ``matrix`` (or judges ``from_dir``)
    and decides; :attr:`Result.decisions` holds the decisions, :attr:`Result.ok` whether every
    model is GO."""
    return _call("gate", out, quiet, {"matrix": None if options.get("from_dir") else matrix, **options})
