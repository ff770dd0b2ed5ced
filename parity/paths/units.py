"""Helpers every sharding path shares: module lookup, unit roots, policies, ``fully_shard``.

A plugin path usually only decides its :class:`~parity.paths.base.UnitSpec` list and hands
it to :func:`apply_units`, so every path builds ``MixedPrecisionPolicy`` the same way.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from parity.model.plan import PrecisionPlan, canonical_fqn
from parity.paths.base import ShardReport, UnitSpec

OVERRIDE_FIELD = "param_dtype_override_fn"


def module_index(model: nn.Module) -> dict[str, nn.Module]:
    """Canonical FQN -> outermost module with that name (a checkpoint wrapper, if any)."""
    index: dict[str, nn.Module] = {}
    for name, mod in model.named_modules():
        index.setdefault(canonical_fqn(name), mod)
    return index


def under(fqn: str, prefix: str) -> bool:
    return prefix == "" or fqn == prefix or fqn.startswith(prefix + ".")


def resolve_roots(roots: tuple[str, ...], plan: PrecisionPlan) -> dict[tuple[str, ...], list[str]]:
    """Assign every managed parameter to the innermost declared root that contains it.

    A tie group whose aliases fall under different declared roots merges those roots into
    one grouped unit (``fully_shard([a, b])``); that is only possible when each alias's root
    is the module owning it directly, else a :class:`ValueError` names the tie and the fix.
    Returns ``{root-group: [param FQNs]}`` in the declared order.
    """
    def innermost(fqn: str) -> str:
        owners = [r for r in roots if under(fqn, r)]
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


def is_forwardless_container(module: nn.Module) -> bool:
    """A ``ModuleList``/``ModuleDict`` without ``forward``: ``fully_shard`` refuses it."""
    return isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward


def native_api_available() -> bool:
    """Whether this torch build has ``MixedPrecisionPolicy.param_dtype_override_fn`` (2.15+)."""
    import torch.distributed.fsdp as fsdp

    return OVERRIDE_FIELD in {f.name for f in dataclasses.fields(fsdp.MixedPrecisionPolicy)}


def unit_policy(unit: UnitSpec, params: dict[str, nn.Parameter]):
    """The ``MixedPrecisionPolicy`` a unit spec describes (overrides keep their own dtype)."""
    import torch.distributed.fsdp as fsdp

    kwargs = dict(
        param_dtype=unit.param_dtype, reduce_dtype=unit.reduce_dtype,
        output_dtype=unit.output_dtype, cast_forward_inputs=unit.cast_forward_inputs,
    )
    if unit.overrides:
        keep = {id(params[p]) for p in unit.overrides}
        kwargs[OVERRIDE_FIELD] = lambda p: p.dtype if id(p) in keep else None
    return fsdp.MixedPrecisionPolicy(**kwargs)


def apply_units(
    model: nn.Module, report: ShardReport, mesh, reshard_after_forward: bool, ignored: set[nn.Parameter],
    shard_placement_fn=None, offload_policy=None,
) -> None:
    """``fully_shard`` every unit of ``report`` in order (a tied group as one grouped call);
    ``shard_placement_fn`` and ``offload_policy`` as ``fully_shard`` takes them (None: FSDP's
    defaults, dimension 0 and no offloading)."""
    import torch.distributed.fsdp as fsdp

    modules = module_index(model)
    params: dict[str, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        params.setdefault(canonical_fqn(name), p)
    for unit in report.units:
        targets = [modules[m] for m in unit.modules]
        fsdp.fully_shard(
            targets if len(targets) > 1 else targets[0],
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=unit_policy(unit, params),
            ignored_params=set(ignored) if ignored else None,
            **({"shard_placement_fn": shard_placement_fn} if shard_placement_fn is not None else {}),
            **({"offload_policy": offload_policy} if offload_policy is not None else {}),
        )
