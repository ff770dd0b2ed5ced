"""How rank processes start, importing nothing heavy (no torch): the command line calls
:func:`start_early` before it imports torch itself.

On Linux ranks are forked from multiprocessing's fork server, which imports torch and the
worker once (:data:`PRELOAD`); a pool then starts in well under a second. The server itself
takes as long as a torch import to start. :func:`start_early` starts it at the top of a
command that will run cells, so it imports torch while the command imports its own (two
imports side by side instead of one after the other: about 2.5 s earlier to the first cell
on two cores).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys

#: Modules the fork server imports once, so forked ranks start with them: torch and the worker,
#: torch._dynamo (FSDP's first call imports it: about 1 s of every pool's first cell) and
#: parity's own fixtures (the server skips a module that does not import), and the registry of
#: models built from them (:mod:`parity.execute.warm`).
PRELOAD = ["parity.execute.worker", "torch._dynamo", "parity_fixtures", "parity.execute.warm"]

#: Linux's limit on a Unix socket's path (107 bytes), less the name the fork server adds.
SOCKET_DIR_MAX = 107 - len("/listener-12345678")

#: Commands that start rank pools; ``--list`` (selection only) and ``--from`` (judging earlier
#: results) start none.
_RUNNING = {"run", "gate", "bench", "fuzz"}
_NOT_RUNNING = {"--list", "--from", "-h", "--help"}


def context():
    """The multiprocessing context ranks start in: the fork server on Linux (``PARITY_START=spawn``
    spawns instead, e.g. to rule the server out), spawn elsewhere. The fork server listens on a
    Unix socket in the temporary folder: where that folder's path is too long for a socket
    address (a deep ``TMPDIR``), ranks are spawned."""
    from multiprocessing import util

    if (not sys.platform.startswith("linux") or os.environ.get("PARITY_START") == "spawn"
            or len(util.get_temp_dir()) > SOCKET_DIR_MAX):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def ensure_server(ctx) -> None:
    """Start ``ctx``'s fork server if it is one and is not running, with SIGINT blocked: the
    server and every rank it forks inherit the mask, and a rank ignores SIGINT before it
    unblocks it (the parent handles a Ctrl-C for the whole run). From the main thread SIGINT is
    also ignored while the server starts, a disposition it keeps through its exec: a Ctrl-C
    while it imports torch (:data:`PRELOAD`) is the parent's alone, never a traceback of the
    server's (a Ctrl-C that arrives meanwhile stays pending for the parent, blocked)."""
    if ctx.get_start_method() != "forkserver":
        return
    import threading
    from multiprocessing import forkserver

    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    handler = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    try:
        if handler is not None:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        forkserver.ensure_running()
    finally:
        if handler is not None:
            signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def stop_server() -> None:
    """End the fork server now (the command is done: its pools are stopped). A command that
    ended early -- bad input, exit code 2 -- no longer leaves a server importing torch for
    nothing."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)  # it may still be importing: closing its pipe alone waits for that
        server._stop()  # reaps it, closes the pipe, removes the socket
    except (OSError, AttributeError):
        pass


def start_early(argv: list[str]) -> None:
    """Start the fork server now if ``argv`` (the command line, without the program) runs
    cells outside torchrun; best effort: anything unusual leaves it to the first pool."""
    words = set(argv)
    if not argv or argv[0] not in _RUNNING or words & _NOT_RUNNING or "LOCAL_RANK" in os.environ:
        return  # under torchrun every process is a rank: no pools
    try:
        ensure_server(context())
    except (OSError, ValueError):
        pass
