"""``bench --harness MATRIX``: what parity itself costs per cell, so its own regressions show.

The bench's models and paths select cells of ``MATRIX``; they run as ``run`` would run them
(into ``OUT/harness/``), and the run's phases are reported per cell: starting the ranks, the
parent waiting for them, rank 0's build / steps / checkpoint lifecycle (which overlap the
parent's judging of the cell before), the parent's reference and comparisons, and the rest
(records, reports, queues). ``bench.md`` gets the table, ``bench.json`` the figures.
"""

from __future__ import annotations

import contextlib
import io
import json
import os

from parity.errors import UsageError

#: The phases reported, in order, as ``timings.json`` names them.
PHASES = ("spawn", "waiting for ranks", "build", "steps", "checkpoint", "reference+compare",
          "other (parent, queues, skips)", "wall")


def harness_cost(matrix: str, models: list[tuple[str, str]], paths: list[str], *, device: str, out_dir: str,
                 timeout: float) -> tuple[int, dict]:
    """(the run's exit code, ``{"matrix", "cells", "verdicts", phase: seconds...}``; ``verdicts``:
    cells per verdict, so a harness run that failed says how in ``bench.md``)."""
    from collections import Counter

    from parity.report.records import read_records
    from parity.report.summary import cell_verdicts
    from parity.runner import RunOptions, run_cells

    m, cells = harness_cells(matrix, models, paths)
    out = os.path.join(out_dir, "harness")
    options = RunOptions(out_dir=out, device=device, timeout=timeout, progress=False, title=f"harness {m.name}",
                         overwrite=True)
    with contextlib.redirect_stdout(io.StringIO()):  # the run's own table: the bench reports instead
        code = run_cells(cells, options, skip_reason=m.skip_reason)
    with open(os.path.join(out, "timings.json")) as fh:
        timings = json.load(fh)
    verdicts = dict(Counter(str(v) for v in cell_verdicts(read_records(os.path.join(out, "cells.csv"))).values()))
    return code, {"matrix": m.name, "cells": len(cells), "verdicts": verdicts, **{k: timings.get(k, 0.0) for k in PHASES}}


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
    n = max(1, cost["cells"])
    lines = [f"## parity's own cost per cell (matrix {cost['matrix']}, {cost['cells']} cells of these models "
             "and paths)", "", "| phase | seconds | per cell |", "|---|---|---|"]
    lines += [f"| {k} | {cost[k]:.2f} | {cost[k] / n:.3f} |" for k in PHASES]
    return lines + ["", f"The harness run's cells: {verdict_line(cost)} (its summary: harness/summary.md).", "",
                    "Rank 0's build, steps and checkpoint overlap the parent's judging of the cell before; "
                    "the wall is spawn + waiting for ranks + reference+compare + other. Spawn is the time the "
                    "parent is blocked starting ranks: they start at the run's start from a fork server that "
                    "imported torch while the parent read the matrix, and are usually ready by their first "
                    "cell, so it is small.", ""]
