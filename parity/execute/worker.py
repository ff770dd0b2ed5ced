"""Run one cell on one rank of a real process group and return what happened.

The worker only observes; the parent process judges (reference, comparisons). What a rank
returns is an :class:`~parity.execute.observation.Observation` of plain CPU tensors:
outputs, input gradients, local gradient and parameter shards per step, the global
gradient norm, the shard report and the contract observations.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from parity.errors import IsolationError
from parity.execute import collectives, lifecycle, moves, oplog, parallel, probes, recompute
from parity.execute.observation import Observation
from parity.execute.training import Heartbeat, build, train_step
from parity.faults import Injector
from parity.matrix.cell import Cell
from parity.model import trace
from parity.model.registry import get_fixture
from parity.paths import ShardReport, get_path


def _expected_isolation(cell: Cell, exc: IsolationError, obs: Observation) -> bool:
    """Record an isolation error the fixture declares for the path that raised it."""
    raised = get_path(exc.path)
    if get_fixture(cell.fixture, cell.source).expects(exc.path, raised.contract)[0] != "isolation-error":
        return False
    obs.expected_error, obs.expected_params = str(exc), tuple(exc.params)
    obs.report = ShardReport(requested=cell.path, taken=exc.path, contract=raised.contract,
                             fallback_reason=exc.fallback_reason)
    return True


def _watch_recomputes(cell: Cell, s, recorder, obs: Observation):
    """Count the watched modules' forwards per segment (:mod:`parity.execute.recompute`); compiled
    blocks are not watched (their hooks would be traced into the graphs)."""
    if s.compiled is not None:
        return lambda: None
    fixture = get_fixture(cell.fixture, cell.source)
    names = recompute.watched(cell.checkpointing, fixture.blocks, tuple(m for u in s.report.units for m in u.modules))
    obs.contracts.watched = names
    obs.contracts.module_runs, close = recompute.watch(s.model, names, recorder.segments,
                                                       matmuls=cell.checkpointing == "selective")
    return close


def _steps(cell: Cell) -> int:
    """A traced re-run (:mod:`parity.judge.divergence`) reads every rank's micro-batches of
    ``cell.trace_step`` only: it trains up to that step and skips the checkpoint lifecycle; a cell
    trains all its steps."""
    return cell.trace_step + 1 if cell.trace else cell.steps


def run_rank(cell: Cell, *, rank: int, world: int, mesh, device: torch.device,
             heartbeat: Heartbeat | None = None, trained: Callable[[Observation], None] | None = None) -> Observation:
    """Build, shard and train the cell, observe the trained model and the marker contract; then
    the checkpoint lifecycle. ``trained`` is handed the observation before the lifecycle starts
    (which only adds :meth:`Observation.after_training` to it), where the cell has one."""
    inject = Injector(cell.faults, rank=rank, world=world)
    beat = heartbeat or (lambda what: None)
    obs = Observation(rank=rank, whole=cell.whole_tensors)
    if not _train(cell, obs, inject, rank=rank, world=world, mesh=mesh, device=device, beat=beat):
        return obs
    if cell.lifecycle and not cell.trace:
        if trained is not None:
            trained(obs)
        t2 = time.perf_counter()
        with inject.active("lifecycle"):
            obs.contracts.resume = lifecycle.resume(cell, rank=rank, world=world, mesh=mesh, device=device,
                                                    inject=inject, heartbeat=beat)
            if cell.move != "none":
                obs.contracts.moved = moves.moved(cell, rank=rank, world=world, mesh=mesh, device=device,
                                                  inject=inject, heartbeat=beat)
        obs.timings["checkpoint"] = time.perf_counter() - t2
    return obs


def _train(cell: Cell, obs: Observation, inject: Injector, *, rank: int, world: int, mesh, device: torch.device,
           beat: Heartbeat) -> bool:
    """Everything the rank observes of the cell but its checkpoint lifecycle, into ``obs``; False
    when sharding raised the isolation error the fixture declares (recorded: nothing more runs)."""
    t0 = time.perf_counter()
    with inject.active("main"):
        inject.site("start")
        try:
            s = build(cell, cell.path, mesh=mesh, device=device, inject=inject, obs=obs)
        except IsolationError as exc:
            if _expected_isolation(cell, exc, obs):
                return False
            raise
        beat("built")
        recorder = probes.Recorder(s.model, s.report)
        recorder.segments.functional = collectives.functional_scope(cell)
        if s.compiled is not None:  # graphs compiled and run, per segment of the loop
            s.compiled.where = lambda: recorder.segments.current
        tp, unwatch = None, (lambda: None)
        t1 = time.perf_counter()
        try:  # from here on the recorder's patches are undone whatever happens: the worker lives on
            unwatch = _watch_recomputes(cell, s, recorder, obs)
            if any(o.startswith("tp-") for o in s.owners.values()):
                tp = parallel.TPReductions(s.model, s.owners)
            if cell.trace:  # every rank, every micro-batch of the traced step
                for mb in range(cell.microbatches):
                    obs.traces[mb] = trace.Trace()
                    trace.install(s.model, obs.traces[mb], when=lambda mb=mb: recorder.at == (cell.trace_step, mb))
            obs.timings["build"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            logging = cell.trace and cell.op_log and rank == 0
            with recorder.segments.counted():
                for step in range(_steps(cell)):
                    with oplog.recording(obs.op_log) if logging and step == cell.trace_step else contextlib.nullcontext():
                        train_step(cell, s, step, rank=rank, world=world, device=device, obs=obs, recorder=recorder,
                                   heartbeat=beat, tp=tp)
                    if cell.lifecycle and step == cell.resume_step:  # what a resumed run must reproduce
                        obs.contracts.resume_step = step
                        obs.contracts.optim = lifecycle.optimizer_state(cell, s.model, s.opt)
            obs.contracts.collectives = recorder.segments.calls
            if s.compiled is not None:
                obs.contracts.compiles, obs.contracts.graph_runs = list(s.compiled.compiled), dict(s.compiled.calls)
                obs.contracts.block_runs = dict(s.compiled.block_calls)
        finally:
            recorder.close()  # unpatch the collectives even when the cell fails; the worker lives on
            unwatch()
            if tp is not None:
                obs.contracts.tp_reduce, obs.contracts.tp_partials = tp.close(), tp.partials
        obs.timings["steps"] = time.perf_counter() - t1
        inject.site("trained", model=s.model)
        recorder.finish(s.model, obs.contracts)
    beat("contracts")
    with inject.active("markers"):
        obs.contracts.markers = lifecycle.marker_contract(cell, device)
    return True
