"""Running under ``torchrun``: every process is one rank; rank 0 judges and writes.

``python -m parity run`` detects torchrun's environment and, instead of spawning workers,
joins the process group torchrun set up (NCCL on GPUs, gloo on CPU). Cells whose rank count
differs from the launched world size are reported as SKIP.

``--timeout`` is the process group's timeout here (when parity starts the group): a peer's
in-process hang cannot be interrupted, but a rank that stops answering makes its peers' next
exchange of the cell fail after that many seconds. Rank 0, which judges and writes, also watches
its own part of each cell by silence (no heartbeat for twice as long) and leaves it on a
signal (torchrun's teardown once a peer left), so a hang of its own never costs what finished.
The cell is then TIMEOUT (or the run interrupted), and, the group being in doubt, no further
cell starts (rank 0 writes what finished, as for a rank that dies). Rank 0's word
before each cell travels on a second group with the backend's default timeout: its peers wait
there while it judges.

Before each cell rank 0 names it to its peers (:meth:`TorchrunExecutor.proceed`): they wait
there while it judges the cell before, run the cell it names (a peer whose own skip rules would
skip it says so, and the cell is an ERROR naming that rank), and a run rank 0 ends or stops early
(a signal) ends theirs too, so every rank exits with its code (:func:`agreed`); so does a run rank 0
refuses once the group exists (an ``--out`` in use: :meth:`TorchrunExecutor.refuse`). A rank that dies (a crash, a kill)
takes the group with it: the survivors' next exchange fails. The cell in flight is then an
ERROR on rank 0 naming that loss, no further cell starts, and rank 0 writes what finished, the
summary marked interrupted and the reports before torchrun's teardown ends it; its peers stop
with exit code 1.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from parity.errors import UsageError
from parity.matrix.cell import Cell
from parity.execute.pool import CellFailure, backend
from parity.execute.wire import from_bytes, to_bytes
from parity.interrupt import Interrupted, at_once


#: What torchrun sets in each process it starts (and torch's ``env://`` rendezvous reads): the
#: ranks first (any of them set says a launcher started the process), then the rendezvous.
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
LAUNCH_VARIABLES = (*RANK_VARIABLES, "MASTER_ADDR", "MASTER_PORT")


def under_torchrun() -> bool:
    """Whether torchrun started this process (its variables set). ``run`` and ``gate`` first
    refuse a partial set (:func:`check_launch`), which would otherwise read as no launcher: each
    process would run the whole matrix into the same files."""
    return all(k in os.environ for k in (*RANK_VARIABLES, "MASTER_ADDR"))


def check_launch() -> None:
    """Where any of ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` is set, every one of
    :data:`LAUNCH_VARIABLES` set, the ranks integers with ``0 <= RANK < WORLD_SIZE``: else a
    one-line :class:`UsageError` naming the variable."""
    if not any(k in os.environ for k in RANK_VARIABLES):
        return
    fix = "launch with torchrun (it sets " + ", ".join(LAUNCH_VARIABLES) + "), or unset RANK, WORLD_SIZE and LOCAL_RANK"
    missing = [k for k in LAUNCH_VARIABLES if not os.environ.get(k)]
    if missing:
        raise UsageError(f"torchrun: {', '.join(missing)} not set beside "
                         f"{', '.join(k for k in LAUNCH_VARIABLES if k not in missing)}; {fix}")
    values = {}
    for k in (*RANK_VARIABLES, "MASTER_PORT"):
        try:
            values[k] = int(os.environ[k])
        except ValueError:
            raise UsageError(f"torchrun: {k}={os.environ[k]!r} is not an integer; {fix}") from None
    if not 0 <= values["RANK"] < values["WORLD_SIZE"] or values["LOCAL_RANK"] < 0:
        raise UsageError(f"torchrun: RANK={values['RANK']} LOCAL_RANK={values['LOCAL_RANK']} with "
                         f"WORLD_SIZE={values['WORLD_SIZE']}: want 0 <= RANK < WORLD_SIZE and LOCAL_RANK >= 0; {fix}")


def writes_results() -> bool:
    """Whether this process judges and writes a run's files: always, except a torchrun peer."""
    return not under_torchrun() or os.environ["RANK"] == "0"


_lost = ""
"""Why this process's group can no longer exchange ('' while it can): set by the executor."""
_lost_how = ""
"""The same in a few words, for a summary: a rank left, or a rank did not answer in time."""
_control = None
"""The group rank 0's word travels on (:class:`TorchrunExecutor`; ``None``: the default group)."""


def _lose(when: str, exc: BaseException | None, own: str = "", timeout: float = 0.0,
          hang: str = "the group's exchange timed out") -> str:
    """Record that the group is lost (``when``: during / before a cell) and return why; with
    ``timeout``, because an exchange waited that long for a rank that did not answer."""
    global _lost, _lost_how
    seen = own or f"the exchange failed: {type(exc).__name__}: {exc}"
    _lost_how = f"a rank did not answer within --timeout {timeout:g} s" if timeout else "a rank left the torchrun group"
    head = (f"{_lost_how} {when} (a hang; {hang})"
            if timeout else f"{_lost_how} {when} (torchrun's log names it and its exit code)")
    _lost = f"{head}; {seen.splitlines()[0][:240] if seen else ''}"
    return _lost


#: :attr:`TorchrunExecutor.lost_how` when rank 0 itself was stopped by a signal during its own part
#: of a cell: no rank left as far as it knows (a stop of the job, or torchrun's teardown after one did).
SIGNALLED = "rank 0 was stopped by a signal"


def _lose_to_signal() -> None:
    """Record that rank 0 was stopped during its own part of a cell: its peers wait in an exchange
    it will not join, so the group is lost too, but nothing says a rank left."""
    global _lost, _lost_how
    _lost_how = SIGNALLED
    _lost = (f"{SIGNALLED} during its part of a cell (a stop of the job, or torchrun's teardown after a rank left: "
             "torchrun's log says which)")


#: What a collective's error says when it timed out: gloo's "Timed out waiting ...", NCCL's watchdog's
#: "collective operation timeout ... before timing out". Not any "timeout": a model's own error
#: mentioning one (``timeout_ms must be positive``) is an ERROR, not a hung group.
_TIMED_OUT = ("timed out waiting", "collective operation timeout", "before timing out")


def _timed_out(text: str) -> bool:
    """Whether a collective's error says it timed out (:data:`_TIMED_OUT`)."""
    return any(words in text.lower() for words in _TIMED_OUT)


class _Silent(BaseException):
    """Rank 0's own part of a cell reported nothing for the cell's timeout (a ``BaseException``: no
    handler turning a failure into evidence may take it)."""


@contextlib.contextmanager
def _watched(rank: int, timeout: float):
    """Rank 0 running its own part of a cell: it judges and writes, so it must come back. A signal
    (torchrun tearing the group down after a peer left) raises at once (:func:`at_once`), and twice
    ``timeout`` seconds without a heartbeat raise :class:`_Silent` -- silence, as in a pool, not a
    guess of the cell's length. Twice: a peer's hang ends rank 0's collective with the group's own
    timeout first, and is reported as the peer's. Code that catches every exception (DCP's steps)
    may take either: it is raised again at the next heartbeat and where the block ends. Yields the
    heartbeat that restarts the count. Peers watch nothing: rank 0's leaving ends their wait."""
    if rank != 0 or not timeout or threading.current_thread() is not threading.main_thread():
        yield lambda what: None
        return
    fired: list[int] = []

    def silent(signum, frame):
        fired.append(signum)
        raise _Silent()

    old = signal.signal(signal.SIGALRM, silent)
    try:
        with at_once() as interrupted:
            def heartbeat(what: str) -> None:
                interrupted()
                if fired:
                    raise _Silent()
                signal.setitimer(signal.ITIMER_REAL, 2 * timeout)

            heartbeat("start")
            yield heartbeat
            if fired:
                raise _Silent()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def agreed(code: int) -> int:
    """Under torchrun, rank 0's exit code on every rank (a peer passes anything; it receives rank
    0's): each node's CI job reads its own process's code, and a peer's 0 would read as a pass of
    a run that failed. Elsewhere, or before the process group exists, ``code``. Once the group
    is lost nothing is exchanged: each rank keeps its own code, a peer's being 1."""
    if not (under_torchrun() and dist.is_initialized()):
        return code
    if _lost:
        return code if code >= 0 else 1
    box = [code if dist.get_rank() == 0 else None]
    try:
        dist.broadcast_object_list(box, src=0, group=_control)
    except Exception:  # noqa: BLE001 - a rank left after the last cell: no verdict to share
        return code if code >= 0 else 1
    return box[0]


def _join(backend: str, timeout: float) -> None:
    """Form torchrun's process group. A peer that exits before it joins -- refusing bad input
    only it saw, say -- leaves this rank waiting for ``timeout`` seconds, then torch's store error:
    that is a one-line :class:`UsageError` (exit 2, refused before any work), not a traceback."""
    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    except dist.DistError as exc:  # the store timed out waiting for a peer, or its address did not answer
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise UsageError(f"torchrun: rank {os.environ.get('RANK', '?')}: the process group did not form within "
                         f"{timeout:g} s at {where} ({type(exc).__name__}: {first}); a peer exited before joining "
                         "(its own line says why) or cannot reach that address: fix it and launch again") from None


class TorchrunExecutor:
    launched = True
    """Its ranks are torchrun's world (over nodes, maybe): the world size, not this node's GPU
    count, decides which cells run."""

    def __init__(self, device_type: str, timeout: float):
        global _control
        from torch.distributed.device_mesh import init_device_mesh

        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            self.device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        else:
            self.device = torch.device("cpu")
        self.timeout = 0.0
        """The group's timeout when parity set it (0: a group the caller started keeps its own)."""
        self._released = False
        if not dist.is_initialized():
            _join(backend(device_type), timeout)
            self.timeout = timeout
            _control = dist.new_group(timeout=dist.default_pg_timeout)
        self.mesh = init_device_mesh(device_type, (self.world,))

    @property
    def lost(self) -> str:
        """Why the group can no longer exchange ('' while it can)."""
        return _lost

    @property
    def lost_how(self) -> str:
        """:attr:`lost` in a few words ('' while the group can exchange)."""
        return _lost_how

    @property
    def signalled(self) -> bool:
        """Whether the group was lost because rank 0 itself was stopped by a signal mid-cell."""
        return _lost_how == SIGNALLED

    def skip_reason(self, cell: Cell) -> str:
        return "" if cell.ranks == self.world else f"needs {cell.ranks} ranks; torchrun launched {self.world}"

    def proceed(self, cell_id: str | None = None) -> str | None:
        """Rank 0 tells every peer which cell runs next (``cell_id``; ``None``: none, the run is
        over); a peer returns what it was told, and runs that cell whatever its own plan was. A
        failed exchange is the group's loss (:class:`CellFailure` ERROR)."""
        box = [cell_id if self.rank == 0 else None]
        try:
            dist.broadcast_object_list(box, src=0, group=_control)
        except Exception as exc:  # noqa: BLE001 - a rank died between cells
            raise CellFailure("ERROR", _lose("before this cell started", exc)) from None
        return box[0]

    def release(self) -> None:
        """Rank 0, ending the run (its last cell done, or stopped early): tell the peers no cell
        follows instead of leaving them waiting (nothing to say once the group is lost)."""
        if self.rank == 0 and not _lost and not self._released:
            self._released = True  # once: the peers' next exchange is agreed()'s
            try:
                dist.broadcast_object_list([None], src=0, group=_control)
            except Exception:  # noqa: BLE001 - they are gone (the same signal stopped them): nothing waits
                pass

    def refuse(self, code: int) -> None:
        """Rank 0 refusing the run after the group started (an ``--out`` in use or holding another
        run's results): its peers, waiting for a cell, are told none follows and exit with
        ``code`` as rank 0 does, instead of failing at torchrun's teardown."""
        if self.rank == 0:
            self.release()
            agreed(code)

    def follow(self, cells: list[Cell], timeout: float, own_skip) -> int:
        """A peer's whole run: the cells rank 0 names, in its order (a peer never runs a cell of
        its own choosing); ``own_skip(cell)`` is why this rank would not run one ('' when it
        would). Returns 0 when rank 0 says no cell follows (:func:`agreed` gives the run's code),
        1 once the group is lost: no cell can run without the rank that left, or in a group that
        timed out."""
        by_id = {c.id: c for c in cells}
        while True:
            try:
                told = self.proceed()
                if told is None:
                    return 0
                cell = by_id.get(told)
                self.run(cell, timeout, refuse=own_skip(cell) if cell is not None else "its matrix has no such cell")
            except CellFailure:
                pass
            if self.lost:
                return 1

    def _agree(self, refuse: str) -> str:
        """Every rank says whether it can run the cell rank 0 named (``refuse``: why not, '' if it
        can); returns the first refusal, naming its rank ('' when all can). Nodes may differ (a
        compiler, a library) and a rank running a cell its peers do not would hang them."""
        said = [None] * self.world
        t0 = time.monotonic()
        try:  # on the cell's group: its --timeout holds from here on
            dist.all_gather_object(said, refuse)
        except Exception as exc:  # noqa: BLE001 - a rank died or hangs as the cell starts
            raise self._lost_in(exc, t0, "as this cell started") from None
        return next((f"rank {r} would not run this cell here ({why}); the ranks must agree on every cell "
                     "(the same matrix, torch build and libraries on every node)" for r, why in enumerate(said) if why), "")

    def _lost_in(self, exc: BaseException, t0: float, when: str, own: str = "") -> CellFailure:
        """The cell's failure when an exchange begun at ``t0`` failed: TIMEOUT when it waited out
        the group's timeout (a hang), ERROR otherwise (a rank left)."""
        hung = self.timeout and (time.monotonic() - t0 >= 0.9 * self.timeout or _timed_out(str(exc)))
        return CellFailure("TIMEOUT" if hung else "ERROR", _lose(when, exc, own, self.timeout if hung else 0.0))

    def run(self, cell: Cell | None, timeout: float, refuse: str = ""):
        """``cell`` on this rank; rank 0 returns every rank's observations (a peer ``None``), or
        raises :class:`CellFailure`. Rank 0 names the cell to its peers first; a peer has been
        told, and ``refuse`` says why it cannot run it (then no rank does: an ERROR)."""
        from parity.execute.worker import run_rank

        if self.rank == 0:
            self.proceed(cell.id)
        refused = self._agree(refuse)
        if refused:
            if self.rank == 0:
                raise CellFailure("ERROR", refused)
            return None
        try:
            with _watched(self.rank, timeout) as heartbeat:
                obs = run_rank(cell, rank=self.rank, world=self.world, mesh=self.mesh, device=self.device,
                               heartbeat=heartbeat)
            payload = ("ok", to_bytes(obs))
        except _Silent:
            raise CellFailure("TIMEOUT", _lose("during this cell", None, f"rank 0 made no progress for {2 * timeout:g} s "
                                               "(twice --timeout)", timeout,
                                               hang="rank 0's own part of it reported nothing")) from None
        except Interrupted:  # torchrun's teardown (a peer left) or a signal: the peers cannot follow
            _lose_to_signal()
            raise
        except Exception as exc:  # noqa: BLE001
            payload = ("error", f"rank {self.rank} raised {type(exc).__name__}: {exc}")
        gathered = [None] * self.world if self.rank == 0 else None
        own = payload[1] if payload[0] == "error" else ""
        t0 = time.monotonic()
        try:
            dist.gather_object(payload, gathered, dst=0)
        except Exception as exc:  # noqa: BLE001 - a rank died or hangs: the group cannot exchange again
            raise self._lost_in(exc, t0, "during this cell", own) from None
        # every rank reads the errors it has (rank 0 all of them): after a timed-out collective the
        # group is in doubt, and no further cell starts
        errors = [p[1] for p in gathered if p[0] == "error"] if self.rank == 0 else [own] if own else []
        hung = next((e for e in errors if self.timeout and _timed_out(e)), "")
        if hung:
            _lose("during this cell", None, hung, self.timeout)
        if self.rank != 0:
            return None
        if errors:
            raise CellFailure("TIMEOUT" if hung else "ERROR", errors[0])
        return [from_bytes(p[1]) for p in gathered]
