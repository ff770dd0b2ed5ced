"""Long-lived rank workers: one process group per rank count, reused cell after cell.

A cell that raises, crashes a rank (e.g. a gloo abort) or stops making progress becomes a
:class:`CellFailure` naming the rank; the pool is then torn down and restarted so the run
goes on. Workers only observe (:func:`parity.execute.worker.run_rank`); the parent judges.

Hangs are found by silence, not by a guess of how long a cell takes: workers send a
heartbeat after building and after every micro-batch, and a cell is a TIMEOUT only when no
rank has reported anything for ``timeout`` seconds.

Starting a rank: on Linux ranks are forked from multiprocessing's fork server, which imported
torch and the worker once for the whole process (a pool starts in well under a second instead
of every rank importing torch for seconds; the server holds no threads or process group);
elsewhere they are spawned.

Workers never outlive or block on their parent: they ignore SIGINT (the parent handles a
Ctrl-C for the whole run; SIGINT stays blocked from before the fork server starts until the
worker ignores it), ask the kernel to kill them when the process that started them dies --
before a spawned rank imports torch (:mod:`parity.execute.spawned`); a forked rank's parent
is the fork server, which exits when this process does --, stop taking cells once it is
gone, and never wait on a result nobody reads (``cancel_join_thread``).
Every file they create lives under the run's temporary folder, which the parent removes.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import tempfile
import time
import traceback
import warnings

import torch

from parity.errors import EXIT_UNGUARDED, UNGUARDED, UsageError
from parity.execute import spawned, starting
from parity.execute.starting import context
from parity.execute.wire import from_bytes, to_bytes
from parity.interrupt import Interrupted
from parity.paths import registry

__all__ = ["CellFailure", "Interrupted", "RankPool", "context"]


class CellFailure(Exception):
    """A cell that did not finish: ``verdict`` ERROR or TIMEOUT and why. ``observed``: every rank's
    observation of the cell's training where each sent it before its checkpoint lifecycle failed
    (:func:`_perform`; judged as such), else None."""

    def __init__(self, verdict: str, reason: str, observed: list | None = None):
        self.verdict, self.reason, self.observed = verdict, reason, observed
        super().__init__(f"{verdict}: {reason}")


#: The most payload bytes a message carries on the results queue itself. A larger payload (an
#: observation, a long traceback) goes through a file and the message names it: every message
#: then fits one pipe write of at most ``PIPE_BUF`` bytes, which the kernel makes atomic, so a
#: rank killed while sending leaves a whole message or none -- never a half-written one the
#: parent would wait on for the rest, beyond any timeout or signal.
INLINE = 1024


def backend(device_type: str) -> str:
    """The process group's backend: on CUDA, NCCL for CUDA tensors and gloo for CPU ones (a
    CPU-offloaded gradient's norm, the object collectives); gloo on CPU."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def _send(results, tmp: str, item: tuple) -> None:
    """Put ``(status, rank, payload)`` on ``results``; a payload over :data:`INLINE` bytes is
    written to a file under ``tmp`` first (renamed into place once whole) and sent as its path."""
    status, rank, payload = item
    if len(payload) > INLINE:
        fd, part = tempfile.mkstemp(prefix=f"result-r{rank}-", suffix=".part", dir=tmp)
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
        path = part.removesuffix(".part")
        os.replace(part, path)
        item = (status, rank, b"", os.path.basename(path))  # the name alone: a deep ``tmp`` stays out
    results.put(item)


def _received(message: tuple, tmp: str) -> tuple[str, int, bytes]:
    """``(status, rank, payload)`` of a message :func:`_send` put, reading (and removing) its file
    under ``tmp``."""
    if len(message) == 3:
        return message
    status, rank, _, name = message
    path = os.path.join(tmp, name)
    with open(path, "rb") as fh:
        payload = fh.read()
    os.remove(path)
    return status, rank, payload


def _next_task(tasks, parent: int):
    """The next cell, or None to stop; also None once the parent is gone (killed runs leave
    no orphans: every rank holds the queue's write end too, so no EOF ever arrives)."""
    while True:
        try:
            return tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return None


def _worker(rank: int, world: int, store: str, device_type: str, tasks, results, tmp: str,
            paths: tuple = ()) -> None:
    registry.receive(paths)  # the parent's registered paths (parity.paths.register)
    parent = os.getppid()  # this run's process, or the fork server that lives as long as it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked by the parent during spawn
    results.cancel_join_thread()  # exiting never waits for the parent to read
    tempfile.tempdir = tmp  # DCP checkpoints and the like go where the parent cleans up
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    def put(item) -> None:
        if os.getppid() == parent:
            _send(results, tmp, item)

    if device_type == "cuda":
        torch.cuda.set_device(rank)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    dist.init_process_group(backend(device_type), init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh(device_type, (world,))
    put(("ready", rank, b""))
    while (task := _next_task(tasks, parent)) is not None:
        try:
            _perform(task, put, rank=rank, world=world, mesh=mesh, device=device)
        except BaseException as exc:  # noqa: BLE001 - every failure becomes a verdict
            tb = traceback.format_exc(limit=-3)
            put(("error", rank, f"{type(exc).__name__}: {exc}\n{tb}".encode()))
    if os.getppid() == parent:
        dist.destroy_process_group()


def _perform(task, put, *, rank: int, **where) -> None:
    """Run ``task`` on this rank and put its result. A cell with a checkpoint lifecycle sends its
    observation in two messages: ``trained`` (everything but the lifecycle's evidence, before the
    lifecycle starts), then ``ok`` (that evidence): a rank the lifecycle kills leaves the cell's
    training evidence behind. Any other task (a benchmark) brings its own job."""
    from parity.execute.worker import run_rank
    from parity.matrix.cell import Cell

    def beat(what: str) -> None:
        put(("alive", rank, what.encode()))

    if not isinstance(task, Cell):
        put(("ok", rank, to_bytes(task.run_on_rank(task, rank=rank, heartbeat=beat, **where))))
        return
    early = []

    def trained(obs) -> None:
        early.append(obs)
        put(("trained", rank, to_bytes(obs)))

    obs = run_rank(task, rank=rank, heartbeat=beat, trained=trained, **where)
    put(("ok", rank, to_bytes(obs.after_training() if early else obs)))


class RankPool:
    """``world`` spawned ranks sharing one process group.

    ``tmp``: the run's temporary folder (the store and every worker temp file live there).
    ``stop_requested``: polled while waiting; when it returns True the wait raises
    :class:`Interrupted`.
    """

    def __init__(self, world: int, device_type: str = "cpu", *, tmp: str | None = None,
                 start_timeout: float = 300.0, stop_requested=lambda: False):
        self.world, self.device_type, self.start_timeout = world, device_type, start_timeout
        # a folder of its own unless given: a rendezvous file left in a shared folder by an earlier
        # pool of the same size would send these ranks to dead peers
        self._own_tmp = not tmp
        self.tmp = tmp or tempfile.mkdtemp(prefix="parity-pool-")
        self.stop_requested = stop_requested
        self.procs: list = []
        self.ready = False
        self.spawn_seconds = 0.0
        self._generation = 0

    def start(self) -> None:
        if not self.procs:
            self.launch()
        t0 = time.perf_counter()
        self._collect("ready", self.start_timeout)
        self.spawn_seconds += time.perf_counter() - t0

    def launch(self) -> None:
        """Start the ranks without waiting for them, so a pool can warm up while another works."""
        t0 = time.perf_counter()
        ctx = context()
        os.makedirs(self.tmp, exist_ok=True)
        self._generation += 1
        store = os.path.join(self.tmp, f"store-r{self.world}-{self._generation}")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(self.world)]
        self.procs = [
            ctx.Process(  # spawned.start: die-with-parent first, then import this module (and torch)
                target=spawned.start,
                args=(f"{__name__}:_worker", 0 if ctx.get_start_method() == "forkserver" else os.getpid(),
                      r, self.world, store, self.device_type, self.tasks[r], self.results, self.tmp,
                      registry.carried()),
                daemon=True,
            )
            for r in range(self.world)
        ]
        starting.ensure_server(ctx)  # usually already running (starting.start_early)
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # children inherit the mask
        try:
            for p in self.procs:
                p.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        self.spawn_seconds += time.perf_counter() - t0
        self.ready = False

    def _collect(self, kind: str, timeout: float, early: dict[int, bytes] | None = None) -> dict[int, bytes]:
        """Wait for every rank's ``kind`` message; ``timeout`` counts seconds of silence. A rank's
        ``trained`` message goes to ``early``; a failure names what each failing rank reported last."""
        got: dict[int, bytes] = {}
        errors: dict[int, str] = {}
        last: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        grace = None
        while len(got) + len(errors) < self.world:
            if self.stop_requested():
                raise Interrupted()
            now = time.monotonic()
            if now > deadline or (grace is not None and now > grace):
                break
            try:
                status, rank, payload = _received(self.results.get(timeout=0.05), self.tmp)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self.procs) if p.exitcode is not None]
                if dead and grace is None:
                    grace = time.monotonic() + 2.0  # let surviving ranks report first
                continue
            deadline = time.monotonic() + timeout  # any message is progress
            if status == "alive":
                last[rank] = payload.decode()
                continue
            if status == "trained":  # the cell's training evidence; its checkpoint lifecycle follows
                if early is not None:
                    early[rank] = payload
                last[rank] = "training observed"
                continue
            if status == "error":
                errors[rank] = payload.decode()
                grace = grace or time.monotonic() + 2.0
            else:
                got[rank] = payload
        if len(got) == self.world:
            return got
        # a rank that died is the cause; its peers' errors (connection resets) are symptoms
        def after(r: int) -> str:
            return f" after it reported {last[r]!r}" if r in last else ""

        if any(p.exitcode == EXIT_UNGUARDED for p in self.procs):  # the user's script, not the cell
            raise UsageError(UNGUARDED)
        causes = [f"rank {r} died with exit code {p.exitcode}{after(r)}"
                  for r, p in enumerate(self.procs) if p.exitcode is not None]
        causes += [f"rank {r} raised {errors[r].strip()}" for r in sorted(errors)]
        if causes:
            raise CellFailure("ERROR", "; ".join(causes))
        missing = [r for r in range(self.world) if r not in got]
        raise CellFailure("TIMEOUT", f"rank(s) {missing} made no progress for {timeout:g} s"
                          + "".join(f"; rank {r} last reported {last[r]!r}" for r in missing if r in last))

    def run(self, cell, timeout: float) -> list:
        """Run one cell (or a task with ``run_on_rank``, e.g. a benchmark) on every rank;
        returns each rank's observation (or measurement), rank order."""
        self.submit(cell)
        return self.collect(timeout)

    def submit(self, cell) -> None:
        """Hand ``cell`` to every rank without waiting for it (start the ranks first if needed);
        :meth:`collect` waits for its results. One cell at a time per pool."""
        try:
            if not self.procs or not self.ready:
                self.start()
                self.ready = True
            for q in self.tasks:
                q.put(cell)
        except CellFailure:
            self.stop(kill=True)
            raise

    def collect(self, timeout: float) -> list:
        """The submitted cell's observation from every rank, rank order; a failure stops the pool
        (the next :meth:`submit` restarts it) and raises :class:`CellFailure`."""
        early: dict[int, bytes] = {}
        try:
            got = self._collect("ok", timeout, early)
        except CellFailure as exc:
            self.stop(kill=True)
            if len(early) == self.world:
                exc.observed = [from_bytes(early[r]) for r in range(self.world)]
            raise
        return [from_bytes(got[r]).onto(from_bytes(early[r])) if r in early else from_bytes(got[r])
                for r in range(self.world)]

    def stop(self, kill: bool = False, grace: float = 5.0) -> None:
        """Ask idle workers to exit, wait up to ``grace`` seconds, kill whatever is left."""
        self.procs = [p for p in self.procs if p.pid is not None]  # a failed launch started only some
        if not self.procs:
            return
        if not kill:
            for q in self.tasks:
                q.put(None)
        deadline = time.monotonic() + (0.0 if kill else grace)
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        for q in (*self.tasks, self.results):
            q.close()
            q.cancel_join_thread()
        self.procs = []
        if self._own_tmp:  # its stores and the ranks' files; a restart makes it again
            shutil.rmtree(self.tmp, ignore_errors=True)
