"""The parent's rank pools during a run: one :class:`~parity.execute.pool.RankPool` per rank
count, each working on at most one cell ahead of the run's turn.

A run judges cells in its own order (:mod:`parity.runner`), but while it judges one, every
idle pool may be handed the next cell it runs (:meth:`Pools.hand`); :meth:`Pools.observe`
then collects that cell's observations in its turn -- or, when a pool is asked for another
cell first (a traced re-run), finishes the cell ahead and keeps its result until its turn.
A cell that fails ahead keeps its :class:`~parity.execute.pool.CellFailure` the same way.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections import Counter

from parity.execute.pool import CellFailure, RankPool
from parity.matrix.cell import Cell


class Pools:
    """``timings`` (the run's): ``spawn`` and ``waiting for ranks`` seconds are added to it.
    The pools' stores and every file their workers write (checkpoints) live in one temporary
    folder, made at :meth:`launch` and removed by :meth:`close`."""

    def __init__(self, device: str, *, timeout: float, timings: Counter):
        self.device, self.timeout, self.timings = device, timeout, timings
        self.tmp = ""
        self.pools: dict[int, RankPool] = {}
        self.ahead: dict[int, Cell] = {}
        """rank count -> the cell submitted to that pool ahead of its turn."""
        self.finished: dict[str, object] = {}
        """cell id -> observations (or the CellFailure) of a cell ahead collected early."""

    def launch(self, worlds, stop_requested) -> None:
        """Start a pool for every rank count of ``worlds`` now, so later ones warm up while the
        first works (once per run). ``stop_requested``: polled while a pool waits."""
        if self.pools:
            return
        self.tmp = self.tmp or tempfile.mkdtemp(prefix="parity-run-")
        for world in sorted(set(worlds)):
            self.pools[world] = RankPool(world, self.device, tmp=self.tmp, stop_requested=stop_requested)
            self.pools[world].launch()

    def observe(self, cell: Cell) -> list:
        """``cell``'s observations, rank order (raises :class:`CellFailure`): collected from its pool,
        where it may already be running."""
        if cell.id in self.finished and not cell.trace:
            return _result(self.finished.pop(cell.id))
        pool = self.pools[cell.ranks]
        ahead = self.ahead.pop(cell.ranks, None)
        if ahead is not None and ahead is not cell:  # the pool works on a cell ahead: finish that first
            self.finished[ahead.id] = self._collect(pool)
            ahead = None
        if ahead is None:
            self._timed(pool, pool.submit, cell)
        return _result(self._collect(pool))

    def hand(self, cells: list[Cell]) -> None:
        """Submit each of ``cells`` (at most one per rank count, each for an idle pool) ahead of
        its turn."""
        for cell in cells:
            pool = self.pools[cell.ranks]
            try:
                self._timed(pool, pool.submit, cell)
            except CellFailure as exc:
                self.finished[cell.id] = exc
                continue
            self.ahead[cell.ranks] = cell

    def close(self, kill: bool) -> None:
        """Stop every pool (``kill``: at once) and remove the temporary folder."""
        for pool in self.pools.values():
            pool.stop(kill=kill, grace=3.0)
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _collect(self, pool: RankPool):
        """The submitted cell's observations, or the :class:`CellFailure` it ended with."""
        t0 = time.perf_counter()
        try:
            return self._timed(pool, pool.collect, self.timeout)
        except CellFailure as exc:
            return exc
        finally:
            self.timings["waiting for ranks"] += time.perf_counter() - t0

    def _timed(self, pool: RankPool, call, *args):
        spawn0 = pool.spawn_seconds
        try:
            return call(*args)
        finally:
            self.timings["spawn"] += pool.spawn_seconds - spawn0


def _result(got):
    if isinstance(got, CellFailure):
        raise got
    return got
