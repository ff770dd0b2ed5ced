"""The first code a spawned rank worker runs: die with the parent, then import the worker.

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


def start(target: str, parent: int, *args) -> None:
    """Run ``target`` (``module:function``) with ``args`` after :func:`die_with_parent`;
    ``parent`` is the pid that spawned this process."""
    die_with_parent()
    if os.getppid() != parent:  # died before the request took effect: nobody will signal us
        os._exit(0)
    module, _, function = target.partition(":")
    getattr(importlib.import_module(module), function)(*args)
