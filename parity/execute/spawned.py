"""The first code a rank worker runs: die with the parent, then import the worker.

(Ranks forked from the fork server, :func:`parity.execute.pool.context`, have torch already:
the server imported it; for them only the first step applies.)

Importing torch takes seconds; a parent killed meanwhile must not leave workers behind. So
the process target is :func:`start`, in this module, which imports nothing heavy: it asks
the kernel to SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``; a
no-op elsewhere, where the workers' parent-liveness check between cells remains), exits at
once if the parent is already gone, and only then imports the real target (and with it
torch). Before the target, multiprocessing's spawn re-runs the parent's main script in the
child (not a ``-m`` package's ``__main__``): the ``parity`` command's script imports only
:func:`parity.main`, which is light, so nothing imports torch before :func:`start`.
"""

from __future__ import annotations

import importlib
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (best effort elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _release_fork_server() -> None:
    """A rank forked by multiprocessing's fork server holds the server's "alive" pipe, which
    keeps the server running until every client and every child of theirs is gone. A rank
    lets go of it, so the server exits when the run's process does, and the kernel then kills
    the rank (:func:`die_with_parent`): no rank outlives a killed run."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None


def start(target: str, parent: int, *args) -> None:
    """Run ``target`` (``module:function``) with ``args`` after :func:`die_with_parent`;
    ``parent`` is the pid that spawned this process, or 0 for the process that forked it (a
    fork server), read before the request."""
    forked = not parent
    parent = parent or os.getppid()
    die_with_parent()
    if forked:
        _release_fork_server()
    if os.getppid() != parent:  # died before the request took effect: nobody will signal us
        os._exit(0)
    module, _, function = target.partition(":")
    getattr(importlib.import_module(module), function)(*args)
