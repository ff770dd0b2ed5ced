"""Two ways to shard one model, behind one call: :func:`shard`.

``plan_sharding`` is pure (no process group): it decides units, policies and fallback.
``apply_sharding`` checks rank consistency and calls ``fully_shard`` for each unit,
innermost first.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from parity.errors import IsolationError, RankMismatchError, UsageError
from parity.paths.legacy import plan_legacy
from parity.paths.native import eligibility, native_api_available, plan_native
from parity.paths.units import ShardReport, UnitSpec, module_index, resolve_roots
from parity.plan import PrecisionPlan, canonical_fqn

PATHS = ("legacy", "native")


def check_path(path: str) -> str:
    if path not in PATHS:
        raise UsageError(f"unknown path {path!r}; valid: {', '.join(PATHS)}")
    return path


def plan_sharding(model: nn.Module, roots: tuple[str, ...], plan: PrecisionPlan, path: str) -> ShardReport:
    """Decide the units for ``path`` (falling back from native to legacy when ineligible)."""
    check_path(path)
    # the outermost unit must be the root module alone, else output_dtype has nowhere to go
    members = resolve_roots(roots, plan) if "" in roots else {}
    if plan.config.output_dtype is not None and ("",) not in members:
        raise UsageError(
            f"output_dtype {plan.config.output_dtype} would be silently ignored: no outermost FSDP unit of "
            "the root module alone (declare \"\" as the last unit root, untied from other roots, or leave "
            "output_dtype natural)"
        )
    members = members or resolve_roots(roots, plan)
    if path == "native":
        reasons = eligibility(members, plan)
        if not reasons:
            return ShardReport(requested=path, taken="native", units=plan_native(members, plan))
        fallback = "; ".join(reasons)
    else:
        fallback = ""
    try:
        units = plan_legacy(members, plan, list(module_index(model)))
    except IsolationError as exc:
        if fallback:
            raise IsolationError(exc.params, fallback) from None
        raise
    return ShardReport(requested=path, taken="legacy", fallback_reason=fallback, units=units)


def check_rank_consistency(plan: PrecisionPlan, group: dist.ProcessGroup | None = None) -> None:
    """Compare every rank's resolved compute dtypes; raise naming parameters and ranks.

    Runs before any ``fully_shard``: a rank-dependent override would otherwise make ranks
    build different all-gather buffers, which aborts gloo (nothing Python can catch).
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    mine = plan.compute_dtypes()
    everyone: list[dict[str, str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    problems = []
    for fqn in sorted(set().union(*everyone)):
        seen = {r: d.get(fqn, "<missing>") for r, d in enumerate(everyone)}
        if len(set(seen.values())) > 1:
            problems.append(f"{fqn} ({', '.join(f'rank {r}: {v}' for r, v in seen.items())})")
    if problems:
        raise RankMismatchError(
            "compute dtypes differ across ranks for " + "; ".join(problems)
            + "; make the precision plan rank-independent before sharding"
        )


def _policy(unit: UnitSpec, params: dict[str, nn.Parameter], faults: frozenset[str]) -> MixedPrecisionPolicy:
    kwargs = dict(
        param_dtype=unit.param_dtype,
        reduce_dtype=torch.bfloat16 if "bf16_reduce" in faults else unit.reduce_dtype,
        output_dtype=unit.output_dtype,
        cast_forward_inputs=unit.cast_forward_inputs,
    )
    if "cast_child_inputs" in faults and not unit.cast_forward_inputs:
        kwargs["cast_forward_inputs"] = True  # an FP32 child no longer owns its input conversion
    if "drop_output_dtype" in faults:
        kwargs["output_dtype"] = None
    if "drop_override" in faults and unit.param_dtype == torch.float32:
        kwargs["param_dtype"] = torch.bfloat16  # legacy FP32 unit computing in BF16
    if unit.overrides and native_api_available():
        keep = set() if "drop_override" in faults else {id(params[p]) for p in unit.overrides}
        kwargs["param_dtype_override_fn"] = lambda p: p.dtype if id(p) in keep else None
    return MixedPrecisionPolicy(**kwargs)


def apply_sharding(
    model: nn.Module,
    report: ShardReport,
    plan: PrecisionPlan,
    *,
    mesh=None,
    reshard_after_forward: bool = True,
    ignored: set[nn.Parameter] | None = None,
    faults: frozenset[str] = frozenset(),
    check_ranks: bool = True,
) -> None:
    if check_ranks:
        check_rank_consistency(plan)
    modules = module_index(model)
    params = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        params.setdefault(canonical_fqn(name), p)
    for unit in report.units:
        targets = [modules[m] for m in unit.modules]
        fully_shard(
            targets if len(targets) > 1 else targets[0],
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=_policy(unit, params, faults),
            ignored_params=set(ignored) if ignored else None,
        )


def shard(
    model: nn.Module,
    path: str,
    *,
    roots: tuple[str, ...],
    plan: PrecisionPlan,
    mesh=None,
    reshard_after_forward: bool = True,
    ignored: set[nn.Parameter] | None = None,
    faults: frozenset[str] = frozenset(),
) -> ShardReport:
    """Shard ``model`` along ``path`` and report the units, the path taken and any fallback."""
    report = plan_sharding(model, roots, plan, path)
    apply_sharding(
        model, report, plan, mesh=mesh, reshard_after_forward=reshard_after_forward,
        ignored=ignored, faults=faults,
    )
    return report


__all__ = [
    "PATHS", "ShardReport", "UnitSpec", "apply_sharding", "check_path", "check_rank_consistency",
    "plan_sharding", "shard",
]
