"""Errors with a one-line message that names the thing and the fix, and how parity writes its files (:func:`writing`, :func:`text_file`)."""

from __future__ import annotations

import contextlib


def plugin_fix(ep) -> str:
    """How to remove the installed package declaring entry point ``ep``: ``pip uninstall NAME``."""
    dist = getattr(ep, "dist", None)
    return "pip uninstall " + (getattr(dist, "name", None) or ep.value.split(":")[0].split(".")[0])


def brief(exc: BaseException) -> str:
    """``Type: message``; for an exception that carries each rank's failure (DCP's
    ``CheckpointException``: a traceback per rank), each rank's own error instead of the tracebacks."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return f"{type(exc).__name__}: " + "; ".join(
            f"rank {r}: {type(pair[0]).__name__}: {pair[0]}" if isinstance(pair, tuple) and pair else f"rank {r}: {pair}"
            for r, pair in sorted(failures.items()))
    return f"{type(exc).__name__}: {exc}"


class UsageError(ValueError):
    """Bad input from the user (unknown fixture, path, dtype, matrix...). The CLI exits 2."""


class OutputError(Exception):
    """A result file could not be written (disk full, quota, permissions changed mid-run).
    The CLI exits :data:`EXIT_OUTPUT` with one line naming the file and what to do."""

    def __init__(self, path: str, exc: OSError, fix: str = "make room or fix its permissions, then rerun"):
        self.path, self.reason, self.fix = path, exc.strerror or str(exc), fix
        super().__init__(path)

    def __str__(self) -> str:
        return f"cannot write {self.path} ({self.reason}); {self.fix}"


EXIT_OUTPUT = 74
"""``EX_IOERR`` (sysexits.h): parity could not write its results."""


@contextlib.contextmanager
def writing(path: str):
    """Writes to ``path`` inside this block raise :class:`OutputError` instead of ``OSError``
    (naming the file the error names, when it names one: ``path`` may be a folder of them)."""
    try:
        yield
    except OSError as exc:
        raise OutputError(str(exc.filename) if exc.filename else path, exc) from None



def text_file(path: str, mode: str = "w", **kw):
    """``path`` opened for writing text as parity writes every file it leaves: UTF-8 whatever the
    locale (pages declare it), a character UTF-8 cannot hold (a lone surrogate in a record built
    through the API) written backslash-escaped rather than stopping the write."""
    return open(path, mode, encoding="utf-8", errors="backslashreplace", **kw)

class IsolationError(ValueError):
    """A dtype-split path cannot give a distinct-dtype parameter its own FSDP unit."""

    def __init__(self, params: list[str], fallback_reason: str = "", *, path: str = "legacy",
                 read_by: dict[str, str] | None = None):
        self.params = params
        self.fallback_reason = fallback_reason
        self.path = path
        """The path whose plan raised (after any fallback)."""
        self.read_by = read_by or {}
        """Parameter -> the module whose forward reads it outside its own unit's forward (empty:
        the parameters share their owning module with another dtype's)."""
        prefix = f"fell back to {path} ({fallback_reason}); " if fallback_reason else ""
        if self.read_by:
            why = ("; ".join(f"{p} is read by {m or '<root>'}'s forward, outside the forward of the unit holding it"
                             for p, m in sorted(self.read_by.items()))
                   + " (FSDP gathers a unit's parameters only inside that forward); read each only in its "
                   "holder's forward() (return what the parent needs)")
        else:
            why = ("each shares its owning module with parameters of another (storage, compute) dtype; move it "
                   "into a submodule of its own whose forward() uses it (a holder module)")
        super().__init__(
            prefix + f"{path} dtype-split cannot isolate " + ", ".join(params) + f": {why}, use the native path, "
            "or declare the outcome: Fixture.expect={'dtype-split': 'isolation-error:" + ",".join(params) + "'}"
        )


class IncompleteObservation(ValueError):
    """The ranks' observations of a trained cell lack what every such cell sends (a rank, a step's
    gradients, a micro-batch's output): nothing can be judged against the reference, and the
    message names what is missing (:func:`parity.judge.coverage.missing_observations`)."""


class RankMismatchError(RuntimeError):
    """Ranks resolved different compute dtypes for the same parameter."""

EXIT_UNGUARDED = 87
"""A rank process that found the user's script calling parity at import (no ``__main__`` guard)
exits with this code, so the run that started it refuses with one line instead of judging a
dead rank (:func:`parity.api._refuse_in_bootstrap`)."""

UNGUARDED = ("your script calls parity when imported, and every rank process imports it again; put the call "
             "under `if __name__ == \"__main__\":`")
