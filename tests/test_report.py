"""Bench, compare, the HTML report (and its rendering in headless Chromium), the CI workflow."""

import glob
import json
import csv
import os
import re
import shutil
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

PARITY = [sys.executable, "-m", "parity"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _parity(*args, timeout=600):
    return subprocess.run([*PARITY, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")  # once per test worker, even when xdist interleaves modules
def gated(tmp_path_factory):
    """A small real gate run with a deliberate fault, so there are failing records."""
    out = str(tmp_path_factory.mktemp("report") / "run")
    proc = _parity("run", "--matrix", "smoke", "-k", "fixture == 'kda' and ranks == 1 and microbatches == 1",
                   "--fault", "perturb_grad", "--out", out)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    proc = _parity("gate", "--from", out, "--junit", os.path.join(out, "gate-junit.xml"))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out


@pytest.mark.slow
@pytest.mark.xdist_group("report")
def test_a_gate_over_a_filtered_faulted_run_records_what_it_left_out(gated):
    """gate.json says what the decision is worth: the matrix, its digest, what ran of it and
    the faults; the failing model stays NO-GO (partial evidence never hides a failure)."""
    meta = json.load(open(os.path.join(gated, "gate.json")))
    scope = meta["scope"]
    assert scope["matrix"] == "smoke" and len(scope["matrix_digest"]) == 16 and not scope["complete"]
    assert scope["cells_run"] == 2 and scope["cells_expected"] == 48 and scope["faults"] == ["perturb_grad"]
    assert scope["options"] == {"-k": "fixture == 'kda' and ranks == 1 and microbatches == 1"}
    assert meta["versions"]["torch"] and meta["device"] == "cpu"
    assert [d["decision"] for d in meta["decisions"]] == ["NO-GO"]
    assert "complete: **no**" in open(os.path.join(gated, "gate.md")).read()
    junit = open(os.path.join(gated, "gate-junit.xml")).read()  # gate --from writes the decisions' cases too
    assert 'type="NO-GO"' in junit and 'name="kda"' in junit, junit[-1500:]
    assert "Injected fault perturb_grad: flagged in 2 of 2 cells that ran." in open(os.path.join(gated, "summary.md")).read()


def test_a_fault_no_cell_flags_is_said_to_prove_nothing():
    """A green run under a fault is not evidence that the checks work: the summary says how many
    of the cells that ran the fault turned non-PASS, and what none means (skipped cells do not count)."""
    from parity.judge.record import Record, Verdict
    from parity.report.summary import fault_line, summary_markdown

    rows = [Record(cell=f"m/native/c{i}", fixture="m", path="native", check="grad", verdict=v)
            for i, v in enumerate((Verdict.PASS, Verdict.PASS, Verdict.SKIP))]
    assert fault_line(rows, ()) == ""
    line = fault_line(rows, ["drop_override", "drop_override"])
    assert line.startswith("Injected fault drop_override: flagged in 0 of 2 cells that ran; no check fired")
    rows[1] = Record(cell="m/native/c1", fixture="m", path="native", check="grad", verdict=Verdict.FAIL)
    assert fault_line(rows, ["a", "b"]) == "Injected fault a+b: flagged in 1 of 2 cells that ran."
    assert "Injected fault" not in summary_markdown(rows, title="m", timings={}, cells_total=3)
    assert summary_markdown(rows, title="m", timings={}, cells_total=3, faults=["a"]).splitlines()[2].startswith(
        "Injected fault a: flagged in 1 of 2")


@pytest.mark.slow
@pytest.mark.xdist_group("report")
def test_report_html_is_one_self_contained_page(gated):
    text = open(os.path.join(gated, "report.html")).read()
    assert "<script" not in text and not re.search(r"(src|href)=\"?https?:", text)
    assert 'id="heatmap"' in text and "NO-GO" in text and "Failing records" in text and "Versions and hardware" in text


@pytest.mark.slow
@pytest.mark.browser
@pytest.mark.xdist_group("report")
def test_report_renders_in_headless_chromium(gated):
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        if os.environ.get("PARITY_REQUIRE_BROWSER"):
            pytest.fail("no chromium on PATH (apt-get install chromium)")
        pytest.skip("no chromium on PATH; nox -s report requires it")
    page = "file://" + os.path.join(gated, "report.html")
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page],
                         capture_output=True, text=True, timeout=120).stdout
    assert "<b class=\"NO-GO\">NO-GO</b>" in dom  # the gate decision, on top
    assert dom.index('id="gate"') < dom.index('id="heatmap"') < dom.index('id="failing"')
    heat = dom[dom.index('id="heatmap"'):dom.index("</table>", dom.index('id="heatmap"'))]
    assert "FAIL" in heat and "#f4a6a6" in heat  # the faulty check is marked and red
    assert "perturb_grad" in dom and "torch" in dom


@pytest.mark.slow
@pytest.mark.xdist_group("report")
def test_compare_passes_identical_results_and_flags_a_worsened_copy(gated, tmp_path):
    same = _parity("compare", gated, gated, "--write-digest", str(tmp_path / "baseline"))
    assert same.returncode == 0 and "NO REGRESSION" in same.stdout
    worse = tmp_path / "worse"
    worse.mkdir()
    with open(os.path.join(gated, "cells.csv")) as fh:
        rows = list(csv.DictReader(fh))
    failing = {r["cell"] for r in rows if r["verdict"] not in ("PASS", "SKIP")}
    victim = next(r for r in rows if r["cell"] not in failing and r["verdict"] == "PASS" and r["check"] == "output")
    victim["verdict"], victim["ratio"] = "FAIL", "50.0"
    with open(worse / "cells.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    flagged = _parity("compare", gated, str(worse))
    assert flagged.returncode == 1
    assert f"cell {victim['cell']}: PASS -> FAIL" in flagged.stdout and "worst ratio" in flagged.stdout
    # a cells.csv without run.json: nothing says it holds every row (a cut copy read as green)
    assert "the new run is of unknown status (no run.json beside its cells.csv)" in flagged.stdout
    # a committed baseline is just the digest: comparing against it works the same
    again = _parity("compare", str(tmp_path / "baseline"), str(worse))
    assert again.returncode == 1 and f"cell {victim['cell']}: PASS -> FAIL" in again.stdout, again.stdout
    refused = _parity("compare", str(worse), gated)  # such a directory is no baseline
    assert refused.returncode == 2 and "of unknown status (no run.json" in refused.stderr, refused.stderr


def test_compare_keeps_cross_path_ratios_apart_and_flags_a_pair_that_stopped_being_compared(tmp_path):
    """A cross-path row's ratio grew unseen under the same check's own-cell maximum (one key per
    fixture and check), and a FAIL pair that turned UNPAIRED read as an improvement (review)."""
    from parity.judge.record import Record, Verdict
    from parity.report.compare import compare, digest
    from parity.report.records import RecordWriter

    rows = [Record(cell="kda/native/r1", fixture="kda", path="native", check="grad_norm", verdict=Verdict.PASS,
                   observed=0.1, allowed=1.0, ratio=0.1, signal=10.0, allowed_over_signal=0.1),
            Record(cell="kda/native/r1", fixture="kda", path="legacy~native", check="grad_norm",
                   verdict=Verdict.PASS, observed=0.02, allowed=1.0, ratio=0.02, signal=10.0, allowed_over_signal=0.1)]
    writer = RecordWriter(str(tmp_path / "cells.csv"))
    writer.write(rows)
    writer.close()
    checks = digest(str(tmp_path))["checks"]
    assert checks == {"kda|grad_norm": 0.1, "kda|grad_norm (cross-path)": 0.02}
    old = {"cells": {"m/r1/s0": "FAIL"}, "checks": checks, "status": "complete"}
    new = {"cells": {"m/r1/s0": "UNPAIRED"}, "status": "complete",
           "checks": {**checks, "kda|grad_norm (cross-path)": 0.105}}
    bad, _ = compare(old, new)
    assert bad == ["cell m/r1/s0: FAIL -> UNPAIRED",
                   "check kda / grad_norm (cross-path): worst ratio 0.02 -> 0.105 (grew more than 2x)"], bad
    assert compare(new, {**new, "cells": {"m/r1/s0": "PASS"}})[0] == []  # compared again: no regression
    # a cell skipped before that passes now gained evidence; one that fails now is an alarm
    assert compare({**old, "cells": {"c": "SKIP"}}, {**old, "cells": {"c": "PASS"}})[0] == []
    assert compare({**old, "cells": {"c": "SKIP"}}, {**old, "cells": {"c": "FAIL"}})[0] == ["cell c: SKIP -> FAIL"]


def test_bench_trains_a_model_keeping_other_gradient_dtypes_with_sgd():
    """torch 2.15's AdamW cannot step BF16 weights holding FP32 gradients: bench would leave
    bf16_grads unmeasured and exit 1, as `python -m parity bench` once did."""
    from parity.bench.run import bench_optimizer

    assert bench_optimizer("bf16_grads", "") == "sgd" and bench_optimizer("kda", "") == "adamw"


@pytest.mark.slow
def test_parity_s_own_cost_is_per_cell_that_ran_and_compare_weighs_it(tmp_path):
    """A skipped cell is no cell's cost; a harness run whose figures moved beyond their spread
    is a regression on a GPU and listed on CPU, as any bench time."""
    from parity.bench import harness
    from parity.bench.tables import write_csv
    from parity.report.compare import compare, digest

    def cost(seconds):
        runs = [dict.fromkeys(harness.PHASES, s) for s in seconds]
        return {"matrix": "smoke", "cells": 2, "ran": 1, "repeats": len(runs), "verdicts": {"PASS": 1, "SKIP": 1},
                **dict.fromkeys(harness.PHASES, seconds[len(seconds) // 2]), "iqr": dict.fromkeys(harness.PHASES, 0.1), "runs": runs}

    assert "| wall | 1.00 | 0.10 | 1.000 |" in harness.markdown(cost([0.9, 1.0, 1.1]))
    assert harness.csv_rows({**cost([1.0]), "ran": 0}, "cpu") == [] and "| wall | 1.00 | 0.10 | – |" in \
        harness.markdown({**cost([1.0]), "ran": 0})
    for device, regressed in (("cuda", True), ("cpu", False)):
        for name, seconds in (("old", [0.9, 1.0, 1.1]), ("new", [9.9, 10.0, 10.1])):
            (tmp_path / device / name).mkdir(parents=True)
            write_csv(str(tmp_path / device / name / "bench.csv"), harness.csv_rows(cost(seconds), device))
            (tmp_path / device / name / "bench.json").write_text('{"failed": []}')
        bad, info = compare(digest(str(tmp_path / device / "old")), digest(str(tmp_path / device / "new")))
        lines = bad if regressed else info
        assert any(line.startswith("bench harness:smoke / all / harness wall: 1 -> 10") for line in lines), (bad, info)


def test_a_spread_s_iqr_lies_within_its_range():
    from parity.report.summary import spread

    assert spread([1797.0, 43.2])["iqr"] <= 1797.0 - 43.2
    assert spread([float(x) for x in range(10)])["iqr"] == 4.5


@pytest.mark.xdist_group("bench")
def test_bench_counts_the_collectives_each_path_issues(tmp_path):
    out = str(tmp_path / "bench")
    proc = _parity("bench", "--fixtures", "kda,unisolatable", "--steps", "2", "--warmup", "1", "--out", out,
                   "--harness", "smoke", "--harness-repeats", "2")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with open(os.path.join(out, "bench.csv")) as fh:
        rows = list(csv.DictReader(fh))
    value = {(r["fixture"], r["path"], r["metric"]): float(r["value"]) for r in rows if r["repetition"] == "0"}
    # kda: legacy 5 units (2 blocks, 2 FP32 holders, root), native 3; every unit all-gathers in
    # forward and backward and reduce-scatters once; the same bytes travel either way
    assert value[("kda", "legacy", "collectives total")] == 15 and value[("kda", "native", "collectives total")] == 9
    assert value[("kda", "legacy", "bytes total")] == value[("kda", "native", "bytes total")] > 0
    assert value[("kda", "native", "collectives all-gather forward")] == 3
    assert value[("kda", "native", "packing total")] > 0
    assert len([r for r in rows if r["metric"] == "step time" and r["fixture"] == "kda"]) == 4
    md = open(os.path.join(out, "bench.md")).read()
    assert md.index("## Environment") < md.index("## kda") and "| collectives total | count/step | 15 | 9 | 0.60 |" in md
    assert "unisolatable / legacy: ERROR (declared isolation error" in md
    # parity's own cost: smoke's cells of these models and paths, run as `run` would
    assert "## parity's own cost per cell (matrix smoke, 16 cells" in md
    harness = json.load(open(os.path.join(out, "bench.json")))["harness"]
    assert harness["cells"] == harness["ran"] == 16 and 0 < harness["reference+compare"] < harness["wall"]
    assert sum(harness["verdicts"].values()) == 16 and "The harness run's cells: " in md
    assert harness["repeats"] == 2 and "16 ran; median of 2 runs" in md  # figures with a spread, rows compare reads
    assert len([r for r in rows if r["fixture"] == "harness:smoke" and r["metric"] == "harness wall"]) == 2


def test_a_harness_run_that_fails_says_so_where_bench_fails(tmp_path, monkeypatch, capsys):
    """The harness run's own table goes nowhere: a bench failing for it names how it failed."""
    from parity.bench import harness
    from parity.cli import main

    cost = {"matrix": "smoke", "cells": 2, "verdicts": {"FAIL": 1, "PASS": 1}, **dict.fromkeys(harness.PHASES, 1.0)}
    monkeypatch.setattr(harness, "harness_cost", lambda *a, **k: (1, cost))
    assert main(["bench", "--fixtures", "kda", "--paths", "native", "--ranks", "1", "--warmup", "0", "--steps", "1",
                 "--harness", "smoke", "--out", str(tmp_path / "b")]) == 1
    out = str(tmp_path / "b" / "harness" / "summary.md")
    assert f"parity: bench --harness smoke: the harness run did not pass (1 FAIL, 1 PASS); see {out}" \
        in capsys.readouterr().err
    assert "The harness run's cells: 1 FAIL, 1 PASS" in (tmp_path / "b" / "bench.md").read_text()


@pytest.mark.xdist_group("bench")
def test_bench_that_measured_nothing_fails_and_a_fallback_is_named_beside_its_rows(tmp_path):
    """A declared isolation error is listed, not a failure -- unless nothing at all was measured;
    a path that fell back has rows, and bench.md says whose cost they are."""
    from parity.cli import main

    assert main(["bench", "--fixtures", "unisolatable", "--paths", "legacy", "--ranks", "2", "--warmup", "0",
                 "--steps", "1", "--out", str(tmp_path / "none")]) == 1
    assert main(["bench", "--fixtures", "mixed_storage", "--paths", "native", "--ranks", "2", "--warmup", "0",
                 "--steps", "1", "--out", str(tmp_path / "fell")]) == 0
    with open(tmp_path / "fell" / "bench.csv") as fh:
        assert {r["path_taken"] for r in csv.DictReader(fh)} == {"legacy"}
    assert "mixed_storage / native: took legacy (fell back)" in (tmp_path / "fell" / "bench.md").read_text()
    # the same isolation error, not declared by the model: a failure, as its matrix cell is (review)
    source = tmp_path / "undeclared.py"
    source.write_text("import dataclasses\nfrom parity.model.registry import registered\n\n\ndef model():\n"
                      "    return dataclasses.replace(registered()['unisolatable'], name='undeclared', expect={})\n")
    assert main(["bench", "--model", f"{source}:model", "--paths", "legacy,native", "--ranks", "1", "--warmup",
                 "0", "--steps", "1", "--out", str(tmp_path / "undeclared")]) == 1
    md = (tmp_path / "undeclared" / "bench.md").read_text()
    assert "undeclared / legacy: ERROR: " in md and "declared isolation error" not in md, md


def test_the_workflow_is_valid_yaml_and_runs_only_documented_commands():
    import yaml  # the test extra installs it
    with open(os.path.join(ROOT, ".github", "workflows", "parity.yml")) as fh:
        flow = yaml.safe_load(fh)
    assert {"pr", "nightly", "gpu"} <= set(flow["jobs"])
    assert True in flow or "on" in flow  # YAML 1.1 reads the key `on` as True
    docs = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    text = "\n".join(open(path).read() for path in docs)
    runs = [step["run"] for job in flow["jobs"].values() for step in job["steps"] if "run" in step]
    assert runs
    for command in runs:
        assert command.strip() in text, f"not documented in README or docs/: {command}"
        # a session parametrized over torch runs once per version: one --out would be written twice
        for session in ("parity", "gate"):
            assert not (f"nox -s {session} --" in command and "--out" in command), f"name one torch: {command}"


def test_compare_judges_one_sample_bench_figures_memory_by_growth_and_lists_the_rest():
    """Memory and profiled packing are measured once a bench: an IQR rule never flagged them
    (a doubled CUDA peak passed); a memory peak grown past MEMORY_GROWTH is a regression, a moved
    packing time is listed as not judged."""
    from parity.report.compare import MEMORY_GROWTH, compare

    def bench(memory, packing, steps=(10.0, 1.0)):
        return {"cells": {}, "checks": {}, "bench": {
            "kda|native|memory cuda max_memory_allocated MiB": {"median": memory, "iqr": 0.0, "n": 1},
            "kda|native|packing total": {"median": packing, "iqr": 0.0, "n": 1},
            "kda|native|step time": {"median": steps[0], "iqr": steps[1], "n": 5}}}

    old = bench(100.0, 2.0)
    assert compare(old, bench(100.0, 2.0)) == ([], [])
    bad, info = compare(old, bench(200.0, 20.0))
    assert bad == [f"bench kda / native / memory cuda max_memory_allocated MiB: 100 -> 200 (grew more than "
                   f"{MEMORY_GROWTH - 1:.0%})"]
    assert info == ["bench kda / native / packing total: 2 -> 20 (one sample each side: not judged)"]
    bad, info = compare(old, bench(105.0, 2.0))  # within an allocator's rounding: listed, not a regression
    assert not bad and info == ["bench kda / native / memory cuda max_memory_allocated MiB: 100 -> 105 "
                                "(one sample each side: not judged)"]
    assert compare(old, bench(100.0, 2.0, steps=(13.0, 1.0)))[0]  # a timed metric keeps its IQR rule
    # ... for growth only (a faster step is not a regression), and not on CPU, where times only
    # order the paths (the exit code followed the machine's noise); a newly failing model is
    bad, info = compare(old, bench(100.0, 2.0, steps=(7.0, 1.0)))
    assert not bad and info[-1].endswith("(less)"), info
    on_cpu = [{**b, "bench": {k: {**v, "device": "cpu"} for k, v in b["bench"].items()}} for b in (old, bench(
        100.0, 2.0, steps=(13.0, 1.0)))]
    bad, info = compare(*on_cpu)
    assert not bad and info[-1].endswith("(a CPU time: listed, not judged)"), info
    bad, _ = compare(old, {**old, "bench_failed": ["broken|native"]})
    assert bad == ["bench broken / native: not measured now (bench.md says why)"]
    assert compare({**old, "bench_failed": ["broken|native"]}, {**old, "bench_failed": ["broken|native"]}) == ([], [])


def test_summary_and_report_show_each_failing_cells_stage_and_what_they_cut_and_say_when_a_run_is_not_green(tmp_path):
    """A failing cell's hundred gradient rows once pushed its stage and divergence records out of
    summary.md's first 20 and report.html's first 500, silently; an interrupted run's page and an
    all-skipped run's summary and page read as green."""
    from parity.judge.record import Record, Verdict
    from parity.report.html import SHOWN_FAILING, write_html
    from parity.report.summary import SHOWN_PER_CELL, summary_markdown

    base = dict(cell="kda/native/r2", fixture="kda", path="native")
    grads = [Record(**base, check="grad", name=f"w{i}", step=0, verdict=Verdict.FAIL, observed=2.0, allowed=1.0, ratio=2.0)
             for i in range(SHOWN_FAILING + 5)]
    stage = Record(**base, check="stage", name="gather", verdict=Verdict.FAIL, detail="first divergent stage: gather")
    records = grads + [stage]
    md = summary_markdown(records, title="t", timings={}, cells_total=1)
    assert "FAIL stage gather" in md and f"... {len(records) - SHOWN_PER_CELL} more (cells.csv has every record)" in md
    assert "reproduce: `python -m parity repro kda/native/r2 --from DIR --out repro.py`" in md  # NO-GO says how (review)
    write_html(str(tmp_path), records, {"status": "complete", "cells": ["kda/native/r2"]})
    page = (tmp_path / "report.html").read_text()
    assert "first divergent stage: gather" in page and f"The first {SHOWN_FAILING}" in page and "id='banner'" not in page
    assert f"python -m parity repro kda/native/r2 --from {tmp_path} --out repro.py" in page
    write_html(str(tmp_path), records)  # no run.json in tmp_path: nothing says these are every cell's rows
    assert "How this run ended is not recorded (no run.json)" in (tmp_path / "report.html").read_text()
    write_html(str(tmp_path), records, {"cells": ["kda/native/r2"]})
    assert "How this run ended is not recorded (run.json records no status)" in (tmp_path / "report.html").read_text()
    write_html(str(tmp_path), grads[:1], {"status": "interrupted", "cells": ["kda/native/r2", "kda/legacy/r2"]})
    assert "Run interrupted: 1 of 2 cells not run (e.g. kda/legacy/r2)" in (tmp_path / "report.html").read_text()
    skipped = [Record(**base, check="run", name="cell", verdict=Verdict.SKIP, detail="needs 2 GPUs")]
    assert "**Nothing was checked**: every cell was skipped (needs 2 GPUs)" in summary_markdown(
        skipped, title="t", timings={}, cells_total=1)
    write_html(str(tmp_path), skipped, {"status": "complete", "cells": ["kda/native/r2"]})
    assert "Nothing was checked: every cell was skipped (needs 2 GPUs)" in (tmp_path / "report.html").read_text()


def test_outputs_are_utf8_whatever_the_locale_and_survive_a_lone_surrogate(tmp_path):
    """A record the Python API built with a lone surrogate once crashed ``report.html``, and every
    report file was written in the locale's encoding (an ASCII locale refused a non-ASCII tensor
    name) while the page declares UTF-8 (review, twenty-second stop)."""
    script = (
        "import sys; from parity.judge.record import Record, Verdict\n"
        "from parity.report.html import write_html\nfrom parity.report.summary import summary_markdown\n"
        "r = Record(cell='c', fixture='kda', path='native', check='grad', name='norm\\u2192scale\\ud800',"
        " verdict=Verdict.FAIL, observed=2.0, allowed=1.0, ratio=2.0, detail='gr\\u00f6\\u00dfer')\n"
        "write_html(sys.argv[1], [r], {'status': 'complete', 'cells': ['c']})\n"
        "open(sys.argv[1] + '/s.md', 'w', encoding='utf-8', errors='backslashreplace').write("
        "summary_markdown([r], title='t', timings={}, cells_total=1))\n")
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    proc = subprocess.run([sys.executable, "-X", "utf8=0", "-c", script, str(tmp_path)], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    page = (tmp_path / "report.html").read_bytes().decode("utf-8")
    assert "norm\u2192scale\\ud800" in page and "gr\u00f6\u00dfer" in page


@settings(max_examples=100, deadline=None)
@given(detail=st.text(alphabet=st.characters(blacklist_categories=())))
def test_any_detail_is_written_read_back_and_shown_inert(tmp_path_factory, detail):
    """A detail is any exception's text (a lone surrogate from a non-UTF-8 file name, NUL, a terminal's
    escapes): cells.csv takes it (escaped where UTF-8 cannot hold it) and reads back one row; markdown
    shows it without a control character."""
    from parity.judge.record import Record, Verdict
    from parity.report.records import RecordWriter, read_records
    from parity.report.summary import md_text

    path = str(tmp_path_factory.mktemp("rows") / "cells.csv")
    writer = RecordWriter(path)
    writer.write([Record(cell="c", fixture="kda", path="native", check="run", name="cell", verdict=Verdict.ERROR,
                         detail=detail)], sync=False)
    writer.close()
    (row,) = read_records(path, whole=True)
    assert row.verdict == Verdict.ERROR
    assert all(c.isprintable() for c in md_text(detail, cell=True))
