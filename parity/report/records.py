"""``cells.csv``: records appended and flushed as each cell finishes, and read back."""

from __future__ import annotations

import csv
import io
import math
import operator
import os

from parity.errors import UsageError, text_file
from parity.judge.record import BAR, COLUMNS, OUTCOME_CHECKS, Record, Verdict

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
        # a detail is any exception's text: one holding a lone surrogate (a non-UTF-8 file name) is
        # written escaped, never a failed write that would lose the run's rows
        self._fh = text_file(path, "a" if append else "w", newline="")
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
    if values["verdict"] == Verdict.PASS and (why := _unjudged_pass(values)):
        raise ValueError(why)
    return Record(**values)


#: Relative difference a quotient of numbers written to six significant digits (:func:`_fmt`) may show.
_WRITTEN = 1e-4


def _unjudged_pass(values: dict) -> str:
    """Why a PASS row cannot have been written by a judge ("" when it can): a measured check's PASS
    carries observed, allowed and ratio, finite, with ratio = observed / allowed (0 when nothing
    was observed) at most 1, and an allowance under :data:`BAR` of the signal it judges (else it
    would read INCONCLUSIVE), written with that signal wherever something was allowed (a PASS
    without it never had its allowance weighed) and at least ``allowed / signal`` (the row's
    allowed is its worst element's, at most the whole allowance the share weighs). Only
    :data:`OUTCOME_CHECKS` pass without numbers."""
    names = ("observed", "allowed", "ratio")
    nums = {k: values[k] for k in names if values[k] != ""}
    if not nums and values["check"] in OUTCOME_CHECKS:
        return ""
    if len(nums) < len(names):
        return f"a PASS of {values['check']} without its " + " / ".join(k for k in names if k not in nums)
    observed, allowed, ratio = (nums[k] for k in names)
    if not all(map(math.isfinite, (observed, allowed, ratio))) or ratio > 1.0:
        return "a PASS whose numbers say otherwise: " + ", ".join(f"{k} {v:g}" for k, v in nums.items())
    quotient = 0.0 if observed == 0 else observed / allowed if allowed > 0 else math.inf
    if not math.isclose(ratio, quotient, rel_tol=_WRITTEN):
        return f"a PASS whose ratio {ratio:g} is not observed / allowed ({quotient:g})"
    share = values["allowed_over_signal"]
    if allowed > 0 and "" in (share, values["signal"]):  # vacuity was never weighed
        return (f"a PASS of {values['check']} that allowed {allowed:g} without the size of what it judged "
                "(signal / allowed_over_signal)")
    if share != "" and not share < BAR * (1 + _WRITTEN):
        return f"a PASS whose allowance is {share:g} of the change it judges (at least {BAR:g}: INCONCLUSIVE)"
    least = allowed / values["signal"] if share != "" and allowed > 0 and values["signal"] > 0 else 0.0
    if share != "" and share < least * (1 - _WRITTEN):  # the whole allowance over the signal: never below this row's
        return f"a PASS whose allowed_over_signal {share:g} is under allowed / signal ({least:g})"
    return ""


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
    # lines end at "\n" only, as csv wrote them: str.splitlines would also cut a detail at "\x85" or "\u2028"
    reader = csv.DictReader(io.StringIO(text, newline=""))
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
