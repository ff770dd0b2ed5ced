"""``report.html``: one self-contained page (no network, no script) for people.

Top to bottom: the gate decision (when the directory holds ``gate.json``), a heatmap of the
worst ratio per check x cell group (fixture / path; colour by ratio, INCONCLUSIVE / ERROR /
TIMEOUT marked), the ratio distribution per check, the failing records with their details,
the bench tables (when ``bench.md`` is there) and the versions and hardware.
"""

from __future__ import annotations

import html
import json
import math
import os

from parity.errors import UsageError, text_file
from parity.judge.record import BAD, SEVERITY, Record, Verdict
from parity.report.outdir import MANIFEST, read_json, read_manifest
from parity.report.summary import RATIO_COLUMNS, located_first, nothing_checked, ratio_rows, repro_command, verdict_counts

REPORT = "report.html"
_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em;max-width:1400px}
table{border-collapse:collapse;margin:0.5em 0 1.5em}td,th{border:1px solid #ccc;padding:2px 6px;font-size:12px}
th{background:#f4f4f4}.GO{color:#176f2c}.NO-GO{color:#b00020}.NA{color:#555}.PARTIAL{color:#a15c00}.banner{background:#fff3cd;padding:.5em;border:1px solid #c9a227}
td.h{text-align:center;min-width:3.2em}pre{background:#f7f7f7;padding:0.5em;overflow-x:auto;font-size:12px}
"""


def _colour(ratio: float) -> str:
    """Green (0) through yellow (0.5) to red (>= 1): how much of its allowance a check used."""
    if not math.isfinite(ratio) or ratio >= 1:
        return "#f4a6a6"
    if ratio >= 0.5:
        return "#f7e3a1"
    return f"hsl(120, 45%, {92 - 30 * ratio:.0f}%)"


def _esc(x) -> str:
    return html.escape(str(x))


def _table(header: list[str], rows: list[list[str]], raw: bool = False) -> str:
    out = ["<table><tr>" + "".join(f"<th>{_esc(h)}</th>" for h in header) + "</tr>"]
    for r in rows:
        out.append("<tr>" + "".join(f"<td>{c if raw else _esc(c)}</td>" for c in r) + "</tr>")
    return "\n".join(out) + "</table>"


def heatmap(records: list[Record]) -> str:
    worst: dict[tuple[str, str], Record] = {}
    marks: dict[tuple[str, str], str] = {}
    for r in records:
        group = f"{r.fixture}/{r.path}"
        key = (r.check, group)
        if r.verdict in (Verdict.ERROR, Verdict.TIMEOUT, Verdict.INCONCLUSIVE, Verdict.FAIL):
            if SEVERITY[Verdict(r.verdict)] > SEVERITY.get(Verdict(marks.get(key, "SKIP")), 0):
                marks[key] = str(r.verdict)
        if isinstance(r.ratio, float) and not math.isnan(r.ratio):
            if key not in worst or r.ratio > worst[key].ratio:
                worst[key] = r
    checks = sorted({k[0] for k in (*worst, *marks)})
    groups = sorted({k[1] for k in (*worst, *marks)})
    rows = []
    for check in checks:
        cells = [f"<th>{_esc(check)}</th>"]
        for g in groups:
            r, mark = worst.get((check, g)), marks.get((check, g), "")
            if r is None and not mark:
                cells.append('<td class="h"></td>')
                continue
            ratio = r.ratio if r is not None else math.inf
            text = ("inf" if not math.isfinite(ratio) else f"{ratio:.2f}") + (f" {mark[:4]}" if mark else "")
            tip = f"{r.cell} {r.name}: {r.detail}" if r is not None else mark
            colour = _colour(math.inf if mark else ratio)
            cells.append(f'<td class="h" style="background:{colour}" title="{_esc(tip)[:300]}">{_esc(text)}</td>')
        rows.append("<tr>" + "".join(cells) + "</tr>")
    head = "<tr><th>check \\ fixture/path</th>" + "".join(f"<th>{_esc(g)}</th>" for g in groups) + "</tr>"
    return f'<table id="heatmap">{head}\n' + "\n".join(rows) + "</table>"


def _read_gate(path: str) -> dict:
    """``gate.json``: ``decisions`` is a list of objects with a ``model`` and a ``decision`` string, their
    ``reasons`` / ``notes`` lists of strings; anything else is a :class:`UsageError`."""
    fix = f"rewrite it with parity gate --from {os.path.dirname(path) or '.'}"
    gate = read_json(path, fix)

    def strings(x) -> bool:
        return isinstance(x, list) and all(isinstance(s, str) for s in x)

    decisions = gate.get("decisions", [])
    ok = isinstance(decisions, list) and all(
        isinstance(d, dict) and isinstance(d.get("model"), str) and isinstance(d.get("decision"), str)
        and strings(d.get("reasons", [])) and strings(d.get("notes", [])) for d in decisions)
    if not ok:
        raise UsageError(f"{path}: decisions are not as parity writes them; {fix}")
    return gate


def write_html(out_dir: str, records: list[Record], manifest: dict | None = None) -> str:
    """Write ``report.html`` into ``out_dir`` from its records and whatever else is there.
    ``manifest``: the ``run.json`` a finishing run or merge is about to write (it writes that last,
    so that a folder marked complete has every file); otherwise the one in ``out_dir``."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>parity report</title><style>{_STYLE}</style>"
             "</head><body>", f"<h1>parity report: {_esc(os.path.abspath(out_dir))}</h1>"]
    run = manifest if manifest is not None else (
        read_manifest(out_dir) if os.path.isfile(os.path.join(out_dir, MANIFEST)) else None)
    parts += [f"<p class='banner' id='banner'>{_esc(x)}</p>" for x in _banners(records, run)]
    gate_path = os.path.join(out_dir, "gate.json")
    if os.path.isfile(gate_path):
        gate = _read_gate(gate_path)
        parts.append(f"<h2 id='gate'>Gate: enable <code>{_esc(gate.get('candidate'))}</code>?</h2>")
        rows = []
        for d in gate.get("decisions", []):
            cls = {"GO": "GO", "NO-GO": "NO-GO", "PARTIAL": "PARTIAL"}.get(d["decision"], "NA")
            why = "; ".join(d.get("reasons") or d.get("notes") or []) or "every check passed"
            rows.append([_esc(d["model"]), f"<b class='{cls}'>{_esc(d['decision'])}</b>", _esc(why[:600])])
        parts.append(_table(["model", "decision", "reasons / notes"], rows, raw=True))
    parts.append("<h2>Cells</h2><p id='counts'>" + "<br>".join(_esc(x) for x in verdict_counts(records)) + "</p>")
    parts += ["<h2>Worst ratio per check and fixture/path</h2>",
              "<p>observed / allowed; green: under half the allowance, yellow: over half, red: over it or "
              "marked FAIL / INCONCLUSIVE (INCO) / ERROR / TIMEOUT (TIME). Hover for the record.</p>", heatmap(records)]
    parts += ["<h2>Ratio distribution per check</h2>", _table(RATIO_COLUMNS, ratio_rows(records))]
    failing = located_first([r for r in records if Verdict(r.verdict) in BAD])
    parts.append(f"<h2 id='failing'>Failing records ({len(failing)})</h2>")
    if failing:
        parts.append(f"<p id='reproduce'>Reproduce the first failing cell: <code>{_esc(repro_command(failing[0].cell, out_dir))}"
                     "</code> (any cell id above in its place).</p>")
        if len(failing) > SHOWN_FAILING:
            parts.append(f"<p>The first {SHOWN_FAILING}, each failing cell's stage and first divergent module first; "
                         "cells.csv has every record.</p>")
        parts.append(_table(["verdict", "cell", "check", "name", "observed", "allowed", "ratio", "dtype", "detail"],
                            [[r.verdict, r.cell, r.check, r.name, r.observed, r.allowed, r.ratio, r.dtype,
                              str(r.detail)[:500]] for r in failing[:SHOWN_FAILING]]))
    bench_md = os.path.join(out_dir, "bench.md")
    if os.path.isfile(bench_md):
        with open(bench_md, encoding="utf-8", errors="replace") as fh:
            parts += ["<h2 id='bench'>Bench</h2>", f"<pre>{_esc(fh.read())}</pre>"]
    if run is not None:
        env = {"torch": run.get("torch"), "device": run.get("device"), "status": run.get("status"),
               "options": json.dumps(run.get("options", {}))}
        environment = run.get("environment")
        env.update({k: v for k, v in (environment if isinstance(environment, dict) else {}).items() if k not in env})
        parts += ["<h2 id='env'>Versions and hardware</h2>", _table(["", ""], [[k, v] for k, v in env.items()])]
    parts.append("</body></html>")
    path = os.path.join(out_dir, REPORT)
    with text_file(path) as fh:
        fh.write("\n".join(parts))
    return path


#: Failing records the page lists (it says so when there are more).
SHOWN_FAILING = 500


def _banners(records: list[Record], run: dict | None) -> list[str]:
    """What the counts below would not say: a run that stopped before every cell ran (its
    ``run.json`` status), or one that checked nothing (every cell skipped): both exit non-zero."""
    out = []
    if run is None or not run.get("status"):  # nothing says the rows below are every cell of a run
        out.append("How this run ended is not recorded (" + ("no run.json" if run is None else "run.json records no "
                   "status") + "): the counts below are of the rows cells.csv holds, not known to be every cell.")
    elif run.get("status") != "complete":
        listed = run.get("cells") if isinstance(run.get("cells"), list) else []
        done = {r.cell for r in records}
        missing = [c for c in listed if c not in done]
        out.append(f"Run {run.get('status')}: {len(missing)} of {len(listed)} cells not run "
                   f"(e.g. {missing[0]}); the counts below are of the cells that ran." if missing
                   else f"Run {run.get('status')}: not a complete run.")
    why = nothing_checked(records)
    if why:
        out.append(f"Nothing was checked: every cell was skipped ({why}); the run exits 1.")
    return out


def report_dir(directory: str) -> str:
    """``parity report DIR``: (re)write DIR/report.html from a run's records as it recorded them
    (:func:`parity.report.outdir.recorded`); returns its path."""
    from parity.errors import writing
    from parity.report.outdir import recorded

    cells = os.path.join(directory, "cells.csv")
    if not os.path.isfile(cells):
        raise UsageError(f"report: no cells.csv in {directory}; give the --out directory of a parity run")
    records = recorded(directory, "report", "rerun the matrix into a new --out")
    with writing(os.path.join(directory, REPORT)):
        return write_html(directory, records)
