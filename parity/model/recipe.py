"""The training recipe both sides share: the optimizer, its learning-rate schedule and, for
float16, the loss scale.

The sharded run and the reference build both from here, so the reference needs nothing
from the worker modules. An optimizer recipe also says how one of its steps may round
(the per-element parameter allowance) and which state it keeps (the optimizer checks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

LR, WEIGHT_DECAY, MOMENTUM = 1e-2, 0.1, 0.9
#: float16 training scales the loss; a power of two, so scaling and unscaling are exact and
#: the reference can apply the same factor. Small enough that a tiny model's first steps do
#: not overflow (a skipped step would leave nothing to compare).
LOSS_SCALE = 2.0**8


@dataclass(frozen=True, kw_only=True)
class OptimizerRecipe:
    name: str
    make: Callable[[list], torch.optim.Optimizer]
    """Builds the optimizer over a parameter list (FP32 math on the storage dtype)."""
    state_keys: tuple[str, ...]
    """Every key its per-parameter state holds."""
    moments: tuple[str, ...]
    """State tensors compared after a resume (each one update from identical gradients)."""
    at_param: int
    """Roundings per step at the parameter's own magnitude."""
    at_update: int
    """Roundings per step relative to the step's size."""
    counter: str = ""
    """The state key counting the optimizer steps a parameter has taken (AdamW's ``step``: its
    bias correction reads it), if any."""
    moments_follow_grad: bool = False
    """Its moments take the gradient's dtype (SGD's momentum buffer starts as a copy of the
    first gradient), not the parameter's (AdamW's start as ``zeros_like(param)``): they differ
    for a parameter whose ``grad_dtype`` is not its own."""

    def moment_dtype(self, t) -> torch.dtype:
        """The dtype the moments of plan entry ``t`` are kept in."""
        return t.kept_grad if self.moments_follow_grad else t.storage


#: AdamW's defaults, which the recipe keeps.
BETAS, EPS = (0.9, 0.999), 1e-8


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def update_sensitivity(name: str, state: dict, lr: float) -> torch.Tensor | float:
    """How far one step's update can move, per element, per unit change of the gradient it
    took (a first-order bound, from the optimizer state right after that step, taken with
    learning rate ``lr``): SGD with momentum moves by ``lr``; AdamW by ``lr / (sqrt(v^) + eps) x
    ((1 - b1) / (1 - b1^t) + |m^| / (sqrt(v^) + eps) x sqrt((1 - b2) / (1 - b2^t)))`` (the first
    moment's share, and the second moment's: sqrt(v^) is Lipschitz in the gradient with that
    constant)."""
    if name == "sgd":
        return lr
    b1, b2 = BETAS
    t = float(state["step"])
    m = state["exp_avg"].double() / (1 - b1 ** t)
    root = (state["exp_avg_sq"].double() / (1 - b2 ** t)).sqrt() + EPS
    return lr / root * ((1 - b1) / (1 - b1 ** t) + m.abs() / root * ((1 - b2) / (1 - b2 ** t)) ** 0.5)


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)


OPTIMIZERS: dict[str, OptimizerRecipe] = {
    # AdamW: decoupled decay and the final subtraction at |p|; moments (3 + 4), bias
    # corrections 2, sqrt, eps add, divide, step-size multiply relative to the step
    "adamw": OptimizerRecipe(name="adamw", make=_adamw, state_keys=("exp_avg", "exp_avg_sq", "step"),
                             moments=("exp_avg", "exp_avg_sq"), at_param=2, at_update=14, counter="step"),
    # SGD with momentum: decay term and the final subtraction at |p|; gradient add,
    # momentum multiply and add, learning-rate multiply relative to the step
    "sgd": OptimizerRecipe(name="sgd", make=_sgd, state_keys=("momentum_buffer",),
                           moments=("momentum_buffer",), at_param=2, at_update=4, moments_follow_grad=True),
}


def optimizer_recipe(name: str) -> OptimizerRecipe:
    return OPTIMIZERS[name]


def make_optimizer(params, name: str = "adamw") -> torch.optim.Optimizer:
    return OPTIMIZERS[name].make(params)


#: Steps over which the ``decay`` schedule takes the learning rate linearly to zero: far longer
#: than any cell (``--steps`` allows 1000; the rate stays above 3/4 of ``LR``), as a real run's
#: decay spans the run. Every step's rate differs from the next by ``LR / DECAY_STEPS``, which the
#: exact ``lr`` records see, while updates keep the size the allowances are judged against (a
#: faster decay leaves BF16-stored weights' steps too small to tell from their rounding).
DECAY_STEPS = 4096


def _decay(step: int) -> float:
    return 1.0 - step / DECAY_STEPS


#: Learning-rate schedules: the factor of ``LR`` at each optimizer step (0-based), as recipes
#: give it to ``LambdaLR``; ``constant`` runs without a scheduler.
SCHEDULES: dict[str, Callable[[int], float] | None] = {"constant": None, "decay": _decay}


def scheduled_lr(schedule: str, step: int) -> float:
    """The learning rate optimizer step ``step`` takes: ``LambdaLR``'s own arithmetic
    (``base_lr * factor(step)``), so a scheduler that follows the recipe matches it bitwise."""
    factor = SCHEDULES[schedule]
    return LR if factor is None else LR * factor(step)


def make_scheduler(opt: torch.optim.Optimizer, schedule: str):
    """The recipe's scheduler over ``opt`` (None for ``constant``), stepped once after every
    optimizer step, and saved and loaded with the checkpoint as recipes do."""
    factor = SCHEDULES[schedule]
    return None if factor is None else torch.optim.lr_scheduler.LambdaLR(opt, factor)


def set_lr(opt: torch.optim.Optimizer, schedule: str, step: int) -> None:
    """Set every param group's rate to step ``step``'s, as the schedule gives it (the reference's
    way: no scheduler object, nothing shared with the run's)."""
    for group in opt.param_groups:
        group["lr"] = scheduled_lr(schedule, step)


def loss_scale(param_dtype: torch.dtype) -> float:
    """The loss scale a recipe uses with ``param_dtype`` (1 = no scaler)."""
    return LOSS_SCALE if param_dtype == torch.float16 else 1.0


def rescales_gradients(clip: float, param_dtype: torch.dtype) -> bool:
    """Whether something scales the gradients between their reduction and the optimizer step:
    clipping, or the gradient scaler unscaling them (a loss scale). Such a cell's gradients are
    recorded twice, as reduced and as stepped with."""
    return bool(clip) or loss_scale(param_dtype) != 1.0


def clip_coefficient(max_norm: float, norm) -> float:
    """The factor clipping scales every gradient by, ``min(1, max_norm / (norm + 1e-6))``, as
    ``clip_grads_with_norm_`` forms it, in ``norm``'s own arithmetic (an FP32 tensor, as the
    ranks clip; or a Python float)."""
    return min(1.0, float(max_norm / (norm + 1e-6)))


def loss_divisor(reduction: str, data_world: int) -> int:
    """What each rank divides its loss by besides its micro-batch count: under a ``sum``
    reduction the recipe normalizes the loss over the data-parallel ranks itself (FSDP
    sums); under ``mean`` FSDP divides (:attr:`parity.matrix.cell.Cell.reduction`)."""
    return folded_divisors(reduction, data_world, 1)[0]


def folded_divisors(reduction: str, data_world: int, fold: int) -> tuple[int, int]:
    """(loss divisor, reduced-gradient divisor) on a layout each of whose ranks trains ``fold``
    data ranks' batches of a ``data_world * fold``-rank layout (a moved checkpoint's one-rank
    side, :mod:`parity.execute.moves`), so each backward computes what it computes on the full
    layout: under ``sum`` every rank there divided its loss by the full data world before the
    backward (a float16 loss halved or not rounds its gradient's subnormals differently) and
    the sum needs nothing after; under ``mean`` FSDP averaged over the full layout's ranks,
    so the reduced gradients are divided by ``fold`` after."""
    if reduction == "sum":
        return data_world * fold, 1
    return 1, fold


def owner_reduction(reduction: str, ignored_reduction: str) -> str:
    """How the owner of FSDP-ignored parameters combines their gradients across ranks: as the
    recipe's reduction under ``sum``, else as the fixture declares."""
    return "sum" if reduction == "sum" else ignored_reduction


def owed_moments(optimizer: str, param_dtype: torch.dtype) -> tuple[str, ...]:
    """The moments an optimizer step must leave for every parameter it stepped, by name: the
    recipe's, except under a loss scale, whose first steps may be skipped on overflow (no state
    made yet; such a cell owes some moment, not each one)."""
    return OPTIMIZERS[optimizer].moments if loss_scale(param_dtype) == 1.0 else ()


def state_tensors(opt: torch.optim.Optimizer, names: dict[int, str],
                  keep=lambda t: t.detach().cpu().clone()) -> dict[str, dict[str, torch.Tensor]]:
    """An optimizer's per-parameter state tensors, state key -> parameter name (``names``: by
    ``id``) -> ``keep(tensor)``; scalars (AdamW's ``step``) left out."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for p, state in opt.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                out.setdefault(key, {})[names[id(p)]] = keep(value)
    return out
