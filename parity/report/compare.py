"""``python -m parity compare OLD NEW``: two result directories side by side.

A directory is reduced to its **digest** (``digest.json``, small enough to commit under
``results/baselines/``): each cell's worst verdict, each check's worst ratio, and the bench
metrics (median, IQR) when ``bench.csv`` is there. A directory holding only a digest
compares like a full one. Regressions:

- a cell whose verdict got worse (PASS -> FAIL, ERROR, ...), or that the new run lacks;
- a check whose worst ratio (per model) grew by more than ``factor`` and now exceeds ``floor`` (a tenth
  of its allowance by default: below that, growth is rounding noise, not a trend);
- a bench count or byte total that changed at all (they are deterministic), or a timed
  metric whose median moved by more than the two runs' IQRs together.
"""

from __future__ import annotations

import csv
import json
import math
import os

from parity.errors import UsageError
from parity.judge.record import SEVERITY, Verdict
from parity.report.records import read_records
from parity.report.summary import spread

DIGEST = "digest.json"


def digest(directory: str) -> dict:
    cells_csv = os.path.join(directory, "cells.csv")
    bench_csv = os.path.join(directory, "bench.csv")
    if not os.path.isfile(cells_csv) and not os.path.isfile(bench_csv):
        path = os.path.join(directory, DIGEST)
        if not os.path.isfile(path):
            return {}
        with open(path) as fh:
            return json.load(fh)
    cells: dict[str, str] = {}
    checks: dict[str, float] = {}
    for r in read_records(cells_csv) if os.path.isfile(cells_csv) else ():
        prev = cells.get(r.cell)
        if prev is None or SEVERITY[Verdict(r.verdict)] > SEVERITY[Verdict(prev)]:
            cells[r.cell] = str(r.verdict)
        if isinstance(r.ratio, float) and math.isfinite(r.ratio):
            key = f"{r.fixture}|{r.check}"
            checks[key] = max(checks.get(key, 0.0), r.ratio)
    out = {"cells": cells, "checks": checks, "bench": {}, "matrix": _matrix_of(directory)}
    if os.path.isfile(bench_csv):
        values: dict[str, list[float]] = {}
        with open(bench_csv) as fh:
            for row in csv.DictReader(fh):
                values.setdefault(f"{row['fixture']}|{row['path']}|{row['metric']}", []).append(float(row["value"]))
        for key, v in values.items():
            s = spread(v)
            out["bench"][key] = {"median": s["median"], "iqr": s["iqr"], "n": len(v)}
    return out


def _matrix_of(directory: str) -> str:
    try:
        with open(os.path.join(directory, "run.json")) as fh:
            return str((json.load(fh).get("options") or {}).get("matrix", ""))
    except (OSError, ValueError):
        return ""


def _worse(old: str, new: str) -> bool:
    return SEVERITY[Verdict(new)] > SEVERITY[Verdict(old)] and Verdict(new) != Verdict.SKIP


def compare(old: dict, new: dict, *, factor: float = 2.0, floor: float = 0.1) -> tuple[list[str], list[str]]:
    """(regressions, other changes), each a line."""
    bad, info = [], []
    for cell, was in sorted(old.get("cells", {}).items()):
        now = new.get("cells", {}).get(cell)
        if now is None:
            bad.append(f"cell {cell}: {was} before, not run now")
        elif now != was:
            (bad if _worse(was, now) else info).append(f"cell {cell}: {was} -> {now}")
    added = sorted(set(new.get("cells", {})) - set(old.get("cells", {})))
    if added:
        info.append(f"{len(added)} cells only in the new run (e.g. {added[0]})")
    for check, was in sorted(old.get("checks", {}).items()):
        now = new.get("checks", {}).get(check)
        if now is None:
            continue
        if now > floor and now > factor * was:
            bad.append(f"check {check.replace('|', ' / ')}: worst ratio {was:.3g} -> {now:.3g} (grew more than {factor:g}x)")
        elif abs(now - was) > 1e-12:
            info.append(f"check {check.replace('|', ' / ')}: worst ratio {was:.3g} -> {now:.3g}")
    for key, was in sorted(old.get("bench", {}).items()):
        now = new.get("bench", {}).get(key)
        if now is None:
            continue
        metric = key.split("|")[2]
        exact = metric.startswith(("collectives", "bytes", "units"))
        moved = abs(now["median"] - was["median"])
        if (exact and moved > 0) or (not exact and moved > was["iqr"] + now["iqr"] and was["n"] > 1):
            bad.append(f"bench {key.replace('|', ' / ')}: {was['median']:.4g} -> {now['median']:.4g}"
                       + ("" if exact else f" (IQRs {was['iqr']:.3g}, {now['iqr']:.3g})"))
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


def digest_of(directory: str, what: str) -> dict:
    """The digest of a results directory; :class:`UsageError` naming it when there is none."""
    if not os.path.isdir(directory):
        raise UsageError(f"{what} {directory}: no such directory")
    d = digest(directory)
    if not d:
        raise UsageError(f"{what} {directory}: no cells.csv, bench.csv or digest.json there; give a parity results "
                         "directory")
    return d


def compare_dirs(old_dir: str, new_dir: str, *, factor: float, write_digest: str = "") -> int:
    """``parity compare``: print the report; 1 on a regression. ``write_digest``: also store
    NEW's digest there (a baseline for ``results/baselines/``)."""
    old, new = digest_of(old_dir, "compare"), digest_of(new_dir, "compare")
    bad, info = compare(old, new, factor=factor)
    print(report(old_dir, new_dir, bad, info))
    if write_digest:
        os.makedirs(write_digest, exist_ok=True)
        with open(os.path.join(write_digest, DIGEST), "w") as fh:
            json.dump(new, fh, indent=0, sort_keys=True)
    return 1 if bad else 0
