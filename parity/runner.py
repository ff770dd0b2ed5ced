"""Run cells: spawn (or join) ranks, judge each cell as it finishes, append records.

Pools are started once per rank count and reused; cells that crash or hang become
ERROR/TIMEOUT records and the pool restarts. Legacy and native runs of the same cell are
also compared with each other (``path = legacy~native``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace

import torch

from parity.cellspec import Cell
from parity.compare import cross_path
from parity.pool import CellFailure, RankPool
from parity.record import Record, RecordWriter
from parity.report import cell_verdicts, summary_markdown, terminal_table
from parity.verdicts import base_fields, failure_record, judge_cell


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    out_dir: str = "results/latest"
    """Where ``cells.csv``, ``summary.md`` and ``timings.json`` go."""
    device: str = "cpu"
    """``cpu`` (gloo) or ``cuda`` (NCCL); resolve ``auto`` before building options."""
    timeout: float = 60.0
    """Seconds one cell may take before it is a TIMEOUT."""
    fp64: bool = False
    """Also run an FP64 reference and record every error against it (information)."""
    progress: bool | None = None
    """Progress line on a TTY; None = detect."""
    title: str = "run"


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class _Progress:
    def __init__(self, total: int, tty: bool):
        self.total, self.tty, self.done, self.bad, self.t0 = total, tty, 0, 0, time.perf_counter()

    def update(self, cell: Cell, verdict: str, seconds: float) -> None:
        self.done += 1
        self.bad += verdict in ("FAIL", "ERROR", "TIMEOUT")
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / self.done * (self.total - self.done)
        if self.tty:
            sys.stderr.write(f"\r[{self.done}/{self.total}] failures {self.bad}  eta {eta:5.0f}s ")
            if self.done == self.total:
                sys.stderr.write("\n")
        else:
            sys.stderr.write(f"[{self.done}/{self.total}] {verdict:<7} {cell.id} ({seconds:.2f}s)\n")
        sys.stderr.flush()


def _skip_reason(cell: Cell, device: str, skip_reason) -> str:
    reason = (skip_reason(cell) if skip_reason else "")
    if not reason and device == "cuda" and cell.ranks > torch.cuda.device_count():
        reason = f"needs {cell.ranks} GPUs; {torch.cuda.device_count()} visible"
    return reason


def run_cells(cells: list[Cell], options: RunOptions, *, skip_reason=None, executor=None) -> int:
    """Run ``cells``; returns the exit code (0 all pass, 1 any FAIL/ERROR/TIMEOUT)."""
    device = options.device
    cells = [replace(c, device=device) for c in cells]
    torch.set_num_threads(1)  # the reference must use the same kernels as the one-thread ranks
    if executor is not None and executor.rank != 0:  # torchrun peers observe; rank 0 judges and writes
        for cell in sorted(cells, key=lambda c: c.ranks):
            if not _skip_reason(cell, device, skip_reason):
                try:
                    executor.run(cell, options.timeout)
                except CellFailure:
                    pass
        return 0
    os.makedirs(options.out_dir, exist_ok=True)
    writer = RecordWriter(os.path.join(options.out_dir, "cells.csv"))
    records: list[Record] = []
    timings = Counter()
    tty = sys.stderr.isatty() if options.progress is None else options.progress
    progress = _Progress(len(cells), tty)
    pending: dict[str, tuple[Cell, object]] = {}
    wall0 = time.perf_counter()
    pools: dict[int, RankPool] = {}

    def emit(new: list[Record]) -> None:
        writer.write(new)
        records.extend(new)

    try:
        for cell in sorted(cells, key=lambda c: c.ranks):
            t0 = time.perf_counter()
            reason = _skip_reason(cell, device, skip_reason)
            if reason:
                emit([Record(**base_fields(cell), check="run", name="cell", verdict="SKIP", detail=reason)])
                progress.update(cell, "SKIP", 0.0)
                continue
            try:
                if executor is not None:
                    observations = executor.run(cell, options.timeout)
                else:
                    if not pools:  # launch every pool now: later ones warm up while the first works
                        for world in sorted({c.ranks for c in cells if not _skip_reason(c, device, skip_reason)}):
                            pools[world] = RankPool(world, device)
                            pools[world].launch()
                    pool = pools[cell.ranks]
                    spawn0 = pool.spawn_seconds
                    observations = pool.run(cell, options.timeout)
                    timings["spawn"] += pool.spawn_seconds - spawn0
            except CellFailure as exc:
                if executor is None:
                    timings["spawn"] += pools[cell.ranks].spawn_seconds - spawn0
                emit([failure_record(cell, exc.verdict, exc.reason)])
                progress.update(cell, exc.verdict, time.perf_counter() - t0)
                continue
            for key in ("build", "steps", "checkpoint"):
                timings[key] += observations[0].timings.get(key, 0.0)
            j0 = time.perf_counter()
            try:
                judged = judge_cell(cell, observations, fp64=options.fp64, device=_ref_device(device))
            except Exception as exc:  # noqa: BLE001 - a broken judge is that cell's ERROR
                emit([failure_record(cell, "ERROR", f"judging failed: {type(exc).__name__}: {exc}")])
                progress.update(cell, "ERROR", time.perf_counter() - t0)
                continue
            new = judged.records
            if judged.run is not None:
                other = pending.pop(cell.pair_id, None)
                if other is None:
                    pending[cell.pair_id] = (cell, judged)
                else:
                    try:
                        new = new + _cross_records(other, (cell, judged))
                    except Exception as exc:  # noqa: BLE001 - a broken comparison is an ERROR row
                        new = new + [Record(**base_fields(cell), check="cross", name=cell.pair_id, verdict="ERROR",
                                            detail=f"cross-path comparison failed: {type(exc).__name__}: {exc}")]
            timings["reference+compare"] += time.perf_counter() - j0
            emit(new)
            verdict = cell_verdicts([r for r in new if r.cell == cell.id]).get(cell.id, "PASS")
            progress.update(cell, verdict, time.perf_counter() - t0)
    finally:
        for pool in pools.values():
            pool.stop()
        writer.close()
    timings["wall"] = time.perf_counter() - wall0
    timings["other (parent, queues, skips)"] = timings["wall"] - sum(
        timings[k] for k in ("spawn", "build", "steps", "checkpoint", "reference+compare"))
    timings["cells"] = len(cells)
    timings["per_cell"] = timings["wall"] / max(1, len(cells))
    with open(os.path.join(options.out_dir, "summary.md"), "w") as fh:
        fh.write(summary_markdown(records, title=options.title, timings=dict(timings), cells_total=len(cells)))
    with open(os.path.join(options.out_dir, "timings.json"), "w") as fh:
        json.dump(dict(timings), fh, indent=2)
    print(terminal_table(records))
    print(f"wall {timings['wall']:.1f} s for {len(cells)} cells ({timings['per_cell']:.3f} s/cell); "
          f"results in {options.out_dir}")
    bad = any(r.verdict in ("FAIL", "ERROR", "TIMEOUT") for r in records)
    return 1 if bad else 0


def _ref_device(device: str) -> str:
    return "cuda:0" if device == "cuda" else "cpu"


def _cross_records(a, b) -> list[Record]:
    (cell_a, ja), (cell_b, jb) = sorted([a, b], key=lambda x: x[0].path)
    base = base_fields(cell_a)
    base.update(cell=cell_a.pair_id, path="legacy~native",
                path_taken=f"{ja.records[0].path_taken}~{jb.records[0].path_taken}")
    return [c.record(base) for c in cross_path(ja.comparisons, jb.run, cell_a.microbatches)]
