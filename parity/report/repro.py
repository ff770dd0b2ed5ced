"""``parity repro CELL --from DIR``: one self-contained script that re-runs a failing cell.

``CELL`` is a cell id, or a pair id (the ``cell`` of a ``legacy~native`` record: the cell id
without its path), whose reproducer re-runs the pair's cells together so their cross-path
comparison runs again. The script holds the cell as data (its every axis, the model source of a plugin, the faults that
were injected), what the earlier run found, and one call: :func:`rerun` runs the cell alone on
its own ranks (gloo on CPU, or the device it names), with the per-module trace of a failing cell,
and prints the failing checks and the first divergence. It is small enough to attach to a bug
report; it needs parity and the torch build the header names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
import tempfile
from collections.abc import Callable

import torch

from parity.digests import data_sha256
from parity.errors import UsageError
from parity.judge.record import LOCATING_CHECKS, Verdict
from parity.matrix.cell import Cell
from parity.report.outdir import CELLS, read_manifest, recorded
from parity.report.summary import visible

_BAD = (Verdict.FAIL, Verdict.ERROR, Verdict.TIMEOUT, Verdict.INCONCLUSIVE)


def find_cells(cell_id: str, out: str, select: Callable[[dict], list[Cell]]) -> list[Cell]:
    """The cells ``cell_id`` names in the run recorded in ``out`` (one cell, or every cell of a
    pair), rebuilt from its options by ``select`` (the command line's selection: recorded options
    -> cells). A model file the run named relative to where it ran is found through the absolute
    paths ``run.json`` records (``sources``), so ``repro`` works from any directory."""
    manifest = read_manifest(out)
    listed = set(manifest.get("cells", []))
    options = dict(manifest.get("options", {}))
    if options.get("model"):
        options["model"] = [_located(m, manifest.get("sources") or {}) for m in options["model"]]
    rebuilt = [c for c in select(options) if c.id in listed]
    cells = [c for c in rebuilt if c.id == cell_id] or [c for c in rebuilt if c.pair_id == cell_id]
    if cell_id not in listed and len(cells) < 2:
        failing = _failing(out)
        hint = f"; a failing one: {failing[0].cell}" if failing else ""
        raise UsageError(f"repro: {cell_id!r} is not a cell or a pair of the run in {out}{hint}")
    if not cells:
        raise UsageError(f"repro: {cell_id!r} cannot be rebuilt from {out}'s options (was a model source moved?)")
    return cells


def _located(source: str, sources: dict) -> str:
    """``source`` (``path.py:factory``), its path made absolute where it does not resolve from here
    but one of the run's recorded files ends with it."""
    target, _, attr = source.rpartition(":")
    if not target.endswith(".py") or os.path.isfile(target) or os.path.isabs(target):
        return source
    tail = os.sep + os.path.normpath(target)
    found = [f for f in sources if str(f).endswith(tail)]
    return f"{found[0]}:{attr}" if len(found) == 1 else source


#: The run's options that change a cell's verdict beyond the cell itself: its ``--timeout`` (a
#: TIMEOUT re-run under the default would pass) and ``--require-native``; a script carries them.
RECORDED = ("timeout", "require_native")


def _run_options(manifest: dict) -> dict:
    return recorded_options(manifest.get("options") or {})


def recorded_options(options: dict) -> dict:
    """Of :data:`RECORDED`, what ``options`` (a run's, or a fuzz campaign's) holds that
    ``RunOptions`` would not default to (a script names only those)."""
    from parity.runner import RunOptions

    defaults = {f.name: f.default for f in dataclasses.fields(RunOptions) if f.name in RECORDED}
    return {k: options[k] for k in RECORDED if options.get(k) is not None and options[k] != defaults[k]}


def _failing(out: str, ids: set[str] | None = None) -> list:
    """The records of ``out`` that did not pass, and those locating a failure (of ``ids``' cells): read as ``report`` and ``gate
    --from`` read them -- a complete run only as it recorded them (a cut, emptied or missing
    ``cells.csv`` is a :class:`UsageError`, not a reproducer saying nothing failed); an interrupted
    run's as they are, none where it wrote none."""
    if not os.path.isfile(os.path.join(out, CELLS)) and read_manifest(out).get("status") != "complete":
        return []
    rows = recorded(out, "repro", "rerun the matrix into a new --out")
    # a failing cell's divergence record passes where no module's output differs: that says where not to look
    return [r for r in rows if (r.verdict in _BAD or r.check in LOCATING_CHECKS) and (ids is None or r.cell in ids)]


def _ids(cells: list[Cell]) -> set[str]:
    """The ``cell`` values of ``cells``' records: their ids, and their pair's id when they are a pair."""
    return {c.id for c in cells} | ({cells[0].pair_id} if len(cells) > 1 else set())


def _line(r, paths: bool = False) -> str:
    """One record: verdict, check, name, step, observed / allowed (ratio) when numeric, detail
    (``paths``: the record's path first, where a pair's two cells are listed together)."""
    numbers = (f"observed {r.observed:.3g}, allowed {r.allowed:.3g} (ratio {r.ratio:.3g}); "
               if isinstance(r.observed, float) and isinstance(r.allowed, float) else "")
    step = f" step {r.step}" if r.step != "" else ""
    return f"{f'[{r.path}] ' if paths else ''}{r.verdict} {r.check} {r.name}{step}: {numbers}{r.detail}"


def _stages(bad: list, pair: bool) -> list[str]:
    """Each failing cell's first divergent stage (its ``stage`` record, without the record's own
    heading), named by cell where a pair's two cells are listed."""
    return _per_cell(bad, "stage", pair, lambda r: r.detail.removeprefix("first divergent stage: "))


def _divergences(bad: list, pair: bool) -> list[str]:
    """Each failing cell's first divergent module (its ``divergence`` record's detail: a PASS one
    says no module's output or input gradient differs, so the difference arises outside them)."""
    return _per_cell(bad, "divergence", pair, lambda r: r.detail)


def _per_cell(bad: list, check: str, pair: bool, text) -> list[str]:
    found = [r for r in bad if r.check == check]
    if not found:
        unfinished = sorted({r.verdict for r in bad if r.check == "run"})
        if unfinished:
            return [f"not located: the cell did not finish ({', '.join(unfinished)})"]
        return ["not located" if any(r.verdict in _BAD for r in bad) else "none: nothing failed"]
    return [f"{text(r)} (in {r.cell})" if pair else text(r) for r in found]


def script(cells: list[Cell], out: str) -> str:
    """The reproducer's text for ``cells`` (one cell, or a pair's) of the run recorded in ``out``."""
    origin = f"{os.path.abspath(out)} (torch {torch.__version__})"
    manifest = read_manifest(out)
    return render(cells[0] if len(cells) == 1 else cells, _failing(out, _ids(cells)), origin,
                  options=_run_options(manifest), sources=manifest.get("sources") or {})


def render(cell: Cell | list[Cell], bad: list, origin: str, *, options: dict | None = None,
           sources: dict | None = None) -> str:
    """The reproducer's text: ``cell`` (or a pair's cells) as data, what failed (``bad``: its
    records that did not pass) and where it was found (``origin``), and the call that re-runs it
    with the run's ``options`` (:func:`rerun`'s keywords). ``sources``: the run's file digests
    (``run.json``), which an embedded model file must still match. The fuzz campaign writes its
    failing examples in this format too."""
    cells = cell if isinstance(cell, list) else [cell]
    found = [r for r in bad if r.check not in LOCATING_CHECKS]
    lines = [f"  {_line(r, len(cells) > 1)[:200]}" for r in found[:5]]
    if len(found) > 5:
        lines.append(f"  ... {len(found) - 5} more")
    header = "\n".join([
        f"parity reproducer: {cells[0].id if len(cells) == 1 else 'the pair ' + cells[0].pair_id}",
        "",
        f"From {origin}:",
        *(lines or ["  nothing failed there"]),
        *(f"First divergent stage: {text[:600]}" for text in _stages(bad, len(cells) > 1)),
        *(f"First divergence: {text[:300]}" for text in _divergences(bad, len(cells) > 1)),
        "",
        f"Run: python <this file>  (parity and torch {torch.__version__}; {cells[0].ranks} rank(s), {cells[0].device})",
        "     python <this file> --op-log FILE  also writes the failing step's operator log (DebugMode's format)",
    ])
    embedded = _embedded_model(cells[0], sources or {})
    name, data = ("CELL", repr(cells[0])) if len(cells) == 1 else ("CELLS", "[\n    " + ",\n    ".join(map(repr, cells)) + ",\n]")
    target = name if not embedded else (f"with_model({name})" if name == "CELL" else f"[with_model(c) for c in {name}]")
    run = f"rerun({target}, sys.argv[1:]{''.join(f', {k}={v!r}' for k, v in sorted((options or {}).items()))})"
    data = data.replace("\n", "\n    ")
    return (f"{_comment(header)}\n\nimport sys\n\nfrom parity.matrix.cell import Cell\n"
            f"from parity.report.repro import edited, rerun\n\n"
            f"with edited():  # an edit no run can take is one line and exit 2, not a traceback\n"
            f"    {name} = {data}\n{embedded}\nif __name__ == \"__main__\":\n    raise SystemExit({run})\n")


def _comment(text: str) -> str:
    """``text`` as comment lines: whatever a record's detail holds (a user's exception text with
    quotes, backslashes, control characters) cannot end the comment or break the script; characters
    a comment line cannot hold are written as their escapes."""
    return "\n".join(f"# {visible(raw)}".rstrip() for raw in text.split("\n"))


def _embedded_model(cell: Cell, sources: dict) -> str:
    """For a model loaded from a file (``path/to/file.py:factory``): the file's text and a
    ``with_model`` that writes it to a fresh folder (removed when the script ends) and points the
    cell there, so the reproducer runs where that file is not (a bug report's reader). A file
    whose digest differs from the one the run recorded in ``sources`` is a :class:`UsageError`:
    the script would re-run another model than the one that failed. Modules the file imports from
    beside it are not embedded: the script finds them in the file's folder where it still exists.
    Other sources -- an installed ``pkg.module`` -- are named in the cell and must be installed."""
    target, _, attr = cell.source.rpartition(":")
    if not target.endswith(".py") or not os.path.isfile(target):
        return ""
    with open(target, "rb") as fh:
        data = fh.read()
    recorded = sources.get(os.path.realpath(target))
    if recorded and data_sha256(data) != recorded:
        raise UsageError(f"repro: {target} changed since the run (its SHA-256 is not the one run.json records); "
                         "restore it, or rerun the matrix and reproduce from the new run")
    text = data.decode("utf-8")
    name = os.path.basename(target)
    return (f"\n#: {target}, as the run loaded it\nMODEL_SOURCE = {text!r}\n\n\n"
            "def with_model(cell):\n"
            "    import atexit, dataclasses, os, shutil, tempfile\n\n"
            f"    beside = {os.path.dirname(os.path.abspath(target))!r}  # modules the model imports from its folder\n"
            "    if os.path.isdir(beside):  # this process and the ranks it starts\n"
            "        sys.path.append(beside)\n"
            "        os.environ['PYTHONPATH'] = os.pathsep.join(filter(None, (os.environ.get('PYTHONPATH'), beside)))\n"
            "    folder = tempfile.mkdtemp(prefix='parity-repro-')\n"
            "    atexit.register(shutil.rmtree, folder, True)\n"
            f"    path = os.path.join(folder, {name!r})\n"
            "    with open(path, 'w') as fh:\n"
            "        fh.write(MODEL_SOURCE)\n"
            f"    return dataclasses.replace(cell, source=path + {':' + attr!r})\n\n")


@contextlib.contextmanager
def edited():
    """Around a reproducer's ``CELL = Cell(...)``: a value a hand edit made that no cell can take
    (``ranks=0``) is one line on stderr and exit 2, as the CLI says bad input."""
    try:
        yield
    except UsageError as exc:
        print(f"parity: reproducer: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _rerunnable(cells: list) -> None:
    """A :class:`UsageError` for what a hand-edited reproducer asks that no run can do: something
    other than a cell, a model no source describes, an unknown fault (each would be an ERROR cell
    that says the model or fault is wrong, and a fault summary claiming a cell that never trained)."""
    from parity.faults import check_faults
    from parity.model.registry import get_fixture
    from parity.paths import get_path

    for c in cells:
        if not isinstance(c, Cell):
            raise UsageError(f"reproducer: {c!r} is not a parity Cell; restore the script's CELL / CELLS")
        get_fixture(c.fixture, c.source)
        check_faults(c.faults)
        for path in (c.path, c.baseline, *filter(None, c.crossload.split(","))):
            get_path(path)


def rerun(cell: Cell | list[Cell], argv: list[str] | None = None, **recorded) -> int:
    """Run ``cell`` alone, or a pair's cells together (traced where they fail), print what failed
    and where it diverged first; the verdict code (0: it passed now). ``argv`` (the script's arguments): ``--op-log
    FILE`` also copies the traced step's operator log there (:mod:`parity.execute.oplog`);
    anything else is a one-line usage error (2). ``recorded``: the run's options the script
    carries (:data:`RECORDED`), as ``RunOptions`` takes them. The results stay in a
    temporary folder the last line names (``report.html`` for the bug report)."""
    from parity.report.outdir import op_log_path
    from parity.runner import RunOptions, run_cells

    argv = list(argv or [])
    if argv and (len(argv) != 2 or argv[0] != "--op-log"):
        print(f"usage: python <reproducer> [--op-log FILE]; got {' '.join(argv)}", file=sys.stderr)
        return 2
    cells = cell if isinstance(cell, list) else [cell]
    try:
        _rerunnable(cells)
    except UsageError as exc:  # the script's cells, edited by hand: one line, as the CLI says it
        print(f"parity: {exc}", file=sys.stderr)
        return 2
    run_dir = os.path.join(tempfile.mkdtemp(prefix="parity-repro-"), "run")
    code = run_cells(cells, RunOptions(out_dir=run_dir, progress=False, op_log=bool(argv), **recorded))
    bad = _failing(run_dir, _ids(cells))
    logged = next((p for p in (op_log_path(run_dir, c.id) for c in cells) if os.path.isfile(p)), "")
    if argv:
        if logged:
            shutil.copyfile(logged, argv[1])
            print(f"operator log: {argv[1]} (DebugMode.load_logs reads it)")
        else:
            print("operator log: none (the cell did not fail numerically, or this torch cannot write one)")
    for r in (r for r in bad if r.check not in LOCATING_CHECKS):
        print(_line(r, len(cells) > 1)[:300])
    for text in _stages(bad, len(cells) > 1):
        print(f"first divergent stage: {text}")
    for text in _divergences(bad, len(cells) > 1):
        print(f"first divergence: {text}")
    print(f"results: {run_dir} (report.html for the bug report)")
    return code
