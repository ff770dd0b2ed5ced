"""parity in a team's own pytest suite: the ``parity_run`` and ``parity_gate`` fixtures.

Registered as a pytest plugin (entry point ``pytest11``); it only defines the two fixtures and
imports nothing heavy until a test uses one. Each fixture is a callable taking what
:func:`parity.run` / :func:`parity.gate` take, writing into the test's ``tmp_path``; a bad
verdict fails the test with the worst records (check, tensor, observed / allowed / ratio, cell,
detail) and each failing cell's first divergence where it was located::

    def test_my_model_may_enable_native(parity_gate):
        parity_gate(model="my_pkg.models:parity_model", matrix="default")

Under ``pytest -n N`` each pytest worker runs its own cells (parity's rank pools live in that
worker's process), so N workers and 2-rank cells use 2N processes at a time: size ``-n`` for
the machine.
"""

from __future__ import annotations

import pytest

from parity.judge.record import NOT_ASKED  # an enum module: no torch

#: Failing records shown in a test's failure message.
SHOWN = 8


def explain(result) -> str:
    """A failed result as a test failure message: exit code, where the results are, the worst records."""
    lines = [f"parity exit code {result.code}; results in {result.out}"]
    skipped = _nothing_checked(result.out)
    if skipped:  # its pair rows would read as the failure; the run's own reason comes first
        lines.append(f"  nothing was checked: every cell was skipped ({skipped[:300]})")
    for d in result.decisions:
        lines.append(f"  {d['model']}: {d['decision']}" + (f" ({'; '.join(d['reasons'])[:300]})" if d["reasons"] else ""))
    import pandas as pd

    bad = result.failures()
    located = bad[bad["check"] == "divergence"]
    for _, r in bad[bad["check"] != "divergence"].head(SHOWN).iterrows():
        ratio = "" if pd.isna(r["ratio"]) else f" observed {r['observed']:.3g} allowed {r['allowed']:.3g} ratio {r['ratio']:.3g}"
        lines.append(f"  {r['verdict']} {r['check']} {r['name']}{ratio} [{r['cell']}] {str(r['detail'])[:200]}")
    for _, r in located.head(SHOWN).iterrows():
        lines.append(f"  first divergence in {r['cell']}: {r['name']} {str(r['detail'])[:200]}")
    if len(bad) > SHOWN:
        lines.append(f"  ... {len(bad)} failing records in all (summary.md, report.html)")
    return "\n".join(lines)


def _nothing_checked(out: str) -> str:
    """Why the run in ``out`` checked nothing (every cell skipped), or "" (its records unreadable
    included: the exit code already says the run failed)."""
    import os

    from parity.errors import UsageError
    from parity.report.records import read_records
    from parity.report.summary import nothing_checked

    try:
        return nothing_checked(read_records(os.path.join(out, "cells.csv")))
    except (UsageError, OSError):
        return ""


def _fixture(command: str, tmp_path):
    """The callable behind ``parity_run`` / ``parity_gate``: each call writes its own directory under
    the test's ``tmp_path`` (unless given ``out``), quiet unless ``quiet=False``; bad input fails the
    test in one line, a signal stops the session (as the CLI and ``@pytest.mark.parity`` do)."""
    from parity import api
    from parity.errors import UsageError

    calls = [0]

    def call(**options):
        calls[0] += 1
        in_place = any(options.get(k) for k in api._IN_PLACE)  # that directory is the results'
        default = None if in_place else str(tmp_path / f"parity-{command}{'-' + str(calls[0]) if calls[0] > 1 else ''}")
        out = options.pop("out", None)
        out = default if out is None else out  # out="" is refused as parity.run refuses it
        refused = ""
        try:
            result = getattr(api, command)(out=out, quiet=options.pop("quiet", True), **options)
        except UsageError as exc:
            refused = str(exc)
        except TypeError as exc:  # a keyword parity.run does not take (any other TypeError is a bug: its traceback)
            if "unexpected keyword argument" not in str(exc):
                raise
            refused = str(exc)
        if refused:  # outside the handler: one line, no chained exception
            pytest.fail(f"parity_{command}: {refused}", pytrace=False)
        if result.code in (130, 143):  # SIGINT / SIGTERM reached the run: the session stops
            raise KeyboardInterrupt
        if not result.ok:
            pytest.fail(explain(result), pytrace=False)
        return result

    return call


@pytest.fixture
def parity_run(tmp_path):
    """``parity_run(matrix=..., model=..., **options)``: run cells; the test fails unless every one passed."""
    return _fixture("run", tmp_path)


@pytest.fixture
def parity_gate(tmp_path):
    """``parity_gate(model=..., matrix="default", **options)``: the test fails unless every model is GO."""
    return _fixture("gate", tmp_path)


# --- one pytest test per cell: @pytest.mark.parity(...) and the parity_cell fixture --------------

MARKER = ("parity(matrix='smoke', model=..., **options): one test per cell that parity.run with these "
          "options selects; parity's verdict for the cell is the test's outcome (fixture parity_cell)")


def pytest_configure(config):
    config.addinivalue_line("markers", MARKER)
    if not config.pluginmanager.hasplugin("xdist"):  # the cells' own mark (below), known under --strict-markers
        config.addinivalue_line("markers", "xdist_group(name): tests pytest-xdist's --dist loadgroup runs on one "
                                           "worker (parity: a pair group's cells)")


#: ``run`` options a marker cannot honour: its cells run in pytest's own temporary folders, one pair
#: group at a time, and each test's outcome is the verdict (no part, JUnit of parity's, op log,
#: resumed or listed run).
_NOT_IN_A_MARKER = ("shard", "junit", "op_log", "resume", "out", "overwrite", "list")


def _marked(node):
    markers = list(node.iter_markers("parity"))
    if len(markers) > 1:  # the closest would win silently
        raise pytest.UsageError(f"{node.nodeid}: {len(markers)} @pytest.mark.parity markers (on the test, its class "
                                "or module); give one marker with every option")
    marker = markers[0] if markers else None
    if marker is not None and marker.args:
        raise pytest.UsageError("@pytest.mark.parity takes keywords only, e.g. "
                                "@pytest.mark.parity(model='my_pkg.models:parity_model', matrix='smoke')")
    unsupported = [k for k in _NOT_IN_A_MARKER if marker is not None and k in marker.kwargs]
    if unsupported:
        raise pytest.UsageError(f"@pytest.mark.parity on {node.nodeid}: {unsupported[0]}= does not apply in a marker "
                                "(each test's outcome is its cell's verdict; pytest's --junitxml has one case per "
                                "cell); drop it, or call parity.run from a test")
    return marker


def pytest_generate_tests(metafunc):
    """A test marked ``parity`` becomes one test per selected cell, its id the cell's id (``-k``
    selects cells; ``--junitxml`` carries one case per cell)."""
    marker = _marked(metafunc.definition)
    if marker is None:
        return
    from parity.errors import UsageError

    # a collection error of one line (pytrace=False: no pluggy frames before the message); the
    # session ends as for any collection error, before any cell runs
    refused = ""
    try:
        _, cells, _ = _selection(dict(marker.kwargs))
    except (UsageError, TypeError) as exc:
        refused = str(exc)  # failed outside the handler: one message, not a chain of two
    if refused:
        pytest.fail(f"@pytest.mark.parity on {metafunc.definition.nodeid}: {refused}", pytrace=False)
    if not cells:  # pytest would skip an empty parametrization: a test that checks nothing must not pass
        pytest.fail(f"@pytest.mark.parity on {metafunc.definition.nodeid}: no cells selected; loosen "
                    "filter/paths/ranks", pytrace=False)
    if "parity_cell" not in metafunc.fixturenames:
        metafunc.fixturenames.append("parity_cell")
    # a pair group's cells share an xdist group: with --dist loadgroup they run on one worker,
    # which runs the group once
    params = [pytest.param(c, marks=pytest.mark.xdist_group(c.pair_id)) for c in cells]
    metafunc.parametrize("parity_cell", params, ids=[c.id for c in cells], indirect=True)


def _number(value) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return 0.0
    return number if number == number else 0.0


class CellOutcome:
    """One cell's records (and its cross-path comparison's, for the compared path) after its pair
    group ran; :meth:`check` turns the verdict into the test's outcome."""

    def __init__(self, cell, records, out: str, skip_reason: str = ""):
        self.cell, self.records, self.out, self.skip_reason = cell, records, out, skip_reason

    @property
    def verdict(self) -> str:
        """The worst verdict of the cell's records and its comparison's; SKIP when the cell's own
        records are all SKIP (its comparison is then UNPAIRED for that reason: nothing ran)."""
        from parity.judge.record import SEVERITY, Verdict

        if not self.records:
            return "ERROR"
        own = [r for r in self.records if r.cell == self.cell.id]
        if own and all(r.verdict == Verdict.SKIP for r in own):
            return "SKIP"
        return str(max((r.verdict for r in self.records), key=lambda v: SEVERITY[v]))

    def check(self) -> None:
        verdict = self.verdict
        if verdict == "SKIP":
            reasons = {r.detail for r in self.records if r.detail}
            pytest.skip(SKIPPED + ("; ".join(sorted(reasons))[:300] or "no reason recorded"))
        left = all(r.name in NOT_ASKED for r in self.records if r.verdict == "UNPAIRED")
        if verdict == "UNPAIRED" and left:
            return  # the cell passed; its pair was not asked for or cannot exist (the CLI exits 0; the gate decides)
        if verdict != "PASS":
            pytest.fail(self.explain(), pytrace=False)

    def explain(self) -> str:
        from parity.judge.record import SEVERITY, Verdict

        if not self.records:
            return f"{self.cell.id}: no records were written (results in {self.out})"
        bad = sorted((r for r in self.records if SEVERITY[r.verdict] > SEVERITY[Verdict.PASS]),
                     key=lambda r: (-SEVERITY[r.verdict], -_number(r.ratio)))
        lines = [f"{self.cell.id}: {self.verdict}; results in {self.out}"]
        for r in [r for r in bad if r.check != "divergence"][:SHOWN]:
            ratio = (f" observed {_number(r.observed):.3g} allowed {_number(r.allowed):.3g} ratio {_number(r.ratio):.3g}"
                     if r.ratio != "" else "")
            lines.append(f"  {r.verdict} {r.check} {r.name}{ratio} {r.detail[:200]}")
        lines += [f"  first divergence: {r.name} {r.detail[:200]}" for r in bad if r.check == "divergence"][:SHOWN]
        return "\n".join(lines)


#: How the skip message of a cell parity skipped (verdict SKIP) begins.
SKIPPED = "parity skipped the cell: "
#: Marked test function -> what its cells' reports were ("judged", "skipped"), this session.
_SEEN: dict[str, set[str]] = {}
#: The marked test functions whose every cell parity skipped (the session fails).
_NOTHING: list[str] = []


def pytest_sessionstart(session):
    _SEEN.clear()
    _NOTHING.clear()


def _skip_message(report) -> str:
    longrepr = report.longrepr
    return str(longrepr[2]) if isinstance(longrepr, (tuple, list)) and len(longrepr) == 3 else str(longrepr)


def pytest_runtest_logreport(report):
    """Counts the outcomes of marked tests (under xdist, the controller sees every worker's)."""
    if "parity" not in report.keywords:
        return
    seen = _SEEN.setdefault(report.nodeid.split("[")[0], set())
    if report.skipped:
        if _skip_message(report).removeprefix("Skipped: ").startswith(SKIPPED):
            seen.add("skipped")
    elif report.failed or report.when == "call":
        seen.add("judged")


def pytest_sessionfinish(session):
    """A marked test whose every cell parity skipped checked nothing: the session fails, as
    ``python -m parity run`` exits 1 when every cell was skipped (:func:`parity.runner.verdict_code`)."""
    if hasattr(session.config, "workerinput"):  # an xdist worker sees part of the cells; the controller decides
        return
    _NOTHING[:] = sorted(test for test, seen in _SEEN.items() if seen == {"skipped"})
    if _NOTHING and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    """Names the marked tests that failed the session by checking nothing."""
    if _NOTHING:
        terminalreporter.write_sep("=", "parity: nothing checked", red=True)
        for test in _NOTHING:
            terminalreporter.write_line(f"parity: every cell of {test} was skipped; nothing was checked")


#: (marker options, pair group) -> CellOutcome per cell id, for this pytest process.
_GROUPS: dict[tuple, dict] = {}
#: Marker options -> what they select (:func:`parity.api.select`), once per pytest process.
_SELECTIONS: dict[str, tuple] = {}


def _selection(options: dict) -> tuple:
    key = repr(sorted(options.items()))
    if key not in _SELECTIONS:
        from parity import api

        from parity.cli.run import check_models
        from parity.runner import resolve_device

        _SELECTIONS[key] = api.select(**options)
        resolve_device(_SELECTIONS[key][2]["device"])  # device='cuda' on a machine without one: a usage error now
        check_models(_SELECTIONS[key][1], warn=False)  # a model every cell would fail on: a usage error now
    return _SELECTIONS[key]


def _run_group(options: dict, cell, tmp_path_factory) -> dict:
    """Run the cell's pair group (every path of its axis values: the cross-path comparison needs
    them) once per pytest process; every cell of the group reads its records from it."""
    key = (repr(sorted(options.items())), cell.pair_id)
    if key not in _GROUPS:
        from parity.report.records import read_records
        from parity.runner import RunOptions, resolve_device, run_cells

        matrix, cells, opts = _selection(options)
        group = [c for c in cells if c.pair_id == cell.pair_id]
        out = str(tmp_path_factory.mktemp("parity-cell"))
        code = run_cells(group, RunOptions(out_dir=out, device=resolve_device(opts["device"]),
                                           timeout=opts["timeout"], fp64=bool(opts["fp64"]), progress=False,
                                           overwrite=True, require_native=bool(opts["require_native"])),
                         skip_reason=matrix.skip_reason)
        if code in (130, 143):  # SIGINT / SIGTERM reached the run: the session stops, as the CLI does
            raise KeyboardInterrupt
        records = read_records(f"{out}/cells.csv")
        held = _held(group, records)
        _charge_loads(group, held)
        _GROUPS[key] = {c.id: CellOutcome(c, held[c.id], out) for c in group}
    return _GROUPS[key]


def _held(group, records) -> dict:
    """Each cell's records: its own, and for a cell beside the baseline its own pair's rows
    (``baseline~path``) -- not another path's of the group, whose failure is that path's test's."""
    return {c.id: [r for r in records if r.cell == c.id or (r.cell == c.pair_id and c.path != c.baseline
                                                            and r.path == f"{c.baseline}~{c.path}")]
            for c in group}


def _charge_loads(group, held: dict) -> None:
    """A baseline cell whose only failures are the loads of its checkpoint into other paths
    (:func:`parity.report.gate.failed_loads`): those records, and the ``stage`` / ``divergence``
    rows that locate them, fail the loading paths' tests, as the gate charges them -- a bug in a
    team's own sharding helper does not fail their baseline's test. Kept on the baseline when a
    loading path's own cell was skipped (its test would read SKIP, and the failure be lost)."""
    from parity.judge.record import BAD, LOCATING_CHECKS, Verdict
    from parity.report.gate import failed_loads

    cell_of = {c.path: c.id for c in group}
    ran = {p for p, i in cell_of.items() if any(r.cell == i and r.verdict != Verdict.SKIP for r in held[i])}
    for c in (c for c in group if c.path == c.baseline):
        targets = failed_loads(c.id, held[c.id], set(cell_of) - {c.path})
        if not targets or not targets <= ran:
            continue
        for r in [r for r in held[c.id] if r.cell == c.id and r.verdict in BAD]:
            named = r.name.split(":", 1)[0]
            for path in sorted(targets if r.check in LOCATING_CHECKS else {named} & targets):
                held[cell_of[path]].append(r)
            held[c.id].remove(r)


def pytest_collection_modifyitems(config, items):
    """A marker on a test pytest does not parametrize (a ``unittest.TestCase`` method) would run no
    cell and pass: a usage error instead."""
    for item in items:
        if item.get_closest_marker("parity") is not None and "parity_cell" not in getattr(item, "fixturenames", ()):
            raise pytest.UsageError(f"@pytest.mark.parity on {item.nodeid}: the test must take the parity_cell "
                                    "argument (def test_...(parity_cell): ...), which makes it one test per cell; a "
                                    "unittest.TestCase method cannot")


@pytest.fixture
def parity_cell(request, tmp_path_factory):
    """The outcome of one cell of a ``@pytest.mark.parity`` test (its pair group runs once per
    pytest process); the test fails with the worst records unless the cell passed."""
    marker = _marked(request.node)
    if marker is None or not hasattr(request, "param"):
        raise pytest.UsageError("parity_cell is for tests marked @pytest.mark.parity(...)")
    return _run_group(dict(marker.kwargs), request.param, tmp_path_factory)[request.param.id]


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """After a marked test's own body: the cell's verdict decides its outcome."""
    result = yield
    outcome = pyfuncitem.funcargs.get("parity_cell")
    if isinstance(outcome, CellOutcome):
        outcome.check()
    return result
