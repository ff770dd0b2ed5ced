"""An in-house dtype-split helper, packaged as a parity path plugin.

Where parity's ``legacy`` path wraps *maximal uniform subtrees* of the minority dtype group,
this helper wraps the *module that directly owns* each parameter whose (storage, compute)
dtype differs from its root's majority -- a different but valid grouping, the way many
hand-written ``fully_shard_by_dtype`` helpers work. Installing this package registers it
under the name ``owner_split`` (entry-point group ``parity.paths``)::

    pip install ./examples/external_path
    python -m parity run --paths legacy,native,owner_split --matrix smoke
"""

from __future__ import annotations

from collections import defaultdict

from parity.errors import IsolationError
from parity.paths import DTYPE_SPLIT, ShardReport
from parity.paths.legacy import group_policy
from parity.paths.units import apply_units, is_forwardless_container, module_index, resolve_roots, under


class OwnerSplitPath:
    name = "owner_split"
    contract = DTYPE_SPLIT
    fallback = None

    def unavailable(self) -> str | None:
        return None

    def plan(self, model, roots, precision_plan, ignored) -> ShardReport:
        plan, config = precision_plan, precision_plan.config
        modules = module_index(model)
        units, unisolatable = [], []
        for root_group, params in resolve_roots(roots, plan).items():
            outermost = root_group == ("",)
            group_of = {p: (plan[p].storage, plan[p].compute) for p in params}
            size = defaultdict(int)
            for p in params:
                size[group_of[p]] += plan[p].numel
            majority = max(size, key=lambda g: (size[g], str(g)))
            owners = sorted({p.rpartition(".")[0] for p in params if group_of[p] != majority},
                            key=lambda m: -m.count("."))  # innermost first
            remaining = list(params)
            for owner in owners:
                inside = [p for p in remaining if under(p, owner)]
                groups = {group_of[p] for p in inside}
                if len(root_group) > 1 or owner in root_group or len(groups) != 1 \
                        or is_forwardless_container(modules[owner]):
                    unisolatable += [p for p in inside if group_of[p] != majority]
                    continue
                units.append(group_policy(groups.pop(), config, (owner,), inside, outermost=False))
                remaining = [p for p in remaining if p not in inside]
            units.append(group_policy(majority, config, root_group, remaining, outermost))
        if unisolatable:
            raise IsolationError(sorted(unisolatable), path=self.name)
        return ShardReport(requested=self.name, taken=self.name, contract=self.contract, units=tuple(units))

    def apply(self, model, report, mesh, reshard_after_forward, ignored) -> None:
        apply_units(model, report, mesh, reshard_after_forward, ignored)
