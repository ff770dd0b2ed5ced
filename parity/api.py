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

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass

#: Parser entries that are not options a call passes: ``out`` is the call's own argument.
_NOT_OPTIONS = ("help", "out")


@dataclass(frozen=True)
class Result:
    """What a call left in ``out`` (a parity results directory) and its exit code."""

    out: str
    code: int

    @property
    def ok(self) -> bool:
        """Exit code 0: complete evidence, nothing wrong (for a gate: every model GO or NOT APPLICABLE)."""
        return self.code == 0

    def __bool__(self) -> bool:
        """:attr:`ok`: ``if parity.gate(...)`` and ``assert parity.run(...)`` read the verdict."""
        return self.ok

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
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)["decisions"]


def _numeric(df):
    import pandas as pd

    from parity.report.records import NUMERIC_COLUMNS

    for col in NUMERIC_COLUMNS:
        df[col] = pd.to_numeric(df[col].replace({"": None}), errors="coerce")
    return df


def _actions(command: str, every: bool = False) -> dict:
    """The command's options as the CLI's parser defines them: keyword (its ``dest``) -> action
    (``every``: ``--out`` and ``--help`` too, which calls give otherwise)."""
    from parity.cli import _parser

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices[command]._actions if every or a.dest not in _NOT_OPTIONS}


def _argv(command: str, options: dict) -> list[str]:
    """``options`` as the command line: a switch when true, an appended option once per value
    (``model``, ``fault``), a list joined by commas (``paths``, ``ranks``)."""
    actions = _actions(command)
    argv = [command]
    for key, value in options.items():
        action = actions.get(key)
        if action is None:
            raise TypeError(f"parity.{command}() got an unexpected keyword argument {key!r}")
        if value is None:
            continue
        _check_type(command, key, action, value)
        flag = action.option_strings[-1]
        if action.nargs == 0:
            argv += [flag] if value else []
        elif isinstance(action, argparse._AppendAction):
            for v in [value] if isinstance(value, (str, os.PathLike)) else value:
                argv.append(f"{flag}={os.fspath(v)}")
        elif isinstance(value, (list, tuple)):
            argv.append(f"{flag}={','.join(map(str, value))}")
        else:  # FLAG=VALUE: a value starting with "-" (a folder "-out", a seed -1) is the value, not an option
            argv.append(f"{flag}={os.fspath(value) if isinstance(value, os.PathLike) else str(value)}")
    return argv


#: Keyword arguments whose value is text to parse (an expression), never a number.
_TEXT = ("filter",)


def _check_type(command: str, key: str, action, value) -> None:
    """A :class:`~parity.errors.UsageError` naming ``key`` when ``value`` is not what it can be: a
    bool for a switch; a string (or a list of them) for a repeatable option (``model``,
    ``fault``); a string, a number or, for a comma option, a list of them otherwise."""
    from parity.errors import UsageError

    def scalar(v, text_only=False):
        if isinstance(v, (str, os.PathLike)):
            return True
        return not text_only and isinstance(v, (int, float)) and not isinstance(v, bool)

    if action.nargs == 0:
        ok, want = isinstance(value, bool), "True or False"
    elif isinstance(value, (list, tuple)) and not value:
        ok, want = False, "at least one value, or leave it out (an empty list names nothing)"
    elif isinstance(action, argparse._AppendAction):
        ok = scalar(value, True) or (isinstance(value, (list, tuple)) and all(scalar(v, True) for v in value))
        want = "a string or a list of strings"
    elif key in _TEXT:
        ok, want = scalar(value, True), "a string"
    else:
        ok = scalar(value) or (isinstance(value, (list, tuple)) and all(scalar(v) for v in value))
        want = "a string, a number or a list of them"
    if not ok:
        raise UsageError(f"parity.{command}({key}=...): got {type(value).__name__} {value!r:.60}; give {want}")


#: Options naming the directory a call works in, and what the call does there.
_IN_PLACE = {"from_dir": "is judged in place (its gate files go there)", "resume": "writes into that directory"}


def _call(command: str, out: str | None, quiet: bool, options: dict) -> Result:
    from parity.cli import _command
    from parity.errors import UsageError

    _refuse_in_bootstrap(command)
    if options.get("list"):  # would return ok with nothing run
        raise UsageError(f"parity.{command}(list=True) runs nothing; list the cells with parity.select(...)")
    argv = _argv(command, options)
    # a directory the command works in, as the command line does (_argv refused an option the command lacks)
    if out is not None and not isinstance(out, (str, os.PathLike)):
        raise UsageError(f"parity.{command}(out=...): got {type(out).__name__} {out!r:.60}; give a directory path")
    if not isinstance(quiet, bool):
        raise UsageError(f"parity.{command}(quiet=...): got {type(quiet).__name__} {quiet!r:.60}; give True or False")
    key = next((k for k in _IN_PLACE if options.get(k)), None)
    made = not key and out is None  # a temporary results folder this call makes
    if key:
        if out and os.path.abspath(out) != os.path.abspath(options[key]):
            raise UsageError(f"{key}={options[key]!r} {_IN_PLACE[key]}; drop out={out!r}")
        out = os.fspath(options[key])
    else:
        if out is not None and not os.fspath(out):  # an empty path is a mistake, not "a new temporary one"
            raise UsageError(f"parity.{command}(out=''): give a directory path, or leave out= out for a new "
                             "temporary directory")
        out = os.fspath(out) if out is not None else tempfile.mkdtemp(prefix=f"parity-{command}-")
        argv.append(f"--out={out}")
    from parity.runner import quietly

    try:
        args = _parse(command, argv)
        with quietly(quiet), _in_keywords(command):  # the command's own refusals in the keywords' words
            code = _command(args)
    except BaseException:
        if made:  # only if the refusal left it empty: never results
            with contextlib.suppress(OSError):
                os.rmdir(out)
        raise
    return Result(out=out, code=max(0, code))


@contextlib.contextmanager
def _in_keywords(command: str):
    """A :class:`~parity.errors.UsageError` raised inside, as the keyword call's (:func:`_as_keywords`)."""
    from parity.errors import UsageError

    try:
        yield
    except UsageError as exc:
        raise UsageError(_as_keywords(command, str(exc))) from None


def _parse(command: str, argv: list[str]):
    """``argv`` parsed as the command line would be, its errors in the keywords' words."""
    from parity.cli import _parser

    with _in_keywords(command):
        return _parser().parse_args(argv)


def _as_keywords(command: str, message: str) -> str:
    """A command-line error as the keyword call's: ``argument --mesh: ...`` names
    ``parity.run(mesh=...)``, without pointing at ``--help``; any other option the message names
    (``loosen -k/--paths``) is named by its keyword (``loosen filter/paths``) outside a command line
    it quotes."""
    message = re.sub(r" \(see \S+ \S+ --help\)$", "", message)
    keyword = {flag: dest for dest, action in _actions(command, every=True).items() for flag in action.option_strings}
    message = re.sub(r"argument (-k|--[a-z0-9-]+)", lambda m: f"parity.{command}({keyword.get(m.group(1), m.group(1))}=...)",
                     message)
    # a command line the message quotes (``python -m parity run --resume D``) keeps its flags
    pieces = re.split(r"(python -m parity [^;)]*)", message)
    return "".join(piece if i % 2 else re.sub(r"(?<![\w-])(-k|--[a-z0-9-]+)\b",
                                               lambda m: keyword.get(m.group(1), m.group(1)), piece)
                   for i, piece in enumerate(pieces))


def _refuse_in_bootstrap(command: str) -> None:
    """A script calling :func:`run` without an ``if __name__ == "__main__":`` guard is imported
    again by every rank process multiprocessing starts: such a process says so in one line and
    exits with :data:`~parity.errors.EXIT_UNGUARDED`, which the run that started it turns into
    the same :class:`~parity.errors.UsageError` (:mod:`parity.execute.pool`), instead of starting
    runs inside ranks or judging dead ones."""
    import multiprocessing

    from parity.errors import EXIT_UNGUARDED, UNGUARDED

    if getattr(multiprocessing.current_process(), "_inheriting", False) or (
            getattr(sys.modules.get("__main__"), "__name__", "") == "__mp_main__"):
        print(f"parity.{command}(): {UNGUARDED}", file=sys.stderr, flush=True)
        os._exit(EXIT_UNGUARDED)


def select(*, matrix: str | None = None, **options):
    """What ``run`` with these options would run, without running it: (the matrix, its selected
    cells as :class:`~parity.matrix.cell.Cell` objects, the effective options). ``smoke`` unless
    ``matrix`` names another; with ``resume=DIR``, that run's recorded matrix, as :func:`run`."""
    from parity.cli import RUN_DEFAULTS, _run_settings, _select

    _recorded_matrix("select", "resume", matrix, options)
    chosen = None if options.get("resume") else _or(matrix, "smoke")
    args = _parse("run", _argv("run", {"matrix": chosen, **options}) + ["--list"])
    with _in_keywords("run"):  # the selection's own refusals
        opts = _run_settings(args, RUN_DEFAULTS)
        found, cells = _select(opts)
        if opts["shard"]:  # one part's cells, as run --shard I/N runs them
            from parity.cli.run import _part_of

            cells, _ = _part_of(cells, opts["shard"], found.name)
    return found, cells, opts


def run(*, matrix: str | None = None, out: str | None = None, quiet: bool = False, **options) -> Result:
    """Run a matrix (``python -m parity run``; ``smoke`` unless ``matrix`` names another).
    ``out``: the results directory (default: a new temporary one); ``options``: the command's
    options as keywords (``model``, ``paths``, ``ranks``, ``filter`` for ``-k``, ``seed``,
    ``steps``, ``fault``, ``fp64``, ``shard`` ...; ``resume=DIR`` continues that run in DIR, with
    its recorded options and matrix, as ``--resume`` does); ``quiet`` drops the table the command
    prints."""
    _recorded_matrix("run", "resume", matrix, options)
    return _call("run", out, quiet, {"matrix": None if options.get("resume") else _or(matrix, "smoke"), **options})


def gate(*, matrix: str | None = None, out: str | None = None, quiet: bool = False, **options) -> Result:
    """GO / NO-GO per model (``python -m parity gate``): runs ``matrix`` (``default`` unless named;
    or judges ``from_dir``, as it ran) and decides; :attr:`Result.decisions` holds the decisions,
    :attr:`Result.ok` whether every model is GO (or NOT APPLICABLE). One part of a split run (``shard``) decides
    nothing and is refused here: run the parts with :func:`run` and decide on their merge."""
    from parity.errors import UsageError

    _recorded_matrix("gate", "from_dir", matrix, options)
    if options.get("shard"):
        raise UsageError(f"parity.gate(shard={options['shard']!r}) decides nothing (one part); run each part with "
                         "parity.run(shard=...) and decide on all of them: python -m parity merge PARTS... --out DIR "
                         "--gate")
    return _call("gate", out, quiet, {"matrix": None if options.get("from_dir") else _or(matrix, "default"), **options})


def _or(value, default):
    """``default`` only where nothing was given: an empty or false value is the caller's, and
    checked as given (``matrix=""`` is refused, as ``--matrix ''`` is, never read as the default)."""
    return default if value is None else value


def _recorded_matrix(command: str, key: str, matrix, options: dict) -> None:
    """``resume`` / ``from_dir`` take the directory's recorded matrix: another named beside it would
    be ignored, so it is refused (as the command line refuses ``--matrix`` there)."""
    if options.get(key) and matrix is not None:
        from parity.errors import UsageError

        raise UsageError(f"parity.{command}({key}=...) uses the matrix that run recorded; drop matrix={matrix!r}")
