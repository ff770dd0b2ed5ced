"""``bench --harness MATRIX``: what parity itself costs per cell, so its own regressions show.

The bench's models and paths select cells of ``MATRIX``; they run as ``run`` would run them
(into ``OUT/harness/``, ``--harness-repeats`` times: medians and IQRs), and the run's phases are
reported per cell that ran (a skipped cell costs nothing): starting the ranks, the
parent waiting for them, rank 0's build / steps / checkpoint lifecycle (which overlap the
parent's judging of the cell before), the parent's reference and comparisons, and the rest
(records, reports, queues). ``bench.md`` gets the table, ``bench.json`` the figures.
"""

from __future__ import annotations

import json
import os

from parity.errors import UsageError

#: The phases reported, in order, as ``timings.json`` names them.
PHASES = ("spawn", "waiting for ranks", "build", "steps", "checkpoint", "reference+compare",
          "other (parent, queues, skips)", "wall")


def harness_cost(matrix: str, models: list[tuple[str, str]], paths: list[str], *, device: str, out_dir: str,
                 timeout: float, repeats: int = 1) -> tuple[int, dict]:
    """(the runs' exit code, ``{"matrix", "cells", "ran", "repeats", "verdicts", phase: median seconds...,
    "iqr": {phase: seconds}}``): the cells run ``repeats`` times (a run that does not pass ends the
    repeats; ``verdicts``, cells per verdict of the last run, say how in ``bench.md``); ``ran``: the
    cells that ran (not SKIP), which the per-cell figures divide by."""
    from collections import Counter

    from parity.report.records import read_records
    from parity.report.summary import cell_verdicts, spread
    from parity.runner import RunOptions, quietly, run_cells

    m, cells = harness_cells(matrix, models, paths)
    out = os.path.join(out_dir, "harness")
    options = RunOptions(out_dir=out, device=device, timeout=timeout, progress=False, title=f"harness {m.name}",
                         overwrite=True)
    runs, code, verdicts = [], 0, {}
    for _ in range(repeats):
        with quietly():  # the bench reports instead (warnings and errors still reach stderr)
            code = run_cells(cells, options, skip_reason=m.skip_reason)
        with open(os.path.join(out, "timings.json"), encoding="utf-8") as fh:
            timings = json.load(fh)
        runs.append({k: float(timings.get(k, 0.0)) for k in PHASES})
        verdicts = dict(Counter(str(v) for v in cell_verdicts(read_records(os.path.join(out, "cells.csv"))).values()))
        if code:
            break
    spreads = {k: spread([r[k] for r in runs]) for k in PHASES}
    ran = sum(n for v, n in verdicts.items() if v != "SKIP")
    return code, {"matrix": m.name, "cells": len(cells), "ran": ran, "repeats": len(runs), "verdicts": verdicts,
                  **{k: spreads[k]["median"] for k in PHASES}, "iqr": {k: spreads[k]["iqr"] for k in PHASES},
                  "runs": runs}


def csv_rows(cost: dict, device: str) -> list[dict]:
    """``bench.csv`` rows of parity's own cost, seconds per cell that ran, one per phase and run
    (``compare`` weighs them by their spread like any bench figure); none when no cell ran."""
    ran = cost.get("ran", 0)
    if not ran:
        return []
    base = {"fixture": f"harness:{cost['matrix']}", "path": "all", "path_taken": "", "ranks": "", "device": device}
    return [{**base, "metric": f"harness {k}", "unit": "s/cell", "repetition": i, "value": run[k] / ran}
            for i, run in enumerate(cost.get("runs", [])) for k in PHASES]


def verdict_line(cost: dict) -> str:
    """The harness run's cells per verdict, in one line."""
    return ", ".join(f"{n} {v}" for v, n in sorted(cost.get("verdicts", {}).items())) or "no cell recorded"


def harness_cells(matrix: str, models: list[tuple[str, str]], paths: list[str]) -> tuple:
    """(the matrix, its cells of these models and paths); none is a usage error, which ``bench``
    raises before it measures anything."""
    from parity.matrix import load

    m = load(matrix, tuple(dict.fromkeys(s for _, s in models if s)))
    names = {n for n, _ in models}
    cells = [c for c in m.cells if c.fixture in names and c.path in paths]
    if not cells:
        raise UsageError(f"--harness {matrix}: no cell of that matrix has these models and paths; "
                         "choose a matrix with them or --harness none")
    return m, cells


def markdown(cost: dict) -> list[str]:
    ran, repeats = cost.get("ran", 0), cost.get("repeats", 1)
    lines = [f"## parity's own cost per cell (matrix {cost['matrix']}, {cost['cells']} cells of these models "
             f"and paths, {ran} ran; median of {repeats} run{'s' if repeats != 1 else ''})", "",
             "| phase | seconds | IQR | per cell that ran |", "|---|---|---|---|"]
    iqr = cost.get("iqr", {})
    lines += [f"| {k} | {cost[k]:.2f} | {iqr.get(k, 0.0):.2f} | " + (f"{cost[k] / ran:.3f} |" if ran else "– |")
              for k in PHASES]
    return lines + ["", f"The harness run's cells: {verdict_line(cost)} (its summary: harness/summary.md).", "",
                    "Rank 0's build, steps and checkpoint overlap the parent's judging of the cell before; "
                    "the wall is spawn + waiting for ranks + reference+compare + other. Spawn is the time the "
                    "parent is blocked starting ranks: they start at the run's start from a fork server that "
                    "imported torch while the parent read the matrix, and are usually ready by their first "
                    "cell, so it is small. A cell skipped is no cell's cost: the figures divide by the cells "
                    "that ran.", ""]
