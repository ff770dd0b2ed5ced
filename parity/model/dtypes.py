"""The one table of dtype names parity accepts, and unit roundoffs.

Every place that turns a user-facing name into a ``torch.dtype`` (CLI options, matrix
files, output dtype) goes through :func:`parse_dtype`, so the valid choices are listed
in exactly one place.
"""

from __future__ import annotations

import torch

from parity.errors import UsageError

#: name -> dtype. ``natural`` means "no cast" (``None``) where a setting allows it.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
ALIASES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}
NATURAL = "natural"

#: Unit roundoff u = 2**-p (p = significand bits incl. the implicit one) for round-to-nearest.
UNIT_ROUNDOFF: dict[torch.dtype, float] = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}


def parse_dtype(
    value: str | torch.dtype | None,
    *,
    what: str = "dtype",
    allow_natural: bool = False,
    allowed: tuple[str, ...] | None = None,
) -> torch.dtype | None:
    """Turn a name into a dtype; unknown names raise :class:`UsageError` listing valid ones."""
    if isinstance(value, torch.dtype):
        value = dtype_name(value)
    choices = list(allowed or DTYPES)
    if allow_natural:
        choices = [NATURAL, *choices]
    if value is None or value == NATURAL or value == "none":
        if allow_natural:
            return None
        raise UsageError(f"{what}: a dtype is required; valid: {', '.join(choices)}")
    name = ALIASES.get(str(value), str(value))
    if name not in choices or name == NATURAL:
        raise UsageError(f"{what}: unknown value {value!r}; valid: {', '.join(choices)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype | None) -> str:
    """Inverse of :func:`parse_dtype`: ``torch.bfloat16`` -> ``"bfloat16"``, None -> natural."""
    if dtype is None:
        return NATURAL
    return str(dtype).removeprefix("torch.")


def unit_roundoff(dtype: torch.dtype) -> float:
    if dtype not in UNIT_ROUNDOFF:
        raise UsageError(f"no unit roundoff for {dtype}; floating dtypes: {', '.join(DTYPES)}")
    return UNIT_ROUNDOFF[dtype]


def coarser(a: torch.dtype | None, b: torch.dtype | None) -> torch.dtype | None:
    """The less precise of two floating dtypes (None is ignored)."""
    if a is None or b is None:
        return a or b
    return a if UNIT_ROUNDOFF[a] >= UNIT_ROUNDOFF[b] else b


def finer(a: torch.dtype | None, b: torch.dtype | None) -> torch.dtype | None:
    """The more precise of two floating dtypes (None is ignored)."""
    if a is None or b is None:
        return a or b
    return a if UNIT_ROUNDOFF[a] <= UNIT_ROUNDOFF[b] else b
