"""The gate's rules, each with a case that breaks it, and the records it reads."""

import json
import math
from dataclasses import replace
import os
import xml.etree.ElementTree as ET

import pytest
import torch

from parity.judge import tolerance
from parity.judge.compare import Comparison
from parity.judge.record import OUTCOME_CHECKS, Record, Verdict
from parity.report.gate import GO, NO_GO, NOT_APPLICABLE, PARTIAL, decide


def _cell(fixture, path, i, **kw):
    return f"{fixture}/{path}/r1/c{i}", kw


def rec(fixture, path, i, check="grad", verdict="PASS", taken=None, **kw):
    cell = f"{fixture}/{path}/r1/c{i}" if "~" not in path else f"{fixture}/r1/c{i}"
    if verdict == "PASS" and check not in OUTCOME_CHECKS:  # as a judge writes a measured PASS
        kw = {"observed": 0.0, "allowed": 1.0, "ratio": 0.0, "signal": 10.0, "allowed_over_signal": 0.1, **kw}
    kw.setdefault("ranks", 2)  # a GO needs sharded cells (test_a_go_needs_a_cell_on_two_ranks)
    return Record(cell=cell, fixture=fixture, path=path, path_taken=taken if taken is not None else path.split("~")[0],
                  check=check, name=kw.pop("name", "w"), verdict=Verdict(verdict), **kw)


def healthy(fixture="m", n=2):
    """Passing cells of both paths, each with its checkpoint lifecycle's records, and their pairs."""
    rows = []
    for i in range(n):
        rows += [rec(fixture, "legacy", i), rec(fixture, "native", i), rec(fixture, "legacy~native", i, taken="")]
        rows += [rec(fixture, p, i, check="checkpoint.same") for p in ("legacy", "native")]
        rows += [rec(fixture, p, i, check="coverage", name="records") for p in ("legacy", "native")]
        rows += [rec(fixture, p, i, check="dtype.compute", name="A_log", dtype="float32") for p in ("legacy", "native")]
    return rows


def test_healthy_results_are_go():
    assert decide(healthy(), "m", "native").decision == GO


def test_a_go_needs_a_cell_on_two_ranks():
    """One rank shards nothing and reduces across no one: a user's matrix of one-rank cells
    passed every check and read GO (review). PARTIAL, naming what to add; one sharded cell is enough,
    and a failure stays NO-GO."""
    one = [replace(r, ranks=1) for r in healthy()]
    d = decide(one, "m", "native")
    assert d.decision == PARTIAL and d.reasons == [
        "every native cell that trained the native path ran on one rank: nothing was sharded or reduced across "
        "ranks; add cells of 2 ranks or more (ranks = [1, 2] in the matrix)"]
    sharded = [replace(r, ranks=2) if r.cell == one[1].cell else r for r in one]  # one native cell on 2 ranks
    assert one[1].path == "native" and decide(sharded, "m", "native").decision == GO
    # ...that took native: a 2-rank cell that fell back as declared sharded legacy (review)
    fell = [replace(r, path_taken="legacy") if r.cell == one[1].cell else r for r in sharded]
    fell += [rec("m", "native", 0, check="fallback", name="declared", taken="legacy", detail="declared: x", ranks=2)]
    fell = [replace(r, cell=one[1].cell) if r.check == "fallback" else r for r in fell]
    assert decide(fell, "m", "native").decision == PARTIAL
    # one step: no step read what an earlier one wrote -- a native bug in FP32 values that start
    # exact in BF16 (norm weights of ones) passed a steps = 1 matrix as GO (review)
    once = [replace(r, cell=r.cell + "/st-1") for r in healthy()]
    d = decide(once, "m", "native")
    assert d.decision == PARTIAL and d.reasons == [
        "every native cell that trained the native path ran one step: no step read what an earlier one wrote "
        "(optimizer state, updated parameters); run 2 steps or more (steps = 2)"]
    assert decide([replace(r, cell=r.cell + "/st-3") for r in healthy()], "m", "native").decision == GO
    assert decide(one + [rec("m", "native", 0, verdict="FAIL", ranks=1)], "m", "native").decision == NO_GO
    from parity.report.gate import apply_scope

    apply_scope([d], {"complete": False, "left_out": ["46 of 48 cells not run"], "options": {}})
    assert d.decision == PARTIAL and d.reasons[0] == "partial evidence: 46 of 48 cells not run" and len(d.reasons) == 2


def test_a_go_that_kept_nothing_in_fp32_says_the_override_was_not_exercised():
    """A model computing nothing in FP32 trains native's override as a no-op: its GO shows the
    units match, not the override (review: such GOs read like any other)."""
    rows = [r for r in healthy() if r.check != "dtype.compute"]
    d = decide(rows, "m", "native")
    assert d.decision == GO and d.notes[-1].startswith("no native cell computed a parameter in another dtype")


def test_a_baseline_of_the_candidates_own_contract_is_not_evidence(monkeypatch):
    """A per-parameter plugin as the baseline made every pair native against its own kind: GO
    without a dtype-split run (review)."""
    from parity.paths import registry
    from parity.paths.native import NativePath

    monkeypatch.setattr(registry, "_extra", {})
    registry.register(type("Twin", (NativePath,), {"name": "twin"})())
    rows = [replace(r, path=r.path.replace("legacy", "twin"), path_taken=r.path_taken.replace("legacy", "twin"))
            for r in healthy()]
    d = decide(rows, "m", "native")
    assert d.decision == NO_GO and "the baseline twin shards by native's own contract (per-parameter)" in d.reasons[0]
    # two dtype-split paths (a team's helper gated against legacy) are a fair pair (review)
    from parity.paths.legacy import LegacyPath

    registry.register(type("Split", (LegacyPath,), {"name": "split"})())
    rows = [replace(r, cell=r.cell.replace("native", "split"), path=r.path.replace("native", "split"),
                    path_taken=r.path_taken.replace("native", "split")) for r in healthy()]
    assert decide(rows, "m", "split").decision == GO


def test_a_failing_third_path_is_not_ignored_by_a_gate_on_native():
    rows = healthy() + [rec("m", "owner_split", 0), rec("m", "legacy~owner_split", 0, taken="")]
    d = decide(rows, "m", "native")
    assert d.decision == GO and d.notes == ["path owner_split also ran and passed; this gate decides on native only"]
    rows += [rec("m", "owner_split", 1, verdict="FAIL")]
    d = decide(rows, "m", "native")
    assert d.decision == NO_GO and d.reasons[0].startswith("path owner_split ran beside native and failed in 1 cells")
    assert "gate --candidate owner_split" in d.reasons[0]


def test_a_third_path_that_fell_back_is_not_said_to_have_passed():
    """A plugin path that fell back to legacy in every cell passed as legacy's runs: the note
    says so, not "also ran and passed" (review, twenty-first stop); a gate on it is NO-GO by
    its own name."""
    rows = healthy() + [rec("m", "fb", i, taken="legacy", fallback_reason="unsupported build: x") for i in (0, 1)]
    d = decide(rows, "m", "native")
    assert d.decision == GO and d.notes == [
        "path fb also ran but fell back to legacy in 2 of 2 cells (e.g. m/fb/r1/c0: its own code did not run there); "
        "this gate decides on native only: python -m parity gate --candidate fb decides on fb"]
    d = decide(rows, "m", "fb")
    assert d.decision == NO_GO and d.reasons[0].startswith("fb not exercised: 2 of 2 fb cells took another path")


def test_native_that_fell_back_for_an_unsupported_build_is_not_evidence():
    rows = healthy()
    rows = [r for r in rows if r.path != "native"]
    for i in range(2):
        rows += [rec("m", "native", i, taken="legacy", fallback_reason="unsupported build: torch 2.13.0 has no ..."),
                 rec("m", "native", i, check="fallback", name="unsupported build", taken="legacy",
                     fallback_reason="unsupported build: torch 2.13.0 has no ...")]
    d = decide(rows, "m", "native")
    assert d.decision == NO_GO and d.reasons[0].startswith("native not exercised: 2 of 2 native cells")


def test_native_cells_that_record_no_path_taken_are_not_evidence():
    """A run whose native rows name no path taken (a results file written otherwise) showed
    nothing about which path trained: NO-GO saying so, not a PARTIAL blaming ranks (review)."""
    rows = [replace(r, path_taken="") if r.path == "native" else r for r in healthy()]
    d = decide(rows, "m", "native")
    assert d.decision == NO_GO and d.reasons[0] == ("native not shown to run: 2 of 2 native cells record no path "
                                                   "taken (e.g. m/native/r1/c0); rerun them"), d.reasons


def test_a_declared_fallback_is_not_applicable_and_an_undeclared_one_is_no_go():
    rows = [rec("m", "native", 0, taken="legacy", fallback_reason="unit x mixes trainable storage dtypes"),
            rec("m", "native", 0, check="fallback", name="declared", taken="legacy",
                fallback_reason="unit x mixes trainable storage dtypes"),
            rec("m", "legacy", 0), rec("m", "legacy~native", 0, taken="")]
    assert decide(rows, "m", "native").decision == NOT_APPLICABLE
    assert decide(rows[:2], "m", "native").decision == NO_GO  # compared with no baseline: not even that shown
    rows[1].name = "undeclared"
    rows[1].verdict = Verdict.FAIL
    assert decide(rows, "m", "native").decision == NO_GO


def test_a_declared_fallback_or_isolation_error_with_a_skipped_cell_is_not_not_applicable():
    """NOT APPLICABLE (exit 0) speaks for every candidate cell: one skipped cell (e.g. too few
    ranks under torchrun) leaves its pair unpaired, and that is NO-GO as on any other model."""
    def fell_back(i):
        return [rec("m", "native", i, taken="legacy", fallback_reason="unit x mixes trainable storage dtypes"),
                rec("m", "native", i, check="fallback", name="declared", taken="legacy",
                    fallback_reason="unit x mixes trainable storage dtypes")]

    def raised(i):
        return [rec("m", "native", i, check="expected_error", name="isolation")]

    for one in (fell_back, raised):
        rows = one(0) + [rec("m", "legacy", 0), rec("m", "legacy~native", 0, taken="")]
        assert decide(rows, "m", "native").decision == NOT_APPLICABLE, one
        rows += [rec("m", "legacy", 1), rec("m", "native", 1, check="run", verdict="SKIP"),
                 rec("m", "legacy~native", 1, check="pair", verdict="UNPAIRED", taken="", name="skipped",
                     detail="native was skipped")]
        d = decide(rows, "m", "native")
        assert d.decision == NO_GO and "1 pairs not compared: native was skipped" in d.reasons, (one, d.reasons)


def test_not_applicable_is_no_go_when_the_evidence_beside_it_fails():
    """A declared fallback or isolation error makes enabling the candidate change nothing, but a
    failing comparison, baseline cell or candidate record beside it is still a failure (exit 1)."""
    fell_back = [rec("m", "native", 0, taken="legacy", fallback_reason="unit x mixes trainable storage dtypes"),
                 rec("m", "native", 0, check="fallback", name="declared", taken="legacy",
                     fallback_reason="unit x mixes trainable storage dtypes")]
    raised = [rec("m", "native", 0, check="expected_error", name="isolation")]
    for one in (fell_back, raised):
        rows = one + [rec("m", "legacy", 0), rec("m", "legacy~native", 0, taken="")]
        assert decide(rows, "m", "native").decision == NOT_APPLICABLE
        for bad in (rec("m", "legacy~native", 0, check="output", verdict="FAIL", taken=""),
                    rec("m", "legacy", 0, check="param", verdict="FAIL"),
                    rec("m", "native", 0, check="output", verdict="ERROR", taken=one[0].path_taken)):
            d = decide(rows + [bad], "m", "native")
            assert d.decision == NO_GO and d.reasons, (one, bad, d)
        d = decide(rows + [rec("m", "legacy~native", 0, check="output", verdict="FAIL", taken="")], "m", "native")
        assert d.notes[-1].startswith("would be NOT APPLICABLE") and d.reasons[0].startswith("cross-path: output")


def test_a_candidate_cell_without_its_pair_row_is_no_go():
    """Every candidate cell gets a pair row (compared or UNPAIRED); rows of a pair that are gone
    from the results are missing evidence, not a pair that needed no comparison."""
    rows = [r for r in healthy() if not (r.path == "legacy~native" and r.cell == "m/r1/c1")]
    d = decide(rows, "m", "native")
    assert d.decision == NO_GO and d.reasons == [
        "1 native cells have no cross-path record in the results (e.g. m/native/r1/c1): their comparison with "
        "the baseline is missing"]


def test_a_trained_cell_without_its_coverage_record_or_a_pair_of_skips_is_no_go():
    """A passing cell's records end with its coverage record (what it owed arrived) and a pair's
    rows compare something: a cell left with a few PASS rows, or a pair whose every row is SKIP,
    is evidence missing, not a cell or a pair that passed."""
    rows = [r for r in healthy() if not (r.check == "coverage" and r.cell == "m/native/r1/c1")]
    d = decide(rows, "m", "native")
    assert d.decision == NO_GO and d.reasons == [
        "1 of 2 native cells that trained hold no coverage record (e.g. m/native/r1/c1): nothing says their owed "
        "records arrived; rerun them"]
    skipped = [replace(r, verdict=Verdict.SKIP, detail="compiled: not compared") if r.cell == "m/r1/c1" else r
               for r in healthy()]
    d = decide(skipped, "m", "native")
    assert d.decision == NO_GO and d.counts["pairs compared"] == 1 and d.reasons == [
        "1 pairs compared nothing, every row SKIP (e.g. m/r1/c1: compiled: not compared)"]


def test_all_native_cells_skipped_is_no_go():
    rows = [rec("m", "legacy", 0), rec("m", "native", 0, check="run", verdict="SKIP")]
    d = decide(rows, "m", "native")
    assert d.decision == NO_GO and "all skipped" in d.reasons[0]


def test_failures_inconclusive_records_and_unexplained_unpaired_pairs_are_no_go():
    for bad in (rec("m", "native", 0, verdict="FAIL", ratio=3.0),
                rec("m", "native", 0, check="param", verdict="INCONCLUSIVE", ratio=0.0),
                rec("m", "legacy~native", 0, verdict="FAIL", ratio=2.0, taken=""),
                rec("m", "legacy~native", 0, check="pair", verdict="UNPAIRED", taken="", name="did-not-finish",
                    detail="legacy did not finish (ERROR)"),
                # the gate reads the code, not the words
                rec("m", "legacy~native", 0, check="pair", verdict="UNPAIRED", taken="", name="did-not-finish",
                    detail="legacy raised the fixture's expected isolation error"),
                rec("m", "legacy", 1, verdict="ERROR")):
        d = decide(healthy() + [bad], "m", "native")
        assert d.decision == NO_GO, bad
    worst = decide(healthy() + [rec("m", "native", 0, verdict="FAIL", ratio=3.0)], "m", "native").reasons[0]
    assert worst.startswith("native: grad: 1 FAIL records in 1 cell, worst ratio 3")


def test_a_no_go_names_the_first_divergence_before_its_later_symptoms():
    """Reasons were sorted by check name: a corrupted gather read first as the resumed step's
    ``checkpoint.cross`` (review). The cell's ``stage`` record leads, then the module, then the
    checks in pipeline order."""
    bad = [rec("m", "native", 0, check="checkpoint.cross", name="legacy:param:w", verdict="FAIL", ratio=9.0),
           rec("m", "native", 0, check="param", verdict="FAIL", ratio=5.0, step=1),
           rec("m", "native", 0, check="divergence", name="blocks.0", verdict="FAIL", ratio=3.0, step=1),
           rec("m", "native", 0, check="gathered", verdict="FAIL", ratio=2.0, step=1),
           rec("m", "native", 0, check="stage", name="gather", verdict="FAIL", ratio=2.0, step=1,
               detail="first divergent stage: gather at step 1: gathered w")]
    reasons = decide(healthy() + bad, "m", "native").reasons
    assert [x.split(":")[1].strip() for x in reasons] == [
        "first divergent stage", "divergence", "gathered", "param", "checkpoint.cross"], reasons
    assert reasons[0] == ("native: first divergent stage: gather at step 1: gathered w (m/native/r1/c0; first "
                          "divergent stage: gather in 1 cell)")


def test_gate_md_gives_a_no_go_its_reproducer(tmp_path):
    """gate.md said where a NO-GO diverged but not how to re-run it (review, twenty-second stop)."""
    from parity.report.gate import evaluate, write

    records = healthy() + [rec("m", "native", 1, check="param", verdict="FAIL", ratio=5.0),
                           rec("m", "native", 0, check="stage", name="gather", verdict="FAIL", ratio=2.0)]
    write(str(tmp_path), evaluate(records), records, meta={"candidate": "native", "torch": "x", "matrix": "smoke",
                                                            "results": "results/latest"})
    md = (tmp_path / "gate.md").read_text()
    assert "- reproduce: `python -m parity repro m/native/r1/c0 --from results/latest --out repro.py`" in md
    assert md.count("reproduce:") == 1


def test_a_baseline_that_cannot_shard_leaves_go_with_a_note():
    rows = [rec("m", "native", 0), rec("m", "native", 0, check="coverage"), rec("m", "legacy", 0, check="expected_error"),
            rec("m", "legacy~native", 0, check="pair", verdict="UNPAIRED", taken="", name="expected-isolation-error",
                detail="legacy raised the fixture's expected isolation error; native was judged against the "
                       "reference alone")]
    d = decide(rows, "m", "native")
    assert d.decision == GO and "judged against the reference alone" in d.notes[0]


def _isolated(i, raised_by="legacy"):
    """Cell ``i``'s pair, unpaired because ``raised_by`` raised the model's declared isolation error."""
    return rec("m", "legacy~native", i, check="pair", verdict="UNPAIRED", taken="", name="expected-isolation-error",
               detail=f"{raised_by} raised the fixture's expected isolation error")


def test_the_isolation_error_excuses_a_pair_only_where_the_candidate_trained():
    """A skipped candidate cell is NO-GO whatever code its pair row carries (the runner gives it the
    baseline's); a candidate that raised the isolation error where it also trains elsewhere is no
    evidence, and the 'judged against the reference alone' note is only for cells it trained in."""
    base = [rec("m", "native", 0), rec("m", "legacy", 0, check="expected_error"), _isolated(0),
            rec("m", "legacy", 1, check="expected_error"), _isolated(1)]
    skipped = decide(base + [rec("m", "native", 1, check="run", verdict="SKIP")], "m", "native")
    assert skipped.decision == NO_GO and any(r.startswith("1 of 2 native cells were skipped") for r in skipped.reasons)
    raised = decide(base + [rec("m", "native", 1, check="expected_error", taken="native")], "m", "native")
    assert raised.decision == NO_GO and any("1 pairs not compared" in r for r in raised.reasons), raised.reasons
    assert raised.notes[0] == ("the baseline cannot shard this model (declared isolation error) in 1 cells: native "
                               "was judged against the reference alone there")
    everywhere = [rec("m", "native", i, check="expected_error", taken="native") for i in range(2)]
    assert decide(base[1:] + everywhere, "m", "native").decision == NOT_APPLICABLE


def test_a_candidate_that_raises_or_falls_back_as_declared_everywhere_is_not_applicable():
    """Native raising the declared isolation error trains nothing to compare: its pair rows are
    excused whatever the baseline did (skipped there, say); raising in some cells and falling
    back as declared in the others (``weights=mixed``) is NOT APPLICABLE too."""
    raise_ = [rec("m", "native", i, check="expected_error", taken="native") for i in range(2)]
    rows = raise_ + [rec("m", "legacy", 0), _isolated(0, "native"), rec("m", "legacy", 1, check="run", verdict="SKIP"),
                     rec("m", "legacy~native", 1, check="pair", verdict="UNPAIRED", taken="", name="skipped",
                         detail="legacy was skipped")]
    assert decide(rows, "m", "native").decision == NOT_APPLICABLE
    mixed = [raise_[0], rec("m", "native", 1, taken="legacy", fallback_reason="mixes weight formats"),
             rec("m", "native", 1, check="fallback", name="declared", taken="legacy", detail="mixes weight formats"),
             rec("m", "legacy", 0), _isolated(0, "native"), rec("m", "legacy", 1), rec("m", "legacy~native", 1, taken="")]
    d = decide(mixed, "m", "native")
    assert d.decision == NOT_APPLICABLE and d.notes[0].startswith("native raises the isolation error the model "
                                                                  "declares in 1 cells and falls back"), d.notes


def test_a_declared_fallback_in_some_cells_is_said_beside_a_go():
    rows = healthy() + [rec("m", "native", 1, check="fallback", name="declared", taken="legacy",
                            detail="declared: mixes weight formats")]
    rows = [replace(r, path_taken="legacy") if r.cell == "m/native/r1/c1" else r for r in rows]
    d = decide(rows, "m", "native")
    assert d.decision == GO and d.notes == ["native falls back in 1 of 2 cells, as the model declares: declared: "
                                            "mixes weight formats"], d.notes


def test_not_applicable_needs_its_pairs_too():
    """NOT APPLICABLE exits 0 like GO: an unpaired (skipped) or missing pair row makes it NO-GO."""
    rows = []
    for i in range(2):
        rows += [rec("m", "native", i, taken="legacy", fallback_reason="mixes storage"),
                 rec("m", "native", i, check="fallback", name="declared", taken="legacy", detail="mixes storage"),
                 rec("m", "legacy", i), rec("m", "legacy~native", i, taken="")]
    assert decide(rows, "m", "native").decision == NOT_APPLICABLE
    rows[-2] = rec("m", "legacy", 1, check="run", verdict="SKIP")
    rows[-1] = rec("m", "legacy~native", 1, check="pair", verdict="UNPAIRED", taken="", name="skipped",
                   detail="legacy was skipped")
    d = decide(rows, "m", "native")
    assert d.decision == NO_GO and "1 pairs not compared: legacy was skipped" in d.reasons, d.reasons
    assert decide(rows[:-1], "m", "native").decision == NO_GO  # its pair row gone


def test_an_allowance_as_large_as_its_signal_is_inconclusive():
    expected = torch.tensor([1.0, -2.0])
    big = tolerance.Allowance(2.5, torch.float32, "too wide")
    row = Comparison(0, "grad", "w", expected.clone(), expected, big).record(dict(cell="c", fixture="m", path="native"))
    assert row.verdict == Verdict.INCONCLUSIVE and row.signal == 2.0 and math.isclose(row.allowed_over_signal, 1.25)
    fine = tolerance.Allowance(1e-6, torch.float32, "sharp")
    row = Comparison(0, "grad", "w", expected.clone(), expected, fine).record(dict(cell="c", fixture="m", path="native"))
    assert row.verdict == Verdict.PASS


def test_a_skipped_bf16_update_fails_the_parameter_check():
    # the vacuity the old 16 s u max|p| allowance had: a BF16 parameter's whole AdamW step passed
    before = (0.1 * torch.randn(64)).to(torch.bfloat16)  # weights of a tiny model
    after = (before.float() - 1e-2 * torch.sign(torch.randn(64))).to(torch.bfloat16)
    allow = tolerance.parameter(torch.bfloat16, after, after - before)
    row = Comparison(0, "param", "w", before, after, allow, signal=float((after - before).abs().max())).record(
        dict(cell="c", fixture="m", path="native"))
    assert row.verdict == Verdict.FAIL and row.allowed_over_signal < 1


def test_a_run_where_every_cell_is_skipped_exits_nonzero(tmp_path, capsys):
    from parity.cli import main

    matrix = tmp_path / "allskip.toml"
    matrix.write_text('description = "every cell skipped"\nsteps = 2\n[axes]\nfixture = ["kda"]\n'
                      'path = ["legacy", "native"]\nranks = [2]\n[[skip]]\nwhen = "ranks == 2"\n'
                      'reason = "needs 2 GPUs"\n')
    junit = tmp_path / "x.xml"
    assert main(["run", "--matrix", str(matrix), "--out", str(tmp_path / "x"), "--junit", str(junit)]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("parity: every cell was skipped (needs 2 GPUs")
    suite = ET.parse(junit).getroot().find("testsuite")  # CI reads the file as it reads the exit code: not green
    assert suite.get("failures") == "1" and suite.find("testcase[@name='run']/failure").get("type") == "NOTHING CHECKED"
    assert main(["gate", "--from", str(tmp_path / "x")]) == 1  # nothing checked: no GO
    scope = json.loads((tmp_path / "x" / "gate.json").read_text())["scope"]
    assert scope["cells_run"] == scope["cells_skipped"] == 2
    assert "2 of 2 cells (2 of them skipped)" in (tmp_path / "x" / "gate.md").read_text()


def test_trajectory_allows_twice_the_emulations_distance_to_fp64_and_no_more():
    from parity.judge.reference import ReferenceRun
    from parity.judge.trajectory import trajectory_records
    from parity.model.plan import PrecisionConfig, resolve_plan

    model = torch.nn.Linear(4, 4)
    plan = resolve_plan(model, PrecisionConfig())
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    truth = {n: p + 0.1 for n, p in init.items()}  # where FP64 training went
    own = {n: p + 1e-3 for n, p in truth.items()}  # the emulation's own error
    fp64, emulated = ReferenceRun(params=[init, truth]), ReferenceRun(params=[init, own])  # two steps
    base = dict(cell="c", fixture="m", path="native")
    close = {n: p + 1.5e-3 for n, p in truth.items()}  # 1.5 x the emulation's distance, beside it
    far = {n: p + 3e-3 for n, p in truth.items()}  # 3 x
    assert {r.verdict for r in trajectory_records([init, close], emulated, fp64, init, plan, base)} == {Verdict.PASS}
    assert {r.verdict for r in trajectory_records([init, far], emulated, fp64, init, plan, base)
            if r.check == "trajectory"} == {Verdict.FAIL}
    # as close to FP64, but on the far side of it from the recipe it emulates: only the direct bound sees it
    across = {n: p - 1.5e-3 for n, p in truth.items()}
    verdicts = {(r.check, r.verdict) for r in trajectory_records([init, across], emulated, fp64, init, plan, base)}
    assert verdicts == {("trajectory", Verdict.PASS), ("trajectory.emulation", Verdict.FAIL)}


def test_junit_has_a_case_per_cell_and_check_and_carries_the_evidence(tmp_path):
    import xml.etree.ElementTree as ET

    from parity.report.junit import write_junit

    rows = healthy(n=1) + [rec("m", "native", 0, check="param", verdict="FAIL", ratio=3.0, observed=3e-3,
                               allowed=1e-3, detail="per element"),
                           rec("m", "native", 0, check="input_grad", verdict="SKIP", detail="tokens")]
    write_junit(str(tmp_path / "j.xml"), rows, suite="t")
    suite = ET.parse(tmp_path / "j.xml").getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("11", "1", "1")  # 2 checkpoint, 2 dtype, 2 coverage
    failure = suite.find("testcase[@name='param']/failure")
    assert "observed 0.003, allowed 0.001, ratio 3.0" in failure.get("message")


def test_narrowed_evidence_is_partial_and_a_no_go_stays_no_go():
    from parity.report.gate import PARTIAL, apply_scope, is_go

    good, bad = decide(healthy("a"), "a", "native"), decide(healthy("b") + [rec("b", "native", 0, verdict="FAIL")],
                                                            "b", "native")
    apply_scope([good, bad], {"complete": False, "left_out": ["46 of 48 cells not run"], "options": {"-k": "x"}})
    assert (good.decision, bad.decision) == (PARTIAL, NO_GO) and not is_go([good])
    assert good.reasons[0].startswith("partial evidence, would be GO on what ran: 46 of 48 cells not run")


@pytest.mark.parametrize("narrow, left_out", [
    ({"filter": "fixture == 'kda'"}, "cells not run"),
    ({"ranks": "1"}, "cells not run"),
    ({"paths": "legacy"}, "cells not run"),
    ({"steps": 1}, "--steps 1 instead of the matrix's 2"),
    ({"fault": ["perturb_grad"]}, "faults injected: perturb_grad"),
    ({"seed": 3}, "cells not run"),
])
def test_a_gate_is_complete_only_on_the_whole_matrix_with_its_steps_and_no_fault(narrow, left_out):
    from parity.cli import RUN_DEFAULTS, _scope, _select

    whole = {**RUN_DEFAULTS, "matrix": "smoke"}
    _, cells = _select(whole)
    full = _scope(whole, [c.id for c in cells])
    assert full["complete"] and full["cells_run"] == full["cells_expected"] == 48 and not full["left_out"]
    opts = {**whole, **narrow}
    _, ran = _select(opts)
    scope = _scope(opts, [c.id for c in ran])
    assert not scope["complete"] and any(left_out in x for x in scope["left_out"]), scope
    assert scope["matrix_digest"] == full["matrix_digest"]
    assert _scope(None, [])["complete"] is False  # a directory that records no options proves nothing


def test_gate_refuses_injected_faults(capsys):
    from parity.cli import main

    assert main(["gate", "--fault", "perturb_grad", "-k", "ranks == 1"]) == 2
    assert "gate refuses --fault" in capsys.readouterr().err


def test_a_candidate_compared_with_no_other_path_is_no_go(tmp_path, capsys):
    """Native cells that are their own baseline pass against the reference but were compared with
    no other path: not a GO (the gate on that run says NO-GO; asked for, it is refused up front)."""
    from parity.cli import main

    alone = [rec("m", "native", i) for i in range(2)]
    d = decide(alone, "m", "native")
    assert d.decision == NO_GO and "compared with no baseline path" in d.reasons[0]
    assert decide(healthy(), "m", "native").decision == GO  # with its pairs, the same cells are GO
    out = str(tmp_path / "run")
    assert main(["run", "--matrix", "smoke", "-k", "fixture == 'kda' and ranks == 1 and microbatches == 1",
                 "--paths", "native", "--baseline", "native", "--out", out]) == 0
    capsys.readouterr()
    assert main(["gate", "--from", out]) == 1
    assert "kda" in capsys.readouterr().out
    assert main(["gate", "--baseline", "native", "-k", "ranks == 1", "--out", str(tmp_path / "g")]) == 2
    assert "the baseline path native is the candidate" in capsys.readouterr().err
    assert main(["gate", "--candidate", "legacy", "-k", "ranks == 1", "--out", str(tmp_path / "g")]) == 2  # legacy:
    assert "the baseline path legacy is the candidate" in capsys.readouterr().err  # the default baseline
    assert not os.path.exists(tmp_path / "g")
    from parity.cli import RUN_DEFAULTS, RUN_IDENTITY
    from parity.report import outdir

    resumed = tmp_path / "resumed"  # a gate whose run recorded --baseline native, resumed for legacy
    resumed.mkdir()
    outdir.write_manifest(str(resumed), {"options": {**{k: RUN_DEFAULTS[k] for k in RUN_IDENTITY}, "baseline": "native"},
                                         "cells": [], "status": "interrupted", "torch": "0", "device": "cpu"})
    assert main(["gate", "--resume", str(resumed), "--candidate", "legacy"]) == 2
    err = capsys.readouterr().err
    assert "is the candidate" not in err and "the interrupted run used torch '0'" in err, err


def test_a_failed_load_of_the_baselines_checkpoint_is_charged_to_the_path_that_loaded_it():
    """The baseline cell saves a checkpoint and loads it into every other path; when only such a
    load fails (its ``stage`` record beside it), the reason names that path, not the baseline."""
    def loaded_into(target):
        return [rec("m", "legacy", 0, check="checkpoint.cross", name=f"{target}:grad:w", verdict="FAIL",
                    observed=1.0, allowed=0.1, ratio=10.0, detail=f"resumed on {target}"),
                rec("m", "legacy", 0, check="stage", name="resumed", verdict="FAIL",
                    detail=f"first divergent stage: resumed: checkpoint.cross {target}:grad:w")]

    own = decide(healthy() + loaded_into("native"), "m", "native")
    assert own.decision == NO_GO and not any("baseline failed" in r for r in own.reasons), own.reasons
    assert any(r.startswith("native (this gate's candidate) failed to resume from the baseline's checkpoint in 1 cells")
               for r in own.reasons), own.reasons
    other = decide(healthy() + [rec("m", "liar", 0)] + loaded_into("liar"), "m", "native")
    assert other.decision == NO_GO and not any("baseline failed" in r for r in other.reasons), other.reasons
    assert any(r.startswith("path liar, beside native (python -m parity gate --candidate liar decides on it) failed")
               for r in other.reasons), other.reasons
    both = decide(healthy() + [rec("m", "liar", 0), rec("m", "forgets", 0)] + loaded_into("liar")
                  + loaded_into("forgets"), "m", "native")  # two helpers beside: each its own load, not the baseline
    assert not any("baseline failed" in r for r in both.reasons), both.reasons
    for helper in ("liar", "forgets"):
        assert any(r.startswith(f"path {helper}, beside native (python -m parity gate --candidate {helper} decides on "
                                f"it) failed to resume from the baseline's checkpoint in 1 cells (e.g. m/legacy/r1/c0: "
                                f"checkpoint.cross {helper}:grad:w") for r in both.reasons), both.reasons
    own_step = decide(healthy() + loaded_into("native") + [rec("m", "legacy", 0, verdict="FAIL", observed=1.0,
                                                               allowed=0.1, ratio=10.0)], "m", "native")
    assert any(r.startswith("baseline failed in 1 cells") for r in own_step.reasons), own_step.reasons
    for name in ("entry:model/w", "moved:legacy:save"):  # the baseline's own saving: no path's load
        saved = decide(healthy() + [rec("m", "legacy", 0, check="checkpoint.saved", name=name, verdict="FAIL")],
                       "m", "native")
        assert [r for r in saved.reasons if "failed" in r][0].startswith("baseline failed in 1 cells"), saved.reasons


def test_a_class_fp32_typo_that_leaves_nothing_fp32_is_no_go_and_other_warnings_are_notes():
    """Both paths agree on keeping nothing in FP32: a GO would say the override works where it never
    ran. ``Fixture.expect_fp32=()`` (nothing is meant to be FP32) lets it be GO; a pattern that
    selects nothing beside others that do is a note."""
    from parity.report.gate import apply_model_warnings

    note = "MyModel._keep_in_fp32_modules_strict pattern 'A_lgo' selects no parameter or buffer"
    decisions = [decide(healthy("a"), "a", "native"), decide(healthy("b"), "b", "native")]
    apply_model_warnings(decisions, {"a": {"notes": [note], "fp32_unselected": True},
                                     "b": {"notes": [note], "fp32_unselected": False}})
    assert decisions[0].decision == NO_GO and "declare Fixture.expect_fp32=() if nothing" in decisions[0].reasons[0]
    assert decisions[1].decision == GO and decisions[1].notes == [f"run warned: {note}"]
    older = [decide(healthy("a"), "a", "native")]  # a run.json without the key: nothing says they were read
    apply_model_warnings(older, None)
    assert older[0].decision == NO_GO and older[0].reasons[0].startswith("run.json records no model_warnings")
    # on one rank the decision was PARTIAL first: the typo still leads, and no note speaks of "this GO" (review)
    one = [decide([replace(r, ranks=1) for r in healthy("a") if r.check != "dtype.compute"], "a", "native")]
    assert one[0].decision == PARTIAL and any("this GO" in n for n in one[0].notes)
    apply_model_warnings(one, {"a": {"notes": [], "fp32_unselected": True}})
    assert one[0].decision == NO_GO and one[0].reasons[0].startswith("its class declares FP32 patterns")
    assert len(one[0].reasons) == 2 and not any("this GO" in n for n in one[0].notes)


def test_a_baseline_that_ran_another_path_is_no_go_unless_declared():
    """A native baseline on a torch build without the native API ran legacy in every cell: the
    candidate was compared with legacy, and the gate said GO (review)."""
    fell = []
    for r in healthy():
        if r.path == "legacy":  # the baseline here is native: swap the roles
            fell.append(replace(r, path="native", cell=r.cell.replace("/legacy/", "/native/"), path_taken="legacy",
                                fallback_reason="unsupported build: no param_dtype_override_fn"))
        elif r.path == "native":
            fell.append(replace(r, path="owner", cell=r.cell.replace("/native/", "/owner/"), path_taken="owner"))
        else:
            fell.append(replace(r, path="native~owner"))
    d = decide(fell, "m", "owner")
    assert d.decision == NO_GO and d.reasons == [
        "baseline native not exercised: 2 of 2 baseline native cells ran legacy (unsupported build: no "
        "param_dtype_override_fn): the candidate was compared with legacy, not native; run the baseline where it "
        "runs, or gate against another baseline"], d.reasons
    declared = fell + [rec("m", "native", i, check="fallback", name="declared", taken="legacy") for i in range(2)]
    d = decide(declared, "m", "owner")
    assert d.decision == GO and any(n.startswith("baseline native falls back as the model declares") for n in d.notes)


TYPO_MODEL = """import dataclasses
import sys

sys.path.insert(0, {examples!r})
import my_model


class Typo(my_model.MyModel):
    _keep_in_fp32_modules_strict = {patterns!r}


def parity_model():
    base = my_model.parity_model()
    return dataclasses.replace(base, build=lambda: Typo(){fields})
"""


@pytest.mark.parametrize("patterns, fields, decision", [
    (["norm_wieght", "A_lgo", "dt_bais"], "", "NO-GO"),
    (["norm_wieght", "A_lgo", "dt_bais"], ", expect_fp32=()", "GO"),
    (["norm_weight", "A_log", "dt_bias", "not_in_this_config"], "", "GO"),
    # FP32 by a recorded dtype, not by name: the override runs, the typo is a note
    (["norm_wieght"], ", compute_dtypes={'layers.0.norm.norm_weight': 'float32'}", "GO"),
])
def test_the_gate_reads_what_run_warned_about_a_models_fp32_declaration(patterns, fields, decision, tmp_path):
    from parity.cli import main

    examples = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples", "own_model")
    (tmp_path / "typo.py").write_text(TYPO_MODEL.format(examples=examples, patterns=patterns, fields=fields))
    out = tmp_path / "run"
    code = main(["gate", "--model", f"{tmp_path / 'typo.py'}:parity_model", "--matrix", "smoke", "-k",
                 "ranks == 1 and microbatches == 1", "--out", str(out)])
    gate = json.loads((out / "gate.json").read_text())
    assert [d["decision"] for d in gate["decisions"]] == [decision if decision == "NO-GO" else "PARTIAL"], gate
    assert code == 1
    warned = json.loads((out / "run.json").read_text())["model_warnings"]["my_model"]
    assert warned["fp32_unselected"] is (decision == "NO-GO") and "selects no parameter" in warned["notes"][0]


def test_a_go_says_how_far_its_checkpoint_evidence_reaches():
    """The DCP lifecycle runs only in one-micro-batch cells without activation checkpointing: a
    decision over cells without it says how many cells held checkpoint evidence."""
    rows = healthy() + [rec("m", "native", 9, microbatches=3), rec("m", "native", 9, check="coverage"),
                        rec("m", "legacy", 9), rec("m", "legacy~native", 9, taken="")]
    d = decide(rows, "m", "native")
    assert d.decision == GO and d.notes[-1].startswith("checkpoint save/load/resume was checked in 2 of 3 native cells")
    assert not [n for n in decide(healthy(), "m", "native").notes if n.startswith("checkpoint")]


@pytest.mark.xdist_group("gate-from")
def test_a_gate_from_a_run_whose_matrix_file_changed_since_is_refused(tmp_path, capsys):
    """``gate --from`` reads the matrix file again to know what the complete matrix is: edited
    after the run (its ``ranks`` narrowed to what ran), a PARTIAL run read as the whole matrix
    and turned GO (review). The file's digest in ``run.json`` now has to match."""
    import shutil

    from parity.cli import main

    matrix = tmp_path / "m.toml"
    shutil.copy(os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "matrices", "smoke.toml"), matrix)
    out = str(tmp_path / "run")
    assert main(["run", "--matrix", str(matrix), "-k", "fixture == 'kda' and ranks == 1 and microbatches == 1",
                 "--out", out]) == 0
    assert main(["gate", "--from", out]) == 1  # PARTIAL: -k left most of the matrix out
    matrix.write_text(matrix.read_text() + "\n# edited after the run\n")
    capsys.readouterr()
    assert main(["gate", "--from", out]) == 2
    assert f"gate: {os.path.realpath(matrix)} is not the file the run read" in capsys.readouterr().err


@pytest.mark.xdist_group("gate-from")
def test_a_gate_from_a_narrowed_run_of_two_model_files_reads_only_what_it_ran(tmp_path, capsys):
    """A run narrowed to one of two model files records only that file's digest: the other was
    held against it, and a PARTIAL run became exit 2 (review of the check above)."""
    from parity.cli import main

    own = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples", "own_model", "my_model.py")
    sources = []
    for name in ("ma", "mb"):
        with open(own) as fh:
            (tmp_path / f"{name}.py").write_text(fh.read().replace('name="my_model"', f'name="{name}"'))
        sources += ["--model", f"{tmp_path / name}.py:parity_model"]
    out = str(tmp_path / "run")
    assert main(["run", "--matrix", "smoke", *sources, "-k", "fixture == 'ma' and ranks == 1 and microbatches == 1",
                 "--out", out]) == 0
    capsys.readouterr()
    assert main(["gate", "--from", out]) == 1, capsys.readouterr().err  # PARTIAL, as -k made it


@pytest.mark.xdist_group("gate-from")
def test_a_gate_over_no_records_or_a_malformed_model_warning_is_one_line(tmp_path, capsys, monkeypatch):
    """No record: exit 1 with no decision, no reason and a JUnit file of no case (green to CI);
    a ``model_warnings`` entry that is not run's: a traceback (review)."""
    import json
    import shutil

    from parity.cli import main
    from parity.report import outdir

    out = str(tmp_path / "run")
    assert main(["run", "--matrix", "smoke", "-k", "fixture == 'kda' and ranks == 1 and microbatches == 1",
                 "--out", out]) == 0
    edited = shutil.copytree(out, tmp_path / "edited")
    manifest = json.loads((edited / "run.json").read_text())
    manifest["model_warnings"] = {"kda": "x"}
    (edited / "run.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert main(["gate", "--from", str(edited)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run.json: model_warnings['kda'] is not {notes: [text], fp32_unselected" in err, err
    monkeypatch.setattr(outdir, "complete_records", lambda *a, **k: [])
    assert main(["gate", "--from", out, "--junit", str(tmp_path / "j.xml")]) == 2
    assert "holds no records, so no model to decide on" in capsys.readouterr().err
