"""Activation checkpointing as a rank ran it: each watched module's forward calls per segment of
the training loop, and whether its forward output joined the autograd graph.

A checkpointed module runs its forward once in the forward and once more in the backward that
needs its activations: torch's non-reentrant checkpoint calls the module again, so its forward
hooks fire in that backward. Checkpointing that wrapped nothing, or a checkpoint that kept its
activations, trains the same numbers and passes every numeric check; these counts are what
shows it (:mod:`parity.judge.recompute`).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._pytree import tree_leaves

from parity.model.plan import canonical_fqn

#: (step, segment label, module FQN) -> [forward calls, calls whose output required gradient,
#: calls of the checkpoint wrapper around it].
Runs = dict[tuple[int, str, str], list[int]]


def watched(checkpointing: str, blocks: tuple[str, ...], unit_modules: tuple[str, ...]) -> tuple[str, ...]:
    """The modules whose forwards the cell's checkpointing runs again in backward: every unit
    module and the root (``outer``), else the model's blocks (``full``, ``selective``; under
    ``none`` the same blocks, which must then run once)."""
    return tuple(sorted(set(unit_modules) | {""})) if checkpointing == "outer" else tuple(blocks)


def watch(model: nn.Module, names: tuple[str, ...], where: Callable[[], tuple[int, str]]) -> tuple[Runs, Callable[[], None]]:
    """Count the forward calls of the modules ``names`` (canonical FQNs) under ``where()``'s (step,
    label), and of the checkpoint wrapper around each apart: a wrapper's recompute calls only the
    module it wraps, so in a backward the module's calls less its wrapper's are its own
    recomputes (the wrapper runs again only inside an outer checkpoint's recompute). Returns the
    counts and what removes the hooks."""
    runs: Runs = {}
    handles = []
    for name, module in model.named_modules():
        fqn = canonical_fqn(name)
        if fqn not in names:
            continue
        wrapper = isinstance(module, CheckpointWrapper)

        def counted(mod, args, out, fqn=fqn, wrapper=wrapper):
            seen = runs.setdefault((*where(), fqn), [0, 0, 0])
            if wrapper:
                seen[2] += 1
                return
            seen[0] += 1
            seen[1] += int(any(getattr(t, "requires_grad", False) for t in tree_leaves(out)))
        handles.append(module.register_forward_hook(counted, always_call=True))

    def close() -> None:
        for h in handles:
            h.remove()
    return runs, close
