"""What the functional collectives of a step must be (tensor and expert parallelism's exchanges,
a gradient norm over DTensors), per segment of the loop, from the model's declarations and the
mesh; :mod:`parity.judge.collectives` holds each segment's count to it.

Counted at the dispatcher (:class:`parity.execute.collectives.Exchanges`), where the backwards
torch issues from C++ pass too, over :func:`parity.execute.collectives.functional_scope`:

- a forward (a micro-batch's or an evaluation's): one all-reduce per ``rowwise`` layer of the
  tensor-parallel plan (its Partial output made whole), and each ``expert_parallel`` module's
  declared ``expert_exchanges`` (dispatch, combine);
- a backward: one all-reduce per ``colwise`` layer (its input gradient, Partial over ``tp``),
  and the adjoint of each expert exchange (an all-gather's is a reduce-scatter, and back; an
  all-to-all's an all-to-all); with activation checkpointing a recompute may issue the
  exchanges of the modules it runs again (torch stops recomputing once the saved tensors are
  rebuilt): at most those of each checkpointed module's forward (the blocks; under ``outer``
  the whole model and each unit again, the checkpoints nesting);
- the optimizer segment: the gradient norm all-reduces once per mesh dimension its gradients
  are sharded over, per mesh they live on (FSDP's dimension; a tensor-parallel weight's ``dp``
  and ``tp``; the experts' ``ep``); a loss scaler's found-inf once per gradient dtype (DTensor's
  agreement; the scaler's own all-reduce over the process group is FSDP's kind, counted there);
- nothing anywhere else (state dicts, loads, the loss: parity's own reads are not counted).

On 1-D FSDP and HSDP only the optimizer segment's reductions are counted (unscaling, the norm,
clipping; :func:`unobserved` says where not).
Collectives inside a higher-order operator's body (a compiled region) are not counted.
"""

from __future__ import annotations

from collections import Counter

from parity.execute.collectives import FUNCTIONAL_PREFIX, functional_scope
from parity.execute.recompute import watched
from parity.matrix.cell import Cell
from parity.model.plan import PrecisionPlan
from parity.model.recipe import loss_scale

#: The backward of each expert exchange (autograd's adjoint collective).
ADJOINT = {"all-gather": "reduce-scatter", "reduce-scatter": "all-gather", "all-to-all": "all-to-all"}


def _inside(fqn: str, roots: tuple[str, ...] | None) -> bool:
    return roots is None or any(r == "" or fqn == r or fqn.startswith(r + ".") for r in roots)


def _forward(cell: Cell, fixture, within: tuple[str, ...] | None = None) -> Counter:
    """One forward's exchanges; of the modules under ``within`` only, when given."""
    got: Counter = Counter()
    if cell.mesh == "fsdp+tp":
        got["all-reduce"] += sum(1 for m, s in fixture.tensor_parallel.items() if s == "rowwise" and _inside(m, within))
    if cell.mesh == "ep":
        for m in fixture.expert_parallel:
            if _inside(m, within):
                got.update(fixture.expert_exchanges)
    return got


def _recomputed(cell: Cell, fixture, unit_modules: tuple[str, ...]) -> Counter:
    """The exchanges activation checkpointing may issue again in one backward: those of each
    checkpointed module's forward (:func:`parity.execute.recompute.watched`: the blocks under
    ``full`` and ``selective``; under ``outer`` the root and every unit, nested, so a module inside
    a unit may run again in the root's recompute and in its unit's own), nothing under ``none``."""
    if cell.checkpointing == "none":
        return Counter()
    got: Counter = Counter()
    for root in watched(cell.checkpointing, tuple(fixture.blocks), unit_modules):
        got.update(_forward(cell, fixture, (root,)))
    return got


def _backward(cell: Cell, fixture) -> Counter:
    got: Counter = Counter()
    if cell.mesh == "fsdp+tp":
        got["all-reduce"] += sum(1 for s in fixture.tensor_parallel.values() if s == "colwise")
    if cell.mesh == "ep":
        for _ in fixture.expert_parallel:
            got.update(ADJOINT[k] for k in fixture.expert_exchanges)
    return got


def _trained(plan: PrecisionPlan, step: int, graded: set | None) -> list:
    return [t for t in plan.params
            if t.requires_grad and t.trainable_from <= step and (graded is None or t.fqn in graded)]


def norm_all_reduces(cell: Cell, plan: PrecisionPlan, step: int, graded: set | None) -> int:
    """The gradient norm's all-reduces at ``step``: per mesh holding a gradient, one per dimension
    the gradients there are sharded over (FSDP's meshes: one; tensor parallelism's 2-D mesh: two;
    the experts' ``(dp, ep)``: one, over ``ep``). Plain gradients (an emulated owner's) need none."""
    params = _trained(plan, step, graded)
    fsdp = any(t.ownership == "managed" and not t.parallel.startswith("tp-") for t in params)
    tp = any(t.ownership == "managed" and t.parallel.startswith("tp-") for t in params)
    experts = cell.mesh == "ep" and any(t.parallel == "ep" for t in params)
    return int(fsdp) + 2 * int(tp) + int(experts)


def found_inf_all_reduces(cell: Cell, plan: PrecisionPlan, step: int, graded: set | None) -> tuple[int, int]:
    """(floor, ceiling) of the loss scaler's found-inf agreements at ``step``: ``ShardedGradScaler``
    unscales once per gradient dtype, and DTensor agrees on each call's found-inf over every
    sharded dimension of the first gradient's mesh (``found_inf_reduce_handler``): one on 1-D FSDP
    and HSDP, one or two where a tensor-parallel or expert gradient may come first. None
    without a loss scale."""
    if loss_scale(plan.config.param_dtype) == 1.0:
        return 0, 0
    params = _trained(plan, step, graded)
    if not any(t.ownership == "managed" for t in params):
        return 0, 0
    dtypes = len({t.grad or t.storage for t in params if t.ownership == "managed"})  # groups holding a DTensor
    return dtypes, dtypes * (2 if cell.mesh in ("fsdp+tp", "ep") else 1)


def expected(cell: Cell, fixture, plan: PrecisionPlan, step: int, graded: set | None,
             unit_modules: tuple[str, ...]) -> dict[str, tuple[Counter, Counter]]:
    """Segment label -> (floor, ceiling) of the functional collectives counted there, by kind; a
    segment absent here owes none. Empty where nothing is counted (one rank). ``unit_modules``:
    the modules of the path's FSDP units (what ``outer`` checkpoints)."""
    scope = functional_scope(cell)
    out: dict[str, tuple[Counter, Counter]] = {}
    if scope == "none":
        return out
    if scope == "all":
        fwd, bwd = _forward(cell, fixture), _backward(cell, fixture)
        for mb in range(cell.microbatches):
            out[f"mb{mb}/forward"] = (fwd, fwd)
            out[f"mb{mb}/backward"] = (bwd, bwd + _recomputed(cell, fixture, unit_modules))
        evals = len(cell.eval_labels(step))
        if evals:
            each = Counter({k: n * evals for k, n in fwd.items()})
            out["eval"] = (each, each)
    norm = norm_all_reduces(cell, plan, step, graded)
    low, high = found_inf_all_reduces(cell, plan, step, graded)
    out["optimizer"] = (Counter({"all-reduce": norm + low}), Counter({"all-reduce": norm + high}))
    return out


def unobserved(cell: Cell, label: str) -> bool:
    """Whether functional collectives go uncounted in segment ``label`` of ``cell``."""
    scope = functional_scope(cell)
    return scope == "reductions" and label != "optimizer"


def problems(cell: Cell, fixture, plan: PrecisionPlan, step: int, graded: set | None, unit_modules: tuple[str, ...],
             got: dict[tuple[str, str], int]) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """(segment, problem) pairs for ``got`` ((segment, kind) -> count, kinds without the prefix)
    against :func:`expected`, and what each segment owes in words."""
    want = expected(cell, fixture, plan, step, graded, unit_modules)
    found: list[tuple[str, str]] = []
    labels = {label for label, _ in got} | set(want)
    for label in sorted(labels):
        low, high = want.get(label, (Counter(), Counter()))
        for kind in sorted({k for (lb, k) in got if lb == label} | set(high)):
            n = got.get((label, kind), 0)
            if not low[kind] <= n <= high[kind]:
                bound = str(low[kind]) if low[kind] == high[kind] else f"{low[kind]}-{high[kind]}"
                found.append((label, f"{n} {FUNCTIONAL_PREFIX}{kind}, expected {bound}"))
    words = {label: ", ".join(_words(low, high)) for label, (low, high) in want.items() if +high}
    return found, words


def _words(low: Counter, high: Counter) -> list[str]:
    return [f"{low[k] if low[k] == high[k] else f'{low[k]}-{high[k]}'} {FUNCTIONAL_PREFIX}{k}"
            for k in sorted(high) if high[k]]
