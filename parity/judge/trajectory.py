"""Multi-step evidence: where training goes, judged against an FP64 trajectory.

Per-step checks resync the reference to the sharded run before every step, which is right
for judging one step but says nothing about where several steps lead. Here three runs of
the cell's steps are compared at the end: the sharded run S, the emulating reference E
following its own trajectory (no resync) and the FP64 reference F.

S and E are the same mixed-precision recipe; they differ only in the order of FP32 sums.
Their distances to F are therefore the recipe's own error plus reordering noise, and a
sharded run whose distance exceeds **twice** the emulation's is less accurate than the
recipe can explain: ``d(S, F) <= 2 d(E, F) + u(storage) |F|``. The factor 2 is the triangle
inequality for two computations of equal accuracy (d(S, E) <= d(S, F) + d(E, F)); the floor
is one rounding in the storage dtype, for parameters the recipe computes exactly.
Distances are L2 norms over each parameter: Adam's sign flips move single elements by ~lr,
which a max norm would let swamp the comparison, while the L2 norm of the whole step
(the signal) grows with every element that moved. A record names the dtype that justifies its
allowance: the storage dtype where the floor dominates, else the recipe's compute dtype (the
coarser of storage and ``param_dtype``), whose roundings put E where it is.
"""

from __future__ import annotations

import math

import torch

from parity.judge.record import Record, Verdict, conclusive, explained, judge, vacuity
from parity.judge.reference import ReferenceRun
from parity.model.dtypes import coarser, dtype_name, unit_roundoff
from parity.model.plan import PrecisionPlan

#: d(S, F) may be at most this multiple of d(E, F) (see the module docstring).
MULTIPLE = 2.0


def _l2(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    return float((a.double() - b.double()).norm())


def trajectory_records(sharded: list[dict[str, torch.Tensor]], own: ReferenceRun, fp64: ReferenceRun,
                       initial: dict[str, torch.Tensor], plan: PrecisionPlan, base: dict) -> list[Record]:
    """One record per trainable parameter at the last step."""
    last = len(fp64.params) - 1
    rows = []
    for t in plan.params:
        if not t.requires_grad or t.trainable_from > last:  # never trained in these steps
            continue
        if t.trainable_from == last:  # one step: no trajectory beyond it, and ``param`` judges that step
            rows += [Record(**base, step=last, check=check, name=t.fqn, verdict=Verdict.SKIP,
                            detail=f"trained for one step only (unfrozen at step {last}): the param check judges it")
                     for check in ("trajectory", "trajectory.emulation")]
            continue
        truth = fp64.params[last][t.fqn]
        s = sharded[last].get(t.fqn, torch.zeros(0))
        d_s, d_e = _l2(s, truth), _l2(own.params[last][t.fqn], truth)
        floor = unit_roundoff(t.storage) * float(truth.double().norm())
        allowed = MULTIPLE * d_e + floor
        # which dtype justifies it: the emulated recipe's distance from FP64 comes from its compute dtype
        dtype = dtype_name(t.storage if floor >= MULTIPLE * d_e else coarser(t.storage, plan.config.param_dtype))
        signal = _l2(truth, initial[t.fqn])
        ratio, verdict, how = judge(d_s, allowed)
        verdict = conclusive(verdict, allowed, signal)
        basis = (f"L2 after {last + 1} steps: {MULTIPLE:g} x d(emulation, fp64) {d_e:.3g} + "
                 f"1 x u({dtype_name(t.storage)}) x |fp64| {floor:.3g}")
        rows.append(Record(**base, step=last, check="trajectory", name=t.fqn, observed=d_s, allowed=allowed,
                           ratio=ratio, dtype=dtype, verdict=verdict,
                           detail=explained(verdict, allowed, signal, "; ".join(x for x in (how, basis) if x)),
                           signal=signal,
                           allowed_over_signal=vacuity(allowed, signal)))
        rows.append(_direct(base, last, t, s, own.params[last][t.fqn], allowed, signal, d_e, floor, dtype))
    return rows


def _direct(base: dict, last: int, t, s: torch.Tensor, e: torch.Tensor, allowed: float, signal: float,
            d_e: float, floor: float, dtype: str) -> Record:
    """``trajectory.emulation``: the sharded run against the emulating reference itself,
    ``d(S, E) <= 2 d(E, F) + u |F|`` -- the same budget as against FP64, so a run that drifts
    from the recipe it emulates fails even where FP64 is far from both (the triangle
    inequality alone would allow ``3 d(E, F)``)."""
    d_se = _l2(s, e)
    ratio, verdict, how = judge(d_se, allowed)
    verdict = conclusive(verdict, allowed, signal)
    basis = (f"L2 after {last + 1} steps, sharded vs emulation: {MULTIPLE:g} x d(emulation, fp64) {d_e:.3g} + "
             f"1 x u({dtype_name(t.storage)}) x |fp64| {floor:.3g}")
    return Record(**base, step=last, check="trajectory.emulation", name=t.fqn, observed=d_se, allowed=allowed,
                  ratio=ratio, dtype=dtype, verdict=verdict,
                  detail=explained(verdict, allowed, signal, "; ".join(x for x in (how, basis) if x)), signal=signal,
                  allowed_over_signal=vacuity(allowed, signal))
