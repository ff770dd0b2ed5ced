"""Native per-parameter mixed precision: one unit per declared root with
``MixedPrecisionPolicy(param_dtype_override_fn=...)`` (torch >= 2.15.0).

:func:`eligibility` lists every reason a root cannot take the native path; parity then falls
back to legacy with those reasons recorded. It never upcasts stored weights or changes the
reduce dtype to become eligible.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from parity.dtypes import dtype_name
from parity.paths.units import UnitSpec
from parity.plan import PrecisionPlan

OVERRIDE_FIELD = "param_dtype_override_fn"


def native_api_available() -> bool:
    return OVERRIDE_FIELD in {f.name for f in dataclasses.fields(MixedPrecisionPolicy)}


def _names(dtypes: dict[torch.dtype, list[str]]) -> str:
    return "; ".join(f"{dtype_name(d)}: {', '.join(ps)}" for d, ps in dtypes.items())


def eligibility(members: dict[tuple[str, ...], list[str]], plan: PrecisionPlan) -> list[str]:
    """Reasons the native path cannot represent this plan (empty when eligible)."""
    if not native_api_available():
        return [
            f"unsupported build: torch {torch.__version__} has no "
            f"MixedPrecisionPolicy.{OVERRIDE_FIELD} (first released in 2.15.0)"
        ]
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
        compute = {t.compute for t in trainable}
        reduce: dict[torch.dtype, list[str]] = {}
        for t in trainable:
            reduce.setdefault(t.reduce, []).append(t.fqn)
        if len(compute) > 1 and len(reduce) > 1:
            reasons.append(f"unit {where} mixes compute dtypes without a common reduce dtype ({_names(reduce)})")
    return reasons


def plan_native(members: dict[tuple[str, ...], list[str]], plan: PrecisionPlan) -> tuple[UnitSpec, ...]:
    config = plan.config
    units = []
    for roots, params in members.items():
        reduce = {plan[p].reduce for p in params if plan[p].trainable}
        units.append(
            UnitSpec(
                modules=roots,
                params=tuple(params),
                param_dtype=config.param_dtype,
                reduce_dtype=reduce.pop() if len(reduce) == 1 else config.reduce_dtype,
                output_dtype=config.output_dtype if roots == ("",) else None,
                cast_forward_inputs=True,
                overrides=tuple(
                    p for p in params
                    if plan[p].compute == plan[p].storage and plan[p].compute != config.param_dtype
                ),
            )
        )
    return tuple(units)
