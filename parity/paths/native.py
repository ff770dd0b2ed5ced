"""Native per-parameter mixed precision: one unit per declared root with
``MixedPrecisionPolicy(param_dtype_override_fn=...)`` (torch >= 2.15.0).

:func:`eligibility` lists every reason a root cannot take the native path; the path then
raises :class:`~parity.paths.base.Ineligible` and its declared fallback (legacy) runs with
those reasons recorded. It never upcasts stored weights or changes the reduce dtype to
become eligible.
"""

from __future__ import annotations

import torch

from parity.model.dtypes import dtype_name
from parity.model.plan import PrecisionPlan
from parity.model.spec import MIXED_FORMATS
from parity.paths.base import PER_PARAMETER, Ineligible, ShardReport, UnitSpec
from parity.paths.units import OVERRIDE_FIELD, apply_units, native_api_available, resolve_roots


def _names(dtypes: dict[torch.dtype, list[str]]) -> str:
    return "; ".join(f"{dtype_name(d)}: {', '.join(ps)}" for d, ps in dtypes.items())


def eligibility(members: dict[tuple[str, ...], list[str]], plan: PrecisionPlan) -> list[str]:
    """Reasons the native path cannot represent this plan (empty when eligible)."""
    reasons = []
    pd = plan.config.param_dtype
    for roots, params in members.items():
        where = "+".join(r or "<root>" for r in roots)
        trainable = [plan[p] for p in params if plan[p].trainable]
        storage: dict[torch.dtype, list[str]] = {}
        for t in trainable:
            storage.setdefault(t.storage, []).append(t.fqn)
        if len(storage) > 1:
            reasons.append(f"unit {where} mixes trainable storage dtypes ({_names(storage)})")
        for p in params:
            t = plan[p]
            if t.compute not in (t.storage, pd):
                reasons.append(
                    f"{p} computes in {dtype_name(t.compute)}, which is neither param_dtype "
                    f"{dtype_name(pd)} nor its own {dtype_name(t.storage)}"
                )
        quantized: dict[str, list[str]] = {}
        for p in params:
            if plan[p].format != "none":
                quantized.setdefault(plan[p].format, []).append(p)
        if len(quantized) > 1:
            listing = "; ".join(f"{f}: {', '.join(ps)}" for f, ps in quantized.items())
            reasons.append(f"unit {where} {MIXED_FORMATS} ({listing})")
        compute = {t.compute for t in trainable}
        reduce: dict[torch.dtype, list[str]] = {}
        for t in trainable:
            reduce.setdefault(t.reduce, []).append(t.fqn)
        if len(compute) > 1 and len(reduce) > 1:
            reasons.append(f"unit {where} mixes compute dtypes without a common reduce dtype ({_names(reduce)})")
    return reasons


def plan_per_parameter(members: dict[tuple[str, ...], list[str]], plan: PrecisionPlan) -> tuple[UnitSpec, ...]:
    config = plan.config
    units = []
    for roots, params in members.items():
        reduce = {plan[p].reduce for p in params if plan[p].trainable}
        natural = config.reduce_dtype is None and all(
            plan[p].reduce == plan[p].kept_grad for p in params if plan[p].trainable)
        units.append(
            UnitSpec(
                modules=roots,
                params=tuple(params),
                param_dtype=config.param_dtype,
                # None stays None: each gradient reduces in its own dtype (grad_dtype, else storage), as planned
                reduce_dtype=None if natural else (reduce.pop() if len(reduce) == 1 else config.reduce_dtype),
                output_dtype=config.output_dtype if roots == ("",) else None,
                cast_forward_inputs=True,
                overrides=tuple(
                    p for p in params
                    if plan[p].compute == plan[p].storage and plan[p].compute != config.param_dtype
                ),
            )
        )
    return tuple(units)


class NativePath:
    """One unit per root; FP32-compute parameters keep their dtype through the override."""

    name = "native"
    contract = PER_PARAMETER
    fallback = "legacy"

    def unavailable(self) -> str | None:
        if native_api_available():
            return None
        return (f"unsupported build: torch {torch.__version__} has no "
                f"MixedPrecisionPolicy.{OVERRIDE_FIELD} (first released in 2.15.0)")

    def plan(self, model, roots, precision_plan, ignored) -> ShardReport:
        members = resolve_roots(roots, precision_plan)
        reasons = eligibility(members, precision_plan)
        if reasons:
            raise Ineligible(reasons)
        units = plan_per_parameter(members, precision_plan)
        return ShardReport(requested=self.name, taken=self.name, contract=self.contract, units=units)

    def apply(self, model, report, mesh, reshard_after_forward, ignored, *, shard_placement_fn=None,
              offload_policy=None) -> None:
        apply_units(model, report, mesh, reshard_after_forward, ignored, shard_placement_fn, offload_policy)
