"""The pytest plugin: a team's own test file uses ``parity_run`` / ``parity_gate`` (pytester)."""

import pytest
import torch

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.xdist_group("pytest-plugin")

TEST_FILE = '''
FEW = "fixture == 'kda' and ranks == 1 and microbatches == 1"

import os

def test_green(parity_run):
    result = parity_run(matrix="smoke", filter=FEW)
    assert result.ok and len(result.cells)
    again = parity_run(matrix="smoke", filter=FEW + " and path == 'legacy'", quiet=False, out=None)
    assert again.ok and again.out != result.out and os.path.dirname(again.out) == os.path.dirname(result.out)

def test_a_fault_fails_with_the_worst_records(parity_run):
    parity_run(matrix="smoke", filter=FEW, fault="drop_override")

def test_a_misspelled_value(parity_run):
    parity_run(matrix="smoke", filter=FEW, mesh="fsdpp")

def test_an_unknown_keyword(parity_gate):
    parity_gate(matrix="smoke", filter=FEW, meshes="fsdp")
'''


def test_the_fixtures_turn_verdicts_into_test_outcomes(pytester):
    pytester.makepyfile(test_own=TEST_FILE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=3)
    text = result.stdout.str()
    assert "parity exit code 1; results in" in text
    assert "ratio" in text and "kda/native/r1" in text  # the failing records, with observed / allowed / ratio
    assert "Traceback" not in text.split("test_a_fault_fails_with_the_worst_records")[-1]
    # bad input: one line naming the keyword, no traceback, no chained argparse error
    assert "parity_run: parity.run(mesh=...): invalid choice: 'fsdpp'" in text
    assert "parity_gate: parity.gate() got an unexpected keyword argument 'meshes'" in text
    assert "During handling" not in text and "ArgumentError" not in text


def test_a_fixture_call_a_signal_stopped_stops_the_session(monkeypatch, tmp_path):
    """SIGINT / SIGTERM during ``parity_run(...)``: KeyboardInterrupt ends pytest's session, as for a marked test."""
    from parity import api
    from parity.pytest_plugin import _fixture

    monkeypatch.setattr(api, "run", lambda **options: api.Result(out=str(tmp_path), code=130))
    with pytest.raises(KeyboardInterrupt):
        _fixture("run", tmp_path)(matrix="smoke")


def test_a_fixture_call_with_an_empty_out_is_refused_as_the_api_refuses_it(tmp_path):
    """``parity_run(out="")`` wrote to the fixture's default folder (review); ``parity.run`` refuses it."""
    from parity.pytest_plugin import _fixture

    with pytest.raises(pytest.fail.Exception, match=r"parity.run\(out=''\): give a directory path"):
        _fixture("run", tmp_path)(matrix="smoke", out="", filter="ranks == 3")


MARKED = '''
import pytest

FEW = "fixture == 'kda' and ranks == 1 and microbatches == 1"


@pytest.mark.parity(matrix="smoke", filter=FEW)
def test_kda(parity_cell):
    assert parity_cell.cell.fixture == "kda" and parity_cell.records


@pytest.mark.parity(matrix="smoke", filter=FEW + " and path == 'native'", fault="drop_override")
def test_faulty(parity_cell):
    pass
'''


def test_the_marker_makes_one_test_per_cell_with_the_cells_verdict(pytester):
    pytester.makepyfile(test_cells=MARKED)
    junit = pytester.path / "junit.xml"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v", f"--junitxml={junit}")
    # two cells, and the native one again with a fault that breaks it
    result.assert_outcomes(passed=2, failed=1)
    text = result.stdout.str()
    assert "test_kda[kda/legacy/r1/mb1-every/ac-none/reshard-on/out-natural/s0] PASSED" in text
    assert "test_faulty[kda/native/r1/mb1-every/ac-none/reshard-on/out-natural/s0" in text
    failure = text.split("test_faulty[kda/native", 2)[-1]
    assert "ratio" in failure and "FAIL grad" in failure  # the worst records, observed / allowed / ratio
    assert junit.read_text().count("<testcase") == 3  # one case per cell
    only = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "test_kda and native")
    only.assert_outcomes(passed=1)


def test_the_example_test_file_runs_as_written(pytester):
    import pathlib
    import shutil

    own = pathlib.Path(__file__).parents[1] / "examples" / "own_model"
    (pytester.path / "examples" / "own_model").mkdir(parents=True)
    for name in ("my_model.py", "test_my_model.py"):
        shutil.copy(own / name, pytester.path / "examples" / "own_model" / name)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "examples/own_model/test_my_model.py")
    result.assert_outcomes(passed=3)  # two cells (legacy, native) and the run fixture's test


def test_under_xdist_loadgroup_a_pair_runs_on_one_worker(pytester):
    pytester.makepyfile(test_cells=MARKED)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", "-k", "test_kda")
    result.assert_outcomes(passed=2)


def test_an_unpaired_cell_passes_or_fails_as_the_cli_exits():
    """A native cell judged against the reference alone because legacy raised the isolation error
    the model declares: UNPAIRED by design, exit 0 on the CLI, a passing test here."""
    import pytest

    from parity.judge.record import Record, Unpaired, Verdict
    from parity.matrix.cell import Cell
    from parity.pytest_plugin import CellOutcome

    cell = Cell(fixture="unisolatable", path="native", ranks=2)
    base = dict(cell=cell.id, fixture="unisolatable", path="native", path_taken="native", ranks=2)

    def outcome(reason):
        return CellOutcome(cell, [Record(**base, check="grad", name="w", verdict=Verdict.PASS),
                                  Record(**{**base, "path": "legacy~native"}, check="pair", name=str(reason),
                                         verdict=Verdict.UNPAIRED, detail="why")], out="")
    for asked_for_nothing in (Unpaired.EXPECTED_ISOLATION_ERROR, Unpaired.SKIPPED, Unpaired.BASELINE_NOT_RUN):
        outcome(asked_for_nothing).check()  # as `run` exits 0: the twin cannot exist, was skipped or filtered
    for failed_twin in (Unpaired.DID_NOT_FINISH, Unpaired.NOT_JUDGED, Unpaired.DID_NOT_TRAIN):
        with pytest.raises(pytest.fail.Exception):
            outcome(failed_twin).check()
    assert set(Unpaired) == {Unpaired.EXPECTED_ISOLATION_ERROR, Unpaired.SKIPPED, Unpaired.BASELINE_NOT_RUN,
                             Unpaired.DID_NOT_FINISH, Unpaired.NOT_JUDGED, Unpaired.DID_NOT_TRAIN}  # a new reason is decided here


ALL_SKIPPED = '''
description = "every cell skipped"
steps = 2
[axes]
fixture = ["kda"]
path = ["legacy", "native"]
ranks = [1]
[[skip]]
when = "ranks == 1"
reason = "no such device here"
'''

SELECTIONS = '''
import pytest


@pytest.mark.parity(matrix="allskip.toml", paths="legacy")
def test_nothing_checked(parity_cell):
    pass


@pytest.mark.parity(matrix="allskip.toml")
def test_nothing_checked_on_either_path(parity_cell):
    pass


@pytest.mark.skip(reason="the team's own skip")
@pytest.mark.parity(matrix="smoke", filter="fixture == 'kda' and ranks == 1 and microbatches == 1")
def test_skipped_by_its_team(parity_cell):
    pass
'''


def test_a_marked_test_whose_every_cell_parity_skipped_fails_the_session(pytester):
    """As the CLI exits 1 when every cell was skipped; a test the team skips itself is its business."""
    pytester.makefile(".toml", allskip=ALL_SKIPPED)
    pytester.makepyfile(test_skips=SELECTIONS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(skipped=5)  # a skipped native cell is skipped too, not passed for its unpaired pair
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    text = result.stdout.str()
    assert "parity: every cell of test_skips.py::test_nothing_checked was skipped; nothing was checked" in text
    assert "every cell of test_skips.py::test_nothing_checked_on_either_path was skipped" in text
    assert "parity skipped the cell: no such device here" in text and "test_skipped_by_its_team was" not in text


def test_a_skipped_cell_is_skipped_whatever_its_pair_row_says():
    from parity.judge.record import Record, Unpaired, Verdict
    from parity.matrix.cell import Cell
    from parity.pytest_plugin import CellOutcome

    cell = Cell(fixture="kda", path="native")
    base = dict(cell=cell.id, fixture="kda", path="native", path_taken="native", ranks=1)
    outcome = CellOutcome(cell, [Record(**base, check="run", name="skip", verdict=Verdict.SKIP, detail="no GPU"),
                                 Record(**{**base, "cell": cell.pair_id, "path": "legacy~native"}, check="pair",
                                        name=str(Unpaired.SKIPPED), verdict=Verdict.UNPAIRED, detail="skipped")], out="")
    assert outcome.verdict == "SKIP"
    with pytest.raises(pytest.skip.Exception, match="no GPU"):
        outcome.check()


def test_an_interrupted_group_stops_the_session(monkeypatch, tmp_path_factory):
    """SIGINT / SIGTERM during a marked test's run: KeyboardInterrupt, which ends pytest's session."""
    import parity.runner
    from parity.matrix.cell import Cell
    from parity.pytest_plugin import _run_group

    monkeypatch.setattr(parity.runner, "run_cells", lambda *a, **k: 130)
    options = {"matrix": "smoke", "filter": "fixture == 'kda' and ranks == 1 and microbatches == 1"}
    with pytest.raises(KeyboardInterrupt):
        _run_group(options, Cell(fixture="kda", path="legacy"), tmp_path_factory)


@pytest.mark.parametrize("source, message", [
    ("@pytest.mark.parity(matrix='smoke')\n@pytest.mark.parity(matrix='smoke', filter='ranks == 1')\n"
     "def test_two(parity_cell):\n    pass\n", "2 @pytest.mark.parity markers"),
    ("@pytest.mark.parity(matrix='smoke', junit='x.xml')\ndef test_junit(parity_cell):\n    pass\n",
     "junit= does not apply in a marker"),
    ("import unittest\nclass T(unittest.TestCase):\n    @pytest.mark.parity(matrix='smoke')\n"
     "    def test_ut(self):\n        pass\n", "must take the parity_cell argument"),
    ("@pytest.mark.parity(matrix='smoke', filter=\"fixture == 'kda' and ranks == 1\")\ndef test_no_arg():\n    pass\n",
     "must take the parity_cell argument (def test_...(parity_cell)"),
])
def test_a_marker_parity_cannot_honour_is_a_usage_error(pytester, source, message):
    pytester.makepyfile(test_marker="import pytest\n" + source)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret in (pytest.ExitCode.INTERRUPTED, pytest.ExitCode.USAGE_ERROR), result.ret
    assert message in result.stdout.str() + result.stderr.str()


def test_a_marker_that_selects_no_cell_is_a_usage_error(pytester):
    pytester.makepyfile(test_empty='''
import pytest

@pytest.mark.parity(matrix="smoke", filter="fixture == 'kdaa'")
def test_none(parity_cell):
    pass
''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.INTERRUPTED, result.ret  # a collection error: nothing ran
    said = result.stdout.str() + result.stderr.str()
    assert "@pytest.mark.parity on test_empty.py::test_none: no cells selected" in said
    assert "_caller.py" not in said and "in pytest_generate_tests" not in said, said  # one line, not the hook's frames (review)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_a_marker_asking_for_a_gpu_where_there_is_none_is_refused_at_collection():
    from parity.errors import UsageError
    from parity.pytest_plugin import _selection

    with pytest.raises(UsageError, match="--device cuda: torch .* sees no GPU"):
        _selection({"matrix": "smoke", "device": "cuda", "filter": "fixture == 'kda' and ranks == 1"})


def test_a_failed_load_into_a_teams_helper_fails_the_helpers_test_not_the_baselines():
    """The baseline's checkpoint loads into every other path; a load only the helper's path fails
    is the helper's failure (as the gate charges it): the baseline's test stays green."""
    from types import SimpleNamespace

    from parity.judge.record import Record, Verdict
    from parity.pytest_plugin import _charge_loads

    group = [SimpleNamespace(id=f"m/{p}/r1", path=p, baseline="legacy") for p in ("legacy", "native", "helper")]

    def rec(cell, check="grad", name="w", verdict=Verdict.PASS):
        return Record(cell=cell, fixture="m", path=cell.split("/")[1], check=check, name=name, verdict=verdict)

    def held(helper_skipped=False, own_failure=False):
        base = [rec("m/legacy/r1"), rec("m/legacy/r1", "checkpoint.cross", "helper:grad:w", Verdict.FAIL),
                rec("m/legacy/r1", "checkpoint.cross", "native:grad:w"),
                rec("m/legacy/r1", "stage", "resumed", Verdict.FAIL)]
        base += [rec("m/legacy/r1", "param", "w", Verdict.FAIL)] if own_failure else []
        return {"m/legacy/r1": base, "m/native/r1": [rec("m/native/r1")],
                "m/helper/r1": [rec("m/helper/r1", "run", "cell", Verdict.SKIP) if helper_skipped else rec("m/helper/r1")]}

    charged = held()
    _charge_loads(group, charged)
    assert {r.verdict for r in charged["m/legacy/r1"]} == {Verdict.PASS} and charged["m/native/r1"] == [rec("m/native/r1")]
    assert [(r.check, r.name) for r in charged["m/helper/r1"] if r.verdict == Verdict.FAIL] == [
        ("checkpoint.cross", "helper:grad:w"), ("stage", "resumed")]
    for kept in (held(helper_skipped=True), held(own_failure=True)):  # a skipped helper; the baseline's own failure
        before = {k: list(v) for k, v in kept.items()}
        _charge_loads(group, kept)
        assert kept == before


def test_a_failing_helper_beside_a_passing_one_fails_only_its_own_test():
    """Every cell beside the baseline was handed every pair row of the group: a team's broken
    helper failed the test of a healthy path run beside it (review)."""
    from types import SimpleNamespace

    from parity.judge.record import Record, Verdict
    from parity.pytest_plugin import _held

    group = [SimpleNamespace(id=f"m/{p}/r1", pair_id="m/r1", path=p, baseline="legacy")
             for p in ("legacy", "owner_split", "team_split")]
    rows = [Record(cell=c.id, fixture="m", path=c.path, check="grad", name="w", verdict=Verdict.PASS) for c in group]
    rows += [Record(cell="m/r1", fixture="m", path=f"legacy~{p}", check="grad", name="w", verdict=v)
             for p, v in (("owner_split", Verdict.PASS), ("team_split", Verdict.FAIL))]
    held = _held(group, rows)
    assert [r.path for r in held["m/owner_split/r1"]] == ["owner_split", "legacy~owner_split"]
    assert [r.path for r in held["m/team_split/r1"]] == ["team_split", "legacy~team_split"]
    assert [r.path for r in held["m/legacy/r1"]] == ["legacy"]


def test_marked_tests_collect_under_strict_markers_without_xdist_and_a_refusal_is_said_once(pytester):
    """The cells carry xdist's group mark: without pytest-xdist, --strict-markers must still know it; a
    marker parity refuses is one message, not the refusal and a chained copy of it (review)."""
    pytester.makepyfile(test_strict='''
import pytest

@pytest.mark.parity(matrix="smoke", filter="fixture == 'kda' and ranks == 1 and microbatches == 1")
def test_kda(parity_cell):
    pass
''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", "--strict-markers",
                                           "--collect-only", "-q")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-2000:]
    pytester.makepyfile(test_strict='''
import pytest

@pytest.mark.parity(matrix="smoke", paths="nativ")
def test_kda(parity_cell):
    pass
''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--collect-only", "-q")
    said = result.stdout.str() + result.stderr.str()
    assert "paths: unknown value 'nativ'" in said and "During handling of the above exception" not in said, said


def test_a_failed_run_that_checked_nothing_says_so_first(tmp_path):
    """Every cell skipped: the failure message's first reason is the run's own (nothing was checked),
    not its UNPAIRED pair rows (review)."""
    from parity.api import Result
    from parity.judge.record import Record, Verdict
    from parity.pytest_plugin import explain
    from parity.report.records import RecordWriter

    writer = RecordWriter(str(tmp_path / "cells.csv"))
    writer.write([Record(cell="kda/legacy", fixture="kda", path="legacy", check="run", name="cell",
                         verdict=Verdict.SKIP, detail="needs 2 ranks"),
                  Record(cell="kda", fixture="kda", path="legacy~native", check="pair", name="baseline-not-run",
                         verdict=Verdict.UNPAIRED, detail="the baseline legacy was skipped")], sync=False)
    writer.close()
    text = explain(Result(out=str(tmp_path), code=1))
    assert text.splitlines()[1] == "  nothing was checked: every cell was skipped (needs 2 ranks)", text
