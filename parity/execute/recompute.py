"""Activation checkpointing as a rank ran it: each watched module's forward calls per segment of
the training loop, and whether its forward output joined the autograd graph.

A checkpointed module runs its forward once in the forward and once more in the backward that
needs its activations: torch's non-reentrant checkpoint calls the module again, so its forward
hooks fire in that backward. Checkpointing that wrapped nothing, or a checkpoint that kept its
activations, trains the same numbers and passes every numeric check; these counts are what
shows it (:mod:`parity.judge.recompute`). Under selective checkpointing the matmuls run inside each
watched module are counted too: the policy saves them, so its recompute must run none again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._pytree import tree_leaves

from parity.execute.collectives import LocalOps, Segments
from parity.model.plan import canonical_fqn

#: (step, segment label, module FQN) -> [forward calls, calls whose output required gradient,
#: calls of the checkpoint wrapper around it, matmuls run inside it (counted under ``selective``)].
Runs = dict[tuple[int, str, str], list[int]]
#: The step whose matmuls are counted.
MATMUL_STEP = 0
#: What the selective policy saves (:mod:`parity.execute.checkpointing`): the matmuls counted.
MATMULS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default})


def _seen(runs: Runs, key: tuple[int, str, str]) -> list[int]:
    return runs.setdefault(key, [0, 0, 0, 0])


class _Matmuls(LocalOps):
    """Counts each matmul dispatched while a watched module's forward runs, for the innermost one
    (:class:`~parity.execute.collectives.LocalOps`: a DTensor's local matmul included). Entered as
    a micro-batch's forward or backward segment opens, it sits below the modes selective
    checkpointing enters, so a matmul SAC replays from its storage in a recompute never reaches
    it: what it counts in a backward is what ran again."""

    def __init__(self, runs: Runs, where: Callable[[], tuple[int, str]], inside: list[str]):
        super().__init__()
        self.runs, self.where, self.inside = runs, where, inside

    def seen(self, func, args, kwargs) -> None:
        if func in MATMULS and self.inside:
            _seen(self.runs, (*self.where(), self.inside[-1]))[3] += 1


def watched(checkpointing: str, blocks: tuple[str, ...], unit_modules: tuple[str, ...]) -> tuple[str, ...]:
    """The modules whose forwards the cell's checkpointing runs again in backward: every unit
    module and the root (``outer``), else the model's blocks (``full``, ``selective``; under
    ``none`` the same blocks, which must then run once)."""
    return tuple(sorted(set(unit_modules) | {""})) if checkpointing == "outer" else tuple(blocks)


def watch(model: nn.Module, names: tuple[str, ...], segments: Segments, *,
          matmuls: bool = False) -> tuple[Runs, Callable[[], None]]:
    """Count the forward calls of the modules ``names`` (canonical FQNs) under the current segment
    of the loop (step, label), and of the checkpoint wrapper around each apart: a wrapper's
    recompute calls only the module it wraps, so in a backward the module's calls less its
    wrapper's are its own recomputes (the wrapper runs again only inside an outer checkpoint's
    recompute). With ``matmuls``, the matmuls each runs too, in the forward and backward segments
    of the first step's micro-batches (:class:`_Matmuls`, opened at each: a dispatch mode over
    every op costs -- 15-20 % of a selective cell's time over every step's -- and a policy is the
    same in every step). Returns the counts and what removes the hooks."""
    where = lambda: segments.current  # noqa: E731
    runs: Runs = {}
    handles, inside = [], []
    for name, module in model.named_modules():
        fqn = canonical_fqn(name)
        if fqn not in names:
            continue
        wrapper = isinstance(module, CheckpointWrapper)

        def counted(mod, args, out, fqn=fqn, wrapper=wrapper):
            seen = _seen(runs, (*where(), fqn))
            if wrapper:
                seen[2] += 1
                return
            if inside and inside[-1] == fqn:
                inside.pop()
            seen[0] += 1
            seen[1] += int(any(getattr(t, "requires_grad", False) for t in tree_leaves(out)))
        if matmuls and not wrapper:
            handles.append(module.register_forward_pre_hook(lambda mod, args, fqn=fqn: inside.append(fqn)))
        handles.append(module.register_forward_hook(counted, always_call=True))
    def counting(label: str):
        passes = segments.current[0] == MATMUL_STEP and label.endswith(("/forward", "/backward"))
        return _Matmuls(runs, where, inside) if passes else contextlib.nullcontext()
    if matmuls:
        segments.within.append(counting)

    def close() -> None:
        if counting in segments.within:
            segments.within.remove(counting)
        for h in handles:
            h.remove()
    return runs, close
