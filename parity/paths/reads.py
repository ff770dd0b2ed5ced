"""Where a forward reads each parameter, against the unit a path put it in.

FSDP gathers a unit's parameters in the pre-forward hook of the module(s) it was built on and
frees them after that module's forward. A parameter read anywhere else -- a parent's forward
reading a holder's ``A_log`` directly, a helper method called without ``forward`` -- is still a
sharded DTensor there, and the forward dies with torch's "got mixed torch.Tensor and DTensor".
A path that creates units of its own (the dtype-split isolation of a holder) is told so before
anything is sharded: one forward of a fresh, unsharded instance on the cell's first batch
records, for every parameter use, which modules' forwards were running (in FP32 throughout,
so a model storing some parameters in BF16 runs without FSDP's casts).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from parity.errors import IsolationError
from parity.paths.base import ShardReport


class _Reads(TorchFunctionMode):
    """Records (parameter name, innermost running module) for every read outside its unit's forward."""

    def __init__(self, names: dict[int, str], owner: dict[str, tuple[str, ...]], running: list[str]):
        super().__init__()
        self.names, self.owner, self.running = names, owner, running
        self.outside: dict[str, str] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for leaf in tree_leaves((args, kwargs or {})):
            fqn = self.names.get(id(leaf)) if isinstance(leaf, nn.Parameter) else None
            if fqn is not None and fqn not in self.outside and not set(self.owner[fqn]) & set(self.running):
                self.outside[fqn] = self.running[-1] if self.running else "<caller>"
        return func(*args, **(kwargs or {}))


def read_outside_units(model: nn.Module, inputs: tuple, report: ShardReport, roots: tuple[str, ...]) -> dict[str, str]:
    """Parameter FQN -> the module whose forward read it outside the forward of the unit holding
    it, for units the path created (not among the declared ``roots``); ``model`` is a fresh,
    unsharded instance (hooks are added and removed)."""
    owner = {p: unit.modules for unit in report.units if not set(unit.modules) <= set(roots) for p in unit.params}
    if not owner:
        return {}
    named = list(model.named_parameters(remove_duplicate=False))
    uses = Counter(id(p) for _, p in named)  # a tied parameter (two names) is not judged
    names = {id(p): n for n, p in named if n in owner and uses[id(p)] == 1}
    running: list[str] = []
    handles = []

    def enter(name):
        return lambda module, args: running.append(name)  # returns None: the inputs stay

    def leave(module, args, output):
        running.pop()  # returns None: the output stays

    for name, mod in model.named_modules():
        handles += [mod.register_forward_pre_hook(enter(name)), mod.register_forward_hook(leave, always_call=True)]
    mode = _Reads(names, owner, running)
    try:
        with torch.no_grad(), mode:
            model(*inputs)
    except Exception:  # noqa: BLE001 - a forward this probe cannot run tells nothing; the cell shows its error
        return {}
    finally:
        for h in handles:
            h.remove()
    return mode.outside


def check_reads(model: nn.Module, inputs: tuple, report: ShardReport, roots: tuple[str, ...]) -> None:
    """Raise :class:`IsolationError` naming every parameter read outside its unit's forward."""
    outside = read_outside_units(model, inputs, report, roots)
    if outside:
        raise IsolationError(sorted(outside), report.fallback_reason, path=report.taken, read_by=outside)


def check_fixture_reads(fixture, seed: int, report: ShardReport) -> None:
    """:func:`check_reads` on a fresh FP32 instance of ``fixture`` and its first batch at ``seed``:
    what a cell checks before sharding, and what ``parity plan`` shows as the path's refusal."""
    inputs = tuple(x.float() if x.is_floating_point() else x for x in fixture.batch(seed, 0, 0, 0).inputs)
    check_reads(fixture.make(seed).float(), inputs, report, fixture.unit_roots)
