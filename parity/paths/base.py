"""What a sharding path is, and FSDP units as data.

A path turns (model, unit roots, precision plan) into a :class:`ShardReport` -- which
modules are handed to ``fully_shard`` with which policy -- before anything is sharded; the
report is what the reference emulates, what contracts are derived from and what
``cells.csv`` records. Paths are plugins (:mod:`parity.paths.registry`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from parity.model.dtypes import dtype_name
from parity.model.plan import PrecisionPlan

#: Units per (storage, compute) group, FP32 units owning their input conversion.
DTYPE_SPLIT = "dtype-split"
#: One unit per root, per-parameter compute dtypes through ``param_dtype_override_fn``.
PER_PARAMETER = "per-parameter"
CONTRACTS = (DTYPE_SPLIT, PER_PARAMETER)


class Ineligible(Exception):
    """A path cannot represent this plan; ``reasons`` say why (its fallback runs instead)."""

    def __init__(self, reasons: list[str]):
        self.reasons = reasons
        super().__init__("; ".join(reasons))


@dataclass(frozen=True, kw_only=True)
class UnitSpec:
    """One FSDP unit: ``fully_shard(modules, mp_policy=...)``."""

    modules: tuple[str, ...]
    """Canonical FQNs of the module(s) handed to ``fully_shard`` (several for a tied group)."""
    params: tuple[str, ...]
    """Canonical FQNs of the parameters this unit manages."""
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    output_dtype: torch.dtype | None
    cast_forward_inputs: bool
    overrides: tuple[str, ...] = ()
    """Per-parameter paths: parameters whose ``param_dtype_override_fn`` keeps their own dtype."""

    @property
    def root(self) -> str:
        return "+".join(m or "<root>" for m in self.modules)

    @property
    def state_name(self) -> str:
        """The unit as the reads of its FSDP state name it (:mod:`parity.execute.evaluation`): its
        first module, whose state a grouped unit shares."""
        return self.modules[0] or "<root>"

    def describe(self) -> str:
        pol = (
            f"param={dtype_name(self.param_dtype)} reduce={dtype_name(self.reduce_dtype)} "
            f"output={dtype_name(self.output_dtype)} cast_inputs={self.cast_forward_inputs}"
        )
        over = f" overrides=[{', '.join(self.overrides)}]" if self.overrides else ""
        return f"{self.root}: {len(self.params)} params, {pol}{over}"


@dataclass(frozen=True, kw_only=True)
class ShardReport:
    """What one call to :func:`parity.paths.shard` did (or will do)."""

    requested: str
    """The path asked for."""
    taken: str
    """The path whose units these are (the requested one, or its fallback)."""
    contract: str = DTYPE_SPLIT
    """The taken path's declared contract: what ``unit.policy`` checks against."""
    fallback_reason: str = ""
    units: tuple[UnitSpec, ...] = ()

    def describe(self) -> str:
        head = f"path requested={self.requested} taken={self.taken}"
        if self.fallback_reason:
            head += f" (fallback: {self.fallback_reason})"
        return "\n".join([head, *("  " + u.describe() for u in self.units)])




@runtime_checkable
class ShardingPath(Protocol):
    """A way to shard a model with mixed precision. Register an instance in the
    ``parity.paths`` entry-point group (or with :func:`parity.paths.registry.register`)."""

    name: str
    """Registry name (``--paths``, the ``path`` column)."""
    contract: str
    """``dtype-split`` or ``per-parameter``: which policy contract its units promise."""
    fallback: str | None
    """Path that runs instead when this one is unavailable or ineligible (None: none)."""

    def unavailable(self) -> str | None:
        """Why this path cannot run in this build at all, or None."""

    def plan(self, model: nn.Module, roots: tuple[str, ...], precision_plan: PrecisionPlan,
             ignored: set[nn.Parameter]) -> ShardReport:
        """Decide units without touching a process group. May raise
        :class:`~parity.errors.IsolationError` or :class:`Ineligible`."""

    def apply(self, model: nn.Module, report: ShardReport, mesh, reshard_after_forward: bool,
              ignored: set[nn.Parameter]) -> None:
        """Call ``fully_shard`` for the report's units, innermost first."""
