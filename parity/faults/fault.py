"""What a deliberate fault is: what it breaks, where it is installed, which checks must flag it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

#: Scopes a worker opens: building and training the cell, the checkpoint lifecycle (which
#: trains fresh models and must see the same environment), the marker contract.
SCOPES = ("main", "lifecycle", "markers")
#: Where a broken environment (FSDP, torch, DCP, a helper) shows: everywhere the cell trains.
TRAINING = ("main", "lifecycle")
#: Hook sites a worker passes: before anything ("start"), the resolved plan ("plan", returns
#: a plan), the sharded model ("sharded"), the trained model ("trained").
SITES = ("start", "plan", "sharded", "trained")


@dataclass(frozen=True, kw_only=True)
class Fault:
    name: str
    where: str
    """What is broken and where, in one line."""
    flags: frozenset[str]
    """Checks whose records must turn FAIL (``run``: the cell turns ERROR/TIMEOUT)."""
    cell: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
    """Axis values of the cell the generated test runs (fixture, path, ranks, ...)."""
    patch: Callable[[], Callable[[], None]] | None = None
    """Installs the fault while one of ``scopes`` is open; returns the function that undoes it."""
    scopes: tuple[str, ...] = TRAINING
    site: str = ""
    hook: Callable | None = None
    """Called at ``site`` with (value, rank, world, **context); returns the value."""
    quiet: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
    """Axis values under which the fault must flag nothing: a fault only one configuration
    reveals names the configuration's off value here (e.g. ``init: seeded``)."""
    stage: str = ""
    """Where it acts, in :data:`parity.judge.stages.STAGES` (``run``: it stops the cell); the
    generated test holds the cell's ``stage`` record to it (:data:`parity.faults.registry.STAGE_OF_FAULT`)."""
    acts_on: tuple[str, ...] = ()
    """The tensors it acts on, as ``fnmatch`` patterns of FQNs, where it acts on some and not
    all (:data:`parity.faults.registry.ACTS_ON`); the generated test holds the tensor the ``stage`` record names to them."""
