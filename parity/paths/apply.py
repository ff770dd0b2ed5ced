"""Any registered path behind one call: :func:`plan_sharding` (pure) and :func:`shard`.

``plan_sharding`` asks the path for its units, following its declared fallback when it is
unavailable in this build or ineligible for the plan, and records why. ``shard`` then
checks that every rank resolved the same plan and lets the taken path call ``fully_shard``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import torch.distributed as dist
from torch import nn

from parity.errors import IsolationError, RankMismatchError, UsageError
from parity.model.plan import PrecisionPlan, canonical_fqn
from parity.paths.base import Ineligible, ShardReport
from parity.paths.registry import get_path
from parity.paths.units import module_index, resolve_roots


def _check_output_dtype(roots: tuple[str, ...], plan: PrecisionPlan) -> None:
    # the outermost unit must be the root module alone, else output_dtype has nowhere to go
    members = resolve_roots(roots, plan) if "" in roots else {}
    if plan.config.output_dtype is not None and ("",) not in members:
        raise UsageError(
            f"output_dtype {plan.config.output_dtype} would be silently ignored: no outermost FSDP unit of "
            "the root module alone (declare \"\" as the last unit root, untied from other roots, or leave "
            "output_dtype natural)"
        )


def plan_sharding(
    model: nn.Module, roots: tuple[str, ...], plan: PrecisionPlan, path: str,
    ignored: set[nn.Parameter] | None = None,
) -> ShardReport:
    """The units ``path`` (or the chain of its fallbacks) would shard ``model`` into."""
    _check_output_dtype(roots, plan)
    requested, reasons, seen = path, [], set()
    while True:
        impl = get_path(path)
        seen.add(path)
        reason = impl.unavailable()
        if reason is not None and not isinstance(reason, str):  # a plugin's bug, named before a join trips on it
            raise TypeError(f"path {path!r}: its unavailable() returned {reason!r}, not None or a reason (a str); "
                            "fix that path's unavailable()")
        if reason is None:
            try:
                report = impl.plan(model, roots, plan, set(ignored or ()))
            except Ineligible as exc:
                reason = "; ".join(exc.reasons)
            except IsolationError as exc:
                raise IsolationError(exc.params, "; ".join(reasons), path=path, read_by=exc.read_by) from None
            else:
                if not isinstance(report, ShardReport):  # a plugin's bug, named before replace() trips on it
                    raise TypeError(f"path {path!r}: its plan() returned {type(report).__name__}, not a ShardReport; "
                                    "fix that path's plan()")
                _check_names(report, model, path)
                _check_covered(report, plan, path)
                return replace(report, requested=requested, taken=path, contract=impl.contract,
                               fallback_reason="; ".join(reasons))
        reasons.append(reason)
        if impl.fallback is None or impl.fallback in seen:
            raise UsageError(f"path {path!r} cannot shard this model and declares no usable fallback: {reason}")
        path = impl.fallback


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
    problems = _mismatches(everyone)
    if problems:
        raise RankMismatchError(
            "compute dtypes differ across ranks for " + "; ".join(problems)
            + "; make the precision plan rank-independent before sharding"
        )


def _mismatches(everyone: list[dict[str, str]]) -> list[str]:
    problems = []
    for fqn in sorted(set().union(*everyone)):
        seen = {r: d.get(fqn, "<missing>") for r, d in enumerate(everyone)}
        if len(set(seen.values())) > 1:
            problems.append(f"{fqn} ({', '.join(f'rank {r}: {v}' for r, v in seen.items())})")
    return problems


def _check_names(report: ShardReport, model: nn.Module, path: str) -> None:
    """Every module and parameter a unit of ``report`` names is the model's: a plugin's typo would
    otherwise surface far from it (an isolation error about another parameter, a KeyError while
    judging)."""
    modules = set(module_index(model))  # canonical names: a checkpoint wrapper's token dropped
    params = {canonical_fqn(name) for name, _ in model.named_parameters(remove_duplicate=False)}
    unknown = [f"module {m!r}" for m in sorted({m for u in report.units for m in u.modules} - modules)]
    unknown += [f"parameter {q!r}" for q in sorted({q for u in report.units for q in u.params} - params)]
    if unknown:
        raise TypeError(f"path {path!r}: its plan() names {', '.join(unknown[:5])}"
                         f"{f' and {len(unknown) - 5} more' if len(unknown) > 5 else ''}, which the model does not "
                         "have; fix that path's plan()")


def _check_covered(report: ShardReport, plan: PrecisionPlan, path: str) -> None:
    """The report names at least one unit, and every parameter the plan has FSDP manage in exactly
    one of them: a parameter a plugin leaves out (or counts twice) would be sharded by whichever
    unit's module holds it while every check read the report -- judged against units that do not
    exist, failing (if at all) as a byte count far from the cause."""
    if not report.units:
        raise TypeError(f"path {path!r}: its plan() reports no unit; report every module apply() passes to "
                        "fully_shard (at least the root)")
    count = Counter(q for u in report.units for q in u.params)
    problems = [f"leaves {t.fqn!r} out of every unit" for t in plan.params
                if t.ownership == "managed" and t.fqn not in count]
    problems += [f"lists {q!r} in {n} units" for q, n in count.items() if n > 1]
    if problems:
        raise TypeError(f"path {path!r}: its plan() {'; '.join(problems[:3])}"
                        f"{f' and {len(problems) - 3} more' if len(problems) > 3 else ''}; report every parameter "
                        "FSDP manages in exactly one unit, the one whose module holds it")


def fsdp_params(model: nn.Module):
    """``(name, FSDPParam)`` for every parameter FSDP manages in ``model``: the name of the FSDP
    module whose unit manages it (``""`` for the root), and FSDP's own record of it."""
    from torch.distributed.fsdp import FSDPModule

    for name, mod in model.named_modules():
        if isinstance(mod, FSDPModule):
            state = mod._get_fsdp_state()
            for group in getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]:  # torch <= 2.14
                if group is not None:
                    for fp in group.fsdp_params:
                        yield name, fp


def resolved_dtypes(model: nn.Module) -> dict[str, str]:
    """fqn -> "original/compute/reduce" as ``fully_shard`` resolved them per parameter
    (the policy each FSDP parameter holds before lazy initialization)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for _, fp in fsdp_params(model):
        policy = getattr(fp, "mp_policy", None)  # resolved per parameter inside fully_shard
        if policy is None:
            continue
        dtypes = (fp.sharded_param.dtype, policy.param_dtype, policy.reduce_dtype)
        out[names.get(id(fp.sharded_param), "?")] = "/".join(str(d).removeprefix("torch.") for d in dtypes)
    return out


def reduction_module():
    """FSDP's private module whose ``foreach_reduce`` the reduction probe wraps; None when this
    torch build has no such module or function (the probe is then blind: an ERROR, not a SKIP)."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg
    except ImportError:
        return None
    return pg if callable(getattr(pg, "foreach_reduce", None)) else None


def check_resolved_consistency(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """After ``fully_shard`` and before the first forward: every rank's dtypes as FSDP
    resolved them (original / compute / reduce) must agree, or the first collective would
    abort. Catches what the plan check cannot: a rank-dependent override function or an
    FSDP-side resolution bug."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    everyone: list[tuple[dict[str, str], dict[str, str]] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (resolved_dtypes(model), unit_of(model)), group=group)
    problems = _mismatches([dtypes for dtypes, _ in everyone])
    if problems:
        raise RankMismatchError(
            "FSDP resolved different original/compute/reduce dtypes across ranks for " + "; ".join(problems)
            + "; the override function (or FSDP) must resolve every parameter the same on every rank"
        )
    problems = _mismatches([units for _, units in everyone])
    if problems:  # ranks would gather different buffers in different orders: gloo aborts
        raise RankMismatchError(
            "FSDP units differ across ranks (the module whose unit manages each parameter) for "
            + "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
            + "; the path must shard the same modules on every rank (its plan() or apply() depends on the rank)"
        )


def unit_of(model: nn.Module) -> dict[str, str]:
    """fqn -> the FSDP module (its name, ``<root>`` for the root) whose unit manages the parameter."""
    names = {id(p): canonical_fqn(n) for n, p in model.named_parameters()}
    return {names.get(id(fp.sharded_param), "?"): canonical_fqn(unit) or "<root>" for unit, fp in fsdp_params(model)}


def apply_sharding(
    model: nn.Module, report: ShardReport, plan: PrecisionPlan, *, mesh=None,
    reshard_after_forward: bool = True, ignored: set[nn.Parameter] | None = None,
    group: dist.ProcessGroup | None = None, **options,
) -> None:
    """Check the plan's rank consistency, let the taken path call ``fully_shard``, then check
    what FSDP resolved, on every rank of ``group`` (default: all), before anything reaches a
    collective. ``options``: keyword arguments of ``fully_shard`` the recipe adds
    (``shard_placement_fn``, ``offload_policy``), passed to the path's ``apply``, which must
    take them (:func:`parity.execute.knobs.unsupported` skips a cell whose path does not)."""
    check_rank_consistency(plan, group)
    get_path(report.taken).apply(model, report, mesh, reshard_after_forward, set(ignored or ()), **options)
    check_applied(model, report)
    check_resolved_consistency(model, group)


def check_applied(model: nn.Module, report: ShardReport) -> None:
    """Every module a unit of the report names is an FSDP module once the path's ``apply``
    returned, and no other is: a path (a plugin) that shards less or more than it reports (or
    reports nothing) would otherwise be judged against units that do not exist, and fail
    somewhere far from the cause."""
    from torch.distributed.fsdp import FSDPModule

    if not report.units:
        raise RuntimeError(f"path {report.taken!r}: its plan() reports no unit; report every module apply() "
                           "passes to fully_shard (at least the root)")
    modules = module_index(model)
    for unit in report.units:
        missed = next((m for m in unit.modules if not isinstance(modules.get(m), FSDPModule)), None)
        if missed is not None:
            raise RuntimeError(f"path {report.taken!r}: apply() did not call fully_shard on "
                               f"{repr(missed) if missed else 'the root module'}, a unit its plan() reports; shard "
                               "every unit the report lists, or report only the units apply() shards")
    reported = {m for unit in report.units for m in unit.modules}
    extra = next((n for n, m in modules.items() if isinstance(m, FSDPModule) and n not in reported), None)
    if extra is not None:  # judged as if it were not a unit: its policy would fail far from the cause
        raise RuntimeError(f"path {report.taken!r}: apply() called fully_shard on "
                           f"{repr(extra) if extra else 'the root module'}, which no unit of its plan() reports; "
                           "report every unit apply() shards")


def shard(
    model: nn.Module, path: str, *, roots: tuple[str, ...], plan: PrecisionPlan, mesh=None,
    reshard_after_forward: bool = True, ignored: set[nn.Parameter] | None = None,
) -> ShardReport:
    """Shard ``model`` along ``path`` and report the units, the path taken and any fallback."""
    report = plan_sharding(model, roots, plan, path, ignored)
    apply_sharding(model, report, plan, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored=ignored)
    return report
