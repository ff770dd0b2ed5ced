"""Activation checkpointing applied the way training code applies it."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_SAVED_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def _save_matmuls(ctx, op, *args, **kwargs):
    if op in _SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _ignore_profiler_ranges() -> None:
    """Profiler ranges are not computation. FSDP opens them around (re-)gathers; a nested
    unit inside a checkpointed block opens a different number during the recompute than
    during the forward, and SAC, which counts every dispatched op, then aborts
    ("invocation index ... not found in storage"). Let SAC pass them through uncounted."""
    from torch.utils import checkpoint as ckpt

    for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit"):
        packet = getattr(torch.ops.profiler, name, None)
        for overload in packet.overloads() if packet is not None else ():
            ckpt.SAC_IGNORED_OPS.add(getattr(packet, overload))


def apply_checkpointing(model: nn.Module, mode: str, blocks: tuple[str, ...]) -> None:
    """``full``: composable ``checkpoint`` on each block (names unchanged); ``selective``:
    ``checkpoint_wrapper`` with an op-level policy saving matmul outputs (adds the
    ``_checkpoint_wrapped_module`` prefix that :func:`parity.model.plan.canonical_fqn` removes)."""
    if mode in ("none", "outer"):  # outer: after sharding, see checkpoint_units
        return
    for fqn in blocks:
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name)
        block = parent.get_submodule(child)
        if mode == "full":
            checkpoint(block)
        elif mode == "selective":
            _ignore_profiler_ranges()
            ctx = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
            parent.register_module(child, checkpoint_wrapper(block, context_fn=ctx))
        else:
            raise ValueError(f"unknown checkpointing {mode!r}")



def checkpoint_units(model: nn.Module, report) -> None:
    """AC(FSDP): wrap every non-root FSDP unit in a checkpoint wrapper, innermost first, so
    the checkpoint saves the unit's *uncast* inputs and its recompute runs FSDP's hooks
    (input cast, all-gather, override) again. The root is checkpointed by the training
    loop's call (:func:`parity.execute.training.train_step`)."""
    from parity.model.plan import canonical_fqn

    targets = {m for unit in report.units for m in unit.modules if m}
    for fqn in sorted(targets, key=lambda n: -n.count(".")):
        real = next(n for n, _ in model.named_modules() if canonical_fqn(n) == fqn and n)
        parent_name, _, child = real.rpartition(".")
        parent = model.get_submodule(parent_name)
        parent.register_module(child, checkpoint_wrapper(parent.get_submodule(child)))
