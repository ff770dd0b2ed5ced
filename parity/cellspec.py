"""One cell of a matrix: a fixture trained along one path under one set of axis values."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from parity.dtypes import dtype_name, parse_dtype
from parity.plan import PrecisionConfig

SYNC = ("every", "last")
CHECKPOINTING = ("none", "full", "selective")
OUTPUT_DTYPES = ("natural", "float32", "bfloat16", "float16")
#: Deliberate faults (tests and `--fault`); each must turn some check into FAIL or ERROR.
FAULTS = (
    "drop_override", "bf16_reduce", "perturb_output", "perturb_input_grad", "perturb_grad",
    "scale_grad_norm", "perturb_param", "rank_dependent_override", "skip_rank_check",
    "crash", "hang", "raise", "lose_buffer_marker", "swap_optimizer_state",
    "rename_param", "replace_param", "cast_storage", "cast_child_inputs", "drop_output_dtype",
    "misfile_optimizer_state",
)


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
        """The cell id without its path: legacy and native cells sharing it are compared."""
        return self.id.replace(f"/{self.path}/", "/", 1)

    def precision(self) -> PrecisionConfig:
        return PrecisionConfig(output_dtype=parse_dtype(self.output_dtype, what="output_dtype", allow_natural=True))

    def axes(self) -> dict:
        d = asdict(self)
        d.pop("faults")
        d["reshard"] = "on" if self.reshard else "off"
        d["output_dtype"] = dtype_name(self.precision().output_dtype)
        return d
