"""The fixture interface: a tiny seeded model plus how a recipe hands it to FSDP.

Concrete fixtures live in the top-level ``fixtures`` package; this module only defines
what one is and looks them up by name.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from parity.errors import UsageError


@dataclass(frozen=True, kw_only=True)
class Batch:
    inputs: tuple[torch.Tensor, ...]
    target: torch.Tensor

    def to(self, device) -> "Batch":
        return Batch(inputs=tuple(t.to(device) for t in self.inputs), target=self.target.to(device))


@dataclass(frozen=True, kw_only=True)
class Fixture:
    """A tiny model and its training recipe, as data."""

    name: str
    """Registry name (``--fixture``)."""
    description: str
    """One line for listings."""
    build: Callable[[], nn.Module]
    """Constructs the model; weights come from the global RNG, seeded by :meth:`make`."""
    unit_roots: tuple[str, ...]
    """FQNs handed to ``fully_shard`` in order (blocks first, ``""`` = root last)."""
    blocks: tuple[str, ...]
    """Modules activation checkpointing wraps."""
    make_batch: Callable[[torch.Generator], Batch]
    """One micro-batch from a seeded CPU generator."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """Scalar FP32 loss from (output, target)."""
    token_input: bool = False
    """True when inputs are integer tokens (no input gradient exists)."""
    ignored: Callable[[nn.Module], set[nn.Parameter]] = field(default=lambda m: set())
    """Parameters owned by another parallelism unit (passed as ``ignored_params``)."""
    expect: dict[str, str] = field(default_factory=dict)
    """path -> expected outcome other than training: ``isolation-error``, or ``fallback:TEXT``
    (native falls back to legacy for a reason containing TEXT)."""

    def expects(self, path: str) -> tuple[str, str]:
        """(outcome, reason text) expected on ``path``; ("", "") when it should just train."""
        kind, _, reason = self.expect.get(path, "").partition(":")
        return kind, reason

    def make(self, seed: int) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.build()

    def batch(self, seed: int, step: int, rank: int, microbatch: int) -> Batch:
        key = f"{self.name}/{seed}/{step}/{rank}/{microbatch}".encode()
        gen = torch.Generator().manual_seed(zlib.crc32(key))
        return self.make_batch(gen)


def registry() -> dict[str, Fixture]:
    from fixtures import FIXTURES

    return FIXTURES


def get_fixture(name: str) -> Fixture:
    fixtures = registry()
    if name not in fixtures:
        raise UsageError(f"unknown fixture {name!r}; valid: {', '.join(fixtures)}")
    return fixtures[name]
