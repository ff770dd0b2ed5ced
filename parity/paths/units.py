"""FSDP units as data: which modules are handed to ``fully_shard``, with which policy.

Both paths produce a :class:`ShardReport` before anything is sharded; the report is what the
reference emulates and what ``cells.csv`` records.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from parity.dtypes import dtype_name
from parity.plan import PrecisionPlan, canonical_fqn


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
    """Native only: parameters whose ``param_dtype_override_fn`` keeps their own dtype."""

    @property
    def root(self) -> str:
        return "+".join(m or "<root>" for m in self.modules)

    def describe(self) -> str:
        pol = (
            f"param={dtype_name(self.param_dtype)} reduce={dtype_name(self.reduce_dtype)} "
            f"output={dtype_name(self.output_dtype)} cast_inputs={self.cast_forward_inputs}"
        )
        over = f" overrides=[{', '.join(self.overrides)}]" if self.overrides else ""
        return f"{self.root}: {len(self.params)} params, {pol}{over}"


@dataclass(frozen=True, kw_only=True)
class ShardReport:
    """What one call to :func:`parity.paths.shard` did."""

    requested: str
    taken: str
    fallback_reason: str = ""
    units: tuple[UnitSpec, ...] = ()

    def describe(self) -> str:
        head = f"path requested={self.requested} taken={self.taken}"
        if self.fallback_reason:
            head += f" (fallback: {self.fallback_reason})"
        return "\n".join([head, *("  " + u.describe() for u in self.units)])


def module_index(model: nn.Module) -> dict[str, nn.Module]:
    """Canonical FQN -> outermost module with that name (a checkpoint wrapper, if any)."""
    index: dict[str, nn.Module] = {}
    for name, mod in model.named_modules():
        index.setdefault(canonical_fqn(name), mod)
    return index


def _under(fqn: str, prefix: str) -> bool:
    return prefix == "" or fqn == prefix or fqn.startswith(prefix + ".")


def resolve_roots(roots: tuple[str, ...], plan: PrecisionPlan) -> dict[tuple[str, ...], list[str]]:
    """Assign every managed parameter to the innermost declared root that contains it.

    A tie group whose aliases fall under different declared roots merges those roots into
    one grouped unit (``fully_shard([a, b])``); that is only possible when each alias's root
    is the module owning it directly, else a :class:`ValueError` names the tie and the fix.
    Returns ``{root-group: [param FQNs]}`` in the declared order.
    """
    def innermost(fqn: str) -> str:
        owners = [r for r in roots if _under(fqn, r)]
        if not owners:
            raise ValueError(f"parameter {fqn} is under no declared FSDP root {list(roots)}; add its module or the root \"\"")
        return max(owners, key=len)

    groups: dict[str, tuple[str, ...]] = {r: (r,) for r in roots}
    for t in plan.params:
        if t.ownership != "managed" or not t.tie_group:
            continue
        owners = sorted({innermost(a) for a in t.tie_group}, key=roots.index)
        if len(owners) == 1:
            continue
        parents = {a.rpartition(".")[0] for a in t.tie_group}
        if set(owners) != parents:
            raise ValueError(
                f"tied parameters {', '.join(t.tie_group)} fall under different FSDP roots "
                f"{owners}; declare each owning module ({', '.join(sorted(parents))}) as a root "
                "so they can share one unit"
            )
        merged = tuple(sorted({m for o in owners for m in groups[o]}, key=roots.index))
        for m in merged:
            groups[m] = merged
    members: dict[tuple[str, ...], list[str]] = {}
    for r in roots:
        members.setdefault(groups[r], [])
    for t in plan.params:
        if t.ownership == "managed":
            members[groups[innermost(t.fqn)]].append(t.fqn)
    return members
