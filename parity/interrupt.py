"""SIGINT / SIGTERM, the same for every command: stop at a safe point, keep what finished.

Two modes, one rule (exit 130 for SIGINT, 143 for SIGTERM, one line on stderr):

- inside ``with Signals() as signals:`` (a run's cells and result files, a benchmark, a fuzz
  campaign) a signal only sets a flag, and the command polls ``signals()`` at safe points --
  between cells, benchmarks and examples, between result files -- so no file is torn,
  everything finished is written, worker pools are stopped and temporary folders removed
  before it exits. A wait on a pool polls it too (:class:`Interrupted` ends the wait). Scopes
  nest: an inner one shares the outermost one's flag, so a fuzz campaign sees a signal its
  current example's run stopped for. The first signal counts; a second one is not needed.
- anywhere else (loading a matrix, a plugin's import, ``plan``), :func:`raising` turns the
  signal into :class:`Interrupted` at once, which :func:`parity.cli.main` reports the same way.

Under torchrun only rank 0, which judges and writes, installs them (so that torchrun's teardown
after a rank's death, or a signal to the whole group, lets it finish its files); its peers keep
the default handlers. Rank 0 stopping alone never leaves a peer waiting: the peers' next exchange
fails once it exits (:mod:`parity.execute.torchrun`).
"""

from __future__ import annotations

import contextlib
import signal
import threading

EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


def exit_code(signum: int) -> int:
    return EXIT_SIGNAL[signum]


def name(signum: int) -> str:
    return signal.Signals(signum).name


class Interrupted(BaseException):
    """A stop was asked for (SIGINT/SIGTERM). A ``BaseException``, like ``KeyboardInterrupt``,
    so that handlers turning a cell's failure into a verdict (``except Exception``) and
    hypothesis (which shrinks failing examples) let it through."""

    def __init__(self, signum: int | None = None):
        super().__init__(name(signum) if signum else "interrupted")
        self.signum = signum


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class Signals:
    """SIGINT/SIGTERM set a flag that the command polls at safe points (see the module)."""

    _installed: Signals | None = None
    """The scope whose handlers are installed; nested scopes return it from ``__enter__``."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled  # off under torchrun: its peers could not follow a stop
        self.received: int | None = None
        self._old: dict = {}

    def __enter__(self) -> Signals:
        if Signals._installed is not None:
            return Signals._installed
        if self.enabled and _main_thread():
            for sig in EXIT_SIGNAL:
                self._old[sig] = signal.signal(sig, self._handle)
            Signals._installed = self
        return self

    def _handle(self, signum, frame) -> None:
        self.received = self.received or signum

    def __exit__(self, *exc) -> None:
        if Signals._installed is self:
            for sig, handler in self._old.items():
                signal.signal(sig, handler)
            Signals._installed = None

    def __call__(self) -> bool:
        return self.received is not None

    def check(self) -> None:
        """Raise :class:`Interrupted` if a signal arrived (for loops that unwind to a handler)."""
        if self.received is not None:
            raise Interrupted(self.received)

    @property
    def name(self) -> str:
        return name(self.received) if self.received else ""

    @property
    def code(self) -> int:
        return exit_code(self.received) if self.received else 0


def _raise(signum, frame):
    raise Interrupted(signum)


@contextlib.contextmanager
def raising(enabled: bool = True):
    """Outside a :class:`Signals` scope, SIGINT/SIGTERM raise :class:`Interrupted` at once."""
    if not enabled or not _main_thread():
        yield
        return
    old = {sig: signal.signal(sig, _raise) for sig in EXIT_SIGNAL}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def at_once():
    """Inside a :class:`Signals` scope, for a wait no poll reaches (rank 0's own part of a cell under
    torchrun, where torchrun's teardown after a peer left must not wait on a hang): a signal sets
    the scope's flag, as ever, and also raises :class:`Interrupted` at once. Code that catches every
    exception (DCP wraps its steps in ``except BaseException``) may take that one: the block then
    raises it again where it ends, and the yielded ``check`` raises it at the block's next call."""
    scope = Signals._installed
    if scope is None or not _main_thread():
        yield lambda: None
        return
    got: list[int] = []

    def handle(signum, frame):
        scope._handle(signum, frame)
        got.append(signum)
        raise Interrupted(signum)

    def check() -> None:
        if got:
            raise Interrupted(got[0])

    old = {sig: signal.signal(sig, handle) for sig in EXIT_SIGNAL}
    try:
        yield check
        check()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
