"""``python -m parity bench``: every model x path on one rank count, measured, written.

SIGINT/SIGTERM (:mod:`parity.interrupt`) stop after the measurement in progress is
abandoned: the pool is killed, its temporary folder removed, and what was measured is
written (the rest listed as not run) before exiting 130/143."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

from parity.report.environment import environment
from parity.bench.measure import BenchTask
from parity.bench.tables import PLOTS, markdown, plot, rows_for, write_csv
from parity.errors import UsageError, text_file, writing
from parity.execute.pool import CellFailure, RankPool
from parity.interrupt import Interrupted, Signals
from parity.matrix.cell import Cell
from parity.report.outdir import BENCH_FILES, other_results, run_files_in, usable


def bench_optimizer(name: str, source: str) -> str:
    """AdamW, as the matrices train by default; SGD for a model keeping gradients in another dtype
    than some weights (``Fixture.grad_dtypes``): torch 2.15's AdamW cannot step BF16 weights
    holding FP32 gradients (its ``lerp`` wants one dtype), which is why such recipes use SGD."""
    from parity.model.registry import get_fixture

    return "sgd" if get_fixture(name, source).grad_dtypes else "adamw"


def declared_isolation(name: str, source: str, path: str, reason: str) -> bool:
    """Whether a failed bench run is the isolation error the model declares for ``path``
    (``Fixture.expect``), as a matrix cell judges it; an undeclared one is a failure."""
    from parity.model.registry import get_fixture
    from parity.paths import get_path

    return "IsolationError" in reason and get_fixture(name, source).expects(
        path, get_path(path).contract)[0] == "isolation-error"


def run_bench(*, models: list[tuple[str, str]], paths: list[str], ranks: int, device: str, warmup: int,
              steps: int, out_dir: str, plots: bool, timeout: float, harness: str = "none",
              harness_repeats: int = 1) -> int:
    """``models``: (name, source) pairs. Returns 0, or 1 when a model x path could not be
    measured (other than a declared isolation error, which is listed, not a failure) or nothing
    was measured at all. A path that fell back has rows, and bench.md lists it under "Measured as
    another path (fell back)"."""
    if plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install 'parity[plot]' (the numbers need no plot)") from None
    usable(out_dir)
    held = run_files_in(out_dir)
    if held:  # a bench writes beside no run: compare would read the run's status, not the bench's
        raise UsageError(f"--out {out_dir} holds a run's results ({', '.join(held)}); give the bench its own --out")
    other_results(out_dir, besides="a bench")
    _started(out_dir)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the ranks' profilers: no per-step log lines
    todo = [(name, source, path) for name, source in models for path in paths]
    rows, failures, failed, fell_back, code, ran = [], [], [], [], 0, 0
    with Signals() as signals:
        tmp = tempfile.mkdtemp(prefix="parity-bench-")
        pool = RankPool(ranks, device, tmp=tmp, stop_requested=signals)
        try:
            for name, source, path in todo:
                if signals():
                    break
                cell = Cell(fixture=name, path=path, ranks=ranks, device=device, source=source,
                            steps=warmup + steps + 1, optimizer=bench_optimizer(name, source))
                try:
                    results = pool.run(BenchTask(cell=cell, warmup=warmup, steps=steps), timeout)
                except Interrupted:
                    break
                except CellFailure as exc:
                    if signals():  # a rank killed by the same signal is not this model's failure
                        break
                    ran += 1
                    declared = declared_isolation(name, source, path, exc.reason)
                    failures.append(f"{name} / {path}: {exc.verdict}"
                                    + (" (declared isolation error: this path cannot shard it)" if declared
                                       else f": {exc.reason.splitlines()[0][:300]}"))
                    if not declared:
                        failed.append(f"{name}|{path}")
                        code = 1
                    continue
                if results[0].taken != path:  # its rows are another path's cost: say so where they are read
                    fell_back.append(f"{name} / {path}: took {results[0].taken} (fell back); the rows labelled "
                                     f"{path} measure {results[0].taken}")
                new = rows_for(name, path, ranks, device, results)
                rows += new
                ran += 1
                got = {r["metric"]: r["value"] for r in new if r["repetition"] == 0}
                print(f"{name:<16} {path:<8} took {results[0].taken:<8} units {got['units']:>3}  collectives "
                      f"{got['collectives total']:>4}  MiB {got['bytes total'] / 2**20:8.3f}", flush=True)
        finally:
            pool.stop(kill=True)
            shutil.rmtree(tmp, ignore_errors=True)
        if signals():
            failures += [f"{n} / {p}: not run (interrupted by {signals.name})" for n, _, p in todo[ran:]]
        if not rows and not signals():  # nothing measured is not a measurement, declared or not
            failed += [f"{n}|{p}" for n, _, p in todo if f"{n}|{p}" not in failed]
            print(f"parity: bench measured nothing: none of the {len(todo)} model x path runs could be "
                  "measured (bench.md lists why)", file=sys.stderr)
            code = 1
        cost = {}
        if harness != "none" and not signals():
            from parity.bench.harness import harness_cost

            run_code, cost = harness_cost(harness, models, paths, device=device, out_dir=out_dir, timeout=timeout,
                                          repeats=harness_repeats)
            if run_code in (130, 143):
                signals.received = signals.received or run_code - 128
            elif run_code:  # its table went nowhere: say why bench fails
                from parity.bench.harness import verdict_line

                print(f"parity: bench --harness {harness}: the harness run did not pass ({verdict_line(cost)}); see "
                      f"{os.path.join(out_dir, 'harness', 'summary.md')}", file=sys.stderr)
            code = code or (1 if run_code else 0)
        _write(out_dir, rows, failures, device=device, failed=failed, fell_back=fell_back, warmup=warmup,
               steps=steps, ranks=ranks, plots=plots and not signals(), interrupted=signals.name, harness=cost)
        if signals():
            print(f"parity: interrupted by {signals.name} after {ran} of {len(todo)} model x path "
                  f"runs; what finished is in {out_dir}/bench.csv and bench.md", file=sys.stderr)
            return signals.code
    return code


#: ``bench.json`` from a bench's start until it writes its results: one killed meanwhile (a CI
#: timeout, the OOM killer) reads as unfinished (``compare``), never as the earlier bench's.
RUNNING = "running (or killed before it finished)"


def _started(out_dir: str) -> None:
    """Remove an earlier bench's files from ``out_dir`` and record this one as running."""
    for name in (*BENCH_FILES, *PLOTS):
        path = os.path.join(out_dir, name)
        with writing(path):
            if os.path.exists(path):
                os.remove(path)
    path = os.path.join(out_dir, "bench.json")
    with writing(path), text_file(path) as fh:
        json.dump({"interrupted": RUNNING}, fh)


def _write(out_dir: str, rows: list[dict], failures: list[str], *, device: str, warmup: int, steps: int,
           ranks: int, plots: bool, interrupted: str, harness: dict | None = None, failed: list[str] = (),
           fell_back: list[str] = ()) -> None:
    """``failures``: why each model x path has no rows; ``failed``: the ``model|path`` keys of those
    that make bench exit 1 (``compare`` reads them: a new one is a regression); ``fell_back``: paths
    whose rows measure the path they fell back to."""
    env = environment(device)
    meta = {"environment": env, "warmup": warmup, "steps": steps, "ranks": ranks, "not_measured": failures,
            "failed": list(failed), "fell_back": list(fell_back), **({"harness": harness} if harness else {})}
    path = os.path.join(out_dir, "bench.csv")
    with writing(path):
        from parity.bench.harness import csv_rows

        write_csv(path, rows + (csv_rows(harness, device) if harness else []))
    path = os.path.join(out_dir, "bench.md")
    with writing(path), text_file(path) as fh:
        text = markdown(rows, env, warmup=warmup, steps=steps, failures=failures, fell_back=fell_back)
        if harness:
            from parity.bench.harness import markdown as harness_markdown

            text += "\n" + "\n".join(harness_markdown(harness))
        fh.write(text)
    path = os.path.join(out_dir, "bench.json")
    with writing(path), text_file(path) as fh:
        json.dump({**meta, "interrupted": interrupted} if interrupted else meta, fh, indent=1)
    with writing(out_dir):
        written = plot(rows, out_dir) if plots and rows else []
    print(f"bench: {out_dir}/bench.md, {out_dir}/bench.csv" + "".join(f", {f}" for f in written))


def add_bench_arguments(sub) -> None:
    from parity.arguments import RANK_COUNTS, count, integer, path, positive, steps

    bench = sub.add_parser("bench", help="collectives, bytes, packing, memory and step time per model x path")
    bench.add_argument("--fixtures", help="comma list of models (default: every registered one, or --model's)")
    bench.add_argument("--model", action="append", default=[], help="plugin models: pkg.module:factory (repeatable)")
    bench.add_argument("--paths", default="legacy,native", help="comma list of paths (legacy,native)")
    bench.add_argument("--ranks", type=integer, choices=RANK_COUNTS, default=2, help="rank count (2)")
    bench.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    bench.add_argument("--warmup", type=integer, default=2, help="unmeasured steps first (2)")
    bench.add_argument("--steps", type=steps, default=10, help="measured steps (10, at most 1000)")
    bench.add_argument("--out", type=path, default="results/bench", help="output directory (results/bench)")
    bench.add_argument("--plot", action="store_true", help="also write PNG plots (needs parity[plot])")
    bench.add_argument("--timeout", type=positive, default=120.0, help="seconds without progress (120)")
    bench.add_argument("--harness", default="none", metavar="MATRIX",
                       help="also run MATRIX's cells of these models and paths and report parity's own cost per "
                            "cell (none)")
    bench.add_argument("--harness-repeats", type=count, default=3, metavar="N",
                       help="runs of the harness matrix; its figures are medians (3)")


def bench_command(args) -> int:
    import torch

    from parity.arguments import MAX_STEPS, RANK_COUNTS, csv_list
    from parity.model.registry import distinct, load_source, registered
    from parity.paths import path_names
    from parity.runner import resolve_device

    if args.harness_repeats > 100:
        raise UsageError(f"--harness-repeats must be at most 100, got {args.harness_repeats}")
    if not 0 <= args.warmup <= MAX_STEPS:
        raise UsageError(f"--warmup must be from 0 to {MAX_STEPS}, got {args.warmup}")
    distinct(tuple(args.model))  # as run refuses it
    sourced = [(f.name, src) for src in args.model for f in load_source(src)]
    known = dict(sourced) if sourced else {name: "" for name in registered()}
    names = csv_list(args.fixtures, "--fixtures", list(known)) or list(known)
    paths = csv_list(args.paths, "--paths", path_names())
    models = [(n, known[n]) for n in names]
    if args.harness != "none":  # a wrong matrix, or one without these models, is refused before measuring
        from parity.bench.harness import harness_cells

        harness_cells(args.harness, models, paths)
        inside = os.path.join(args.out, "harness")
        if os.path.exists(inside) and not os.path.isdir(inside):
            raise UsageError(f"--out {args.out}: {inside} is a file, where bench --harness writes its run; remove it "
                             "or choose another --out")
    device = resolve_device(args.device)
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    if device == "cuda" and args.ranks > gpus:  # one GPU per rank, as run's pools
        fit = max(n for n in RANK_COUNTS if n <= max(gpus, 1))
        raise UsageError(f"bench --ranks {args.ranks} --device cuda needs {args.ranks} GPUs; {gpus} visible; "
                         f"give --ranks {fit}")
    return run_bench(models=models, paths=paths, ranks=args.ranks,
                     device=device, warmup=args.warmup, steps=args.steps, out_dir=args.out,
                     plots=args.plot, timeout=args.timeout, harness=args.harness,
                     harness_repeats=args.harness_repeats)
