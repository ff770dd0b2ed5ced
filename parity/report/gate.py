"""The gate: one GO / NO-GO / NOT APPLICABLE per model for enabling a candidate path.

Rules (``docs/gate.md``); each names its evidence in ``reasons`` or ``notes``:

- **NOT APPLICABLE**: the model declares that the candidate falls back (or raises), and in
  every candidate cell it did exactly that for the declared reason.
- **NO-GO** when any of these holds:
  - *native (the candidate) not exercised*: a candidate cell took another path for a reason the model does
    not declare (an unsupported build included) -- such a cell may PASS as a run of the
    other path, but it is no evidence for the candidate;
  - no candidate cell ran at all (none selected, or all SKIP);
  - a candidate cell, or a ``baseline~candidate`` pair, is FAIL / ERROR / TIMEOUT /
    INCONCLUSIVE (each failing check is named with its worst ratio and cell);
  - a baseline cell failed (the comparison it should anchor is void);
  - a pair could not be compared (UNPAIRED) for any reason other than the baseline raising
    the model's declared isolation error;
  - a third path that ran beside them failed (this gate decides on the candidate only, and
    says how to decide on that path; a passing third path is a note);
  - the model's class declares FP32 patterns that select nothing, its plan computes nothing in
    FP32, and ``Fixture.expect_fp32`` does not declare that nothing is meant to be
    (:func:`apply_model_warnings`; run's other warnings about the model are notes).
- **GO** otherwise. When the baseline cannot shard the model (declared isolation error),
  the note says that the candidate was judged against the reference alone.
- **PARTIAL** replaces GO and NOT APPLICABLE when the evidence is narrower than the matrix
  it names (:func:`apply_scope`): a filter, other ranks or paths, fewer steps, an axis
  override or an injected fault. A NO-GO stays NO-GO (what ran already failed). It replaces
  GO, too, where every candidate cell that trained ran on one rank, or ran one step
  (:func:`_sharded_scope`).
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field

from parity.errors import text_file
from parity.judge.record import BAD, LOCATING_CHECKS, Record, Unpaired, Verdict
from parity.judge.stages import STAGES, stage_of
from parity.matrix.cell import pair_of, steps_of
from parity.report.summary import cell_verdicts, is_pair, located_first, md_text, ratio_distribution, repro_command

GO, NO_GO, NOT_APPLICABLE, PARTIAL = "GO", "NO-GO", "NOT APPLICABLE", "PARTIAL"


@dataclass
class Decision:
    model: str
    decision: str
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)


def clip(text: str, n: int, more: str = "") -> str:
    """``text`` cut to ``n`` characters, saying so (and where the rest is, ``more``)."""
    return text if len(text) <= n else text[: n - 1] + "…" + (f" ({more})" if more else "")


def _worst_failures(rows: list[Record]) -> list[str]:
    """One line per failing check, in the order a reader needs them: where the run first diverged
    (the ``stage`` records, then the module ``divergence``), a cell that did not finish, then the
    checks in pipeline order (:data:`parity.judge.stages.STAGES`), the stageless last -- a
    later symptom (a resumed step that read a corrupted checkpoint) never heads the list."""
    by_check: dict[str, list[Record]] = defaultdict(list)
    for r in rows:
        if r.verdict in BAD:
            by_check[(r.check, r.verdict)].append(r)
    out = []
    for (check, verdict), bad in sorted(by_check.items(), key=_pipeline_order):
        if check == "stage":
            out.append(_first_divergence(bad))
            continue
        rated = [r for r in bad if isinstance(r.ratio, float)]
        worst = max(rated, key=lambda r: r.ratio) if rated else bad[0]
        ratio = f", worst ratio {worst.ratio:.3g}" if rated else ""
        cells = len({r.cell for r in bad})
        out.append(f"{check}: {len(bad)} {verdict} records in {cells} cell{'s' if cells != 1 else ''}{ratio} "
                   f"({worst.cell} {worst.name}; {clip(worst.detail, 160)})")
    return out


def _pipeline_order(item: tuple) -> tuple:
    (check, verdict), bad = item
    if check in LOCATING_CHECKS:
        return (0, check != "stage", 0, check, verdict)
    if check == "run":  # the cell did not finish: no stage record says where
        return (1, 0, 0, check, verdict)
    stage = stage_of(bad[0])
    return (2, stage not in STAGES, STAGES.index(stage) if stage in STAGES else 0, check, verdict)


def _first_divergence(located: list[Record]) -> str:
    """The ``stage`` records of the failing cells: the earliest stage's detail first, then how many
    cells first diverged at each stage."""
    def at(r: Record) -> int:
        return STAGES.index(r.name) if r.name in STAGES else len(STAGES)

    first = min(located, key=at)
    counts = Counter(r.name for r in located)
    per = ", ".join(f"{s} in {n} cell{'s' if n != 1 else ''}" for s, n in
                    sorted(counts.items(), key=lambda kv: STAGES.index(kv[0]) if kv[0] in STAGES else len(STAGES)))
    return f"{clip(first.detail, 240)} ({first.cell}; first divergent stage: {per})"


def decide(records: list[Record], model: str, candidate: str) -> Decision:
    rows = [r for r in records if r.fixture == model]
    own = [r for r in rows if not is_pair(r)]
    verdicts = cell_verdicts(own)
    cand_cells = {r.cell for r in own if r.path == candidate}
    ran = {c for c in cand_cells if verdicts[c] != Verdict.SKIP}
    pairs = [r for r in rows if is_pair(r) and r.path.endswith(f"~{candidate}")]
    baselines = {r.path.split("~")[0] for r in pairs}
    base_cells = {r.cell for r in own if r.path in baselines}
    d = Decision(model, GO, counts={
        "candidate cells": len(cand_cells), "candidate cells run": len(ran),
        "candidate cells on the candidate path": len({r.cell for r in own if r.cell in ran and r.path_taken == candidate}),
        "pairs compared": len(_compared(pairs)),
        "pairs unpaired": len({r.cell for r in pairs if r.verdict == Verdict.UNPAIRED}),
    })
    if not ran:
        d.decision = NO_GO
        d.reasons.append(f"no {candidate} cell ran ({len(cand_cells)} selected, all skipped)" if cand_cells
                         else f"no {candidate} cell in the results")
        return d
    fallbacks = [r for r in own if r.cell in ran and r.check == "fallback"]
    expected_errors = [r for r in own if r.cell in ran and r.check == "expected_error"]
    not_taken = {r.cell for r in own if r.cell in ran and r.path_taken and r.path_taken != candidate}
    declared = {r.cell for r in fallbacks if r.name == "declared" and r.verdict == Verdict.PASS}
    # NOT APPLICABLE speaks for every cell: one that was skipped showed nothing, and the
    # decision below counts its unpaired pair as it does on a GO
    every = ran == cand_cells
    raised = {r.cell for r in expected_errors if r.path_taken == candidate and r.verdict == Verdict.PASS}
    fell_back = {c for c in not_taken & declared if verdicts[c] == Verdict.PASS}
    na = ""
    if every and (raised | fell_back) == ran:  # every cell raised or fell back, as the model declares
        reason = next((r.detail for r in fallbacks if r.cell in fell_back), "")
        if not raised:
            na = f"{candidate} falls back in all {len(ran)} cells, as the model declares: {reason}"
        elif not fell_back:
            na = f"{candidate} raises the isolation error the model declares, in all {len(ran)} cells"
        else:
            na = (f"{candidate} raises the isolation error the model declares in {len(raised)} cells and falls back "
                  f"as it declares in the other {len(ran - raised)}: {reason}")
    if na:  # enabling the candidate changes nothing, unless what did run beside it failed or went unpaired
        _failures(d, rows, own, ran, pairs, base_cells, candidate, baselines)
        _pair_reasons(d, pairs, cand_cells, ran, raised, candidate, excused=raised)
        if d.reasons:
            d.decision = NO_GO
            d.notes.append(f"would be {NOT_APPLICABLE} ({na}), but evidence beside it failed")
        else:
            d.decision = NOT_APPLICABLE
            d.notes.append(na)
        return d
    skipped = sorted(cand_cells - ran)
    if skipped:  # a GO speaks for every cell of the matrix: one that was skipped showed nothing
        d.reasons.append(f"{len(skipped)} of {len(cand_cells)} {candidate} cells were skipped (e.g. {skipped[0]}): "
                         "nothing was checked there")
    unrecorded = sorted(ran - {r.cell for r in own if r.path_taken})  # no record says which path trained
    if unrecorded:
        d.reasons.append(f"{candidate} not shown to run: {len(unrecorded)} of {len(ran)} {candidate} cells record no "
                         f"path taken (e.g. {unrecorded[0]}); rerun them")
    undeclared = not_taken - declared
    if undeclared:
        why = sorted({r.fallback_reason for r in own if r.cell in undeclared and r.fallback_reason})
        d.reasons.append(f"{candidate} not exercised: {len(undeclared)} of {len(ran)} {candidate} cells took another path "
                         f"({clip('; '.join(why), 300)})")
    elif not_taken:  # declared: no reason, but a GO does not hide that some cells ran another path
        d.notes.append(f"{candidate} falls back in {len(not_taken)} of {len(ran)} cells, as the model declares: "
                       + next(r.detail for r in fallbacks if r.cell in declared))
    _failures(d, rows, own, ran, pairs, base_cells, candidate, baselines)
    _pair_reasons(d, pairs, cand_cells, ran, raised, candidate, excused=set())
    _baseline_taken(d, own, base_cells)
    raised_any = {r.cell for r in expected_errors if r.verdict == Verdict.PASS}  # a fallback's raise trained nothing
    _uncovered(d, own, verdicts, ran - raised_any, candidate)
    _same_contract(d, baselines, candidate)
    _checkpoint_scope(d, own, ran - raised, candidate)  # a cell that raised trained nothing to save
    _override_scope(d, own, ran - raised, candidate)
    if d.reasons:
        d.decision = NO_GO
    else:
        _sharded_scope(d, own, ran - raised, candidate)
    return d


def _baseline_taken(d: Decision, own: list[Record], base_cells: set[str]) -> None:
    """The baseline's cells must run the baseline: one that took another path for a reason its
    model does not declare (a torch build without the native API, for a native baseline) compared
    the candidate with that other path -- NO-GO; a declared fallback is a note."""
    declared = {r.cell for r in own if r.check == "fallback" and r.name == "declared" and r.verdict == Verdict.PASS}
    took = {r.cell: (r.path, r.path_taken, r.fallback_reason) for r in own
            if r.cell in base_cells and r.path_taken and r.path_taken != r.path}
    if not took:
        return
    undeclared = sorted(c for c in took if c not in declared)
    path, taken, why = took[(undeclared or sorted(took))[0]]
    said = (f"{len(undeclared or took)} of {len(base_cells)} baseline {path} cells ran {taken} "
            f"({clip(why or 'no reason recorded', 200)})")
    if undeclared:
        d.reasons.append(f"baseline {path} not exercised: {said}: the candidate was compared with {taken}, not "
                         f"{path}; run the baseline where it runs, or gate against another baseline")
    else:
        d.notes.append(f"baseline {path} falls back as the model declares: {said}")


def _compared(pairs: list[Record]) -> set[str]:
    """The pairs that compared something: a row that is neither UNPAIRED nor SKIP."""
    return {r.cell for r in pairs if r.verdict not in (Verdict.UNPAIRED, Verdict.SKIP)}


def _uncovered(d: Decision, own: list[Record], verdicts: dict[str, str], trained: set[str], candidate: str) -> None:
    """A candidate cell that trained and passed holds the ``coverage`` record its judging writes
    last (:mod:`parity.judge.coverage`): without it nothing says the records it owed all arrived,
    and a cell holding a few PASS rows would read as a cell that passed every check."""
    covered = {r.cell for r in own if r.check == "coverage"}
    missing = sorted(c for c in trained if verdicts[c] == Verdict.PASS and c not in covered)
    if missing:
        d.reasons.append(f"{len(missing)} of {len(trained)} {candidate} cells that trained hold no coverage record "
                         f"(e.g. {missing[0]}): nothing says their owed records arrived; rerun them")


def _sharded_scope(d: Decision, own: list[Record], trained: set[str], candidate: str) -> None:
    """A GO speaks for sharded training over steps: where every candidate cell that trained the
    candidate path (not a fallback) ran on one rank, FSDP sharded nothing and no gradient was
    reduced across ranks; where every one ran one step, no step read what an earlier one wrote (the
    optimizer's state, FP32 parameters updated off values exact in BF16). Either way what passed is
    a decision on part of what enabling the candidate changes: PARTIAL, naming the cells to add."""
    if not trained:
        return
    took = {r.cell for r in own if r.cell in trained and r.path_taken == candidate}  # a fallback trained another path
    if not any(r.ranks > 1 for r in own if r.cell in took):
        d.decision = PARTIAL
        d.reasons.append(f"every {candidate} cell that trained the {candidate} path ran on one rank: nothing was "
                         "sharded or reduced across ranks; add cells of 2 ranks or more (ranks = [1, 2] in the matrix)")
    if not any(steps_of(c) > 1 for c in took):
        d.decision = PARTIAL
        d.reasons.append(f"every {candidate} cell that trained the {candidate} path ran one step: no step read what "
                         "an earlier one wrote (optimizer state, updated parameters); run 2 steps or more (steps = 2)")


def _same_contract(d: Decision, baselines: set[str], candidate: str) -> None:
    """A per-parameter candidate whose baseline is per-parameter too (a plugin beside native)
    has every pair compare it with its own kind: no evidence that moving from a dtype-split run
    changes nothing. Two dtype-split paths (a team's helper against legacy) are a fair pair. A
    path no longer registered is not judged here."""
    from parity.paths import paths
    from parity.paths.base import PER_PARAMETER

    registered = paths()
    mine = getattr(registered.get(candidate), "contract", None)
    same = sorted(b for b in baselines
                  if mine == PER_PARAMETER and getattr(registered.get(b), "contract", None) == PER_PARAMETER)
    if same:
        d.reasons.append(f"the baseline {', '.join(same)} shards by {candidate}'s own contract ({mine}): its pairs "
                         f"compare {candidate} with its own kind, not with a dtype-split run; gate against a "
                         "dtype-split baseline (--baseline legacy, or your dtype-split plugin)")


def _override_scope(d: Decision, own: list[Record], ran: set[str], candidate: str) -> None:
    """Note a GO whose candidate cells computed no parameter in another dtype than the cells'
    ``param_dtype``: nothing was kept apart, so the GO shows the candidate's units train as the
    baseline's, not how it keeps a parameter in another dtype (``dtype.compute`` names the dtype each
    parameter was planned and observed to compute in)."""
    kept = {r.name for r in own if r.cell in ran and r.check == "dtype.compute" and r.verdict == Verdict.PASS
            and r.dtype and r.dtype != r.param_dtype}
    if not kept and not d.reasons:
        d.notes.append(f"no {candidate} cell computed a parameter in another dtype than its param_dtype: nothing "
                       f"was kept apart here, so this GO shows that {candidate}'s units train as the baseline's, not "
                       "how it keeps a parameter in another dtype")


def _checkpoint_scope(d: Decision, own: list[Record], ran: set[str], candidate: str) -> None:
    """Says how far the checkpoint evidence reaches: the DCP lifecycle runs only in cells of one
    micro-batch, no activation checkpointing, seed 0 and two steps or more
    (:attr:`parity.matrix.cell.Cell.lifecycle`), so a decision over accumulation or activation
    checkpointing alone holds no checkpoint evidence for those configurations."""
    checked = {r.cell for r in own if r.cell in ran and r.check.startswith("checkpoint.")}
    if ran and len(checked) < len(ran):
        d.notes.append(f"checkpoint save/load/resume was checked in {len(checked)} of {len(ran)} {candidate} cells "
                       "(the lifecycle runs where a cell has one micro-batch, no activation checkpointing, seed 0 "
                       "and 2+ steps); checkpoints under the other cells' configurations are not checked")


def _pair_reasons(d: Decision, pairs: list[Record], cand_cells: set[str], ran: set[str], raised: set[str],
                  candidate: str, *, excused: set[str]) -> None:
    """The cross-path evidence every decision needs: a pair row for every candidate cell, each one
    compared -- unless the declared isolation error left nothing to compare. That excuse holds
    where the baseline raised it and the candidate trained (judged against the reference alone),
    and, for NOT APPLICABLE, in the cells ``excused``: where the candidate raised it itself, it
    trained nothing to compare, whatever the baseline did there (raised, was skipped, filtered out)."""
    if not pairs:  # every cell of the candidate is someone's baseline: nothing compared it with another path
        d.reasons.append(f"{candidate} was compared with no baseline path: no {candidate} cell is paired in the "
                         f"results (a run whose --baseline is {candidate} compares nothing with it)")
        return
    grouped = {r.cell for r in pairs}  # a run writes a pair row (compared or UNPAIRED) for every candidate cell
    alone = sorted(c for c in cand_cells if pair_of(c, candidate) not in grouped)
    if alone:
        d.reasons.append(f"{len(alone)} {candidate} cells have no cross-path record in the results (e.g. "
                         f"{alone[0]}): their comparison with the baseline is missing")
    cell_of = {pair_of(c, candidate): c for c in cand_cells}
    trained = ran - raised

    def baseline_raised(r: Record) -> bool:
        return r.name == Unpaired.EXPECTED_ISOLATION_ERROR and cell_of.get(r.cell) in trained

    hollow = sorted(grouped - _compared(pairs) - {r.cell for r in pairs if r.verdict == Verdict.UNPAIRED})
    if hollow:  # every row SKIP: a pair that compared nothing is not a comparison
        d.reasons.append(f"{len(hollow)} pairs compared nothing, every row SKIP (e.g. {hollow[0]}: "
                         f"{clip(next(r.detail for r in pairs if r.cell == hollow[0]), 160)})")
    unpaired = [r for r in pairs if r.verdict == Verdict.UNPAIRED]
    accepted = [r for r in unpaired if baseline_raised(r) or cell_of.get(r.cell) in excused]
    others = [r for r in unpaired if r not in accepted]
    if others:
        d.reasons.append(f"{len(others)} pairs not compared: {others[0].detail}")
    alone_with_reference = [r for r in accepted if baseline_raised(r)]
    if alone_with_reference:
        d.notes.append(f"the baseline cannot shard this model (declared isolation error) in {len(alone_with_reference)} "
                       f"cells: {candidate} was judged against the reference alone there")


def _failures(d: Decision, rows: list[Record], own: list[Record], ran: set[str], pairs: list[Record],
              base_cells: set[str], candidate: str, baselines: set[str]) -> None:
    """The reasons every decision weighs, NOT APPLICABLE included: the candidate's failing records,
    the baseline's, the cross-path comparisons' and other paths' that ran beside them."""
    d.reasons += [f"{candidate}: {x}" for x in _worst_failures([r for r in own if r.cell in ran])]
    failed_base = sorted({r.cell for r in own if r.cell in base_cells and r.verdict in BAD})
    paths = {r.path for r in own}
    loads = {c: failed_loads(c, own, paths) for c in failed_base}
    for path in sorted(set().union(*loads.values())):
        cells = [c for c, targets in loads.items() if path in targets]
        first = next(r for r in own if r.cell == cells[0] and r.verdict in BAD and r.check.startswith("checkpoint.")
                     and r.name.startswith(f"{path}:"))
        whose = (f"{candidate} (this gate's candidate)" if path == candidate else
                 f"path {path}, beside {candidate} (python -m parity gate --candidate {path} decides on it)")
        d.reasons.append(f"{whose} failed to resume from the baseline's checkpoint in {len(cells)} cells (e.g. "
                         f"{cells[0]}: {first.check} {first.name}: {clip(first.detail, 200)})")
    failed_base = [c for c in failed_base if not loads[c]]
    if failed_base:
        first = next(r for r in own if r.cell == failed_base[0] and r.verdict in BAD)
        d.reasons.append(f"baseline failed in {len(failed_base)} cells (e.g. {failed_base[0]}: {first.check} "
                         f"{first.verdict}: {clip(first.detail.split(' | ')[0], 240)}); {candidate} cannot be "
                         "compared with it there")
    d.reasons += [f"cross-path: {x}" for x in _worst_failures(pairs)]
    _other_paths(d, rows, own, candidate, baselines)


def failed_loads(cell: str, own: list[Record], ran: set[str]) -> frozenset[str]:
    """The paths a baseline cell's failures are all about (empty when not only loads'): the
    baseline saves a checkpoint and loads it into every other path (``checkpoint.*`` records
    named ``PATH:...``); a load that fails only there is that path's failure, not the baseline's,
    and loads into several paths that each fail are each of those paths'. A name's prefix is a
    load target only if it is one of the paths that ``ran`` other than the baseline's own."""
    bad = [r for r in own if r.cell == cell and r.verdict in BAD and r.check not in LOCATING_CHECKS]
    targets = {r.name.split(":", 1)[0] if r.check.startswith("checkpoint.") and ":" in r.name else "" for r in bad}
    if not bad or not targets <= ran or any(r.path in targets for r in bad):
        return frozenset()
    return frozenset(targets)


def _other_paths(d: Decision, rows: list[Record], own: list[Record], candidate: str, baselines: set[str]) -> None:
    """Paths that ran beside the candidate and its baseline are not what this gate decides on,
    but their evidence is not ignored: a failing one is a reason (the gate does not exit 0 beside
    failing cells), a passing one a note naming it."""
    for path in sorted({r.path for r in own} - {candidate} - baselines):
        failing = sorted({r.cell for r in rows if r.verdict in BAD
                          and (r.path == path or (is_pair(r) and r.path.endswith(f"~{path}")))})
        if failing:
            d.reasons.append(f"path {path} ran beside {candidate} and failed in {len(failing)} cells or pairs "
                             f"(e.g. {failing[0]}); this gate decides on {candidate} only: "
                             f"python -m parity gate --candidate {path} decides on {path}")
            continue
        cells = {r.cell for r in own if r.path == path}
        fell = sorted({r.cell for r in own if r.path == path and r.path_taken and r.path_taken != path})
        if fell:  # such a cell passed as a run of another path: no word on this one's own code
            taken = sorted({r.path_taken for r in own if r.cell in fell and r.path_taken != path})
            d.notes.append(f"path {path} also ran but fell back to {', '.join(taken)} in {len(fell)} of {len(cells)} "
                           f"cells (e.g. {fell[0]}: its own code did not run there); this gate decides on {candidate} "
                           f"only: python -m parity gate --candidate {path} decides on {path}")
        else:
            d.notes.append(f"path {path} also ran and passed; this gate decides on {candidate} only")


def no_go(d: Decision, reason: str) -> None:
    """Make ``d`` NO-GO for ``reason``: the first reason where the decision was not NO-GO yet (what
    made a PARTIAL is not why it fails), and a note written for a GO no longer says "this GO"."""
    if d.decision == NO_GO:
        d.reasons.append(reason)
        return
    d.decision = NO_GO
    d.reasons.insert(0, reason)
    d.notes = [n for n in d.notes if "this GO" not in n]


def apply_model_warnings(decisions: list[Decision], warnings: dict | None) -> None:
    """What ``run`` warned about each model (``run.json``'s ``model_warnings``) joins its notes; a
    model whose class declares FP32 patterns that select nothing while its plan computes nothing
    in FP32, without ``Fixture.expect_fp32`` saying nothing is meant to be, is NO-GO: both paths
    agree on keeping nothing in FP32, so nothing exercised the per-parameter override the
    migration is about. ``None`` (a ``run.json`` without the key, as parity before 2026-12-06
    wrote it) is no evidence that the declarations were read: NO-GO, naming it."""
    for d in decisions:
        if warnings is None:
            no_go(d, "run.json records no model_warnings (written by an earlier parity): the model's FP32 "
                     "declaration was not checked against its plan; rerun the matrix")
            continue
        found = warnings.get(d.model) or {}
        d.notes += [f"run warned: {note}" for note in found.get("notes", [])]
        if found.get("fp32_unselected"):
            no_go(d, "its class declares FP32 patterns that select no parameter or buffer, and its plan "
                     "computes nothing in FP32 (a typo keeps nothing in FP32, on both paths alike): correct "
                     "the pattern, or declare Fixture.expect_fp32=() if nothing is meant to be FP32")


def apply_scope(decisions: list[Decision], scope: dict) -> None:
    """GO / NOT APPLICABLE become PARTIAL when ``scope`` (what ran against the complete
    matrix) is not complete; the reason says what was left out (first, also where the decision
    was PARTIAL for want of sharded cells)."""
    if scope.get("complete"):
        return
    flags = ", ".join(f"{k} {v}" for k, v in scope.get("options", {}).items())
    why = "; ".join(scope.get("left_out", [])) + (f" (options: {flags})" if flags else "")
    for d in decisions:
        if d.decision in (GO, NOT_APPLICABLE, PARTIAL):  # PARTIAL already: nothing sharded (_sharded_scope)
            would = "" if d.decision == PARTIAL else f", would be {d.decision} on what ran"
            d.reasons.insert(0, f"partial evidence{would}: {why}")
            d.decision = PARTIAL


def is_go(decisions: list[Decision]) -> bool:
    """Exit 0 only when there is a decision and every one is GO or NOT APPLICABLE."""
    return bool(decisions) and all(d.decision in (GO, NOT_APPLICABLE) for d in decisions)


def evaluate(records: list[Record], candidate: str = "native") -> list[Decision]:
    models = list(dict.fromkeys(r.fixture for r in records))
    return [decide(records, m, candidate) for m in models]


def write(out: str, decisions: list[Decision], records: list[Record], *, meta: dict) -> None:
    """``gate.md`` (decision table first, then the evidence) and ``gate.json``."""
    md = [f"# parity gate: enable `{meta['candidate']}`?", "",
          "| model | decision | reasons / notes |", "|---|---|---|"]
    for d in decisions:
        text = "; ".join(d.reasons or d.notes) or "every check passed"
        md.append(f"| {d.model} | **{d.decision}** | {md_text(clip(text, 400, 'gate.json has every reason'), cell=True)} |")
    md += ["", f"torch {meta['torch']}, matrix `{meta['matrix']}`, baseline `{meta.get('baseline', 'legacy')}`, "
           f"results `{meta['results']}`.", ""]
    md += ["## What ran", ""] + _scope_lines(meta.get("scope", {}), meta) + ["", "## Evidence", ""]
    for d in decisions:
        md += [f"### {d.model}: {d.decision}", ""]
        md += [f"- {k}: {v}" for k, v in d.counts.items()]
        md += [f"- reason: {md_text(x)}" for x in d.reasons] + [f"- note: {md_text(x)}" for x in d.notes]
        md += _reproduce(d, records, meta) + [""]
    md += ["## Ratio distribution per check", ""] + ratio_distribution(records)
    with text_file(os.path.join(out, "gate.md")) as fh:
        fh.write("\n".join(md) + "\n")
    with text_file(os.path.join(out, "gate.json")) as fh:
        json.dump({**meta, "decisions": [asdict(d) for d in decisions], "go": is_go(decisions)}, fh, indent=2)


def _reproduce(d: Decision, records: list[Record], meta: dict) -> list[str]:
    """A NO-GO's reproducer: the command for the model's first failing cell or pair, each failing
    cell's stage and divergence records first (as ``summary.md`` lists them)."""
    if d.decision != NO_GO:
        return []
    bad = located_first([r for r in records if r.fixture == d.model and r.verdict in BAD])
    return [f"- reproduce: `{repro_command(bad[0].cell, meta['results'])}`"] if bad else []


def _scope_lines(scope: dict, meta: dict) -> list[str]:
    versions = ", ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items() if v)
    lines = [f"- matrix `{scope.get('matrix', '?')}` (digest `{scope.get('matrix_digest', '?')}`), "
             f"{scope.get('cells_run', '?')} of {scope.get('cells_expected', '?')} cells"
             + (f" ({scope['cells_skipped']} of them skipped)" if scope.get("cells_skipped") else "")
             + f", {scope.get('steps', '?')} steps",
             f"- options: {', '.join(f'`{k} {v}`' for k, v in scope.get('options', {}).items()) or 'none'}; "
             f"faults: {', '.join(scope.get('faults', [])) or 'none'}",
             f"- device {meta.get('device', '?')}; {versions or 'versions not recorded'}",
             "- complete: yes" if scope.get("complete") else f"- complete: **no** ({'; '.join(scope.get('left_out', []))})"]
    return lines
