"""``cells.csv``: records appended and flushed as each cell finishes, and read back."""

from __future__ import annotations

import csv
import math
import operator
import os

from parity.errors import UsageError
from parity.judge.record import COLUMNS, Record, Verdict

NUMERIC_COLUMNS = ("observed", "allowed", "ratio", "fp64_observed", "signal", "allowed_over_signal")
_INTS = ("ranks", "microbatches", "seed")
_values = operator.attrgetter(*COLUMNS)


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
        self._rows = csv.writer(self._fh)
        if not append:
            self._rows.writerow(COLUMNS)
        self._fh.flush()

    def write(self, records: list[Record], *, sync: bool = True) -> None:
        """Append ``records`` and flush; ``sync`` also makes them durable (fsync)."""
        # rows as lists in COLUMNS' order (not asdict, which deep-copies, nor a dict per row:
        # a matrix writes ~100,000 rows and this was a tenth of the parent's judging time)
        self._rows.writerows([[_fmt(v) for v in _values(r)] for r in records])
        self._fh.flush()
        if sync:
            self.sync()

    def sync(self) -> None:
        os.fsync(self._fh.fileno())

    def tell(self) -> int:
        """Bytes in the file so far (what ``progress.jsonl`` records after a group)."""
        return os.fstat(self._fh.fileno()).st_size

    def close(self) -> None:
        """Every row was flushed by :meth:`write`; closing can only fail after a write already
        failed (and was reported), so it never raises."""
        try:
            self._fh.close()
        except OSError:
            pass


def _parse(row: dict[str, str]) -> Record:
    values: dict = dict(row)
    for k in NUMERIC_COLUMNS:
        if values[k] != "":
            values[k] = float(values[k])
    for k in _INTS:
        values[k] = int(values[k])
    if values["step"] != "":
        values["step"] = int(values["step"])
    values["verdict"] = Verdict(values["verdict"])
    if values["verdict"] == Verdict.PASS:  # a PASS its own numbers contradict was not written by a judge
        nums = {k: values[k] for k in ("observed", "allowed", "ratio") if values[k] != ""}
        if any(not math.isfinite(v) for v in nums.values()) or nums.get("ratio", 0.0) > 1.0:
            raise ValueError("a PASS whose numbers say otherwise: " + ", ".join(f"{k} {v:g}" for k, v in nums.items()))
    return Record(**values)


def read_records(path: str, *, whole: bool = False) -> list[Record]:
    """Every complete row of a ``cells.csv`` (a torn last line of a killed run is dropped, unless
    ``whole``: a file ``--resume`` cut at a recorded boundary has none). A file that cannot be read or a
    row that is not a record (a corrupted file) is a :class:`UsageError` naming its row."""
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8
        raise UsageError(f"{path} is unreadable ({exc}); rerun the matrix into a new --out") from None
    if text and not text.endswith("\n") and not whole:
        text = text[: text.rfind("\n") + 1]
    reader = csv.DictReader(text.splitlines(keepends=True))
    try:
        rows = list(reader)
    except csv.Error as exc:
        raise UsageError(f"{path} line {reader.line_num}: not CSV ({exc}); rerun the matrix into a new --out") from None
    if reader.fieldnames and list(reader.fieldnames) != COLUMNS:
        raise UsageError(f"{path}: columns differ from this parity version's ({', '.join(COLUMNS[-3:])}, ...); "
                         "rerun the matrix with this version")
    if rows and not whole and (None in rows[-1] or any(v is None for v in rows[-1].values())):
        rows = rows[:-1]
    records = []
    for n, row in enumerate(rows, 2):
        try:
            records.append(_parse(row))
        except (ValueError, TypeError) as exc:  # a missing or extra field, a number or verdict that is none
            raise UsageError(f"{path} row {n}: not a parity record ({exc}); rerun the matrix into a new --out "
                             "(or --overwrite)") from None
    return records
