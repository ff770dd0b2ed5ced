"""Allowed errors, derived from the unit roundoff of the dtype a quantity was last rounded in.

No per-cell constants: every allowance is ``roundings x u(dtype) x scale`` where the number
of roundings follows from how the quantity is computed (see ``docs/tolerances.md``), ``u``
is the unit roundoff of the dtype that last rounded it, and ``scale`` is a magnitude taken
from the reference run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parity.model.dtypes import coarser, dtype_name, unit_roundoff

#: Roundings per element in one AdamW step (decoupled decay 2, first moment 3, second
#: moment 4, bias corrections 2, sqrt 1, eps add 1, divide 1, step multiply 1, update 1).
ADAMW_ROUNDINGS = 16
#: Floating reductions (norms, sums over reduced precision) accumulate in at least FP32.
ACCUMULATE_DTYPE = torch.float32


@dataclass(frozen=True)
class Allowance:
    allowed: float
    dtype: torch.dtype
    """The dtype whose unit roundoff justified the allowance."""
    basis: str
    """How it was derived, e.g. ``2 x u(bfloat16) x 3.1``."""

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)


def _fmt(n: float, u_dtype: torch.dtype, scale: float) -> str:
    return f"{n:g} x u({dtype_name(u_dtype)}) x {scale:.3g}"


def last_rounding(dtype: torch.dtype, scale: float) -> Allowance:
    """Two computations agreeing up to a final correctly rounded op differ by <= 1 ulp
    (<= 2u|x|). Used for outputs and input gradients."""
    return Allowance(2 * unit_roundoff(dtype) * scale, dtype, _fmt(2, dtype, scale))


def gradient(
    reduce_dtype: torch.dtype, storage_dtype: torch.dtype, terms: int, scale: float,
    *, uses: int = 1, compute_dtype: torch.dtype | None = None,
) -> Allowance:
    """A sum of ``terms`` contributions in ``reduce_dtype`` (recursive-summation bound
    (n-1)u plus one division), then a cast to storage if that is coarser. A weight used
    ``uses`` times per forward (tied) gets its per-use contributions summed either in the
    compute dtype (autograd's input buffer) or in the reduce dtype (FSDP accumulating
    without sync): ``uses - 1`` further roundings in the compute dtype."""
    n = terms * unit_roundoff(reduce_dtype)
    dtype = reduce_dtype
    basis = _fmt(terms, reduce_dtype, scale)
    if uses > 1 and compute_dtype is not None and coarser(compute_dtype, reduce_dtype) == compute_dtype:
        n += (uses - 1) * terms * unit_roundoff(compute_dtype)
        dtype = compute_dtype
        basis += f" + {(uses - 1) * terms} x u({dtype_name(compute_dtype)}) x {scale:.3g} (tied)"
    if coarser(reduce_dtype, storage_dtype) != reduce_dtype:
        n += unit_roundoff(storage_dtype)
        dtype = storage_dtype
        basis += f" + 1 x u({dtype_name(storage_dtype)}) x {scale:.3g}"
    return Allowance(n * scale, dtype, basis)


def grad_norm(grad_dtype: torch.dtype, elements: int, norm: float) -> Allowance:
    """sqrt of a sum of ``elements`` squares accumulated in FP32 (bound N u |norm| covering
    both sides' orderings), plus a final rounding in the gradient dtype if coarser."""
    acc = ACCUMULATE_DTYPE if unit_roundoff(grad_dtype) >= unit_roundoff(ACCUMULATE_DTYPE) else grad_dtype
    n = elements * unit_roundoff(acc)
    basis = _fmt(elements, acc, norm)
    dtype = acc
    if grad_dtype != acc:
        n += 2 * unit_roundoff(grad_dtype)
        basis += f" + 2 x u({dtype_name(grad_dtype)}) x {norm:.3g}"
        dtype = grad_dtype
    return Allowance(n * norm, dtype, basis)


def parameter(storage_dtype: torch.dtype, steps: int, scale: float) -> Allowance:
    """AdamW on identical gradients: ``ADAMW_ROUNDINGS`` roundings per element per step in
    the storage dtype, accumulating over ``steps``."""
    n = steps * ADAMW_ROUNDINGS
    return Allowance(n * unit_roundoff(storage_dtype) * scale, storage_dtype, _fmt(n, storage_dtype, scale))
