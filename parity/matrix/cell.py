"""One cell of a matrix: a fixture trained along one path under one set of axis values."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from parity.model.dtypes import dtype_name, parse_dtype
from parity.model.plan import PrecisionConfig

SYNC = ("every", "last")
CHECKPOINTING = ("none", "full", "selective")
OUTPUT_DTYPES = ("natural", "float32", "bfloat16", "float16")


@dataclass(frozen=True, kw_only=True)
class Cell:
    """Axis values of one run; every field is a column of ``cells.csv``."""

    fixture: str
    path: str
    ranks: int = 1
    microbatches: int = 1
    sync: str = "every"
    """``every``: reduce after each micro-batch; ``last``: ``set_requires_gradient_sync(False)`` until the last."""
    checkpointing: str = "none"
    """``none``; ``full`` (composable ``checkpoint`` on every block); ``selective`` (wrapper + op-level SAC)."""
    reshard: bool = True
    """``reshard_after_forward``."""
    output_dtype: str = "natural"
    """Outermost unit's ``output_dtype`` (``natural`` = None)."""
    seed: int = 0
    steps: int = 2
    device: str = "cpu"
    faults: tuple[str, ...] = field(default=())
    """Deliberate faults (:mod:`parity.faults`) injected into this cell."""
    source: str = ""
    """Where a plugin model comes from (``pkg.module:factory``); empty for registered ones."""
    baseline: str = "legacy"
    """The path other paths are compared with (``baseline~path`` rows)."""
    trace: bool = False
    """Also record per-module outputs and input gradients (re-runs of failing cells)."""
    crossload: str = ""
    """The path the checkpoint lifecycle loads this cell's checkpoint into; empty: the
    baseline (for the baseline itself: no cross-load)."""

    def __post_init__(self):
        if self.microbatches == 1 and self.sync != "every":
            object.__setattr__(self, "sync", "every")  # one micro-batch always synchronizes

    @property
    def id(self) -> str:
        parts = [
            self.fixture, self.path, f"r{self.ranks}", f"mb{self.microbatches}-{self.sync}",
            f"ac-{self.checkpointing}", f"reshard-{'on' if self.reshard else 'off'}",
            f"out-{self.output_dtype}", f"s{self.seed}",
        ]
        if self.faults:
            parts.append("fault-" + "+".join(self.faults))
        return "/".join(parts)

    @property
    def lifecycle(self) -> bool:
        """Whether this cell also runs the checkpoint save/load/resume lifecycle (DCP):
        single micro-batch, no activation checkpointing, seed 0 (a fixed, documented slice)."""
        return self.microbatches == 1 and self.checkpointing == "none" and self.seed == 0 and self.steps >= 2

    @property
    def pair_id(self) -> str:
        """The cell id without its path: cells of different paths sharing it are compared."""
        return self.id.replace(f"/{self.path}/", "/", 1)

    def precision(self) -> PrecisionConfig:
        return PrecisionConfig(output_dtype=parse_dtype(self.output_dtype, what="output_dtype", allow_natural=True))

    @property
    def crossload_target(self) -> str:
        return self.crossload or (self.baseline if self.path != self.baseline else "")

    def axes(self) -> dict:
        d = asdict(self)
        for run_level in ("faults", "source", "baseline", "crossload", "trace"):
            d.pop(run_level)
        d["reshard"] = "on" if self.reshard else "off"
        d["output_dtype"] = dtype_name(self.precision().output_dtype)
        return d
