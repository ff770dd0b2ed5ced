"""Deliberate faults, as data: what each breaks, where, and which checks must flag it.

A check that cannot fail is a defect, so every kind of check has a fault here that makes it
fail; ``tests/test_faults.py`` is generated from :data:`FAULTS` (:mod:`parity.faults.registry`;
a fault's shape is :class:`parity.faults.fault.Fault`) and asserts that exactly the
declared checks flag each fault. Most faults break behaviour *beside* parity -- FSDP's
resolution of dtypes, its casts, its gradient finalization, torch's optimizer and norm, DCP's
state-dict mapping -- the way a real bug there would; a few stand in for a buggy sharding
helper or a broken model. Production modules never name a fault: they open a scope
(:meth:`Injector.active`) or pass a hook site (:meth:`Injector.site`), and this module
decides what happens there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from parity.errors import UsageError
from parity.faults.fault import SCOPES, SITES, TRAINING, Fault
from parity.faults.registry import ACTS_ON, FAULTS, STAGE_OF_FAULT

__all__ = ["ACTS_ON", "FAULTS", "SCOPES", "SITES", "STAGE_OF_FAULT", "TRAINING", "Fault", "Injector", "check_faults"]


def check_faults(names) -> tuple[str, ...]:
    for name in names:
        if name not in FAULTS:
            raise UsageError(f"--fault: unknown value {name!r}; valid: {', '.join(FAULTS)}")
    return tuple(names)


class Injector:
    """The faults of one cell on one rank: patches per scope, hooks per site."""

    def __init__(self, names, *, rank: int, world: int):
        self.faults = [FAULTS[n] for n in names]
        self.rank, self.world = rank, world
        self.scope: str | None = None

    @contextlib.contextmanager
    def active(self, scope: str) -> Iterator[None]:
        """Patches of the faults active in ``scope``; hooks fire only inside their scopes."""
        undo = [f.patch() for f in self.faults if f.patch is not None and scope in f.scopes]
        outer, self.scope = self.scope, scope
        try:
            yield
        finally:
            self.scope = outer
            for u in reversed(undo):
                u()

    def site(self, name: str, value=None, **context):
        for f in self.faults:
            if f.site == name and self.scope in f.scopes:
                value = f.hook(value, rank=self.rank, world=self.world, **context)
        return value
