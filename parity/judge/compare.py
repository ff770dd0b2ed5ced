"""Numeric comparisons: the sharded run against the reference, and the two paths against
each other. Each comparison becomes a :class:`~parity.judge.record.Record` with observed error,
allowed error, their ratio, and the dtype that justified the allowance."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from parity.execute.observation import Observation
from parity.judge import tolerance
from parity.judge.record import Record, Verdict, conclusive, explained, judge, vacuity
from parity.judge.rows import few
from parity.judge.reference import ReferenceRun
from parity.model.plan import PrecisionPlan
from parity.paths.base import UnitSpec


@dataclass(kw_only=True)
class Assembled:
    """Observations of all ranks, with sharded tensors reassembled to full tensors."""

    outputs: list[list[torch.Tensor]] = field(default_factory=list)
    input_grads: list[list[torch.Tensor | None]] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    reduced: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Per step of a clipping or loss-scaled cell, the gradients before unscaling and clipping."""
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    moments: list[dict[str, dict[str, torch.Tensor]]] = field(default_factory=list)
    """Per step, optimizer state key -> fqn -> the full state tensor after the step."""
    grad_norms: list[float] = field(default_factory=list)
    clipped_norms: list[float] = field(default_factory=list)
    evals: dict[tuple[int, str], list[torch.Tensor | None]] = field(default_factory=dict)
    """(step, label) -> each rank's evaluation output (None: that rank has none)."""


def replicated(plan: PrecisionPlan, fqn: str, value, whole: bool) -> bool:
    """Whether every rank holds the whole of ``fqn`` (whole-tensor observations of 2-D meshes,
    ignored parameters, scalars such as an optimizer's step) rather than a dim-0 shard."""
    entry = plan.get(fqn)
    return whole or bool(entry and entry.ownership == "ignored") or not isinstance(value, torch.Tensor) or value.dim() == 0


def piece(t: torch.Tensor, region: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The part of the whole tensor ``t`` a rank holds, ``region`` ``((offset, length), ...)`` per
    dimension (:func:`parity.execute.probes.region`); all of ``t`` for an empty region."""
    return t[tuple(slice(offset, offset + n) for offset, n in region)] if region else t


def gather_full(plan: PrecisionPlan, fqn: str, per_rank: list[dict], whole: bool = False) -> torch.Tensor:
    """The full tensor of ``fqn`` from each rank's local piece: FSDP2 shards dim 0 in rank
    order, so local shards concatenate; ignored parameters (and scalars such as an
    optimizer's step) are replicated, so rank 0's copy is taken, as it is when ranks
    recorded ``whole`` tensors (2-D compositions). Missing -> empty tensor."""
    if any(fqn not in d for d in per_rank):
        return torch.zeros(0)
    first = per_rank[0][fqn]
    if replicated(plan, fqn, first, whole):  # every rank's copy is held to rank 0's: agreement_records
        return first
    return torch.cat([d[fqn] for d in per_rank], dim=0)


def held_by_every_rank(per_rank: list[dict]) -> list:
    """The keys every rank's dict holds, in the order the ranks first hold them: what the judge
    can reassemble. One some rank lacks is :func:`unheld`'s finding (``ranks``), and the checks
    that expect it report it missing; a rank-0-only key once reached the reference empty and
    crashed it, a rank-1-only one went unseen."""
    return [k for k in dict.fromkeys(k for d in per_rank for k in d) if all(k in d for d in per_rank)]


def unheld(per_rank: list[dict], kind: str, name=str) -> list[str]:
    """Per rank, the entries of ``kind`` it lacks that another rank holds (``name(key)`` each):
    every rank observes the same tensors, each its own shard or copy."""
    every = dict.fromkeys(k for d in per_rank for k in d)
    out = []
    for rank, d in enumerate(per_rank):
        lacking = [name(k) for k in every if k not in d]
        if lacking:
            out.append(f"rank {rank} lacks {kind} {few(lacking)}")
    return out


def assemble(observations: list[Observation], plan: PrecisionPlan) -> Assembled:
    """Observations of all ranks with sharded tensors reassembled (:func:`gather_full`), each
    per-parameter entry every rank holds (:func:`held_by_every_rank`)."""
    def full(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {f: gather_full(plan, f, per_rank, observations[0].whole) for f in held_by_every_rank(per_rank)}

    run = Assembled(grad_norms=list(observations[0].grad_norms), clipped_norms=list(observations[0].clipped_norms))
    world = len(observations)
    for k in range(len(observations[0].outputs)):
        run.outputs.append([observations[r].outputs[k] for r in range(world)])
        run.input_grads.append([observations[r].input_grads[k] for r in range(world)])
    for r, o in enumerate(observations):
        for e in o.evals:
            run.evals.setdefault((e.step, e.label), [None] * world)[r] = e.output
    for step in range(len(observations[0].grads)):
        run.grads.append(full([o.grads[step] for o in observations]))
        run.params.append(full([o.params[step] for o in observations]))
    for step in range(min(len(o.moments) for o in observations)):
        per_rank = [o.moments[step] for o in observations]
        run.moments.append({key: full([m[key] for m in per_rank]) for key in held_by_every_rank(per_rank)})
    for step in range(min(len(o.reduced) for o in observations)):
        run.reduced.append(full([o.reduced[step] for o in observations]))
    return run


def differing(plan: PrecisionPlan, whole: bool, per_rank: list[dict], fqn_of=lambda key: key) -> list[tuple[int, object]]:
    """(index into ``per_rank``, key) of every replicated entry of rank 0's ``per_rank[0]`` (key ->
    value; ``fqn_of(key)`` its parameter) that another rank holds otherwise, bitwise: what is
    replicated is judged from rank 0's copy, so each other rank is held to it."""
    return [(i, key) for key, value in per_rank[0].items() if replicated(plan, fqn_of(key), value, whole)
            for i, other in enumerate(per_rank[1:], 1) if not _same(other.get(key), value)]


def agreement_records(observations: list[Observation], plan: PrecisionPlan, base: dict) -> list[Record]:
    """Every rank is a witness of what is replicated: each step's global gradient norm and
    clipped norm (all-reduced scalars) and every replicated gradient, parameter, optimizer
    moment and reduced gradient must be bitwise the same on every rank, since the judged
    values are rank 0's (:func:`assemble`): one ``ranks`` ``replicated`` record per step. And
    every rank must hold the same entries of each kind (:func:`unheld`): a ``held:KIND`` record
    per kind and step, placed at the stage that kind comes from."""
    rows = []
    first, whole = observations[0], observations[0].whole
    for step in range(len(first.grad_norms)):
        problems = [f"rank {o.rank}: {name} {got[step:step + 1]!r} vs rank 0's {want[step:step + 1]!r}"
                    for o in observations[1:] for name, got, want in
                    (("grad_norm", o.grad_norms, first.grad_norms), ("clipped_norm", o.clipped_norms, first.clipped_norms))
                    if got[step:step + 1] != want[step:step + 1]]
        held = []
        for kind, per_rank in _replicated_kinds(observations, step):
            problems += [f"rank {observations[i].rank}: {kind} {key} differs from rank 0's"
                         for i, key in differing(plan, whole, per_rank, lambda k: k[0] if isinstance(k, tuple) else k)]
            lacking = unheld(per_rank, kind, lambda k: ".".join(k) if isinstance(k, tuple) else k)
            held.append(_agreement(base, step, f"held:{kind}", lacking,
                                   f"the same {kind} entries on all {len(observations)} ranks"))
        rows += [_agreement(base, step, "replicated", problems,
                            f"grad norm and replicated tensors bitwise equal on all {len(observations)} ranks"), *held]
    return rows


def _agreement(base: dict, step: int, name: str, problems: list[str], agreed: str) -> Record:
    ok = not problems
    return Record(**base, step=step, check="ranks", name=name, observed=0.0 if ok else 1.0, allowed=0.0,
                  ratio=0.0 if ok else math.inf, verdict=Verdict.PASS if ok else Verdict.FAIL,
                  detail=agreed if ok else "; ".join(problems)[:1000])


def _replicated_kinds(observations: list[Observation], step: int):
    """(kind, one dict per rank) of each step's per-parameter observations; a moment is keyed
    (fqn, state). A rank that lacks the step holds an empty dict, so rank 0's entries differ."""
    def at(seq: list) -> dict:
        return seq[step] if step < len(seq) else {}

    yield "grad", [at(o.grads) for o in observations]
    yield "param", [at(o.params) for o in observations]
    yield "reduced", [at(o.reduced) for o in observations]
    yield "moment", [{(fqn, key): v for key, per_fqn in at(o.moments).items() for fqn, v in per_fqn.items()}
                     for o in observations]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    return a == b


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    b = b.to(a.device)
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def _missing(actual, expected) -> bool:
    """An observation that is absent (stood in for by an empty tensor) where one was expected."""
    return (isinstance(actual, torch.Tensor) and actual.numel() == 0
            and isinstance(expected, torch.Tensor) and expected.numel() > 0)


def amax(t: torch.Tensor) -> float:
    return float(t.double().abs().max()) if t.numel() else 0.0


def moment_change(after: torch.Tensor, before) -> float | None:
    """What one step changed a moment by: the signal its allowance is held to (a moment's own size
    would let a skipped update pass once the moment has grown); None where the moment before
    the step is unknown (its size then stands in)."""
    if not isinstance(before, torch.Tensor) or before.shape != after.shape:
        return None
    return amax(after.double() - before.double())


@dataclass
class Comparison:
    """One planned comparison: what to compare and what allowance it gets."""

    step: int | str
    check: str
    name: str
    actual: torch.Tensor | float
    expected: torch.Tensor | float
    allowance: tolerance.Allowance
    truth: torch.Tensor | float | None = None
    signal: float | None = None
    """The size of what is judged; None: max |expected|."""
    missing: str = ""
    """Why ``actual`` is absent (an empty tensor) when the generic reason would mislead."""
    absent: bool = False
    """Evidence is missing whatever ``actual`` and ``expected`` hold (a cross-path comparison
    whose baseline observed nothing: two empty sides are no agreement): a FAIL."""

    def _observed(self) -> tuple[float, float]:
        """(observed, allowed): the worst element's for element-wise allowances."""
        per = self.allowance.per_element
        if per is None or not isinstance(self.actual, torch.Tensor) or self.actual.shape != per.shape:
            if isinstance(self.actual, torch.Tensor):
                return max_abs(self.actual, self.expected), self.allowance.allowed
            return abs(self.actual - self.expected), self.allowance.allowed
        diff = (self.actual.double() - self.expected.to(self.actual.device).double()).abs()
        if bool(diff.isnan().any()):
            return float("nan"), self.allowance.allowed
        if not diff.numel() or not bool(diff.ne(0).any()):
            return 0.0, self.allowance.allowed
        ratios = torch.where(per > 0, diff / per.clamp_min(torch.finfo(torch.float64).tiny),
                             torch.where(diff > 0, torch.inf, 0.0))
        worst = int(torch.argmax(ratios))
        return float(diff.flatten()[worst]), float(per.flatten()[worst])

    def record(self, base: dict) -> Record:
        observed, allowed = self._observed()
        ratio, verdict, detail = judge(observed, allowed)
        signal = self.signal if self.signal is not None else (
            amax(self.expected) if isinstance(self.expected, torch.Tensor) else abs(self.expected))
        verdict = conclusive(verdict, self.allowance.allowed, signal)
        if self.absent:
            ratio, verdict = math.inf, Verdict.FAIL
        if self.absent or _missing(self.actual, self.expected):
            detail = self.missing or "missing: the run produced nothing to compare"
        detail = explained(verdict, self.allowance.allowed, signal,
                           "; ".join(x for x in (detail, self.allowance.basis) if x))
        fp64 = ""
        if self.truth is not None:
            fp64 = max_abs(self.actual, self.truth) if isinstance(self.actual, torch.Tensor) else abs(self.actual - self.truth)
        return Record(
            **base, step=self.step, check=self.check, name=self.name, observed=observed,
            allowed=allowed, ratio=ratio, dtype=self.allowance.dtype_name,
            verdict=verdict, detail=detail, fp64_observed=fp64,
            signal=signal, allowed_over_signal=vacuity(self.allowance.allowed, signal),
        )


def plan_comparisons(
    run: Assembled, ref: ReferenceRun, plan: PrecisionPlan, *, micro: int,
    replayed: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]], world: int = 1,
    truth: ReferenceRun | None = None, optimizer: str = "adamw", data_ranks: list[int] | None = None,
    input_casts: tuple[torch.dtype, ...] = (),
) -> list[Comparison]:
    """Outputs, input gradients, gradients and the gradient norm against the reference run;
    post-step parameters against the reference optimizer replayed on the observed gradients
    from the observed previous parameters (``replayed[step]`` = (before, after)).
    ``data_ranks[r]``: the reference's rank whose data rank ``r`` saw (tensor-parallel peers
    share theirs); identity when None. ``input_casts``: the dtypes a unit may have cast the
    model's input to (:func:`input_casts`)."""
    out: list[Comparison] = []
    for k, per_rank in enumerate(run.outputs):
        step, mb = divmod(k, micro)
        for r, actual in enumerate(per_rank):
            d = data_ranks[r] if data_ranks else r
            expected = ref.outputs[k][d]
            allow = last_rounding_of(expected)
            t = truth.outputs[k][d] if truth else None
            out.append(Comparison(step, "output", f"rank{r}/mb{mb}", actual, expected, allow, t))
            g, eg = run.input_grads[k][r], ref.input_grads[k][d]
            if eg is None:  # the reference's input has no gradient (token input): nothing to expect
                continue
            allow = tolerance.last_rounding(functools.reduce(tolerance.coarser, input_casts, eg.dtype), amax(eg))
            t = truth.input_grads[k][d] if truth else None
            # a sharded run whose input got no gradient (a path that detached it) is missing evidence
            actual = g if g is not None else torch.zeros(0)
            out.append(Comparison(step, "input_grad", f"rank{r}/mb{mb}", actual, eg, allow, t))
    out += _eval_comparisons(run, ref, world, data_ranks)
    for step, grads in enumerate(ref.grads):
        spread = clipped_spread = 0.0  # sum over gradients of numel x allowance^2
        coef = ref.clip_coefs[step] if step < len(ref.clip_coefs) else 1.0
        staged = step < len(ref.reduced)  # unscaling or clipping comes between reduction and step
        for f, expected in grads.items():
            entry = plan[f]
            scale = ref.terms_scale(step).get(f, amax(expected))
            allow = tolerance.gradient(entry.sum_dtype, entry.kept_grad, ref.grad_terms, scale)
            spread += expected.numel() * allow.allowed ** 2
            if staged:
                actual = run.reduced[step].get(f, torch.zeros(0)) if step < len(run.reduced) else torch.zeros(0)
                t = truth.reduced[step][f] if truth else None
                out.append(Comparison(step, "grad", f, actual, ref.reduced[step][f], allow, t))
            allow = tolerance.clipped(allow, coef, entry.kept_grad, scale)
            clipped_spread += expected.numel() * allow.allowed ** 2
            actual = run.grads[step].get(f, torch.zeros(0))
            t = truth.grads[step][f] if truth else None
            out.append(Comparison(step, "grad.clipped" if staged else "grad", f, actual, expected, allow, t))
        for f in sorted(set(run.grads[step]) - set(grads)):  # a gradient the plan says cannot exist
            allow = tolerance.gradient(torch.float32, torch.float32, ref.grad_terms, 0.0)
            out.append(Comparison(step, "grad", f, run.grads[step][f], torch.zeros(0), allow))
        largest = max((g.numel() for g in grads.values()), default=1)
        gdtype = max((g.dtype for g in grads.values()), key=tolerance.unit_roundoff, default=torch.float32)
        share = _coarse_share(grads)
        allow = tolerance.grad_norm(gdtype, largest, len(grads), world, ref.grad_norms[step], math.sqrt(spread), share)
        t = truth.grad_norms[step] if truth else None
        out.append(Comparison(step, "grad_norm", "global", run.grad_norms[step], ref.grad_norms[step], allow, t))
        if step < len(ref.clipped_norms):
            out.append(_clip_comparison(run, ref, step, gdtype, largest, len(grads), world, math.sqrt(clipped_spread),
                                        share))
        before, after = replayed[step]
        for f, expected in after.items():
            update = expected - before[f]
            allow = tolerance.parameter(plan[f].storage, expected, update, optimizer)
            t = truth.params[step][f] if truth else None
            actual, missing = run.params[step].get(f, torch.zeros(0)), ""
            if f in grads and f not in run.grads[step]:  # replayed without a gradient, an unmoved one would match
                actual, missing = torch.zeros(0), ("missing: the run observed no gradient of it at this step, so the "
                                                   "update it took cannot be replayed")
            out.append(Comparison(step, "param", f, actual, expected, allow, t, signal=amax(update), missing=missing))
    return out


def last_rounding_of(expected: torch.Tensor) -> tolerance.Allowance:
    """An output's allowance: one final rounding in the dtype the reference (which emulates the
    plan's casts) produced it in. Never the observed tensor's dtype: a run that returned a
    coarser dtype would widen its own allowance and name that dtype as its justification
    (``dtype.output`` names the wrong dtype itself)."""
    return tolerance.last_rounding(expected.dtype, amax(expected))


def _eval_comparisons(run: Assembled, ref: ReferenceRun, world: int, data_ranks: list[int] | None) -> list[Comparison]:
    """``eval``: each rank's evaluation output against the reference's forward with the same
    weights and no gradient (one final rounding, as outputs). A rank without one is missing."""
    out = []
    for (step, label), expected_per_rank in ref.evals.items():
        got = run.evals.get((step, label), [None] * world)
        for r in range(world):
            expected = expected_per_rank[data_ranks[r] if data_ranks else r]
            actual = got[r] if r < len(got) and got[r] is not None else torch.zeros(0)
            allow = last_rounding_of(expected)
            out.append(Comparison(step, "eval", f"rank{r}/{label}", actual, expected, allow))
    return out


def _coarse_share(grads: dict[str, torch.Tensor]) -> float:
    """The share of the squared global norm carried by gradients stored coarser than the norm's
    accumulation dtype (the reference's, in their kept dtypes): only their per-tensor norms are
    rounded coarsely (:func:`tolerance.grad_norm`)."""
    squares = {f: float(g.double().pow(2).sum()) for f, g in grads.items()}
    total = sum(squares.values())
    fine = tolerance.unit_roundoff(tolerance.ACCUMULATE_DTYPE)
    coarse = sum(v for f, v in squares.items() if tolerance.unit_roundoff(grads[f].dtype) > fine)
    return coarse / total if total > 0 else 1.0


def _clip_comparison(run: Assembled, ref: ReferenceRun, step: int, gdtype: torch.dtype, largest: int,
                     tensors: int, world: int, gradients: float, share: float = 1.0) -> Comparison:
    """``clip``: the global norm after clipping, judged as a norm of the clipped gradients. Its
    signal is what clipping removed from the norm: a cell whose max-norm is above the norm
    clipped nothing, and its PASS would be vacuous (INCONCLUSIVE). A run that recorded no
    clipped norm is judged as NaN (missing)."""
    expected = ref.clipped_norms[step]
    actual = run.clipped_norms[step] if step < len(run.clipped_norms) else math.nan
    allow = tolerance.grad_norm(gdtype, largest, tensors, world, expected, gradients, share)
    return Comparison(step, "clip", "global", actual, expected, allow, signal=ref.grad_norms[step] - expected)


def input_casts(units: tuple[UnitSpec, ...]) -> tuple[torch.dtype, ...]:
    """Where the model's input gradient was last rounded: at the cast of the input to the root
    unit's ``param_dtype`` when that unit casts its forward inputs; with no unit at the root,
    at any unit's cast that may take the input first. Nothing when no unit casts (``cast_inputs
    = "model"``): the input's own dtype then bounds the last rounding."""
    at_root = [u for u in units if "" in u.modules]
    return tuple(u.param_dtype for u in (at_root or units) if u.cast_forward_inputs and u.param_dtype is not None)


def _widened(c: Comparison, other_expected) -> tolerance.Allowance:
    """``c``'s allowance plus how far the other path's reference lies from ``c``'s (element by
    element where ``c`` is judged so): the two emulations differ by design there."""
    a = c.allowance
    if isinstance(c.expected, torch.Tensor):
        if not isinstance(other_expected, torch.Tensor) or other_expected.shape != c.expected.shape:
            return a
        gap = (c.expected.double() - other_expected.to(c.expected.device).double()).abs()
        worst = float(gap.max()) if gap.numel() else 0.0
        per = a.per_element + gap.to(a.per_element.device) if a.per_element is not None and \
            a.per_element.shape == gap.shape else None
    else:
        worst, per = abs(float(c.expected) - float(other_expected)), None
    return tolerance.Allowance(a.allowed + worst, a.dtype, f"{a.basis} + |reference gap| {worst:.3g} (compiled "
                               "graphs split at each path's own units)", per_element=per)


def cross_path(first: list[Comparison], second: Assembled, micro: int,
               widen: dict | None = None) -> list[Comparison]:
    """Compare two paths' runs of one cell with the allowances of the first's comparisons;
    ``widen`` -- (step, check, name) -> the second path's expectation -- adds to each allowance
    the gap between the two paths' references (compiled blocks: each path's graphs split where
    its own units' hooks run, and both references split the same way)."""
    out = []
    # parameters are judged per path against the optimizer replayed on that path's own
    # gradients; across paths, Adam may turn a legitimate gradient difference into an
    # lr-sized one, so the paths' trajectories are judged by ``trajectory`` instead
    for c in (c for c in first if c.check != "param"):  # same allowance, same signal: the baseline's
        step = c.step
        if c.check in ("output", "input_grad"):
            r, mb = c.name.split("/")
            k = step * micro + int(mb[2:])
            other = (second.outputs if c.check == "output" else second.input_grads)[k][int(r[4:])]
            other = other if other is not None else torch.zeros(0)  # missing: judged as such
        elif c.check == "grad":  # as reduced: before unscaling and clipping where they ran
            grads = second.reduced if second.reduced else second.grads
            other = grads[step].get(c.name, torch.zeros(0)) if step < len(grads) else torch.zeros(0)
        elif c.check == "grad.clipped":
            other = second.grads[step].get(c.name, torch.zeros(0))
        elif c.check == "eval":
            r, label = c.name.split("/")
            got = second.evals.get((step, label), [])
            other = got[int(r[4:])] if int(r[4:]) < len(got) and got[int(r[4:])] is not None else torch.zeros(0)
        elif c.check == "clip":
            other = second.clipped_norms[step] if step < len(second.clipped_norms) else math.nan
        else:
            other = second.grad_norms[step]
        key = (c.step, c.check, c.name)
        allowance = _widened(c, widen[key]) if widen and key in widen else c.allowance
        gone = _missing(c.actual, c.expected)  # the baseline observed nothing: no side to agree with
        out.append(Comparison(step, c.check, c.name, other, c.actual, allowance, signal=c.signal, absent=gone,
                              missing="missing: the baseline path produced nothing to compare" if gone else ""))
    return out
