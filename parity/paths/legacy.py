"""Legacy dtype-split: separate FSDP units per (storage dtype, compute dtype) group.

Within each declared root, parameters are grouped by (storage, compute). One group: the
root is one unit. Two groups: every maximal uniform subtree of the minority group (by
element count) becomes its own unit and the root is wrapped with the majority's policy.
Three or more: every maximal uniform subtree of every group becomes a unit. A parameter of
an isolated group that no uniform subtree contains raises :class:`IsolationError`.

Policies follow the compatibility contract: units computing in ``param_dtype`` cast their
inputs and reduce in ``reduce_dtype``; higher-precision (FP32) units reduce at least in
their compute dtype and do not cast inputs (the module owns its conversion); only the
outermost unit casts outputs to the caller's ``output_dtype``.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from parity.dtypes import finer
from parity.errors import IsolationError
from parity.paths.units import UnitSpec, _under
from parity.plan import PrecisionConfig, PrecisionPlan

Group = tuple[torch.dtype, torch.dtype]


def group_policy(group: Group, config: PrecisionConfig, modules: tuple[str, ...], params, outermost: bool) -> UnitSpec:
    _storage, compute = group
    at_default = compute == config.param_dtype
    return UnitSpec(
        modules=modules,
        params=tuple(params),
        param_dtype=compute,
        reduce_dtype=config.reduce_dtype if at_default else finer(config.reduce_dtype, compute),
        output_dtype=config.output_dtype if outermost else None,
        cast_forward_inputs=at_default,
    )


def _uniform_subtrees(root: str, members: list[str], groups: dict[str, Group], module_names, target: Group):
    """Maximal modules strictly below ``root`` whose member parameters all belong to ``target``."""
    def is_uniform(mod: str) -> bool:
        inside = [p for p in members if _under(p, mod)]
        return bool(inside) and all(groups[p] == target for p in inside)

    found = []
    for mod in module_names:
        if mod == root or not _under(mod, root) or not is_uniform(mod):
            continue
        parent = mod.rpartition(".")[0]
        if parent == root or not _under(parent, root) or not is_uniform(parent):
            found.append(mod)
    return found


def plan_legacy(
    members: dict[tuple[str, ...], list[str]], plan: PrecisionPlan, module_names: list[str]
) -> tuple[UnitSpec, ...]:
    config = plan.config
    units: list[UnitSpec] = []
    unisolatable: list[str] = []
    for roots, params in members.items():
        outermost = roots == ("",)
        groups = {p: (plan[p].storage, plan[p].compute) for p in params}
        by_group: dict[Group, list[str]] = defaultdict(list)
        for p in params:
            by_group[groups[p]].append(p)
        if not by_group:
            units.append(group_policy((config.param_dtype, config.param_dtype), config, roots, [], outermost))
            continue
        ranked = sorted(by_group, key=lambda g: (-sum(plan[p].numel for p in by_group[g]), str(g)))
        majority = ranked[0]
        isolate = ranked[1:] if len(ranked) == 2 else ranked
        remaining = list(params)
        if len(ranked) > 1:
            if len(roots) > 1:
                unisolatable += [p for g in ranked[1:] for p in by_group[g]]
                continue
            for g in isolate:
                for mod in _uniform_subtrees(roots[0], params, groups, module_names, g):
                    inside = [p for p in remaining if _under(p, mod)]
                    units.append(group_policy(g, config, (mod,), inside, outermost=False))
                    remaining = [p for p in remaining if p not in inside]
            unisolatable += [p for p in remaining if groups[p] != majority]
        units.append(group_policy(majority, config, roots, remaining, outermost))
    if unisolatable:
        raise IsolationError(sorted(unisolatable))
    return tuple(units)
