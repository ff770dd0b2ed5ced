"""Argument types and list parsing the command-line modules share; every error names the
value and what is valid (the parser turns it into one line and exit code 2)."""

from __future__ import annotations

import argparse

from parity.errors import UsageError


def positive(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        x = float("nan")
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {value!r}")
    return x


def count(value: str) -> int:
    n = integer(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}")
    return n


def integer(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {value!r}") from None


def csv_list(value: str | None, what: str, valid: list, conv=str) -> list | None:
    if value is None:
        return None
    items = []
    for raw in value.split(","):
        try:
            item = conv(raw.strip())
        except ValueError:
            item = None
        if item not in valid:
            raise UsageError(f"{what}: unknown value {raw.strip()!r}; valid: {', '.join(map(str, valid))}")
        items.append(item)
    return items
