"""How a contract check writes its record: ``observed`` 1 (broken) or 0 (held) against
``allowed`` 0, the expectation and the observation in the detail."""

from __future__ import annotations

from parity.judge.record import Record, Verdict


def contract_row(base: dict, check: str, name: str, ok: bool, expected, observed, note: str = "", dtype: str = "") -> Record:
    detail = f"expected {expected}, observed {observed}" + (f"; {note}" if note else "")
    return Record(**base, check=check, name=name, observed=0.0 if ok else 1.0, allowed=0.0,
                  ratio=0.0 if ok else float("inf"), dtype=dtype, verdict=Verdict.PASS if ok else Verdict.FAIL, detail=detail)


def skipped(base: dict, check: str, name: str, reason: str) -> Record:
    return Record(**base, check=check, name=name, verdict=Verdict.SKIP, detail=reason)


def few(names: list[str], shown: int = 4) -> str:
    """The first ``shown`` of ``names``, and how many more there are."""
    return ", ".join(names[:shown]) + (f" (+{len(names) - shown} more)" if len(names) > shown else "")
