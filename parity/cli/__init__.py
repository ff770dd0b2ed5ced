"""``python -m parity``: ``plan``, ``run``, ``gate``, ``merge``, ``bench``, ``compare``, ``report``, ``fuzz``, ``fixtures``.

Exit codes (docs/usage.md, "Exit codes"): 0 only with evidence (the work done, nothing wrong found; a
closed stdout does not change it); 1 a bad verdict (a cell FAIL/ERROR/TIMEOUT/INCONCLUSIVE, a
NO-GO or PARTIAL gate, a regression); 2 bad input, refused before any work (one line naming the
thing and the fix; a model source exiting at import, an output directory in use, a ``--resume``
of something that changed); 74 a result file could not be written (disk full:
:class:`~parity.errors.OutputError`); 130/143 interrupted by SIGINT/SIGTERM (:mod:`parity.interrupt`),
whatever the command.

:mod:`.parser` holds the grammar, :mod:`.run` the ``run`` command, :mod:`.gate` ``gate`` and
``merge``, :mod:`.inspect` the commands that run nothing; this module dispatches and turns
errors into exit codes.
"""

from __future__ import annotations

import os
import sys

from parity.bench.run import bench_command
from parity.cli.gate import _scope, cmd_gate, cmd_merge
from parity.cli.inspect import _describe_plan, cmd_compare, cmd_fixtures, cmd_plan, cmd_report, cmd_repro
from parity.cli.parser import AXIS_OPTIONS, KNOB_HELP, KNOB_OPTIONS, RUN_DEFAULTS, RUN_IDENTITY, _parser
from parity.cli.run import _run_settings, _select, cmd_run
from parity.errors import EXIT_OUTPUT, OutputError, UsageError
from parity.fuzz import fuzz_command
from parity.interrupt import Interrupted, exit_code, raising

#: What other modules (the Python API, the tests) import from here.
__all__ = ["AXIS_OPTIONS", "KNOB_HELP", "KNOB_OPTIONS", "RUN_DEFAULTS", "RUN_IDENTITY", "_command", "_describe_plan",
           "_parser", "_run_settings", "_scope", "_select", "main"]


class _PipeSafe:
    """``sys.stdout`` (and ``sys.stderr``) while a command runs: when the reader goes away
    (``parity gate | head -1``), what is left to print goes to ``os.devnull`` and the command
    finishes, so its exit code is still its verdict's (a NO-GO must not become 0 because nobody
    read the table)."""

    def __init__(self, stream):
        self._stream = stream

    def _closed(self) -> None:
        devnull = open(os.devnull, "w")
        try:  # the real stream's buffered rest (flushed at exit) goes nowhere instead of failing
            os.dup2(devnull.fileno(), self._stream.fileno())
        except (OSError, ValueError, AttributeError):  # no file descriptor behind it (a test's stream)
            pass
        self._stream = devnull

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._closed()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._closed()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _one_line(exc: Exception) -> str:
    """An error's message as the one line parity prints (user code's multi-line messages joined)."""
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


#: Commands that start their own rank processes: under torchrun each rank would run the whole
#: command into the same files (and share the GPUs its figures measure).
OWN_RANKS = ("bench", "fuzz")


#: Commands that join a launcher's process group when one started them.
LAUNCHED = ("run", "gate")


def _command(args) -> int:
    from parity.execute.torchrun import check_launch, under_torchrun

    commands = {"plan": cmd_plan, "run": cmd_run, "gate": cmd_gate, "merge": cmd_merge, "bench": bench_command,
                "compare": cmd_compare, "repro": cmd_repro,
                "report": cmd_report, "fuzz": fuzz_command, "fixtures": cmd_fixtures}
    if args.command in OWN_RANKS and under_torchrun():
        raise UsageError(f"{args.command} starts its own rank processes; run it without torchrun")
    if args.command in LAUNCHED:
        check_launch()
    try:
        return commands[args.command](args)
    except SystemExit as exc:  # parity returns its codes; only user code (a model) exits
        if exc.code not in (0, None):
            raise
        raise UsageError(f"{args.command}: user code (a model) called sys.exit({exc.code!r}) while parity was "
                         "working; a model must not exit") from None


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit code (see the module docstring). A :class:`UsageError` is one line on
    stderr and exit code 2; a closed stdout or stderr changes nothing (:class:`_PipeSafe`)."""
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = safe = _PipeSafe(streams[0]), _PipeSafe(streams[1])  # ``2>&1 | head`` too
    from parity.execute.torchrun import under_torchrun

    try:
        with raising(enabled=not under_torchrun()):
            return _command(_parser().parse_args(argv))
    except UsageError as exc:
        print(f"parity: {_one_line(exc)}", file=sys.stderr)
        return 2
    except OutputError as exc:
        print(f"parity: {_one_line(exc)}", file=sys.stderr)
        return EXIT_OUTPUT
    except Interrupted as exc:  # outside a command's own safe points: nothing was being written
        print(f"parity: interrupted by {exc}", file=sys.stderr)
        return exit_code(exc.signum) if exc.signum else 130
    except KeyboardInterrupt:  # raised, not signalled (user code, e.g. a model factory): as a Ctrl-C
        print("parity: interrupted by KeyboardInterrupt", file=sys.stderr)
        return 130
    finally:
        for stream in safe:
            stream.flush()
        sys.stdout, sys.stderr = streams
