"""Records: one row per cell x check x name, appended to ``cells.csv`` as cells finish."""

from __future__ import annotations

import csv
import math
import os
from dataclasses import asdict, dataclass, fields

VERDICTS = ("PASS", "FAIL", "ERROR", "TIMEOUT", "SKIP")


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
    verdict: str = "PASS"
    detail: str = ""
    fp64_observed: float | str = ""
    """Error of the FSDP run against an FP64 reference (information, no verdict)."""


COLUMNS = [f.name for f in fields(Record)]


def judge(observed: float, allowed: float) -> tuple[float, str, str]:
    """(ratio, verdict, detail) for a numeric comparison; exact matches say so."""
    if math.isnan(observed):
        return math.inf, "FAIL", "NaN"
    if observed == 0.0:
        return 0.0, "PASS", "exact"
    ratio = observed / allowed if allowed > 0 else math.inf
    return ratio, ("PASS" if ratio <= 1.0 else "FAIL"), ""


def _fmt(v):
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.6g}"
    return v


class RecordWriter:
    """Appends rows and flushes after every cell, so a killed run keeps what finished."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._fh = open(path, "w", newline="")
        self._csv = csv.DictWriter(self._fh, fieldnames=COLUMNS)
        self._csv.writeheader()
        self._fh.flush()

    def write(self, records: list[Record]) -> None:
        for r in records:
            self._csv.writerow({k: _fmt(v) for k, v in asdict(r).items()})
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()
