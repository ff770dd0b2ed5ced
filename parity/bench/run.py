"""``python -m parity bench``: every model x path on one rank count, measured, written."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from parity.bench.environment import environment
from parity.bench.measure import BenchTask
from parity.bench.tables import markdown, plot, rows_for, write_csv
from parity.errors import UsageError
from parity.execute.pool import CellFailure, RankPool
from parity.matrix.cell import Cell


def run_bench(*, models: list[tuple[str, str]], paths: list[str], ranks: int, device: str, warmup: int,
              steps: int, out_dir: str, plots: bool, timeout: float) -> int:
    """``models``: (name, source) pairs. Returns 0, or 1 when a model x path could not be
    measured (other than a declared isolation error, which is listed, not a failure)."""
    if plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install 'parity[plot]' (the numbers need no plot)") from None
    if os.path.isfile(out_dir):
        raise UsageError(f"--out {out_dir} is a file; give a directory")
    os.makedirs(out_dir, exist_ok=True)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the ranks' profilers: no per-step log lines
    tmp = tempfile.mkdtemp(prefix="parity-bench-")
    pool = RankPool(ranks, device, tmp=tmp)
    rows, failures, code = [], [], 0
    try:
        for name, source in models:
            for path in paths:
                cell = Cell(fixture=name, path=path, ranks=ranks, device=device, source=source,
                            steps=warmup + steps + 1)
                try:
                    results = pool.run(BenchTask(cell=cell, warmup=warmup, steps=steps), timeout)
                except CellFailure as exc:
                    declared = "IsolationError" in exc.reason
                    failures.append(f"{name} / {path}: {exc.verdict}"
                                    + (" (declared isolation error: this path cannot shard it)" if declared
                                       else f": {exc.reason.splitlines()[0][:300]}"))
                    code = code if declared else 1
                    continue
                new = rows_for(name, path, ranks, device, results)
                rows += new
                got = {r["metric"]: r["value"] for r in new if r["repetition"] == 0}
                print(f"{name:<16} {path:<8} took {results[0].taken:<8} units {got['units']:>3}  collectives "
                      f"{got['collectives total']:>4}  MiB {got['bytes total'] / 2**20:8.3f}", flush=True)
    finally:
        pool.stop(kill=True)
        shutil.rmtree(tmp, ignore_errors=True)
    env = environment(device)
    write_csv(os.path.join(out_dir, "bench.csv"), rows)
    with open(os.path.join(out_dir, "bench.md"), "w") as fh:
        fh.write(markdown(rows, env, warmup=warmup, steps=steps, failures=failures))
    with open(os.path.join(out_dir, "bench.json"), "w") as fh:
        json.dump({"environment": env, "warmup": warmup, "steps": steps, "ranks": ranks, "not_measured": failures},
                  fh, indent=1)
    written = plot(rows, out_dir) if plots and rows else []
    print(f"bench: {out_dir}/bench.md, {out_dir}/bench.csv" + "".join(f", {f}" for f in written))
    return code
