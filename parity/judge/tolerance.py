"""Allowed errors, derived from the unit roundoff of the dtype a quantity was last rounded in.

No per-cell constants: every allowance is ``roundings x u(dtype) x scale`` where the number
of roundings follows from how the quantity is computed (see ``docs/tolerances.md``), ``u``
is the unit roundoff of the dtype that last rounded it, and ``scale`` is a magnitude taken
from the reference run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from parity.model.dtypes import coarser, dtype_name, unit_roundoff
from parity.model.recipe import optimizer_recipe

#: Floating reductions (norms, sums over reduced precision) accumulate in at least FP32.
ACCUMULATE_DTYPE = torch.float32


@dataclass(frozen=True)
class Allowance:
    allowed: float
    """The allowance (the largest one, for element-wise allowances)."""
    dtype: torch.dtype
    """The dtype whose unit roundoff justified the allowance."""
    basis: str
    """How it was derived, e.g. ``2 x u(bfloat16) x 3.1``."""
    per_element: torch.Tensor | None = None
    """Element-wise allowances, when the quantity is judged element by element."""

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)


def _fmt(n: float, u_dtype: torch.dtype, scale: float) -> str:
    return f"{n:g} x u({dtype_name(u_dtype)}) x {scale:.3g}"


def carried_roundings(dtype: torch.dtype, scale: float, steps: int) -> Allowance:
    """State carried across ``steps`` updates (an optimizer's moments), each update element-wise
    and agreeing up to its last rounding: the differences add at most one rounding per update
    (a moment decays what it carries), <= steps x 2u|x|."""
    return Allowance(2 * steps * unit_roundoff(dtype) * scale, dtype, _fmt(2 * steps, dtype, scale))


def last_rounding(dtype: torch.dtype, scale: float) -> Allowance:
    """Two computations agreeing up to a final correctly rounded op differ by <= 1 ulp
    (<= 2u|x|). Used for outputs and input gradients."""
    return Allowance(2 * unit_roundoff(dtype) * scale, dtype, _fmt(2, dtype, scale))


def gradient(reduce_dtype: torch.dtype, storage_dtype: torch.dtype, terms: int, scale: float) -> Allowance:
    """A sum of ``terms`` contributions in ``reduce_dtype`` (recursive-summation bound
    (n-1)u plus one division), then a cast to storage if that is coarser. A tied weight's
    uses are not widened for: the reference sums them as FSDP does (autograd in the compute
    dtype, or rounded apart on the first micro-batch without sync). The storage term is one
    half-ulp, not a flip per cast and add of each synchronizing micro-batch (up to ``2K - 1``
    ulps for ``K``): the reference reduces in FSDP's order and casts and adds each micro-batch
    in the kept dtype as FSDP does, so the sums it casts are FSDP's bit for bit (every such
    record so far: observed 0) and a flip is a finding, not noise."""
    n = terms * unit_roundoff(reduce_dtype)
    dtype = reduce_dtype
    basis = _fmt(terms, reduce_dtype, scale)
    if coarser(reduce_dtype, storage_dtype) != reduce_dtype:
        n += unit_roundoff(storage_dtype)
        dtype = storage_dtype
        basis += f" + 1 x u({dtype_name(storage_dtype)}) x {scale:.3g}"
    return Allowance(n * scale, dtype, basis)


def clipped(before: Allowance, coef: float, storage_dtype: torch.dtype, scale: float) -> Allowance:
    """A gradient allowance after clipping: both sides multiply by the same FP32 coefficient
    ``coef`` <= 1 (the reference clips with the run's norm, judged by ``grad_norm`` on its own),
    which scales the difference and rounds each product once in the storage dtype:
    ``coef x A + 2 x u(storage) x coef x scale``."""
    if coef >= 1.0:
        return before
    n = 2 * unit_roundoff(storage_dtype)
    basis = f"{coef:.3g} x ({before.basis}) + {_fmt(2, storage_dtype, coef * scale)} (clipped)"
    dtype = coarser(before.dtype, storage_dtype)
    return Allowance(coef * before.allowed + n * coef * scale, dtype, basis)


def summation_depth(numel: int) -> int:
    """Depth of the summation tree a reduction of ``numel`` terms uses (torch's reductions are
    cascaded/pairwise: ceil(log2 n) levels), plus one for the final combination."""
    return math.ceil(math.log2(max(numel, 2))) + 1


def grad_norm(grad_dtype: torch.dtype, largest: int, tensors: int, world: int, norm: float,
              gradients: float = 0.0, coarse_share: float = 1.0) -> Allowance:
    """The global norm sqrt(sum g^2) as a training loop forms it: per tensor (per shard on
    the sharded side) a reduction of its squares, then a sum over tensors, then an
    all-reduce over ranks. A sum of non-negative terms through a summation tree of depth d
    has relative error <= d u (Higham 4.2); the square root halves it. Both sides carry
    such an error, so they differ by at most ``d u(float32) norm`` with
    d = depth(largest tensor) + depth(tensors) + depth(ranks). Gradients stored in a coarser
    dtype have their per-tensor norms n_t rounded in it once on each side, so their squares
    differ by at most 4 u n_t^2 and the norm by ``2 u(grad dtype) x coarse_share x norm``, where
    ``coarse_share`` = (sum of those tensors' n_t^2) / norm^2 (1, every gradient coarse, bounds
    it when the split is not known).
    The gradients themselves may differ within their own allowances A_f; by the triangle
    inequality the norms then differ by at most ``gradients`` = sqrt(sum_f numel_f A_f^2)."""
    acc = ACCUMULATE_DTYPE if unit_roundoff(grad_dtype) >= unit_roundoff(ACCUMULATE_DTYPE) else grad_dtype
    depth = summation_depth(largest) + summation_depth(tensors) + summation_depth(world)
    n = depth * unit_roundoff(acc)
    basis = _fmt(depth, acc, norm)
    dtype = acc
    share = min(coarse_share, 1.0)
    if grad_dtype != acc and share > 0:
        coarse = 2 * unit_roundoff(grad_dtype) * share
        basis += f" + 2 x u({dtype_name(grad_dtype)}) x {share:.3g} x {norm:.3g}"
        dtype = grad_dtype if coarse > n else acc  # the term that dominates justifies the allowance
        n += coarse
    if gradients:
        basis += f" + {gradients:.3g} (allowed gradient differences)"
    return Allowance(n * norm + gradients, dtype, basis)


def parameter(storage_dtype: torch.dtype, param: torch.Tensor, update: torch.Tensor,
              optimizer: str = "adamw") -> Allowance:
    """One optimizer step on identical gradients from identical weights, judged per element:
    ``allowed_i = at_param u |p_i| + at_update u |dp_i|`` in the storage dtype (``update`` =
    dp, the reference step), the counts being the optimizer recipe's roundings per step
    (:class:`parity.model.recipe.OptimizerRecipe`: AdamW 2 and 14, SGD 2 and 4). A frozen
    parameter (no update anywhere) must be bitwise equal."""
    recipe = optimizer_recipe(optimizer)
    at_param, at_update = recipe.at_param, recipe.at_update
    u = unit_roundoff(storage_dtype)
    per_element = at_param * u * param.double().abs() + at_update * u * update.double().abs()
    if not update.numel() or not bool(update.ne(0).any()):
        per_element = torch.zeros_like(per_element)
    basis = (f"per element {at_param} x u({dtype_name(storage_dtype)}) x |p| + "
             f"{at_update} x u({dtype_name(storage_dtype)}) x |dp|")
    top = float(per_element.max()) if per_element.numel() else 0.0
    return Allowance(top, storage_dtype, basis, per_element=per_element)


#: Roundings in one AdamW moment update (second moment: multiply, square, scale, add).
MOMENT_ROUNDINGS = 4


def moment(storage_dtype: torch.dtype, scale: float) -> Allowance:
    """An Adam moment after one update from identical gradients."""
    n = MOMENT_ROUNDINGS
    return Allowance(n * unit_roundoff(storage_dtype) * scale, storage_dtype, _fmt(n, storage_dtype, scale))
