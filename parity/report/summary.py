"""Summaries: the closing table on the terminal and ``summary.md``."""

from __future__ import annotations

import html
import math
import shlex
import statistics
from collections import Counter, defaultdict

import numpy as np

from parity.judge.record import BAD, LOCATING_CHECKS, SEVERITY, VERDICTS, Record, Verdict


def is_pair(r: Record) -> bool:
    """A cross-path row (``baseline~path``) rather than a cell's own."""
    return "~" in r.path


def repro_command(cell: str, results: str) -> str:
    """The command writing a failing cell's (or pair's) reproducer: ``parity repro``."""
    return f"python -m parity repro {shlex.quote(cell)} --from {shlex.quote(results or 'DIR')} --out repro.py"


def check_label(r: Record) -> str:
    """The check a record's ratio is reported under: a cross-path row's apart from the cell's own
    (their allowances differ, so one's growth must not hide under the other's maximum)."""
    return f"{r.check} (cross-path)" if is_pair(r) else r.check


def cell_verdicts(records: list[Record]) -> dict[str, str]:
    """A cell's verdict is its worst record's (TIMEOUT/ERROR > FAIL > PASS > SKIP); cross-path
    comparisons are counted per pair (:func:`pair_verdicts`)."""
    worst: dict[str, str] = {}
    for r in records:
        if is_pair(r):
            continue
        cur = worst.get(r.cell)
        if cur is None or SEVERITY[r.verdict] > SEVERITY[cur]:
            worst[r.cell] = r.verdict
    return worst


#: Non-PASS records listed per cell in ``summary.md`` (the rest are counted, not dropped silently).
SHOWN_PER_CELL = 20


def located_first(records: list[Record]) -> list[Record]:
    """``records`` with the ones locating a failure (the first divergent stage, the first module)
    first: what a reader of a failing cell needs before its hundred gradient rows."""
    return sorted(records, key=lambda r: r.check not in LOCATING_CHECKS)


def nothing_checked(records: list[Record]) -> str:
    """Why a finished run checked nothing -- every cell was skipped (the first skip's reason) --
    or "" when some cell ran: such a run is no evidence, whatever its records say."""
    verdicts = cell_verdicts(records)
    if verdicts and set(verdicts.values()) == {Verdict.SKIP}:
        return next(r.detail for r in records if r.verdict == Verdict.SKIP)
    return ""


def worst_ratios(records: list[Record]) -> dict[str, Record]:
    worst: dict[str, Record] = {}
    for r in records:
        if not isinstance(r.ratio, float) or math.isnan(r.ratio):
            continue
        key = check_label(r)
        if key not in worst or r.ratio > worst[key].ratio:
            worst[key] = r
    return dict(sorted(worst.items()))


def _ratio(v: float) -> str:
    return "inf" if math.isinf(v) else f"{v:.3g}"


def pair_verdicts(records: list[Record]) -> dict[str, str]:
    """Cross-path comparisons, one verdict per (pair, baseline~path)."""
    worst: dict[str, str] = {}
    for r in records:
        key = f"{r.cell} {r.path}"
        if is_pair(r) and SEVERITY[r.verdict] > SEVERITY.get(worst.get(key, "SKIP"), 0):
            worst[key] = r.verdict
    return worst


def _counts(verdicts: dict[str, str]) -> str:
    counts = Counter(verdicts.values())
    return ", ".join(f"{v} {counts.get(v, 0)}" for v in VERDICTS)


def verdict_counts(records: list[Record]) -> list[str]:
    """Two lines: cells by verdict, cross-path pairs by verdict."""
    return ["cells: " + _counts(cell_verdicts(records)), "cross-path pairs: " + _counts(pair_verdicts(records))]


def spread(values: list[float]) -> dict[str, float]:
    """Median, interquartile range and minimum of repeated measurements."""
    if len(values) == 1:
        return {"median": values[0], "iqr": 0.0, "min": values[0]}
    q = statistics.quantiles(values, n=4, method="inclusive")  # within the data: never wider than its range
    return {"median": statistics.median(values), "iqr": q[2] - q[0], "min": min(values)}


def terminal_table(records: list[Record]) -> str:
    lines = verdict_counts(records)
    lines.append(f"{'check':<28} {'worst ratio':>11}  {'dtype':<9} where")
    for check, r in worst_ratios(records).items():
        lines.append(f"{check:<28} {_ratio(r.ratio):>11}  {r.dtype:<9} {r.cell} {r.name}")
    return "\n".join(lines)


RATIO_COLUMNS = ["check", "records", "p50 ratio", "p99 ratio", "max ratio", "p50 allowed/signal",
                 "p99 allowed/signal", "max allowed/signal"]


def _percentiles(values: list[float]) -> list[str]:
    if not values:
        return ["-", "-", "-"]
    v = np.asarray(values)
    p50, p99 = np.percentile(v, [50, 99], method="nearest")  # no interpolation across inf
    return [_ratio(p50), _ratio(p99), _ratio(v.max())]


def ratio_rows(records: list[Record]) -> list[list[str]]:
    """Per check, the p50 / p99 / max of observed/allowed (how much headroom each check
    really has) and of allowed/signal (how sharp it is; INCONCLUSIVE from 0.5):
    :data:`RATIO_COLUMNS`."""
    ratios: dict[str, list[float]] = defaultdict(list)
    vacuity: dict[str, list[float]] = defaultdict(list)
    for r in records:
        if isinstance(r.ratio, float) and not math.isnan(r.ratio):
            key = check_label(r)
            ratios[key].append(r.ratio)
            if isinstance(r.allowed_over_signal, float) and not math.isnan(r.allowed_over_signal):
                vacuity[key].append(r.allowed_over_signal)
    return [[key, str(len(ratios[key])), *_percentiles(ratios[key]), *_percentiles(vacuity[key])]
            for key in sorted(ratios)]


def ratio_distribution(records: list[Record]) -> list[str]:
    """:func:`ratio_rows` as a markdown table."""
    out = ["| " + " | ".join(RATIO_COLUMNS) + " |", "|" + "---|" * len(RATIO_COLUMNS)]
    return out + ["| " + " | ".join(row) + " |" for row in ratio_rows(records)]


def visible(text: str) -> str:
    """``text`` with every character that is not printable (NUL, a terminal's escape, a line break)
    written as its Python escape: shown, and inert wherever the text lands."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def md_text(text, *, cell: bool = False) -> str:
    """``text`` (a detail: an exception message, a model's names) as inert markdown: ``<``, ``>``, ``&``
    escaped (a CI job summary renders raw HTML), on one line, control characters as their escapes, and in
    a table ``cell`` its pipes escaped."""
    out = " ".join(html.escape(str(text), quote=False).split())
    out = visible(out)  # NUL, a terminal's escapes: shown, inert
    return out.replace("|", "\\|") if cell else out


#: How many records the summary lists as closest to their allowances.
CLOSEST = 10


def closest(records: list[Record], n: int = CLOSEST) -> list[Record]:
    """The ``n`` judged records with the highest finite ratio (observed / allowed), highest first."""
    judged = [r for r in records if isinstance(r.ratio, float) and math.isfinite(r.ratio) and r.allowed]
    return sorted(judged, key=lambda r: -r.ratio)[:n]


def fault_line(records: list[Record], faults) -> str:
    """What the injected ``faults`` did: how many of the cells that ran they turned non-PASS. A run
    under a fault that no cell flags is green only in the sense that no check fired: those cells do
    not reveal the fault, or a check missed it; either way it proves nothing about the checks."""
    if not faults:
        return ""
    verdicts = {c: v for c, v in cell_verdicts(records).items() if v != "SKIP"}
    flagged = sum(v in BAD for v in verdicts.values())
    line = f"Injected fault {'+'.join(dict.fromkeys(faults))}: flagged in {flagged} of {len(verdicts)} cells that ran"
    if flagged:
        return line + "."
    return (line + "; no check fired, so these cells do not reveal it or a check missed it (its generated "
            "test in tests/test_faults.py names a cell that must flag it).")


def summary_markdown(records: list[Record], *, title: str, timings: dict[str, float], cells_total: int,
                     not_run: list[str] = (), interrupted: str = "", faults=(), resumable: bool = True,
                     results_dir: str = "") -> str:
    verdicts = cell_verdicts(records)
    counts = Counter(verdicts.values())
    out = [f"# parity run: {md_text(title)}", ""]
    if faults:
        out += [md_text(fault_line(records, faults)), ""]
    if interrupted:
        out += [f"**Interrupted** ({interrupted}) after {cells_total - len(not_run)} of {cells_total} cells; "
                f"{len(not_run)} not run (listed at the end). "
                + (f"Continue with `python -m parity run --resume {results_dir or 'DIR'}`." if resumable
                   else "A torchrun run does not resume: run the matrix again."), ""]
    elif skipped_all := nothing_checked(records):
        out += [f"**Nothing was checked**: every cell was skipped ({md_text(skipped_all)}); the run exits 1.", ""]
    out += ["| verdict | cells |", "|---|---|"]
    out += [f"| {v} | {counts.get(v, 0)} |" for v in VERDICTS if v != Verdict.UNPAIRED]  # a pair's, not a cell's
    held = f"{cells_total - len(not_run)} of {cells_total}" if not_run else f"{cells_total}"
    out += ["", f"{held} cells, {len(records)} records. Cross-path pairs: {_counts(pair_verdicts(records))}.", ""]
    out += ["## Worst ratio per check", "", "| check | ratio | observed | allowed | dtype | cell | name |", "|---|---|---|---|---|---|---|"]
    for check, r in worst_ratios(records).items():
        out.append(f"| {md_text(check, cell=True)} | {_ratio(r.ratio)} | {r.observed:.3g} | {r.allowed:.3g} | "
                   f"{md_text(r.dtype, cell=True)} | {md_text(r.cell, cell=True)} | {md_text(r.name, cell=True)} |")
    out += ["", f"## Closest to the allowance (the {CLOSEST} highest ratios)", "",
            "| ratio | check | name | step | observed | allowed | dtype | cell |", "|---|---|---|---|---|---|---|---|"]
    for r in closest(records):
        out.append(f"| {_ratio(r.ratio)} | {md_text(r.check, cell=True)} | {md_text(r.name, cell=True)} | {r.step} | "
                   f"{r.observed:.3g} | {r.allowed:.3g} | {md_text(r.dtype, cell=True)} | {md_text(r.cell, cell=True)} |")
    out += ["", "## Ratio distribution per check", ""] + ratio_distribution(records)
    by_check = defaultdict(Counter)
    for r in records:
        by_check[r.check][r.verdict] += 1
    out += ["", "## Records per check", "", "| check | " + " | ".join(VERDICTS) + " |", "|---|" + "---|" * len(VERDICTS)]
    for check in sorted(by_check):
        c = by_check[check]
        out.append(f"| {check} | " + " | ".join(str(c.get(v, 0)) for v in VERDICTS) + " |")
    bad = [r for r in records if r.verdict in BAD]
    out += ["", "## Non-PASS cells", ""]
    if not bad:
        out.append("None.")
    for cell in sorted({r.cell for r in bad}):
        out.append(f"- `{cell}`")
        mine = located_first([r for r in bad if r.cell == cell])
        for r in mine[:SHOWN_PER_CELL]:
            where = f" step {r.step}" if r.step != "" else ""
            numbers = (f"observed {r.observed}, allowed {r.allowed}, "
                       if isinstance(r.observed, float) and isinstance(r.allowed, float) else "")
            out.append(f"  - {r.verdict} {md_text(r.check)} {md_text(r.name)}{where}: {numbers}{md_text(r.detail)}")
        if len(mine) > SHOWN_PER_CELL:
            out.append(f"  - ... {len(mine) - SHOWN_PER_CELL} more (cells.csv has every record)")
        out.append(f"  - reproduce: `{repro_command(cell, results_dir)}`")
    skipped = sorted({(r.cell, r.detail) for r in records if verdicts.get(r.cell) == "SKIP"})
    if skipped:
        out += ["", "## Skipped cells", ""] + [f"- `{c}`: {md_text(d)}" for c, d in skipped]
    if not_run:
        out += ["", "## Not run (interrupted)", ""] + [f"- `{c}`" for c in not_run]
    out += ["", "## Where the time went", "", "| phase | seconds |", "|---|---|"]
    out += [f"| {k} | {v:.2f} |" for k, v in timings.items() if isinstance(v, (int, float)) and k != "cells"]
    if isinstance(timings.get("cells"), (int, float)):
        out += ["", f"{timings['cells']:.0f} cells run; per cell: the wall over them."]
    return "\n".join(out) + "\n"
