"""``plan``: the precision plan held to witnesses it was not derived from.

Every rank resolves the plan from the model it built (after tensor / expert parallelism and
quantization changed it), and that one plan drives the sharding path, the reference's
dtypes, every ``dtype.*`` expectation and the allowances' dtypes: a resolution bug would
pass every other check. So, per parameter:

- the parent resolves the plan again from a fresh, unsharded build of the model in its own
  process (taking from the ranks only which parameters another parallelism owns), and every
  rank's entry must equal it (storage, compute, reduce and gradient dtypes, ownership,
  trainability, weight format);
- where the model declares by hand what it keeps in FP32 (``Fixture.expect_fp32``), the
  resolved plan must compute exactly those tensors in FP32 -- a missed strict-FP32 name, or a
  pattern that selects too much, shows here whatever the numbers say.
"""

from __future__ import annotations

import functools

import torch

from parity.execute.observation import Observation
from parity.judge.rows import contract_row as _row
from parity.judge.record import Record
from parity.matrix.cell import Cell
from parity.model.dtypes import dtype_name
from parity.model.formats import layout
from parity.model.plan import PrecisionPlan, TensorPlan, canonical_fqn
from parity.model.registry import get_fixture
from parity.paths.apply import plan_sharding


def _entry(t: TensorPlan | None) -> str:
    if t is None:
        return "<absent>"
    return (f"storage {dtype_name(t.storage)}, compute {dtype_name(t.compute)}, reduce "
            f"{dtype_name(t.reduce) if t.reduce else '-'}, grad {dtype_name(t.grad) if t.grad else '-'}, {t.ownership}, "
            f"{'trainable' if t.requires_grad else 'frozen'} from {t.trainable_from}, {t.format}")


def fresh_plan(cell: Cell, ranks_plan: PrecisionPlan) -> PrecisionPlan:
    """The plan of a fresh, unsharded build in this process; only the map of parameters owned
    by tensor / expert parallelism comes from the ranks (building their mesh needs ranks)."""
    owners = tuple(sorted((t.fqn, t.parallel) for t in ranks_plan.params if t.parallel))
    return _fresh_build(cell.fixture, cell.source, cell.seed, cell.precision(), cell.weights, owners)[2]


@functools.lru_cache(maxsize=64)
def _fresh_build(name: str, source: str, seed: int, config, weights: str, owners: tuple):
    """(model, ignored, plan) of one fresh build per model and recipe in a run (cells differ in
    axes the plan does not read)."""
    fixture = get_fixture(name, source)
    model = fixture.make(seed)
    parallel = dict(owners)
    ignored = set(fixture.ignored(model))
    ignored |= {p for n, p in model.named_parameters() if parallel.get(canonical_fqn(n)) == "ep"}
    plan = fixture.resolve(model, config, ignored, parallel=parallel, formats=layout(fixture.quantizable, weights))
    return model, ignored, plan


@functools.lru_cache(maxsize=64)
def _taken(name: str, source: str, seed: int, config, weights: str, path: str) -> str:
    model, ignored, plan = _fresh_build(name, source, seed, config, weights, ())
    try:
        return plan_sharding(model, get_fixture(name, source).unit_roots, plan, path, ignored).taken
    except Exception:  # noqa: BLE001 - a path that cannot shard the model: its load is an ERROR, judged there
        return ""


def path_taken(cell: Cell, ranks_plan: PrecisionPlan, path: str) -> str:
    """The path a fresh build in this process shards along when ``path`` is asked for (its
    fallback where it cannot): what a load into ``path`` must have run on. '' where unknown here:
    the path raises, or tensor / expert parallelism changes the model (its mesh needs ranks)."""
    if any(t.parallel for t in ranks_plan.params):
        return ""
    return _taken(cell.fixture, cell.source, cell.seed, cell.precision(), cell.weights, path)


def declared_fp32(plan: PrecisionPlan) -> set[str]:
    """What the plan computes in FP32 that a model declares: FSDP-managed parameters and the
    buffers resolved by a strict-FP32 name or marker (FSDP casts neither kind of buffer)."""
    return {t.fqn for t in plan.tensors if t.compute == torch.float32 and t.ownership != "ignored"
            and (t.kind == "param" or t.rule == "strict")}


def check(cell: Cell, fixture, observations: list[Observation], base: dict) -> list[Record]:
    fresh = fresh_plan(cell, observations[0].plan)
    declared = set(fixture.expect_fp32) if fixture.expect_fp32 is not None else None
    resolved = declared_fp32(fresh)
    rows = []
    for t in fresh.tensors:
        if t.kind != "param" and t.fqn not in resolved | (declared or set()):
            continue
        want = _entry(t)
        problems = [f"rank {o.rank}: {_entry(o.plan.get(t.fqn))}" for o in observations
                    if _entry(o.plan.get(t.fqn)) != want]
        if declared is not None and (t.fqn in declared) != (t.fqn in resolved):
            problems.append(f"declared {'FP32' if t.fqn in declared else 'not FP32'} (Fixture.expect_fp32), "
                            f"resolved compute {dtype_name(t.compute)} by rule {t.rule}")
        note = "fresh build in the parent = every rank" + ("" if declared is None else " = the declaration")
        rows.append(_row(base, "plan", t.fqn, not problems, want, "; ".join(problems) or "the same", note,
                         dtype_name(t.compute)))
    return rows
