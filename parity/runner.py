"""Run cells: spawn (or join) ranks, judge each cell as it finishes, append records.

Cells are judged and written by *pair group* (the cells of every path sharing one set of axis
values, baseline first), so each non-baseline path is compared with its baseline as soon as
both finished (``path = baseline~path`` rows) and a group's rows are complete before the next
group's are written -- which is what makes ``--resume`` exact. Groups of different rank counts
interleave in that order (:func:`~parity.matrix.order.order_cells`).

Pools are started once per rank count and reused; cells that crash or hang become
ERROR/TIMEOUT records and the pool restarts. Once a cell is observed, skipped or failed, every
idle pool is handed the next cell it runs (within :data:`LOOKAHEAD` cells; at most one ahead
per pool), so the pools train side by side while the parent judges (a traced re-run first
waits for its pool's cell ahead; under torchrun one cell runs at a time). SIGINT/SIGTERM (:mod:`parity.interrupt`) stop
the run cleanly: no new cell starts, workers are told to exit and killed after a grace
period, the temporary folder is removed, a summary marked "interrupted" is written, and the
exit code is 130 (SIGINT) or 143 (SIGTERM). A signal while the result files are written
lets them be completed (none is torn), then leaves ``run.json`` ``interrupted`` (``--resume``
rewrites them without running a cell) and exits the same way.

The output directory is locked for the whole run (one writer, :func:`parity.report.outdir.locked`).
A result file that cannot be written (disk full) stops the run with an
:class:`~parity.errors.OutputError` (exit 74) after marking ``run.json`` ``failed``; what was
recorded is kept and ``--resume`` continues once there is room.
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from parity.errors import IncompleteObservation, OutputError, UsageError, text_file, writing
from parity.execute import knobs
from parity.execute.pool import CellFailure
from parity.execute.pools import Pools
from parity.interrupt import Interrupted, Signals, exit_code
from parity.judge.cell import base_fields, failure_record, judge_cell, still_judged
from parity.judge.compare import cross_path
from parity.judge.divergence import NUMERIC, locate, traced_step
from parity.judge.record import BAD, Record, Unpaired, Verdict
from parity.matrix.cell import Cell
from parity.matrix.order import order_cells, with_crossload
from parity.report import outdir
from parity.report.junit import write_junit
from parity.report.environment import environment
from parity.report.html import write_html
from parity.report.records import RecordWriter, read_records
from parity.report.summary import cell_verdicts, fault_line, nothing_checked, summary_markdown, terminal_table


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    out_dir: str = "results/latest"
    """Where ``cells.csv``, ``summary.md``, ``timings.json`` and ``run.json`` go."""
    device: str = "cpu"
    """``cpu`` (gloo) or ``cuda`` (NCCL); resolve ``auto`` before building options."""
    timeout: float = 60.0
    """Seconds without progress from any rank before a cell is a TIMEOUT."""
    fp64: bool = False
    """Also run an FP64 reference and record every error against it (information)."""
    progress: bool | None = None
    """Progress line on a TTY; None = detect."""
    title: str = "run"
    manifest: dict | None = None
    """What names this run in ``run.json`` (options, cells); None: a minimal one."""
    overwrite: bool = False
    """Replace another run's results in ``out_dir`` instead of refusing."""
    resume: bool = False
    """Continue the run recorded in ``out_dir``: recorded pair groups are not rerun."""
    require_native: bool = False
    """A fallback the fixture does not declare (an unsupported build included) is a FAIL."""
    junit: str = ""
    """Also write JUnit XML here (one test case per cell x check)."""
    op_log: bool = False
    """Traced re-runs also write rank 0's operator log in DebugMode's format (``traces/<cell>.ops.json``)."""


#: How far past the current cell a pool's next cell is looked for (the order interleaves rank
#: counts, :func:`~parity.matrix.order.order_cells`, so it is usually a few cells away).
LOOKAHEAD = 64


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` where torch sees a GPU, else ``cpu``. ``cuda`` on a machine without one is
    bad input (:class:`UsageError`): every cell would fail the same way, as an ERROR that is not the
    model's."""
    available = torch.cuda.is_available()
    if device == "auto":
        return "cuda" if available else "cpu"
    if device == "cuda" and not available:
        build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU-only build"
        raise UsageError(f"--device cuda: torch {torch.__version__} ({build}) sees no GPU on this machine; "
                         "run on a GPU machine or use --device cpu")
    return device


#: Set by a quiet Python API call (:func:`parity.run` ``quiet=True``): no progress lines on stderr
#: (warnings and errors still go there).
QUIET = contextvars.ContextVar("parity_quiet", default=False)


@contextlib.contextmanager
def quietly(on: bool = True) -> Iterator[None]:
    """While open (``on``): no progress line per cell (:data:`QUIET`) and the runs' own tables
    written nowhere -- for a caller that reports instead (the Python API, the bench's harness)."""
    token = QUIET.set(on)
    try:
        with contextlib.redirect_stdout(io.StringIO()) if on else contextlib.nullcontext():
            yield
    finally:
        QUIET.reset(token)


class _Progress:
    def __init__(self, total: int, tty: bool):
        self.total, self.tty, self.done, self.bad, self.t0 = total, tty, 0, 0, time.perf_counter()
        self.on = not QUIET.get()

    def update(self, cell: Cell, verdict: str, seconds: float) -> None:
        self.done += 1
        self.bad += verdict in BAD
        if not self.on:
            return
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / self.done * (self.total - self.done)
        if self.tty:
            sys.stderr.write(f"\r[{self.done}/{self.total}] failures {self.bad}  eta {eta:5.0f}s ")
            if self.done == self.total:
                sys.stderr.write("\n")
        else:
            sys.stderr.write(f"[{self.done}/{self.total}] {verdict:<7} {cell.id} ({seconds:.2f}s)\n")
        sys.stderr.flush()


def _skip_reason(cell: Cell, device: str, skip_reason, spawned: bool = True) -> str:
    """Why ``cell`` is not run here ('' when it is). ``spawned``: parity starts the ranks, one per
    visible GPU; under torchrun the launched world (the executor's own reason) decides, its
    ranks spread over nodes."""
    reason = (skip_reason(cell) if skip_reason else "") or knobs.unsupported(cell)
    if not reason and spawned and device == "cuda" and cell.ranks > torch.cuda.device_count():
        reason = f"needs {cell.ranks} GPUs; {torch.cuda.device_count()} visible"
    return reason


def run_cells(cells: list[Cell], options: RunOptions, *, skip_reason=None, executor=None) -> int:
    """Run ``cells``; returns the exit code (0 all pass, 1 any FAIL/ERROR/TIMEOUT, 130/143
    interrupted)."""
    device = options.device
    cells = with_crossload(order_cells([replace(c, device=device) for c in cells]))
    torch.set_num_threads(1)  # the reference must use the same kernels as the one-thread ranks
    if executor is not None and executor.rank != 0:  # torchrun peers observe; rank 0 judges and writes
        return executor.follow(cells, options.timeout, lambda c: _skip_reason(c, device, skip_reason, spawned=False))
    out = options.out_dir
    manifest = options.manifest or {"title": options.title, "cells": [c.id for c in cells]}
    with outdir.locked(out, "--resume" if options.resume else "--out"), Signals() as signals:
        if options.resume:
            done_groups, held = outdir.resume_point(out)
            claimed = [c.id for c in cells if c.pair_id in done_groups and c.id not in held]
            if claimed:  # progress says done, the rows are not there: that evidence would never be made
                raise UsageError(f"--resume {out}: {outdir.PROGRESS} records {len(claimed)} cells as done that "
                                 f"{outdir.CELLS} holds no records of (e.g. {claimed[0]}); start a new run with "
                                 "--overwrite")
            outdir.write_manifest(out, {**manifest, "status": "running"})
        else:
            outdir.prepare(out, manifest, overwrite=options.overwrite)
            done_groups = set()
        todo = [c for c in cells if c.pair_id not in done_groups]
        if options.resume and todo:
            outdir.drop_decision(out)
        try:
            run = _Run(cells, todo, options, skip_reason, executor)
            run.execute(signals)
            return run.finish(manifest, signals)
        except OutputError as exc:
            exc.fix = f"make room, then continue: python -m parity run --resume {out}"
            outdir.set_status(out, "failed")
            raise


class _Run:
    def __init__(self, cells, todo, options: RunOptions, skip_reason, executor):
        self.cells, self.todo, self.options = cells, todo, options
        self.skip_reason, self.executor = skip_reason, executor
        self.device = options.device
        self.timings = Counter()
        self.pools = Pools(self.device, timeout=options.timeout, timings=self.timings)
        cells_csv = os.path.join(options.out_dir, outdir.CELLS)
        with writing(cells_csv):
            self.writer = RecordWriter(cells_csv, append=os.path.exists(cells_csv))
        self.group_left = Counter(c.pair_id for c in todo)
        self.group_cells: dict[str, list[Cell]] = {}
        for c in todo:
            self.group_cells.setdefault(c.pair_id, []).append(c)
        self.baseline_judged: dict[str, object] = {}
        self.unpaired: dict[tuple[str, str], tuple[Unpaired, str]] = {}
        """(pair group, path) -> (code, words): why that cell has nothing to be compared with or from."""
        self.paired: set[tuple[str, str]] = set()
        self.position = 0
        """Index in ``todo`` of the cell being run."""
        self.skips: dict[str, str] = {}

    @property
    def lost(self) -> str:
        """Why torchrun's group can no longer run a cell ('' while it can, and without torchrun)."""
        return self.executor.lost if self.executor is not None else ""

    def _skip(self, cell: Cell) -> str:
        """Why ``cell`` is not run ('' when it is); asked once per cell."""
        if cell.id not in self.skips:
            launched = getattr(self.executor, "launched", False)
            self.skips[cell.id] = _skip_reason(cell, self.device, self.skip_reason, spawned=not launched)
        return self.skips[cell.id]

    def _launch_pools(self, stop_requested) -> None:
        self.pools.launch((c.ranks for c in self.todo if not self._skip(c)), stop_requested)

    def execute(self, signals) -> None:
        tty = sys.stderr.isatty() if self.options.progress is None else self.options.progress
        progress = _Progress(len(self.todo), tty)
        self.wall0 = time.perf_counter()
        try:
            for i, cell in enumerate(self.todo):
                if signals():
                    break
                t0 = time.perf_counter()
                self.position = i
                try:
                    new = self._run_one(cell, signals)
                except Interrupted:
                    break
                self.group_left[cell.pair_id] -= 1
                if self.group_left[cell.pair_id] == 0:
                    new = new + self._unpaired_rows(cell.pair_id)
                with writing(self.writer.path):
                    self.writer.write(new)
                if self.group_left[cell.pair_id] == 0:
                    outdir.mark_group_done(self.options.out_dir, cell.pair_id)
                    self.baseline_judged.pop(cell.pair_id, None)
                verdict = cell_verdicts([r for r in new if r.cell == cell.id]).get(cell.id, "PASS")
                progress.update(cell, verdict, time.perf_counter() - t0)
                if self.lost:
                    break
        finally:
            if self.executor is not None:  # torchrun peers waiting for the next cell: there is none
                self.executor.release()
            self.pools.close(kill=signals())
            self.writer.close()

    def _run_one(self, cell: Cell, signals) -> list[Record]:
        reason = self._skip(cell)
        if reason:
            self.unpaired[cell.pair_id, cell.path] = (Unpaired.SKIPPED, f"{cell.path} was skipped: {reason}")
            self._submit_ahead(signals)
            return [Record(**base_fields(cell), check="run", name="cell", verdict=Verdict.SKIP, detail=reason)]
        try:
            observations = self._observe(cell, signals)
        except CellFailure as exc:
            if signals() and not self.lost:  # a worker killed by the same signal is not this cell's fault
                raise Interrupted() from None
            reason = exc.reason + _arrived_too(signals)
            if exc.observed is None:
                self.unpaired[cell.pair_id, cell.path] = (Unpaired.DID_NOT_FINISH,
                                                          f"{cell.path} did not finish ({exc.verdict})")
                self._submit_ahead(signals)
                return [failure_record(cell, Verdict(exc.verdict), reason)]
            observations = exc.observed  # the training finished; its checkpoint lifecycle did not
            for obs in observations:
                obs.lifecycle_lost(cell.path, f"{exc.verdict}: {reason}")
        for key in ("build", "steps", "checkpoint"):
            self.timings[key] += observations[0].timings.get(key, 0.0)
        self._submit_ahead(signals)  # the pools work while this cell is judged
        j0 = time.perf_counter()
        try:
            judged = judge_cell(cell, observations, fp64=self.options.fp64, device=_ref_device(self.device),
                                require_native=self.options.require_native)
        except Exception as exc:  # noqa: BLE001 - a broken judge is that cell's ERROR
            self.unpaired[cell.pair_id, cell.path] = (Unpaired.NOT_JUDGED, f"{cell.path} could not be judged")
            why = (f"incomplete observation: {exc}" if isinstance(exc, IncompleteObservation)
                   else f"judging failed: {type(exc).__name__}: {exc}")
            return [failure_record(cell, Verdict.ERROR, why),
                    *still_judged(cell, observations, self.options.require_native)]
        new = judged.records
        if any(r.check in NUMERIC and r.verdict == Verdict.FAIL for r in new):
            new = new + self._divergence(cell, signals, new)
        if judged.run is None:
            self.unpaired[cell.pair_id, cell.path] = (
                (Unpaired.EXPECTED_ISOLATION_ERROR, f"{new[0].path_taken} raised the fixture's expected isolation error")
                if new[0].verdict == Verdict.PASS
                else (Unpaired.DID_NOT_TRAIN, f"{cell.path} did not train ({new[0].check} {new[0].verdict})"))
        else:
            if cell.path == cell.baseline:
                self.baseline_judged[cell.pair_id] = (cell, judged)
            elif cell.pair_id in self.baseline_judged:
                self.paired.add((cell.pair_id, cell.path))
                try:
                    new = new + _cross_records(self.baseline_judged[cell.pair_id], (cell, judged))
                except Exception as exc:  # noqa: BLE001 - a broken comparison is an ERROR row
                    new = new + [Record(**base_fields(cell), check="cross", name=cell.pair_id, verdict=Verdict.ERROR,
                                        detail=f"cross-path comparison failed: {type(exc).__name__}: {exc}")]
        self.timings["reference+compare"] += time.perf_counter() - j0
        return new

    def _divergence(self, cell: Cell, signals, first_rows: list[Record]) -> list[Record]:
        """Re-run a numerically failing cell with per-module traces, up to the step its records
        diverged at first; name where it diverged."""
        first = first_rows[0]
        base = base_fields(cell, first.path_taken, first.fallback_reason)
        if self.executor is not None:  # torchrun peers run each cell once; a re-run would desynchronize them
            return [Record(**base, check="divergence", name="-", verdict=Verdict.SKIP,
                           detail="not located under torchrun (re-run the cell without torchrun)")]
        try:
            rerun = replace(cell, trace=True, trace_step=traced_step(first_rows), op_log=self.options.op_log)
            traced = self._observe(rerun, signals)
            document: dict = {}
            record = locate(rerun, traced, base, device=_ref_device(self.device), document=document)
            if self.options.op_log:
                document["op_log"] = outdir.write_op_log(self.options.out_dir, cell.id, traced[0].op_log)
            outdir.write_trace(self.options.out_dir, cell.id, document)
            return [record]
        except CellFailure as exc:
            if signals():
                raise Interrupted() from None
            reason = exc.reason
        except Exception as exc:  # noqa: BLE001 - a broken locator is that row's ERROR, not the run's
            reason = f"{type(exc).__name__}: {exc}"
        return [Record(**base, check="divergence", name="-", verdict=Verdict.ERROR,
                       detail=f"the traced re-run failed: {reason}"[:500])]

    def _unpaired_rows(self, group: str) -> list[Record]:
        """One UNPAIRED row for every non-baseline cell of a finished group that was not compared."""
        rows = []
        for cell in self.group_cells[group]:
            if cell.path == cell.baseline or (group, cell.path) in self.paired:
                continue
            if any(c.path == cell.baseline for c in self.group_cells[group]):
                code, why = self.unpaired.get((group, cell.baseline)) or self.unpaired.get(
                    (group, cell.path), (Unpaired.NOT_JUDGED, "no comparison was made"))
            else:
                code, why = Unpaired.BASELINE_NOT_RUN, f"the baseline {cell.baseline} was not run for this cell (filtered out)"
            if (group, cell.baseline) in self.unpaired and (group, cell.path) not in self.unpaired:
                why += f"; {cell.path} was judged against the reference alone"
            base = {**base_fields(cell), "cell": group, "path": f"{cell.baseline}~{cell.path}"}
            rows.append(Record(**base, check="pair", name=code, verdict=Verdict.UNPAIRED, detail=why))
        return rows

    def _observe(self, cell: Cell, signals):
        """``cell``'s observations (raises :class:`CellFailure`): from torchrun's executor, or
        collected from its pool, where it may already be running (:meth:`_submit_ahead`)."""
        if self.executor is not None:
            return self.executor.run(cell, self.options.timeout)
        self._launch_pools(signals)
        return self.pools.observe(cell)

    def _submit_ahead(self, signals) -> None:
        """Hand each idle pool its next cell now; :meth:`_observe` collects it in its turn. Not
        after a signal (no new cell starts), nor under torchrun (one cell at a time)."""
        if self.executor is not None or signals():
            return
        cells = self._upcoming()
        if cells:
            self._launch_pools(signals)
            self.pools.hand(cells)

    def _upcoming(self) -> list[Cell]:
        """For every pool without a cell ahead, the first of the next :data:`LOOKAHEAD` cells that
        it runs and that is neither skipped nor already collected."""
        window = self.todo[self.position + 1:self.position + 1 + LOOKAHEAD]
        idle = {c.ranks for c in window} - set(self.pools.ahead)
        found: dict[int, Cell] = {}
        for cell in window:
            if len(found) == len(idle):
                break
            if (cell.ranks in idle and cell.ranks not in found and cell.id not in self.pools.finished
                    and not self._skip(cell)):
                found[cell.ranks] = cell
        return list(found.values())

    def finish(self, manifest: dict, signals: Signals) -> int:
        """Write summary, timings, report (and JUnit), then ``run.json`` last: ``complete`` only
        when no signal arrived, even one during this writing (which is let finish)."""
        out = self.options.out_dir
        stopped = signals.received or self.lost  # before every cell ran
        t = self.timings
        t["wall"] = time.perf_counter() - self.wall0
        # build, steps and checkpoint are rank 0's and overlap the parent's judging of the cell before
        t["other (parent, queues, skips)"] = t["wall"] - sum(
            t[k] for k in ("spawn", "waiting for ranks", "reference+compare"))
        records = read_records(os.path.join(out, outdir.CELLS))
        recorded = {r.cell for r in records}
        t["cells"] = len([c for c in self.todo if c.id in recorded])  # this launch's cells that finished
        t["per_cell"] = t["wall"] / max(1, t["cells"])
        not_run = [c.id for c in self.cells if c.id not in recorded]
        why = signals.name if stopped else ""
        also = _arrived_too(signals)
        if self.lost:
            why = self.executor.lost_how + also
        faults = [f for c in self.cells for f in c.faults]
        path = os.path.join(out, "summary.md")
        with writing(path), text_file(path) as fh:
            fh.write(summary_markdown(records, title=self.options.title, timings=dict(t), cells_total=len(self.cells),
                                      not_run=not_run if stopped else [], interrupted=why, faults=faults,
                                      resumable=self.executor is None, results_dir=out))
        path = os.path.join(out, "timings.json")
        with writing(path), text_file(path) as fh:
            json.dump({**t, "interrupted": why} if why else dict(t), fh, indent=2)
        def final() -> dict:  # read again for run.json: a signal during this writing counts
            return {**manifest, "status": "interrupted" if signals() or self.lost else "complete",
                    "environment": env}

        env = environment(self.device)
        with writing(os.path.join(out, "report.html")):
            write_html(out, records, final())
        if self.options.junit:
            with writing(self.options.junit):
                write_junit(self.options.junit, records, suite=self.options.title, interrupted=why,
                            not_run=not_run if stopped else [])
        outdir.write_manifest(out, final())
        if self.lost:
            cell = self.todo[self.position].id
            verdict = next((r.verdict for r in records if r.cell == cell and r.check == "run"), None)
            fate = f"that cell is {verdict}" if verdict else "that cell did not finish"
            print(f"parity: {self.executor.lost_how} during {cell}{also}; {fate}, the "
                  f"{len([c for c in not_run if c != cell])} cells after it were not run; finished rows kept in {out} "
                  "(torchrun runs do not resume: run the matrix again)", file=sys.stderr)
            return signals.code if self.executor.signalled and signals() else 1
        if stopped:
            again = ("torchrun runs do not resume: run the matrix again" if self.executor is not None
                     else f"continue: python -m parity run --resume {out}")
            print(f"parity: interrupted by {why} after {len(self.cells) - len(not_run)} of {len(self.cells)} cells; "
                  f"finished rows kept in {out} ({again})", file=sys.stderr)
            return exit_code(stopped)
        if signals():
            print(f"parity: interrupted by {signals.name} while writing the results; all {len(self.cells)} cells are "
                  f"recorded in {out} (finish: python -m parity run --resume {out})", file=sys.stderr)
            return signals.code
        print(terminal_table(records))
        if faults:
            print(fault_line(records, faults))
        print(f"wall {t['wall']:.1f} s for {t['cells']} cells ({t['per_cell']:.3f} s/cell); results in {out}")
        return verdict_code(records)


def _arrived_too(signals: Signals) -> str:
    """Beside a lost torchrun rank: the signal that arrived too, if one did ('' otherwise)."""
    return f"; {signals.name} arrived too (torchrun's teardown, or a stop of the whole job)" if signals() else ""


def verdict_code(records: list[Record]) -> int:
    """A finished run's exit code: 0 only when nothing is bad and not every cell was skipped."""
    skipped = nothing_checked(records)
    if skipped:
        print(f"parity: every cell was skipped ({skipped}); nothing was checked", file=sys.stderr)
        return 1
    return 1 if any(r.verdict in BAD for r in records) else 0


def _ref_device(device: str) -> str:
    return "cuda:0" if device == "cuda" else "cpu"


def _cross_records(baseline, other) -> list[Record]:
    (cell_b, jb), (cell_o, jo) = baseline, other
    base = base_fields(cell_b)
    base.update(cell=cell_b.pair_id, path=f"{cell_b.path}~{cell_o.path}",
                path_taken=f"{jb.records[0].path_taken}~{jo.records[0].path_taken}")
    widen = {(c.step, c.check, c.name): c.expected for c in jo.comparisons} if cell_b.compile != "none" else None
    return [c.record(base) for c in cross_path(jb.comparisons, jo.run, cell_b.microbatches, widen)]
