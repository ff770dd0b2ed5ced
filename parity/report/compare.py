"""``python -m parity compare OLD NEW``: two result directories side by side.

A directory is reduced to its **digest** (``digest.json``, small enough to commit under
``results/baselines/``): each cell's worst verdict, each check's worst ratio, and the bench
metrics (median, IQR) when ``bench.csv`` is there. A directory holding only a digest
compares like a full one. OLD must be a complete run (its ``run.json`` or digest says ``complete``;
an interrupted or empty OLD is refused, exit 2). A complete run, either side, is read only as it
recorded its ``cells.csv`` (cut or appended to afterwards: exit 2). Regressions, whatever OLD holds:

- a cell whose verdict got worse (PASS -> FAIL, ERROR, ...), or that the new run lacks;
- a cell whose verdict is an alarm (:data:`ALARMS`) it was not in OLD, a cell only NEW has included;
- a check whose worst ratio (per model) grew by more than ``factor`` and now exceeds ``floor`` (a tenth
  of its allowance by default: below that, growth is rounding noise, not a trend);
- a model x path NEW's bench could not measure (its ``bench.json`` lists it as failed) and OLD's could;
- a bench count or byte total that changed at all (they are deterministic), a timed metric
  whose median grew by more than the two runs' IQRs together (a CPU time is listed, not judged:
  on CPU times only order the paths), or a memory figure (measured
  once a bench: no spread) that grew by more than :data:`MEMORY_GROWTH` -- an allocator's peak
  for the same program moves by its rounding, not by a tenth. Another one-sample metric
  (profiled packing time) that moved is listed, not judged.
"""

from __future__ import annotations

import csv
import json
import math
import os

from parity.errors import UsageError, text_file
from parity.judge.record import SEVERITY, VERDICTS, Verdict
from parity.report.outdir import DIGEST, MANIFEST, read_json, read_manifest, recorded, usable
from parity.report.summary import check_label, spread

#: A memory figure above this multiple of OLD's is a regression (see the module docstring).
MEMORY_GROWTH = 1.10
#: Verdicts that are a regression wherever they newly appear: in a cell OLD judged otherwise, or in
#: one OLD does not have.
ALARMS = (Verdict.FAIL, Verdict.ERROR, Verdict.TIMEOUT, Verdict.INCONCLUSIVE, Verdict.UNPAIRED)


def _read_digest(path: str) -> dict:
    """A ``digest.json``: ``cells`` maps cell ids to verdicts, ``checks`` names to numbers, ``bench`` keys
    to ``{median, iqr, n}``; anything else is a :class:`UsageError`."""
    fix = "write it again with parity compare --write-digest"
    d = read_json(path, fix)
    cells, checks, bench = d.get("cells", {}), d.get("checks", {}), d.get("bench", {})
    failed, taken = d.get("bench_failed", []), d.get("fell_back", {})
    ok = (isinstance(cells, dict) and all(v in VERDICTS for v in cells.values())
          and isinstance(taken, dict) and all(isinstance(v, str) for v in taken.values())
          and isinstance(checks, dict) and all(_number(v) for v in checks.values())
          and isinstance(bench, dict) and all(_bench_entry(v) for v in bench.values())
          and isinstance(failed, list) and all(isinstance(f, str) for f in failed))
    if not ok:
        raise UsageError(f"{path}: not a digest as parity writes it (cells, checks, bench); {fix}")
    return d


def _bench_entry(v) -> bool:
    return isinstance(v, dict) and all(_number(v.get(k)) for k in ("median", "iqr", "n"))


def _number(x) -> bool:
    """A measurement: a finite int or float (NaN compares as "no change" with anything)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _bench_values(path: str) -> tuple[dict[str, list[float]], dict[str, str]]:
    """``bench.csv``'s values and device per fixture|path|metric; a malformed row is a :class:`UsageError`."""
    values: dict[str, list[float]] = {}
    devices: dict[str, str] = {}
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            for n, row in enumerate(csv.DictReader(fh), 2):
                try:
                    key = f"{row['fixture']}|{row['path']}|{row['metric']}"
                    value = float(row["value"])
                    if not math.isfinite(value):  # NaN would compare as "no change" with anything
                        raise ValueError(f"value {row['value']!r} is not a finite number")
                    values.setdefault(key, []).append(value)
                    devices[key] = str(row.get("device") or "")
                except (KeyError, TypeError, ValueError) as exc:
                    raise UsageError(f"{path} row {n}: not a bench row ({type(exc).__name__}: {exc}); "
                                     "rerun parity bench") from None
    except (OSError, ValueError, csv.Error) as exc:  # ValueError: not UTF-8
        raise UsageError(f"{path} is unreadable ({exc}); rerun parity bench") from None
    return values, devices


def digest(directory: str) -> dict:
    cells_csv = os.path.join(directory, "cells.csv")
    bench_csv = os.path.join(directory, "bench.csv")
    bench_json = os.path.join(directory, "bench.json")  # read where a bench's status or rows need it
    if not any(os.path.isfile(p) for p in (cells_csv, bench_csv, bench_json)):  # a bench killed early: its json
        path = os.path.join(directory, DIGEST)
        if not os.path.isfile(path):
            return {}
        return _read_digest(path)
    cells: dict[str, str] = {}
    checks: dict[str, float] = {}
    fell_back: dict[str, str] = {}  # cell -> the path it took instead of its own
    fix = "compare against the run's own results or rerun it"
    for r in recorded(directory, "compare", fix) if os.path.isfile(cells_csv) else ():
        if r.path_taken and r.path_taken != r.path and "~" not in r.path:
            fell_back[r.cell] = r.path_taken
        prev = cells.get(r.cell)
        if prev is None or SEVERITY[Verdict(r.verdict)] > SEVERITY[Verdict(prev)]:
            cells[r.cell] = str(r.verdict)
        if isinstance(r.ratio, float) and math.isfinite(r.ratio):
            key = f"{r.fixture}|{check_label(r)}"
            checks[key] = max(checks.get(key, 0.0), r.ratio)
    needed = os.path.isfile(bench_csv) or not os.path.isfile(os.path.join(directory, MANIFEST))
    bench = read_json(bench_json, "rerun parity bench") if needed and os.path.isfile(bench_json) else None
    out = {"cells": cells, "checks": checks, "bench": {}, "fell_back": fell_back, **_run_of(directory, bench)}
    if os.path.isfile(bench_csv):
        values, devices = _bench_values(bench_csv)
        for key, v in values.items():
            s = spread(v)
            out["bench"][key] = {"median": s["median"], "iqr": s["iqr"], "n": len(v), "device": devices[key]}
        out["bench_failed"] = _bench_failed(bench or {}, bench_json)
    return out


def _bench_failed(bench: dict, path: str) -> list[str]:
    """The ``model|path`` runs a bench could not measure and exits 1 for (``bench.json``'s ``failed``)."""
    failed = bench.get("failed", [])
    if not isinstance(failed, list) or not all(isinstance(f, str) for f in failed):
        raise UsageError(f"{path}: failed is not a list of model|path names; rerun parity bench")
    return sorted(failed)


#: The status of a ``cells.csv`` with no ``run.json`` beside it: nothing records how that run ended
#: or how many rows it wrote, so a cut file would read as a run of fewer cells.
UNRECORDED = "of unknown status (no run.json beside its cells.csv)"


def _run_of(directory: str, bench: dict | None) -> dict:
    """The matrix and status ``run.json`` records; a bench's status from its ``bench.json``
    (``bench``, read: a bench a signal stopped is interrupted); :data:`UNRECORDED` for cells
    without ``run.json``."""
    if not os.path.isfile(os.path.join(directory, MANIFEST)):
        if bench is not None:
            stopped = bench.get("interrupted")
            return {"matrix": "", "status": f"interrupted ({stopped})" if stopped else "complete"}
        return {"matrix": "", "status": UNRECORDED} if os.path.isfile(os.path.join(directory, "cells.csv")) else {
            "matrix": ""}
    manifest = read_manifest(directory)
    return {"matrix": str((manifest.get("options") or {}).get("matrix", "")), "status": manifest.get("status", "")}


def _worse(old: str | None, new: str) -> bool:
    """Whether verdict ``new`` is a regression from ``old`` (``None``: OLD lacks the cell): more severe,
    an alarm OLD did not have, or a SKIP / UNPAIRED where OLD checked the cell or compared the pair
    (what it showed is gone: a FAIL that turns UNPAIRED was not fixed, it is no longer looked at)."""
    if new == old:
        return False
    if Verdict(new) in (Verdict.SKIP, Verdict.UNPAIRED) and old is not None:
        return True
    if old is None or Verdict(old) == Verdict.SKIP:  # nothing was checked before: only an alarm is worse
        return Verdict(new) in ALARMS
    return SEVERITY[Verdict(new)] > SEVERITY[Verdict(old)] or Verdict(new) in ALARMS  # an alarm of another kind


def _unfinished(d: dict) -> str:
    """Why digest ``d`` holds no finished run ('' when it does): its run's status other than
    ``complete`` (a bench without ``bench.json`` counts as complete: its rows are its counts)."""
    status = d.get("status", "complete")
    return "" if status == "complete" else f"{status or 'of unknown status'}, not complete"


def _finish(d: dict, directory: str) -> str:
    """How an unfinished run of digest ``d`` is finished: a matrix run resumes, a bench runs again."""
    if d.get("matrix"):
        return f"finish it with parity run --resume {directory}"
    return "rerun the matrix into a new --out" if d.get("status") == UNRECORDED else "run that bench again"


def compare(old: dict, new: dict, *, factor: float = 2.0, floor: float = 0.1) -> tuple[list[str], list[str]]:
    """(regressions, other changes), each a line. A NEW run that is not complete is a regression
    in itself: what it did not run is no evidence, even where OLD has nothing to hold it to."""
    bad, info = [], []
    partial = _unfinished(new)
    if partial:
        bad.append(f"the new run is {partial}: its evidence is partial ({_finish(new, 'DIR')})")
    for cell, was in sorted(old.get("cells", {}).items()):
        now = new.get("cells", {}).get(cell)
        if now is None:
            bad.append(f"cell {cell}: {was} before, not run now")
        elif now != was:
            (bad if _worse(was, now) else info).append(f"cell {cell}: {was} -> {now}")
    if "fell_back" in old:  # a digest written before parity recorded fallbacks holds no word on them
        for cell, taken in sorted(new.get("fell_back", {}).items()):
            if cell in old.get("cells", {}) and cell not in old["fell_back"]:  # its path is no longer exercised
                bad.append(f"cell {cell}: ran its own path before, fell back to {taken} now")
    added = sorted(set(new.get("cells", {})) - set(old.get("cells", {})))
    alarms = [c for c in added if _worse(None, new["cells"][c])]
    bad += [f"cell {c}: {new['cells'][c]} (not in the old run)" for c in alarms]
    if len(added) > len(alarms):
        info.append(f"{len(added) - len(alarms)} cells only in the new run (e.g. "
                    f"{next(c for c in added if c not in alarms)})")
    for check, was in sorted(old.get("checks", {}).items()):
        now = new.get("checks", {}).get(check)
        if now is None:  # measured before, not now: that evidence is missing, not better
            bad.append(f"check {check.replace('|', ' / ')}: worst ratio {was:.3g} before, not measured now")
            continue
        if now > floor and now > factor * was:
            bad.append(f"check {check.replace('|', ' / ')}: worst ratio {was:.3g} -> {now:.3g} (grew more than {factor:g}x)")
        elif abs(now - was) > 1e-12:
            info.append(f"check {check.replace('|', ' / ')}: worst ratio {was:.3g} -> {now:.3g}")
    was_failed = set(old.get("bench_failed", ()))
    bad += [f"bench {f.replace('|', ' / ')}: not measured now (bench.md says why)"
            for f in new.get("bench_failed", ()) if f not in was_failed]
    for key, was in sorted(old.get("bench", {}).items()):
        now = new.get("bench", {}).get(key)
        if now is None:  # measured before, not now: that evidence is missing, not better
            bad.append(f"bench {key.replace('|', ' / ')}: {was['median']:.4g} before, not measured now")
            continue
        line = f"bench {key.replace('|', ' / ')}: {was['median']:.4g} -> {now['median']:.4g}"
        metric = key.split("|")[2]
        exact = metric.startswith(("collectives", "bytes", "units"))
        moved = abs(now["median"] - was["median"])
        once = was["n"] <= 1 or now["n"] <= 1  # one sample: no spread to weigh a move against
        cpu = "cpu" in (was.get("device"), now.get("device"))  # CPU times only order the paths
        if exact and moved > 0:
            bad.append(line)
        elif metric.startswith("memory") and now["median"] > MEMORY_GROWTH * was["median"]:
            bad.append(f"{line} (grew more than {MEMORY_GROWTH - 1:.0%})")
        elif once and moved > 0:
            info.append(f"{line} (one sample each side: not judged)")
        elif moved > was["iqr"] + now["iqr"]:
            slower = now["median"] > was["median"] and not metric.startswith("memory")
            note = " (a CPU time: listed, not judged)" if cpu and slower else "" if slower else " (less)"
            (bad if slower and not cpu else info).append(f"{line} (IQRs {was['iqr']:.3g}, {now['iqr']:.3g}){note}")
    return bad, info


def concerns(line: str, model: str) -> bool:
    """Whether a regression line concerns ``model``."""
    if line.startswith("cell "):
        return line.startswith(f"cell {model}/")
    if line.startswith(("bench ", "check ")):
        return line.split(" ", 1)[1].startswith(f"{model} /")
    return True


def report(old_dir: str, new_dir: str, bad: list[str], info: list[str]) -> str:
    lines = [f"# parity compare: {old_dir} -> {new_dir}", "",
             f"**{'REGRESSED' if bad else 'NO REGRESSION'}**: {len(bad)} regression(s), {len(info)} other change(s)", ""]
    if bad:
        lines += ["## Regressions", ""] + [f"- {b}" for b in bad] + [""]
    if info:
        lines += ["## Other changes", ""] + [f"- {i}" for i in info[:200]] + [""]
    return "\n".join(lines)


def digest_of(directory: str, what: str, *, baseline: bool = False) -> dict:
    """The digest of a results directory; :class:`UsageError` naming it when there is none. A
    ``baseline`` (OLD) must also be a complete run that holds results."""
    if not os.path.isdir(directory):
        raise UsageError(f"{what} {directory}: no such directory")
    d = digest(directory)
    if not d:
        raise UsageError(f"{what} {directory}: no cells.csv, bench.csv or digest.json there; give a parity results "
                         "directory")
    partial = _unfinished(d) if baseline else ""
    if partial:
        raise UsageError(f"{what} {directory}: that run is {partial}; "
                         f"{_finish(d, directory)} or compare against a complete run")
    if baseline and not d.get("cells") and not d.get("bench"):
        raise UsageError(f"{what} {directory}: holds no results (no cell, no bench row); compare against a "
                         "complete run")
    return d


def _same_kind(old: dict, new: dict, old_dir: str, new_dir: str) -> None:
    """A run's cells against a bench's rows would list every one of them as a regression: two
    digests holding results of no common kind are a :class:`UsageError`."""
    kinds = [{k for k in ("cells", "bench") if d.get(k)} for d in (old, new)]
    if all(kinds) and not kinds[0] & kinds[1]:
        what = {"cells": "a matrix run's cells", "bench": "a bench's rows"}
        raise UsageError(f"compare: {old_dir} holds {what[min(kinds[0])]}, {new_dir} {what[min(kinds[1])]}: not "
                         "the same kind of results; compare a run with a run, a bench with a bench")


def compare_dirs(old_dir: str, new_dir: str, *, factor: float, write_digest: str = "") -> int:
    """``parity compare``: print the report; 1 on a regression. ``write_digest``: also store
    NEW's digest there (a baseline for ``results/baselines/``)."""
    if write_digest:
        usable(write_digest, "--write-digest")  # before the comparison: its output must have somewhere to go
    old, new = digest_of(old_dir, "compare", baseline=True), digest_of(new_dir, "compare")
    _same_kind(old, new, old_dir, new_dir)
    bad, info = compare(old, new, factor=factor)
    print(report(old_dir, new_dir, bad, info))
    if write_digest:
        with text_file(os.path.join(write_digest, DIGEST)) as fh:
            json.dump(new, fh, indent=0, sort_keys=True)
    return 1 if bad else 0
