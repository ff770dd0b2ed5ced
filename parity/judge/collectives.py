"""``collectives``: what a cell's own training issued, counted where ``torch.distributed`` issues
it, against the path's units, the cell's accumulation and its recipe knobs (see
:func:`collective_checks`)."""

from __future__ import annotations

import math
from dataclasses import replace

from parity.execute.collectives import FUNCTIONAL_PREFIX
from parity.execute.knobs import kept_out_of_backward, shard_dim
from parity.execute.observation import Observation
from parity.judge import exchanges
from parity.judge.record import Record
from parity.judge.reference import ReferenceRun
from parity.judge.rows import contract_row as _row
from parity.matrix.cell import Cell
from parity.model.plan import PrecisionPlan
from parity.model.registry import get_fixture
from parity.model.recipe import loss_scale


def expected_reductions(cell: Cell, obs: Observation, plan: PrecisionPlan, step: int) -> int:
    """Reduce-scatters one synchronizing backward issues: one per unit holding a parameter trained at
    ``step`` (a unit's gradients travel in one collective, mixed dtypes packed; a unit with nothing
    to train reduces nothing). None on one rank: FSDP issues no collective there."""
    return len(_trained_units(obs, plan, step))


def _trained_units(obs: Observation, plan: PrecisionPlan, step: int) -> list:
    """The units holding an FSDP-managed parameter trained at ``step``."""
    trained = {t.fqn for t in plan.params if t.requires_grad and t.trainable_from <= step and t.ownership == "managed"}
    return [u for u in obs.report.units if trained & set(u.params)]


def _shard_size(cell: Cell) -> int:
    """How many ranks FSDP shards over: every rank on a 1-D mesh and under EP (the experts are not
    FSDP's), the ``shard`` dimension of HSDP, the data-parallel dimension under TP."""
    topo = cell.topology()
    return {"hsdp": topo.shape[-1], "fsdp+tp": topo.shape[0]}.get(topo.name, topo.world)


def _tp_style(plan: PrecisionPlan, fqn: str) -> str:
    """How tensor parallelism splits ``fqn``: its plan's owner, and a colwise layer's bias as its
    weight (``ColwiseParallel`` shards both on dim 0; a rowwise layer's bias is replicated)."""
    t = plan.get(fqn)
    if t is not None and t.parallel:
        return t.parallel
    weight = plan.get(fqn.removesuffix("bias") + "weight") if fqn.endswith(".bias") else None
    return "tp-colwise" if weight is not None and weight.parallel == "tp-colwise" else ""


def _local_shape(cell: Cell, style: str, shape: tuple[int, ...], rank: int) -> tuple[int, ...]:
    """The tensor FSDP shards on ``rank``: a tensor-parallel tensor's own tp shard (``ColwiseParallel``
    splits rows, ``RowwiseParallel`` a weight's columns, as ``torch.chunk`` does: the last tp
    ranks hold less of an uneven dimension), any other tensor whole."""
    tp = cell.topology().tp
    dim = {"tp-colwise": 0, "tp-rowwise": 1}.get(style)
    if dim is None or tp == 1 or len(shape) <= dim:
        return shape
    chunk = -(-shape[dim] // tp)
    own = max(0, min(chunk, shape[dim] - chunk * (rank % tp)))  # ranks are row-major: tp is the inner dimension
    return (*shape[:dim], own, *shape[dim + 1:])


def _syncs(cell: Cell, mb: int) -> tuple[bool, bool]:
    """Whether micro-batch ``mb``'s backward reduce-scatters, and whether it all-reduces across
    HSDP replicas: both after every micro-batch (``every``) or only the last (``last``); with
    ``replicas-last`` every backward reduce-scatters and only the last all-reduces."""
    last = mb == cell.microbatches - 1
    return (last or cell.sync in ("every", "replicas-last"),
            cell.mesh == "hsdp" and (last or cell.sync == "every"))


def unit_bytes(cell: Cell, obs: Observation, plan: PrecisionPlan, shapes: dict, step: int,
               graded: set | None = None) -> tuple[dict, dict]:
    """What each unit's collectives carry, from the plan, the path's units and the parameters'
    shapes (a tensor-parallel weight's local tp shard, :func:`_local_shape`; FSDP pads dim 0 to a
    multiple of the ranks it shards over, :func:`_shard_size`): unit -> bytes of its
    all-gather (every parameter in its compute dtype; a quantized weight in its one-byte E4M3
    payload, :data:`parity.model.plan.TensorPlan.format`) and of its reduce-scatter at ``step``
    (padded on the dimension the recipe shards it on, :func:`parity.execute.knobs.shard_dim`)
    (each parameter trained then, in its reduce dtype; of those, only the ones in ``graded`` when
    given: a parameter that gets no gradient, e.g. behind an ``argmax``, is not reduced)."""
    gather, reduce = {}, {}
    shard = _shard_size(cell)
    for u in obs.report.units:
        g = r = 0
        for f in u.params:
            t = plan.get(f)
            if t is None or t.ownership != "managed" or f not in shapes:
                continue
            shape = _local_shape(cell, _tp_style(plan, f), shapes[f], obs.rank)
            dim = shard_dim(cell, shape)  # FSDP pads the dimension it shards to a multiple of the ranks
            rows = -(-shape[dim] // shard) * shard if len(shape) else 1
            padded = rows * (math.prod(shape) // shape[dim] if len(shape) and shape[dim] else 1)
            g += padded * (1 if t.format != "none" else t.compute.itemsize)
            if t.requires_grad and t.trainable_from <= step and t.reduce is not None and (graded is None or f in graded):
                r += padded * t.reduce.itemsize
        gather[u.root], reduce[u.root] = g, r
    return gather, reduce


def _wire(cell: Cell, obs: Observation, plan: PrecisionPlan, ref: ReferenceRun, step: int) -> list[tuple[str, str]]:
    """Bytes per call against the units' (:func:`unit_bytes`): each all-gather carries one unit in
    its compute dtypes, a synchronizing backward reduce-scatters each unit with something to
    train once, in its reduce dtypes. Returns (segment, problem) pairs."""
    shapes = {f: tuple(p.shape) for f, p in ref.params[0].items()}
    graded = set(ref.grads[step]) if step < len(ref.grads) else None
    gather, reduce = unit_bytes(cell, obs, plan, shapes, step, graded)
    calls = {(label, kind): sizes for (s, label, kind), sizes in obs.contracts.collectives.items() if s == step}
    problems = []
    for (label, kind), sizes in sorted(calls.items()):
        if kind == "all-gather":
            odd = [b for b in sizes if b not in gather.values()]
            if odd:
                problems.append((label, f"all-gather of {odd[0]} bytes, no unit's size in its compute dtypes "
                                        f"({sorted(set(gather.values()))})"))
    for mb in range(cell.microbatches):
        scatters, replicas = _syncs(cell, mb)
        if scatters:
            got = sorted(calls.get((f"mb{mb}/backward", "reduce-scatter"), []))
            want = sorted(b for b in reduce.values() if b)
            if got != want:
                problems.append((f"mb{mb}/backward", f"reduce-scatters of {got} bytes, expected {want} "
                                 "(each unit's trained parameters, padded, in their reduce dtypes)"))
        if replicas:
            got = sorted(calls.get((f"mb{mb}/backward", "all-reduce"), []))
            want = sorted(b // _shard_size(cell) for b in reduce.values() if b)
            if got != want:
                problems.append((f"mb{mb}/backward", f"replica all-reduces of {got} bytes, expected {want} "
                                 "(each unit's reduce-scattered shard)"))
    return problems


def _kept_gathered(cell: Cell, obs: Observation, plan: PrecisionPlan, step: int, units: int,
                   bound: dict) -> dict[tuple[str, str], int]:
    """The floor of each forward's all-gathers (tightening ``bound`` where fewer are owed). Under
    ``reshard_backward = "every"`` every backward reshards every unit, so each forward gathers
    every unit again: a unit still gathered would compute with the weights before the optimizer
    step. Under ``"last"`` the first forward of a step all-gathers every unit (the last backward
    resharded them before the optimizer step), and a later micro-batch's forward only the units
    the previous backward had nothing to keep gathered for (no parameter trained this step, or
    no backward gathers them: :func:`_regathered`). An
    evaluation forward between micro-batches may reshard (reshard on), and one that leaves the
    units gathered (reshard off) owes the next forward nothing: the counts are then bounds only."""
    kept_by_eval = {0: not cell.reshard and cell.eval == "between-steps"}  # micro-batch -> follows a kept eval
    kept_by_eval.update({mb: not cell.reshard and cell.eval == "between-microbatches"
                         for mb in range(1, cell.microbatches)})
    if cell.reshard_backward != "last":
        return {(f"mb{mb}/forward", "all-gather"): units for mb, kept in kept_by_eval.items() if not kept}
    kept = expected_reductions(cell, obs, plan, step)  # the units holding a parameter trained this step
    kept -= _regathered(cell, obs, plan, step)
    if cell.eval != "between-microbatches":
        for mb in range(1, cell.microbatches):
            bound[(f"mb{mb}/forward", "all-gather")] = units - kept
    return {("mb0/forward", "all-gather"): units} if not kept_by_eval[0] else {}


def _regathered(cell: Cell, obs: Observation, plan: PrecisionPlan, step: int) -> int:
    """Units holding a parameter trained at ``step`` that no backward gathers
    (``unshard_in_backward = "needed"`` on the units the model declares no backward reads): a
    forward that resharded them (reshard on) leaves nothing to keep gathered, so the next
    forward gathers them again."""
    if not cell.reshard:
        return 0
    return sum(1 for u in _trained_units(obs, plan, step) if kept_out_of_backward(cell, u.modules))


def _outside(cell: Cell, counts: dict, base: dict) -> list[Record]:
    """A FAIL for collectives counted outside every step the cell trains (between steps, around
    the loop): nothing the loop runs there may issue one, and no step's judgement reads them."""
    stray = sorted((s, label, kind, len(sizes)) for (s, label, kind), sizes in counts.items()
                   if s not in range(cell.steps))
    if not stray:
        return []
    said = "; ".join(f"{n} {kind} at {'step ' + str(s) if s >= 0 else 'no step'} ({label})" for s, label, kind, n in stray)
    return [_row(base, "collectives", "outside", False, "no collective outside the cell's steps", said)]


def collective_checks(cell: Cell, obs: Observation, plan: PrecisionPlan, base: dict,
                      ref: ReferenceRun | None = None) -> list[Record]:
    """``collectives``: what the cell's own training issued, counted where ``torch.distributed`` issues
    it, per step and segment of the loop, against the path's units and the cell's accumulation:

    - a backward that synchronizes reduce-scatters once per unit with something to train
      (:func:`expected_reductions`); one inside a ``set_requires_gradient_sync(False)`` window
      reduce-scatters nothing (HSDP ``replicas-last``: every backward reduce-scatters, the replica
      all-reduce waits for the last);
    - forwards, evaluation forwards and state dicts reduce nothing; a forward or backward
      all-gathers each unit at most once (evaluation: once per evaluation forward); with the units
      kept gathered across micro-batches, a step's first forward gathers every unit and later ones
      none that trains (:func:`_kept_gathered`);
    - the forwards of a step all-reduce once per tensorwise FP8 weight (its amax), nothing else;
    - the optimizer segment all-reduces once per FSDP-ignored gradient (its owner) and, with a loss
      scale, once for the gradient scaler's found-inf (on one rank too), nothing else;
    - otherwise nothing is issued on one rank;
    - what travels (bytes per call, :func:`_wire`): each all-gather one unit's parameters in their
      compute dtypes (a quantized weight's E4M3 payload, one byte per element), each
      synchronizing reduce-scatter one unit's trained parameters in their reduce dtypes (a
      reduction in BF16 carries half the bytes).

    HSDP: the same over the ``shard`` dimension, plus one all-reduce per unit across replicas in each
    backward that synchronizes them (:func:`_syncs`), carrying the unit's shard. FSDP x TP and EP:
    the same for FSDP's own collectives, counts and bytes, over the dimension FSDP shards (TP:
    ``dp``, whose all-gathers carry each tensor-parallel weight's local tp shard; EP: every rank,
    the experts excluded). TP's and the experts' own exchanges and the gradient norm's all-reduces
    are functional collectives, counted at the dispatcher and held to :mod:`.exchanges` (counts;
    their dtypes: ``dtype.tp_reduce``)."""
    counts = obs.contracts.collectives
    units = sum(1 for u in obs.report.units if u.params)
    unit_modules = tuple(m for u in obs.report.units for m in u.modules)
    ignored = {t.fqn for t in plan.params if t.ownership == "ignored" and t.requires_grad}
    rows = []
    fixture = get_fixture(cell.fixture, cell.source)
    for step in range(cell.steps):
        got = {(label, kind): len(sizes) for (s, label, kind), sizes in counts.items() if s == step}
        functional = {(label, kind.removeprefix(FUNCTIONAL_PREFIX)): n for (label, kind), n in got.items()
                      if kind.startswith(FUNCTIONAL_PREFIX)}
        got = {k: n for k, n in got.items() if not k[1].startswith(FUNCTIONAL_PREFIX)}
        want: dict[tuple[str, str], int] = {}
        bound: dict[tuple[str, str], int] = {}
        floor: dict[tuple[str, str], int] = {}
        if cell.ranks > 1:
            reductions = expected_reductions(cell, obs, plan, step)
            for mb in range(cell.microbatches):
                scatters, replicas = _syncs(cell, mb)
                want[(f"mb{mb}/backward", "reduce-scatter")] = reductions if scatters else 0
                if replicas:
                    want[(f"mb{mb}/backward", "all-reduce")] = reductions
                bound[(f"mb{mb}/forward", "all-gather")] = bound[(f"mb{mb}/backward", "all-gather")] = units
            evals = len(cell.eval_labels(step))
            bound[("eval", "all-gather")] = units * evals
            floor.update(_kept_gathered(cell, obs, plan, step, units, bound))
            if cell.unshard_in_backward == "needed":  # the backward-free units gather in forward only
                free = set(get_fixture(cell.fixture, cell.source).backward_free)
                skipped = sum(1 for u in obs.report.units if u.params and u.root in free)
                for mb in range(cell.microbatches):
                    bound[(f"mb{mb}/backward", "all-gather")] = units - skipped
        owners = sum(1 for f in ignored if plan[f].trainable_from <= step) if cell.ranks > 1 else 0
        scaler = 1 if loss_scale(plan.config.param_dtype) != 1.0 else 0  # the scaler agrees on found-inf
        if owners + scaler:
            want[("optimizer", "all-reduce")] = owners + scaler
        problems: list[tuple[str, str]] = []
        # a tensorwise FP8 weight agrees on its amax once per step, at its first all-gather (a forward)
        scales = sum(1 for t in plan.params if t.format == "fp8-tensorwise") if cell.ranks > 1 else 0
        amax = sum(n for (label, kind), n in got.items() if kind == "all-reduce" and label.endswith("/forward"))
        if amax != scales:
            problems.append(("mb0/forward", f"the step's forwards: {amax} all-reduce, expected {scales} "
                             "(one per tensorwise FP8 weight)"))
        got = {k: n for k, n in got.items() if not (k[1] == "all-reduce" and k[0].endswith("/forward"))}
        for (label, kind), n in sorted(got.items()):
            if (label, kind) in want or (label, kind) in bound:
                continue
            problems.append((label, f"{n} {kind}, expected none"))
        for key, n in want.items():
            if got.get(key, 0) != n:
                problems.append((key[0], f"{got.get(key, 0)} {key[1]}, expected {n}"))
        for key, n in bound.items():
            if got.get(key, 0) > n:
                problems.append((key[0], f"{got.get(key, 0)} {key[1]}, expected at most {n}"))
        for key, n in floor.items():
            if got.get(key, 0) < n:
                problems.append((key[0], f"{got.get(key, 0)} {key[1]}, expected at least {n} (every unit is "
                                 "sharded again after the optimizer step)"))
        if cell.ranks > 1 and ref is not None and ref.params:
            problems += _wire(cell, obs, plan, ref, step)
        graded = set(ref.grads[step]) if ref is not None and step < len(ref.grads) else None
        odd, owed = exchanges.problems(cell, fixture, plan, step, graded, unit_modules, functional)
        problems += odd
        labels = cell.segments(step)
        labels += sorted(({label for label, _ in got} | {label for label, _ in problems}) - set(labels))
        for label in labels:
            bad = [text for where, text in problems if where == label]
            expected = _expected(label, want, bound, floor, scales, units) if cell.ranks > 1 else \
                "no FSDP collective on one rank"
            if owed.get(label):
                expected += f"; {owed[label]} (tensor / expert parallelism, the gradient norm)"
            elif exchanges.unobserved(cell, label):
                expected += " (functional collectives not counted in this segment on this mesh)"
            row = _row(base, "collectives", label, not bad, expected, "; ".join(bad) or "as expected")
            rows.append(replace(row, step=step))
    return rows + _outside(cell, counts, base)


def _expected(label: str, want: dict, bound: dict, floor: dict, scales: int, units: int) -> str:
    """What one segment owes, in words: exact counts, bounds, the FP8 amax agreement."""
    parts = [f"{n} {kind}" for (where, kind), n in sorted(want.items()) if where == label and n]
    for (where, kind), n in sorted(bound.items()):
        if where == label and (where, kind) not in want:
            low = floor.get((where, kind))
            parts.append(f"{low} {kind}" if low == n else f"{low}-{n} {kind}" if low else f"at most {n} {kind}")
    if label.endswith("/forward") and scales:
        parts.append(f"{scales} all-reduce over the step's forwards (tensorwise FP8 amax)")
    what = ", ".join(parts) + ", nothing else" if parts else "no collective"
    return f"{what} ({units} units; each all-gather one unit in its compute dtypes, each reduce-scatter one unit's " \
        "trained parameters in their reduce dtypes)" if parts else what
