"""parity: a differential correctness harness for FSDP2 mixed precision.

The pipeline, one subpackage per stage (data flows one way, top to bottom):

- :mod:`parity.model` -- fixtures and plugin models, the precision plan;
- :mod:`parity.matrix` -- cells and matrices: what to run;
- :mod:`parity.paths` -- sharding paths (legacy, native, plugins) behind one call;
- :mod:`parity.execute` -- rank workers train and observe;
- :mod:`parity.judge` -- the independent reference, comparisons, contracts, verdicts;
- :mod:`parity.report` -- ``cells.csv``, summaries, output directories;

:mod:`parity.runner` drives a run through them; :mod:`parity.cli` is the command line and
:mod:`parity.api` (``parity.run``, ``parity.gate``, ``parity.select``) the same for Python;
:mod:`parity.faults` holds the deliberate faults that prove each check can fail.
"""

__version__ = "0.2.0"

from parity.api import Result, gate, run, select  # noqa: E402 - light: nothing heavy is imported until called

__all__ = ["Result", "gate", "main", "run", "select"]


def main(argv: list[str] | None = None) -> int:
    """The ``parity`` command. It imports the CLI (and torch) only when called: multiprocessing
    re-runs the command's script in every spawned rank worker before the worker's entry point,
    and that must not import torch before the worker asked to die with its parent
    (:mod:`parity.execute.spawned`)."""
    import signal
    import sys

    from parity.execute.starting import start_early, stop_server
    from parity.interrupt import Interrupted, exit_code, name, raising

    try:
        try:  # SIGINT / SIGTERM while starting (torch imports for seconds): one line, as after
            with raising():
                start_early(sys.argv[1:] if argv is None else argv)  # the rank fork server imports torch beside us
                from parity.cli import main as cli_main  # seconds: torch
        except (KeyboardInterrupt, Interrupted) as exc:
            signum = getattr(exc, "signum", None) or signal.SIGINT
            print(f"parity: interrupted by {name(signum)} while starting; nothing was run", file=sys.stderr)
            return exit_code(signum)
        return cli_main(argv)
    finally:
        stop_server()
