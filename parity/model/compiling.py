"""Compiled blocks (:attr:`parity.matrix.cell.Cell.compile`): the recipe compiles each of the
fixture's blocks before sharding it, ``block.compile(backend=...)``, as recipes do.

FSDP2's hooks are ``torch._dynamo.disable``-d: dynamo runs them eagerly and splits a block's
graph where a unit's hooks run inside it (a nested FP32 unit of the dtype-split path). The
reference (:mod:`parity.judge.reference`) compiles the same blocks with the same backend and
breaks them at the same unit modules (:func:`unit_break`), so both sides run the same graphs.

Every graph dynamo hands the backend is counted (:class:`CompileLog`): where in the loop it
was compiled and how often it ran per segment; ``compile.graphs`` judges it
(:mod:`parity.judge.compiled`) -- a block that fell back to eager, or recompiled where
nothing changed, is a finding, not a pass.

Probes that hook modules skip the compiled blocks and everything inside them
(:func:`parity.model.boundaries.hookable_modules`): a hook traced into a graph would record
fake tensors; what the blocks' parameters were gathered as is read from the all-gathers.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable

import torch
from torch import nn

from parity.paths.units import module_index, under


def compiler_missing(backend: str) -> str:
    """Why ``backend`` cannot compile on this machine (empty: it can): inductor's CPU code needs a
    C++ compiler."""
    if backend != "inductor":
        return ""
    if any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return ""
    return "compile 'inductor' needs a C++ compiler (g++, c++ or clang++ on PATH); none was found"


class CompileLog:
    """The graphs dynamo compiled for a model's blocks and how often each segment ran them."""

    def __init__(self, backend: str, blocks: tuple[str, ...]):
        self.name = backend
        self.blocks = blocks
        self.compiled: list[tuple[int, str]] = []
        """Where each graph was compiled: (step, segment) from :attr:`where`."""
        self.calls: dict[tuple[int, str], int] = {}
        """(step, segment) -> forward graph runs there."""
        self.block_calls: dict[tuple[int, str, str], int] = {}
        """(step, segment, block) -> the forward graph runs while that block's compiled call ran."""
        self.running = ""
        """The block whose compiled call is running ('' outside every block)."""
        self.where: Callable[[], tuple[int, str]] = lambda: (-1, "outside")
        """Where the loop is now (the worker points it at its segments)."""

    def backend(self) -> Callable:
        """The backend handed to ``compile``: ``self.name``'s, counting every graph and every run."""
        inner = torch._dynamo.lookup_backend(self.name)

        def counting(gm, example_inputs):
            self.compiled.append(self.where())
            compiled = inner(gm, example_inputs)
            boxed = getattr(compiled, "_boxed_call", False)  # takes its inputs as one list

            def run(*args):
                key = self.where()
                self.calls[key] = self.calls.get(key, 0) + 1
                if self.running:
                    block = (*key, self.running)
                    self.block_calls[block] = self.block_calls.get(block, 0) + 1
                return compiled(*args)
            run._boxed_call = boxed
            return run
        return counting


def compile_blocks(model: nn.Module, blocks: tuple[str, ...], backend: str) -> CompileLog:
    """Compile every module ``blocks`` names with ``backend``, after dropping whatever dynamo
    cached for earlier models (a worker trains many; their guards would count against the
    recompile limit and fall back to eager silently)."""
    torch._dynamo.reset()
    log = CompileLog(backend, tuple(blocks))
    modules = module_index(model)
    counting = log.backend()  # one callable for every block: another would be a recompile (BACKEND_MATCH)
    for name in blocks:
        modules[name].compile(backend=counting)
        _named_calls(modules[name], name, log)
    return log


def _named_calls(module: nn.Module, name: str, log: CompileLog) -> None:
    """Wrap ``module``'s compiled call (what ``nn.Module.compile`` set, which ``__call__`` runs,
    FSDP's class swap keeping it) so that ``log`` knows which block its graphs run for: outside
    the compiled region, so dynamo never traces it."""
    compiled = module._compiled_call_impl

    def call(*args, **kwargs):
        outer, log.running = log.running, name
        try:
            return compiled(*args, **kwargs)
        finally:
            log.running = outer
    module._compiled_call_impl = call


def compiled_blocks(cell, model: nn.Module, blocks: tuple[str, ...]) -> CompileLog | None:
    """Compile ``model``'s blocks as ``cell`` says (None: it runs them eagerly)."""
    if cell.compile == "none":
        return None
    return compile_blocks(model, blocks, cell.compile)


def unit_break(hook: Callable) -> Callable:
    """``hook`` run eagerly, splitting a compiled graph where it runs, as FSDP's own hooks do."""
    return torch._dynamo.disable(hook)


def compiled_names(cell) -> tuple[str, ...]:
    """The modules ``cell``'s recipe compiles (its fixture's blocks; none when it runs eagerly)."""
    if cell.compile == "none":
        return ()
    from parity.model.registry import get_fixture

    return tuple(get_fixture(cell.fixture, cell.source).blocks)


def inside(fqn: str, blocks: tuple[str, ...]) -> bool:
    """Whether module ``fqn`` is one of the compiled ``blocks`` or inside one."""
    return any(under(fqn, b) for b in blocks if b)
