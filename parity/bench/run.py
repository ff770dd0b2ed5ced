"""``python -m parity bench``: every model x path on one rank count, measured, written."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from parity.report.environment import environment
from parity.bench.measure import BenchTask
from parity.bench.tables import markdown, plot, rows_for, write_csv
from parity.errors import UsageError
from parity.execute.pool import CellFailure, RankPool
from parity.matrix.cell import Cell
from parity.report.outdir import usable


def run_bench(*, models: list[tuple[str, str]], paths: list[str], ranks: int, device: str, warmup: int,
              steps: int, out_dir: str, plots: bool, timeout: float) -> int:
    """``models``: (name, source) pairs. Returns 0, or 1 when a model x path could not be
    measured (other than a declared isolation error, which is listed, not a failure)."""
    if plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install 'parity[plot]' (the numbers need no plot)") from None
    usable(out_dir)
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


def add_bench_arguments(sub) -> None:
    from parity.arguments import count, integer, positive, steps

    bench = sub.add_parser("bench", help="collectives, bytes, packing, memory and step time per model x path")
    bench.add_argument("--fixtures", help="comma list of models (default: every registered one, or --model's)")
    bench.add_argument("--model", action="append", default=[], help="plugin models: pkg.module:factory (repeatable)")
    bench.add_argument("--paths", default="legacy,native", help="comma list of paths (legacy,native)")
    bench.add_argument("--ranks", type=count, default=2, help="rank count (2)")
    bench.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    bench.add_argument("--warmup", type=integer, default=2, help="unmeasured steps first (2)")
    bench.add_argument("--steps", type=steps, default=10, help="measured steps (10, at most 1000)")
    bench.add_argument("--out", default="results/bench", help="output directory (results/bench)")
    bench.add_argument("--plot", action="store_true", help="also write PNG plots (needs parity[plot])")
    bench.add_argument("--timeout", type=positive, default=120.0, help="seconds without progress (120)")


def bench_command(args) -> int:
    from parity.arguments import MAX_STEPS, csv_list
    from parity.model.registry import load_source, registered
    from parity.paths import path_names
    from parity.runner import resolve_device

    if not 0 <= args.warmup <= MAX_STEPS:
        raise UsageError(f"--warmup must be from 0 to {MAX_STEPS}, got {args.warmup}")
    sourced = [(f.name, src) for src in args.model for f in load_source(src)]
    known = dict(sourced) if sourced else {name: "" for name in registered()}
    names = csv_list(args.fixtures, "--fixtures", list(known)) or list(known)
    paths = csv_list(args.paths, "--paths", path_names())
    return run_bench(models=[(n, known[n]) for n in names], paths=paths, ranks=args.ranks,
                     device=resolve_device(args.device), warmup=args.warmup, steps=args.steps, out_dir=args.out,
                     plots=args.plot, timeout=args.timeout)
