"""Argument types and list parsing the command-line modules share; every error names the
value and what is valid (the parser turns it into one line and exit code 2)."""

from __future__ import annotations

import argparse
import math

from parity.errors import UsageError

#: The most optimizer steps a cell (``--steps``, a matrix's ``steps``) or a bench (``--steps``,
#: ``--warmup``) may take: parity checks a few steps; more is a typo, not a plan.
MAX_STEPS = 1000
#: The most micro-batches a step accumulates (matrix files' ``accumulation``): the per-cell
#: timeout counts seconds without progress, and each micro-batch is progress.
MAX_MICROBATCHES = 64
#: Rank counts a cell (``--ranks``, a matrix's ``ranks`` axis) or a bench (``--ranks``) may ask for:
#: the meshes parity builds; anything else is a typo that would start that many processes.
RANK_COUNTS = (1, 2, 4, 8)
#: Seeds ``torch.manual_seed`` takes (a cell's seed, ``--seed``, a matrix's seed axis).
SEEDS = range(-(2**63), 2**64)


def _float(value: str) -> float:
    """``value`` as a float; nan when it is none, so every bound below refuses it."""
    try:
        return float(value)
    except ValueError:
        return float("nan")


def positive(value: str) -> float:
    x = _float(value)
    if not x > 0 or not math.isfinite(x):  # nan and inf included: a limit that never ends is none
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {value!r}")
    return x


def growth_factor(value: str) -> float:
    """``compare --factor``: how much a check's worst ratio may grow; finite and >= 1 (below 1 a
    run compared with itself would regress)."""
    x = _float(value)
    if not x >= 1 or not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 1 (a ratio's allowed growth), got {value!r}")
    return x


def max_norm(value: str) -> float:
    """A gradient clipping max-norm: finite and >= 0 (0: no clipping)."""
    x = _float(value)
    if not (0.0 <= x < math.inf):
        raise argparse.ArgumentTypeError(f"must be a finite max-norm >= 0 (0: no clipping), got {value!r}")
    return x


def count(value: str) -> int:
    n = integer(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}")
    return n


def steps(value: str) -> int:
    n = count(value)
    if n > MAX_STEPS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_STEPS}, got {value!r}")
    return n


def seed(value: str) -> int:
    n = integer(value)
    if n not in SEEDS:
        raise argparse.ArgumentTypeError(f"must be from {SEEDS.start} to {SEEDS.stop - 1} (torch.manual_seed), "
                                         f"got {value!r}")
    return n


def integer(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {value!r}") from None


def csv_list(value: str | None, what: str, valid: list, conv=str) -> list | None:
    """The items of a comma list, each in ``valid`` and given once (``None`` when not given)."""
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
        if item in items:
            raise UsageError(f"{what}: {raw.strip()!r} is given twice; give each value once")
        items.append(item)
    return items


def path(value: str) -> str:
    """A file or directory argument: an empty one is refused, not read as "not given" (``--from ''``
    would otherwise run a new gate, ``--compare-to ''`` compare with nothing)."""
    if not value.strip():
        raise argparse.ArgumentTypeError(f"must name a file or directory, got {value!r}")
    return value


def shard(value: str) -> str:
    """``--shard I/N``, normalized (``"02/8"`` -> ``"2/8"``)."""
    from parity.matrix.shard import parse_shard

    try:
        return str(parse_shard(value))
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
