"""Legacy dtype-split: separate FSDP units per (storage dtype, compute dtype) group.

Within each declared root, parameters are grouped by (storage, compute, weight format). One group: the
root is one unit. Two groups: every maximal uniform subtree of the minority group (by
element count) becomes its own unit and the root is wrapped with the majority's policy.
Three or more: every maximal uniform subtree of every group becomes a unit. A parameter of
an isolated group that no uniform subtree contains raises :class:`IsolationError`. A
uniform subtree that is a ``ModuleList``/``ModuleDict`` without ``forward`` (which
``fully_shard`` refuses) is replaced by its children.

Policies follow the compatibility contract: units computing in ``param_dtype`` cast their
inputs and reduce in ``reduce_dtype``; higher-precision (FP32) units reduce at least in
their compute dtype and do not cast inputs (the module owns its conversion); only the
outermost unit casts outputs to the caller's ``output_dtype``.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from parity.errors import IsolationError
from parity.model.dtypes import finer
from parity.model.plan import PrecisionConfig, PrecisionPlan
from parity.paths.base import DTYPE_SPLIT, ShardReport, UnitSpec
from parity.paths.units import apply_units, is_forwardless_container, module_index, resolve_roots, under

#: (storage dtype, compute dtype, weight format): one recipe per group.
Group = tuple[torch.dtype, torch.dtype, str]


def group_policy(group: Group, config: PrecisionConfig, modules: tuple[str, ...], params, outermost: bool) -> UnitSpec:
    """The unit spec for a (storage, compute, format) group under the dtype-split contract
    (external helpers may pass (storage, compute): the format does not change the policy)."""
    compute = group[1]
    at_default = compute == config.param_dtype
    return UnitSpec(
        modules=modules,
        params=tuple(params),
        param_dtype=compute,
        # a group that computes in no floating dtype (an integer parameter) has no gradient to reduce
        reduce_dtype=(config.reduce_dtype if at_default or not compute.is_floating_point
                      else finer(config.reduce_dtype, compute)),
        output_dtype=config.output_dtype if outermost else None,
        cast_forward_inputs=at_default,
    )


def _within(names: tuple[str, ...], mod: str) -> bool:
    """Whether every name of a parameter (its tie aliases) lies under ``mod``: ``fully_shard(mod)``
    takes a tied parameter whole, so a module holding only some of its names cannot be its unit."""
    return all(under(n, mod) for n in names)


def _uniform_subtrees(root: str, members: list[str], groups: dict[str, Group], module_names, target: Group,
                      aliases: dict[str, tuple[str, ...]]):
    """Maximal modules strictly below ``root`` whose member parameters all belong to ``target``,
    each with every name it is tied under (``aliases``) inside."""
    def is_uniform(mod: str) -> bool:
        inside = [p for p in members if any(under(n, mod) for n in aliases[p])]
        return bool(inside) and all(groups[p] == target and _within(aliases[p], mod) for p in inside)

    found = []
    for mod in module_names:
        if mod == root or not under(mod, root) or not is_uniform(mod):
            continue
        parent = mod.rpartition(".")[0]
        if parent == root or not under(parent, root) or not is_uniform(parent):
            found.append(mod)
    return found


def shardable(name: str, modules: dict[str, nn.Module]) -> list[str]:
    """``name`` itself, or, for a container ``fully_shard`` refuses, its shardable children."""
    if not is_forwardless_container(modules[name]):
        return [name]
    prefix = f"{name}." if name else ""
    return [m for child, _ in modules[name].named_children() for m in shardable(prefix + child, modules)]


def plan_dtype_split(
    members: dict[tuple[str, ...], list[str]], plan: PrecisionPlan, modules: dict[str, nn.Module]
) -> tuple[UnitSpec, ...]:
    config = plan.config
    names = list(modules)
    units: list[UnitSpec] = []
    unisolatable: list[str] = []
    for roots, params in members.items():
        outermost = roots == ("",)
        groups = {p: (plan[p].storage, plan[p].compute, plan[p].format) for p in params}
        aliases = {p: plan[p].tie_group or (p,) for p in params}
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
                for subtree in _uniform_subtrees(roots[0], params, groups, names, g, aliases):
                    for mod in shardable(subtree, modules):
                        inside = [p for p in remaining if _within(aliases[p], mod)]
                        if inside:
                            units.append(group_policy(g, config, (mod,), inside, outermost=False))
                            remaining = [p for p in remaining if p not in inside]
            unisolatable += [p for p in remaining if groups[p] != majority]
        units.append(group_policy(majority, config, roots, remaining, outermost))
    if unisolatable:
        raise IsolationError(sorted(unisolatable))
    return tuple(units)


class LegacyPath:
    """The dtype-split path (what ``fully_shard_by_dtype``-style helpers do)."""

    name = "legacy"
    contract = DTYPE_SPLIT
    fallback = None

    def unavailable(self) -> str | None:
        return None

    def plan(self, model, roots, precision_plan, ignored) -> ShardReport:
        members = resolve_roots(roots, precision_plan)
        units = plan_dtype_split(members, precision_plan, module_index(model))
        return ShardReport(requested=self.name, taken=self.name, contract=self.contract, units=units)

    def apply(self, model, report, mesh, reshard_after_forward, ignored, *, shard_placement_fn=None,
              offload_policy=None) -> None:
        apply_units(model, report, mesh, reshard_after_forward, ignored, shard_placement_fn, offload_policy)
