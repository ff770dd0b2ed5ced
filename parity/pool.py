"""Long-lived rank workers: one process group per rank count, reused cell after cell.

A cell that raises, crashes a rank (e.g. a gloo abort) or hangs past its timeout becomes a
:class:`CellFailure` naming the rank; the pool is then torn down and restarted so the run
goes on. Workers only observe (:func:`parity.cell.run_rank`); the parent judges.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
import traceback
import warnings

import torch

from parity.cellspec import Cell


class CellFailure(Exception):
    def __init__(self, verdict: str, reason: str):
        self.verdict, self.reason = verdict, reason
        super().__init__(f"{verdict}: {reason}")


def to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def _next_task(tasks, parent: int):
    """The next cell, or None to stop; also None once the parent is gone (killed runs leave
    no orphans: every rank holds the queue's write end too, so no EOF ever arrives)."""
    while True:
        try:
            return tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return None


def _worker(rank: int, world: int, store: str, device_type: str, tasks, results, parent: int) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from parity.cell import run_rank

    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh(device_type, (world,))
    results.put(("ready", rank, b""))
    while (cell := _next_task(tasks, parent)) is not None:
        try:
            obs = run_rank(cell, rank=rank, world=world, mesh=mesh, device=device)
            results.put(("ok", rank, to_bytes(obs)))
        except BaseException as exc:  # noqa: BLE001 - every failure becomes a verdict
            tb = traceback.format_exc(limit=-3)
            results.put(("error", rank, f"{type(exc).__name__}: {exc}\n{tb}".encode()))
    if os.getppid() == parent:
        dist.destroy_process_group()


class RankPool:
    """``world`` spawned ranks sharing one process group."""

    def __init__(self, world: int, device_type: str = "cpu", start_timeout: float = 120.0):
        self.world, self.device_type, self.start_timeout = world, device_type, start_timeout
        self.procs: list = []
        self.ready = False
        self.spawn_seconds = 0.0

    def start(self) -> None:
        if not self.procs:
            self.launch()
        t0 = time.perf_counter()
        self._collect("ready", self.start_timeout)
        self.spawn_seconds += time.perf_counter() - t0

    def launch(self) -> None:
        """Spawn the ranks without waiting for them, so a pool can warm up while another works."""
        t0 = time.perf_counter()
        ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="parity-pg-")
        store = os.path.join(self._dir, "store")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(self.world)]
        self.procs = [
            ctx.Process(
                target=_worker, args=(r, self.world, store, self.device_type, self.tasks[r], self.results, os.getpid()),
                daemon=True,
            )
            for r in range(self.world)
        ]
        for p in self.procs:
            p.start()
        self.spawn_seconds += time.perf_counter() - t0
        self.ready = False

    def _collect(self, kind: str, timeout: float) -> dict[int, bytes]:
        got: dict[int, bytes] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        grace = None
        while len(got) + len(errors) < self.world:
            now = time.monotonic()
            if now > deadline or (grace is not None and now > grace):
                break
            try:
                status, rank, payload = self.results.get(timeout=0.05)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self.procs) if p.exitcode is not None]
                if dead and grace is None:
                    grace = time.monotonic() + 2.0  # let surviving ranks report first
                continue
            if status == "error":
                errors[rank] = payload.decode()
                grace = grace or time.monotonic() + 2.0
            else:
                got[rank] = payload
        if len(got) == self.world:
            return got
        # a rank that died is the cause; its peers' errors (connection resets) are symptoms
        causes = [f"rank {r} died with exit code {p.exitcode}" for r, p in enumerate(self.procs) if p.exitcode is not None]
        causes += [f"rank {r} raised {errors[r].strip()}" for r in sorted(errors)]
        if causes:
            raise CellFailure("ERROR", "; ".join(causes))
        missing = [r for r in range(self.world) if r not in got]
        raise CellFailure("TIMEOUT", f"rank(s) {missing} gave no result within {timeout:.0f} s")

    def run(self, cell: Cell, timeout: float) -> list:
        """Run one cell on every rank; returns each rank's observation, rank order."""
        try:
            if not self.procs or not self.ready:
                self.start()
                self.ready = True
            for q in self.tasks:
                q.put(cell)
            got = self._collect("ok", timeout)
        except CellFailure:
            self.stop(kill=True)
            raise
        return [from_bytes(got[r]) for r in range(self.world)]

    def stop(self, kill: bool = False) -> None:
        if not self.procs:
            return
        if not kill:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=5)
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        self.procs = []
        shutil.rmtree(self._dir, ignore_errors=True)
