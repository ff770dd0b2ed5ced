"""Records: one row per cell x check x name, each with its verdict and the evidence for it."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from enum import StrEnum


class Verdict(StrEnum):
    """A record's verdict; a cell's is its worst record's (see :data:`SEVERITY`)."""

    PASS = "PASS"
    FAIL = "FAIL"
    ERROR = "ERROR"
    TIMEOUT = "TIMEOUT"
    SKIP = "SKIP"


VERDICTS = tuple(v.value for v in Verdict)
#: TIMEOUT/ERROR > FAIL > PASS > SKIP.
SEVERITY = {Verdict.ERROR: 4, Verdict.TIMEOUT: 4, Verdict.FAIL: 3, Verdict.PASS: 1, Verdict.SKIP: 0}
BAD = (Verdict.FAIL, Verdict.ERROR, Verdict.TIMEOUT)


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


COLUMNS = [f.name for f in fields(Record)]


def judge(observed: float, allowed: float) -> tuple[float, Verdict, str]:
    """(ratio, verdict, detail) for a numeric comparison; exact matches say so."""
    if math.isnan(observed):
        return math.inf, Verdict.FAIL, "NaN"
    if observed == 0.0:
        return 0.0, Verdict.PASS, "exact"
    ratio = observed / allowed if allowed > 0 else math.inf
    return ratio, (Verdict.PASS if ratio <= 1.0 else Verdict.FAIL), ""
