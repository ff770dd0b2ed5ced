"""Records: one row per cell x check x name, each with its verdict and the evidence for it."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from enum import StrEnum


class Verdict(StrEnum):
    """A record's verdict; a cell's is its worst record's (see :data:`SEVERITY`)."""

    PASS = "PASS"
    FAIL = "FAIL"
    INCONCLUSIVE = "INCONCLUSIVE"
    """Within its allowance, but the allowance is at least half of what it judges (:data:`BAR`)."""
    ERROR = "ERROR"
    TIMEOUT = "TIMEOUT"
    SKIP = "SKIP"
    UNPAIRED = "UNPAIRED"
    """A cross-path pair that could not be compared (the reason is in ``detail``)."""


class Unpaired(StrEnum):
    """Why a ``baseline~path`` pair was not compared: the ``name`` of its UNPAIRED row (the
    gate decides on these codes; ``detail`` says it in words)."""

    EXPECTED_ISOLATION_ERROR = "expected-isolation-error"
    """One side raised the isolation error the model declares: nothing to compare, by design."""
    SKIPPED = "skipped"
    """One side was skipped (a matrix skip, too few GPUs)."""
    DID_NOT_FINISH = "did-not-finish"
    """One side crashed or hung (ERROR / TIMEOUT)."""
    NOT_JUDGED = "not-judged"
    """One side's judging failed."""
    DID_NOT_TRAIN = "did-not-train"
    """One side stopped before training (an unexpected error or an undeclared refusal)."""
    BASELINE_NOT_RUN = "baseline-not-run"
    """The baseline's cell was not in the run (filtered out)."""


#: UNPAIRED reasons a run passes with (it exits 0 with them): the model declares the isolation
#: error, or the twin was skipped or filtered out. Every other reason stems from the twin's
#: failure, whose own ERROR / TIMEOUT records fail the run. The pytest plugin and JUnit read it.
NOT_ASKED = (Unpaired.EXPECTED_ISOLATION_ERROR, Unpaired.SKIPPED, Unpaired.BASELINE_NOT_RUN)

VERDICTS = tuple(v.value for v in Verdict)
#: TIMEOUT/ERROR > FAIL > INCONCLUSIVE > UNPAIRED > PASS > SKIP.
SEVERITY = {Verdict.ERROR: 5, Verdict.TIMEOUT: 5, Verdict.FAIL: 4, Verdict.INCONCLUSIVE: 3, Verdict.UNPAIRED: 2,
            Verdict.PASS: 1, Verdict.SKIP: 0}
#: Verdicts that make ``run`` exit 1.
BAD = (Verdict.FAIL, Verdict.ERROR, Verdict.TIMEOUT, Verdict.INCONCLUSIVE)


@dataclass(kw_only=True)
class Record:
    cell: str
    fixture: str
    path: str
    path_taken: str = ""
    fallback_reason: str = ""
    ranks: int = 1
    microbatches: int = 1
    sync: str = "every"
    checkpointing: str = "none"
    reshard: str = "on"
    output_dtype: str = "natural"
    seed: int = 0
    param_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    optimizer: str = "adamw"
    init: str = "seeded"
    mesh: str = "fsdp"
    weights: str = "none"
    step: int | str = ""
    check: str = ""
    name: str = ""
    observed: float | str = ""
    allowed: float | str = ""
    ratio: float | str = ""
    dtype: str = ""
    """The dtype whose unit roundoff justified ``allowed``."""
    verdict: Verdict = Verdict.PASS
    detail: str = ""
    fp64_observed: float | str = ""
    """Error of the FSDP run against an FP64 reference (information, no verdict)."""
    signal: float | str = ""
    """The size of what was judged (max |expected|; max |dp| of the step for parameters)."""
    allowed_over_signal: float | str = ""
    """``allowed / signal``: at :data:`BAR` or more the allowance proves too little (INCONCLUSIVE)."""


COLUMNS = [f.name for f in fields(Record)]


def judge(observed: float, allowed: float) -> tuple[float, Verdict, str]:
    """(ratio, verdict, detail) for a numeric comparison; exact matches say so."""
    if math.isnan(observed):
        return math.inf, Verdict.FAIL, "NaN"
    if observed == 0.0:
        return 0.0, Verdict.PASS, "exact"
    ratio = observed / allowed if allowed > 0 else math.inf
    return ratio, (Verdict.PASS if ratio <= 1.0 else Verdict.FAIL), ""


def vacuity(allowed: float, signal: float) -> float:
    """``allowed / signal`` (inf when something is allowed of nothing, 0 when nothing is)."""
    if allowed <= 0:
        return 0.0
    return allowed / signal if signal > 0 else math.inf


#: Checks whose PASS is an outcome, not a measurement (the declared isolation error was raised, a
#: fallback was declared, no module diverged): the only PASS records that carry no observed,
#: allowed and ratio; every other PASS is a measurement within its allowance.
OUTCOME_CHECKS = frozenset(("expected_error", "fallback", "divergence"))
#: Checks that say where a cell's other failures arose first (the stage, the first divergent
#: module): no evidence of their own.
LOCATING_CHECKS = frozenset(("stage", "divergence"))

#: The largest share of the judged signal an allowance may take: at half, a change of the
#: signal's own size still lands at least twice the allowance away from the expectation.
BAR = 0.5


def conclusive(verdict: Verdict, allowed: float, signal: float) -> Verdict:
    """A PASS whose allowance is at least half of what it judges is INCONCLUSIVE."""
    if verdict == Verdict.PASS and vacuity(allowed, signal) >= BAR:
        return Verdict.INCONCLUSIVE
    return verdict


def explained(verdict: Verdict, allowed: float, signal: float, detail: str) -> str:
    """``detail``, led for an INCONCLUSIVE record by why: its ratio alone reads as a pass."""
    if verdict != Verdict.INCONCLUSIVE:
        return detail
    why = (f"inconclusive: the allowance is {vacuity(allowed, signal):.2g} of the change it judges ({signal:.3g}), "
           f"at least {BAR:g}: too small a change to tell a bug from rounding (a step that changes more settles "
           "it; on BF16-stored weights later steps change less, so more steps may not)")
    return "; ".join(x for x in (why, detail) if x)


def badness(r: Record) -> tuple[bool, float]:
    """How bad a record is, for keeping the worst rank's: failing first, then by ratio (NaN worst)."""
    ratio = r.ratio if isinstance(r.ratio, float) and not math.isnan(r.ratio) else math.inf
    return r.verdict != Verdict.PASS, ratio
