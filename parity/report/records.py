"""``cells.csv``: records appended and flushed as each cell finishes, and read back."""

from __future__ import annotations

import csv
import math
import os
from dataclasses import asdict

from parity.errors import UsageError
from parity.judge.record import COLUMNS, Record, Verdict

_NUMERIC = ("observed", "allowed", "ratio", "fp64_observed", "signal", "allowed_over_signal")
_INTS = ("ranks", "microbatches", "seed")


def _fmt(v):
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.6g}"
    return v


class RecordWriter:
    """Appends rows and flushes after every cell, so a killed run keeps what finished.
    ``append=True`` continues an existing file (``--resume``)."""

    def __init__(self, path: str, append: bool = False):
        self.path = path
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._fh = open(path, "a" if append else "w", newline="")
        self._csv = csv.DictWriter(self._fh, fieldnames=COLUMNS)
        if not append:
            self._csv.writeheader()
        self._fh.flush()

    def write(self, records: list[Record]) -> None:
        for r in records:
            self._csv.writerow({k: _fmt(v) for k, v in asdict(r).items()})
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        """Every row was flushed by :meth:`write`; closing can only fail after a write already
        failed (and was reported), so it never raises."""
        try:
            self._fh.close()
        except OSError:
            pass


def _parse(row: dict[str, str]) -> Record:
    values: dict = dict(row)
    for k in _NUMERIC:
        if values[k] != "":
            values[k] = float(values[k])
    for k in _INTS:
        values[k] = int(values[k])
    if values["step"] != "":
        values["step"] = int(values["step"])
    values["verdict"] = Verdict(values["verdict"])
    return Record(**values)


def read_records(path: str) -> list[Record]:
    """Every complete row of a ``cells.csv`` (a torn last line of a killed run is dropped)."""
    with open(path, newline="") as fh:
        text = fh.read()
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    reader = csv.DictReader(text.splitlines(keepends=True))
    rows = list(reader)
    if reader.fieldnames and list(reader.fieldnames) != COLUMNS:
        raise UsageError(f"{path}: columns differ from this parity version's ({', '.join(COLUMNS[-3:])}, ...); "
                         "rerun the matrix with this version")
    if rows and (None in rows[-1] or any(v is None for v in rows[-1].values())):
        rows = rows[:-1]
    return [_parse(r) for r in rows]
