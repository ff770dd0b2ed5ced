"""One cell of a matrix: a fixture trained along one path under one set of axis values."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

from parity.errors import UsageError
from parity.model.dtypes import dtype_name, parse_dtype
from parity.model.plan import PrecisionConfig
from parity.model.formats import FORMATS
from parity.model.recipe import SCHEDULES as _SCHEDULES
from parity.model.topology import Topology

SYNC = ("every", "last", "replicas-last")
CHECKPOINTING = ("none", "full", "selective", "outer")
OUTPUT_DTYPES = ("natural", "float32", "bfloat16", "float16")
PARAM_DTYPES = ("bfloat16", "float16")
REDUCE_DTYPES = ("float32", "natural")
OPTIMIZERS = ("adamw", "sgd")
#: Learning-rate schedules (:attr:`Cell.schedule`).
SCHEDULES = tuple(_SCHEDULES)
#: When a cell runs an evaluation forward (``torch.no_grad()``, ``model.eval()``) on its own batch.
EVALS = ("none", "between-steps", "between-microbatches")
INITS = ("seeded", "meta")
#: Where the checkpoint lifecycle's second checkpoint is saved and loaded (:attr:`Cell.move`).
MOVES = ("none", "shrink", "grow", "mesh")
#: How gradients are reduced across data-parallel ranks (:attr:`Cell.reduction`).
REDUCTIONS = ("mean", "sum")
#: Which units a unit's pre-forward / pre-backward all-gathers ahead of time (:attr:`Cell.prefetch`).
PREFETCHES = ("none", "explicit")
#: After which backwards of a step the units reshard their parameters (:attr:`Cell.reshard_backward`).
RESHARD_BACKWARDS = ("every", "last")
#: Which dimension FSDP shards parameters of two or more dimensions on (:attr:`Cell.placement`).
PLACEMENTS = ("dim0", "dim1")
#: Who casts a unit's floating inputs to its compute dtype (:attr:`Cell.cast_inputs`).
CAST_INPUTS = ("fsdp", "model")
#: Which units all-gather in backward (:attr:`Cell.unshard_in_backward`).
UNSHARD_IN_BACKWARDS = ("all", "needed")
#: Who gathers and reshards the units around forwards (:attr:`Cell.unshard`).
UNSHARDS = ("hooks", "explicit")
#: Who ends a backward: FSDP's final callback, the recipe's flag or the recipe's call (:attr:`Cell.finalize`).
FINALIZES = ("auto", "flagged", "manual")
#: When the recipe sets FSDP's per-micro-batch flags (:attr:`Cell.flags`).
FLAGS = ("each", "changed")
#: Where FSDP keeps sharded parameters and gradients between uses (:attr:`Cell.offload`).
OFFLOADS = ("none", "cpu")
#: Over how many ranks a unit reshards after forward (:attr:`Cell.reshard_to`).
RESHARD_TOS = ("all", "half")
#: How the recipe compiles each of the fixture's blocks before sharding (:attr:`Cell.compile`).
COMPILES = ("none", "aot_eager", "inductor")
#: The recipe knobs' axes and their values, each first value FSDP's default (:mod:`parity.execute.knobs`).
KNOB_VALUES = {"reduction": REDUCTIONS, "prefetch": PREFETCHES, "reshard_backward": RESHARD_BACKWARDS,
               "placement": PLACEMENTS, "cast_inputs": CAST_INPUTS, "unshard_in_backward": UNSHARD_IN_BACKWARDS,
               "unshard": UNSHARDS, "finalize": FINALIZES, "offload": OFFLOADS, "reshard_to": RESHARD_TOS,
               "compile": COMPILES, "flags": FLAGS}
#: Weight formats of a fixture's quantizable layers; ``mixed`` alternates the two FP8 formats.
WEIGHTS = (*FORMATS, "mixed")
#: The state-dict APIs read at every state-dict point (:meth:`Cell.state_dict_points`); DCP's
#: ``get_model_state_dict`` (about 5x the cost) only between a forward and its backward, where
#: FSDP's hooks matter most.
STATE_DICT_APIS = ("state_dict", "get_model_state_dict")
#: Axes added after the first matrices, with their id tags; a cell at an axis's default keeps
#: the id it had before the axis existed.
RECIPE_AXES = {"param_dtype": "pd", "reduce_dtype": "rd", "optimizer": "opt", "init": "init", "mesh": "mesh",
               "weights": "w", "clip": "clip", "eval": "eval", "steps": "st", "move": "mv",
               "reduction": "red", "prefetch": "pf", "reshard_backward": "rb", "placement": "pl",
               "cast_inputs": "ci", "unshard_in_backward": "ub", "unshard": "un", "finalize": "fin", "offload": "off", "reshard_to": "rt",
               "compile": "cmp", "schedule": "lr", "flags": "fl"}


def steps_of(cell_id: str) -> int:
    """The optimizer steps a cell ran, read from its id (``st-N``; none: :attr:`Cell.steps`'s default)."""
    tagged = [seg[3:] for seg in cell_id.split("/") if seg.startswith("st-") and seg[3:].isdigit()]
    return int(tagged[0]) if tagged else Cell.steps


def pair_of(cell_id: str, path: str) -> str:
    """The pair group id of the cell ``cell_id`` of path ``path``: its id without the path (cells
    of different paths sharing it are compared)."""
    return cell_id.replace(f"/{path}/", "/", 1)


#: Cell fields that say how a cell runs, not which cell it is: not axes.
_RUN_LEVEL = frozenset(("faults", "source", "baseline", "crossload", "trace", "trace_step", "op_log"))


@dataclass(frozen=True, kw_only=True)
class Cell:
    """Axis values of one run; every field is a column of ``cells.csv``."""

    fixture: str
    path: str
    ranks: int = 1
    microbatches: int = 1
    sync: str = "every"
    """``every``: reduce after each micro-batch; ``last``: ``set_requires_gradient_sync(False)`` until the last;
    ``replicas-last`` (HSDP): reduce-scatter after each micro-batch, all-reduce across replicas only
    after the last (``set_requires_all_reduce``); on other meshes the same as ``every``."""
    checkpointing: str = "none"
    """``none``; ``full`` (composable ``checkpoint`` on every block); ``selective`` (wrapper + op-level SAC),
    both inside the units; ``outer``: a checkpoint wrapper around every non-root FSDP unit (AC(FSDP))."""
    reshard: bool = True
    """``reshard_after_forward``."""
    output_dtype: str = "natural"
    """Outermost unit's ``output_dtype`` (``natural`` = None)."""
    param_dtype: str = "bfloat16"
    """``MixedPrecisionPolicy.param_dtype`` of the recipe; ``float16`` trains with a loss scale."""
    reduce_dtype: str = "float32"
    """Gradient reduction dtype; ``natural`` = None (each gradient's own dtype, torch >= 2.15)."""
    optimizer: str = "adamw"
    """``adamw`` or ``sgd`` (with momentum): :data:`parity.model.recipe.OPTIMIZERS`."""
    schedule: str = "constant"
    """The learning rate over the steps (:data:`parity.model.recipe.SCHEDULES`): ``constant``, or
    ``decay`` (``LambdaLR``, linear towards zero), whose scheduler the checkpoint saves and
    loads; every step's rate is checked (``lr``), and after a resumed step the next one."""
    init: str = "seeded"
    """``seeded``: built with weights; ``meta``: built on the meta device, sharded, ``to_empty``,
    then loaded from a seeded full state dict (the way large models are built)."""
    mesh: str = "fsdp"
    """Composition (:mod:`parity.model.topology`): ``fsdp``, ``hsdp``, ``fsdp+tp``, ``ep``."""
    weights: str = "none"
    """Format of the fixture's quantizable layers (:mod:`parity.model.formats`): ``none``,
    ``fp8-tensorwise``, ``mxfp8``, or ``mixed`` (the two alternate, layer by layer)."""
    clip: float = 0.0
    """Gradient clipping's max-norm: after each step's reduction the gradients are scaled by
    ``min(1, clip / (norm + 1e-6))`` (``clip_grads_with_norm_`` with the global norm), as
    recipes do before the optimizer step; 0: not clipped (the norm is only measured)."""
    eval: str = "none"
    """An evaluation forward under ``torch.no_grad()`` in ``model.eval()``, on its own batch:
    ``between-steps`` after every optimizer step, ``between-microbatches`` after every
    micro-batch's backward but the last (with one micro-batch: ``none``). Training goes on
    after it; its output and the units' sharding after it are checked."""
    seed: int = 0
    steps: int = 2
    """Optimizer steps; the checkpoint lifecycle resumes in the middle (:attr:`resume_step`)."""
    move: str = "none"
    """A checkpoint that moves (:mod:`parity.execute.moves`): besides the lifecycle's same-layout
    checkpoint, one saved on one layout and loaded on another, after :attr:`resume_step` steps.
    ``shrink``: saved on every rank, loaded on half of them (2 -> 1); ``grow``: saved on half,
    loaded on every rank (1 -> 2); ``mesh``: saved on the cell's mesh, loaded on the other of
    1-D FSDP and HSDP (4 ranks). A layout with fewer ranks trains the others' batches as
    micro-batches, so both layouts train on the same global batch. ``none`` where the cell runs
    no lifecycle, has one rank (``shrink``/``grow``) or another mesh or size (``mesh``)."""
    reduction: str = "mean"
    """``mean``: FSDP averages gradients over the data-parallel ranks (its default); ``sum``: the
    recipe divides its loss by the number of data-parallel ranks itself (as token-normalized
    losses do) and FSDP sums -- ``set_gradient_divide_factor(1.0)`` and
    ``set_force_sum_reduction_for_comms(True)`` on every unit (gloo has no pre-multiplied sum);
    the owner of FSDP-ignored parameters sums too. Runs on mesh ``fsdp``."""
    prefetch: str = "none"
    """``none``: FSDP's own prefetching; ``explicit``: each block unit prefetches the next block's
    all-gather in forward (``set_modules_to_forward_prefetch``) and the previous one's in
    backward (``set_modules_to_backward_prefetch``), as recipes set it."""
    reshard_backward: str = "every"
    """``every``: each unit reshards after every backward (FSDP's default); ``last``: the recipe
    keeps the units gathered across a step's micro-batches -- ``set_reshard_after_backward(False)``
    before every micro-batch but the last, ``True`` before the last -- so no forward after the
    first all-gathers, and every unit is sharded again before the optimizer step. One
    micro-batch: ``every``."""
    placement: str = "dim0"
    """``dim0``: FSDP shards every parameter on dimension 0 (its default); ``dim1``: the recipe's
    ``shard_placement_fn`` returns ``Shard(1)`` for parameters of two or more dimensions whose
    dimension 1 splits evenly over the ranks (as recipes shard expert weights whose first
    dimension is small), ``None`` (dimension 0) for the rest. Ranks then record whole tensors. Runs on mesh ``fsdp`` with weights ``none``."""
    cast_inputs: str = "fsdp"
    """``fsdp``: each unit's policy casts its floating inputs to its ``param_dtype``
    (``cast_forward_inputs=True`` where the path sets it); ``model``: every unit's
    ``cast_forward_inputs=False`` -- the model casts its own inputs (runs only on a model that
    declares it does, ``Fixture.casts_inputs``)."""
    unshard_in_backward: str = "all"
    """``all``: every unit all-gathers its parameters for backward (FSDP's default); ``needed``:
    the units whose parameters no backward reads (``Fixture.backward_free``: an embedding, whose
    weight gradient only scatters the output's) do not -- ``set_unshard_in_backward(False)`` --
    as recipes set it. Runs only on a model that declares such units."""
    unshard: str = "hooks"
    """``hooks``: FSDP's pre-forward hooks gather each unit and its ``reshard_after_forward`` holds
    for every forward; ``explicit``: the recipe drives them by hand -- every unit's
    ``unshard(async_op=True)`` before each training forward (the root's handle waited by the
    recipe, the others by FSDP's pre-forward), and evaluation as a phase of its own:
    ``set_reshard_after_forward(False)`` before it, each unit's ``reshard()`` after it, then
    ``set_reshard_after_forward`` back to the cell's ``reshard``. Runs on mesh ``fsdp``."""
    finalize: str = "auto"
    """``auto``: FSDP's final backward callback ends every backward; ``flagged``: the recipe calls
    ``set_is_last_backward`` before each micro-batch (True only for the last, as pipeline
    schedules do); ``manual``: ``set_manual_backward_finalization(True)`` on the root and
    ``finalize_backward(async_op=True)`` after each backward that synchronizes, its handle waited
    before the gradients are read. Runs on mesh ``fsdp``."""
    flags: str = "each"
    """``each``: the recipe sets FSDP's per-micro-batch flags (``set_requires_gradient_sync``, and
    where the cell's knobs use them ``set_requires_all_reduce``, ``set_reshard_after_backward``,
    ``set_is_last_backward``) before every micro-batch; ``changed``: only where they change, before
    the first micro-batch and the last, as a recipe that opens a no-sync window once does. Under
    ``changed`` a flag FSDP itself resets within the window (an evaluation forward, say) stays
    reset; under ``each`` the next micro-batch would set it again and hide that."""
    offload: str = "none"
    """``none``: sharded parameters and gradients stay on the cell's device; ``cpu``: every
    ``fully_shard`` call gets ``CPUOffloadPolicy`` (pinned memory on CUDA): FSDP keeps them on
    the CPU, copies each shard to the device for its all-gather and each reduced gradient back,
    and the optimizer steps on the CPU. On device ``cpu`` nothing moves, but FSDP still takes
    its offload branches (copy-in without the fused cast, gradient accumulation on the host).
    Runs on mesh ``fsdp`` with weights ``none``."""
    reshard_to: str = "all"
    """With ``reshard`` on: ``all``: after forward each unit reshards over every rank it shards
    over (``reshard_after_forward=True``); ``half``: over groups of half of them
    (``reshard_after_forward`` = ranks / 2, an int: the parameters stay sharded over the smaller
    group, ``SHARDED_POST_FORWARD``, and backward all-gathers within it). Needs 4 or more ranks
    (half of 2 is 1, which FSDP turns into reshard off) on mesh ``fsdp``; with ``reshard`` off
    it does not apply (``all``)."""
    compile: str = "none"
    """``none``: every block runs eagerly; ``aot_eager`` / ``inductor``: the recipe compiles each of
    the fixture's blocks (``block.compile(backend=...)``) after activation checkpointing and
    before sharding, as recipes do; FSDP's hooks stay outside the graphs (dynamo skips them), so
    a nested unit breaks its block's graph. The reference compiles the same blocks with the same
    backend and breaks them at the same units (:mod:`parity.model.compiling`); ``inductor``
    needs a C++ compiler (SKIP without one). Runs on mesh ``fsdp`` with weights ``none``,
    cast_inputs ``fsdp`` and checkpointing ``none``: a checkpointed block compiles into other
    graphs in evaluation (``full``: split in two; ``selective``: run eagerly, torch 2.15), and
    the reference cannot recompute through ``functional_call``."""
    device: str = "cpu"
    faults: tuple[str, ...] = field(default=())
    """Deliberate faults (:mod:`parity.faults`) injected into this cell."""
    source: str = ""
    """Where a plugin model comes from (``pkg.module:factory``); empty for registered ones."""
    baseline: str = "legacy"
    """The path other paths are compared with (``baseline~path`` rows)."""
    trace: bool = False
    """Also record per-module outputs and input gradients (re-runs of failing cells)."""
    trace_step: int = 0
    """The step a traced re-run reads (every rank and micro-batch of it): the step where the cell's
    records diverged first (:mod:`parity.judge.stages`); the re-run trains up to it."""
    op_log: bool = False
    """A traced re-run also logs rank 0's operators (:mod:`parity.execute.oplog`)."""
    crossload: str = ""
    """The paths (comma-separated) the checkpoint lifecycle loads this cell's checkpoint into;
    empty: the baseline (for the baseline itself: no cross-load)."""

    def __post_init__(self):
        for axis in ("ranks", "microbatches", "steps"):
            value = getattr(self, axis)  # a reproducer's hand edit, e.g. ranks=0: an IndexError deep in a run
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UsageError(f"{axis} {value!r}: write an integer >= 1")
        for axis, valid in {"move": MOVES, "schedule": SCHEDULES, **KNOB_VALUES}.items():
            if getattr(self, axis) not in valid:
                raise UsageError(f"{axis}: unknown value {getattr(self, axis)!r}; valid: {', '.join(valid)}")
        if self.microbatches == 1 and self.sync != "every":
            object.__setattr__(self, "sync", "every")  # one micro-batch always synchronizes
        if self.eval == "between-microbatches" and self.microbatches == 1:
            object.__setattr__(self, "eval", "none")  # no micro-batch to evaluate between
        if self.microbatches == 1 and self.reshard_backward != "every":
            object.__setattr__(self, "reshard_backward", "every")  # a single backward reshards before the step
        if self.microbatches < 3 and self.flags != "each":
            object.__setattr__(self, "flags", "each")  # no micro-batch between the first and the last
        if self.microbatches == 1 and self.finalize == "flagged":
            object.__setattr__(self, "finalize", "auto")  # a single backward is FSDP's last by default
        if self.sync == "replicas-last" and self.mesh != "hsdp":
            object.__setattr__(self, "sync", "every")  # no replica all-reduce to defer
        if not self._movable():
            object.__setattr__(self, "move", "none")  # nothing to move: the cell does not claim it
        if not (self.clip >= 0.0 and self.clip < float("inf")):
            raise UsageError(f"clip {self.clip!r}: write a finite max-norm >= 0 (0: no clipping)")
        self.topology()  # a composition these ranks cannot form is a usage error
        if self.weights != "none" and self.mesh != "fsdp":
            raise UsageError(f"weights {self.weights!r} runs on mesh 'fsdp'; quantized all-gathers on "
                             f"{self.mesh!r} are not emulated yet (use mesh 'fsdp' or weights 'none')")
        if self.placement != "dim0" and (self.mesh != "fsdp" or self.weights != "none"):
            raise UsageError(f"placement {self.placement!r} runs on mesh 'fsdp' with weights 'none' (use placement "
                             "'dim0' for other compositions and quantized weights)")
        if not self.reshard:
            object.__setattr__(self, "reshard_to", "all")  # nothing reshards after forward
        if self.reshard_to == "half" and (self.mesh != "fsdp" or self.ranks < 4 or self.ranks % 2):
            raise UsageError(f"reshard_to 'half' needs mesh 'fsdp' on an even number of ranks >= 4 (got {self.ranks} "
                             f"on {self.mesh!r}; half of 2 is 1, which FSDP turns into reshard off)")
        if self.reshard_to == "half" and self.unshard == "explicit":
            raise UsageError("unshard 'explicit' restores reshard_after_forward with set_reshard_after_forward, which "
                             "takes a bool in torch 2.15: use reshard_to 'all' with it")
        if self.offload != "none" and self.weights != "none":
            raise UsageError(f"offload {self.offload!r} runs with weights 'none' (use offload 'none' for quantized "
                             "weights)")
        for knob in ("unshard", "finalize", "offload"):
            if getattr(self, knob) != KNOB_VALUES[knob][0] and self.mesh != "fsdp":
                raise UsageError(f"{knob} {getattr(self, knob)!r} runs on mesh 'fsdp' (use {knob} "
                                 f"{KNOB_VALUES[knob][0]!r} on {self.mesh!r})")
        if self.reduction != "mean" and self.mesh != "fsdp":
            raise UsageError(f"reduction {self.reduction!r} runs on mesh 'fsdp'; a summed reduction on {self.mesh!r} "
                             "is not emulated yet (use mesh 'fsdp' or reduction 'mean')")
        if self.eval != "none" and self.weights != "none":
            raise UsageError(f"eval {self.eval!r} runs with weights 'none'; an evaluation forward's quantized "
                             "all-gathers are not emulated yet (use eval 'none')")
        if self.compile != "none" and (self.mesh, self.weights, self.cast_inputs, self.checkpointing) != (
                "fsdp", "none", "fsdp", "none"):
            raise UsageError(f"compile {self.compile!r} runs on mesh 'fsdp' with weights 'none', cast_inputs 'fsdp' and "
                             "checkpointing 'none' (docs/findings.md: compiled checkpointed blocks); use compile 'none' "
                             "for the others")
        if self.init == "meta" and (self.mesh != "fsdp" or self.weights != "none"):
            raise UsageError("init 'meta' runs with mesh 'fsdp' and weights 'none' only; use init 'seeded'")

    def _movable(self) -> bool:
        """Whether this cell can run its ``move`` (``none`` always can)."""
        if self.move == "none":
            return True
        if self.reshard_to != "all":  # another layout has another half
            return False
        if not self.lifecycle or self.weights != "none" or self.init != "seeded":
            return False
        if self.move == "mesh":
            return self.mesh in ("fsdp", "hsdp") and self.ranks >= 4
        return self.mesh == "fsdp" and self.ranks % 2 == 0

    def move_layouts(self) -> tuple["Cell", "Cell"]:
        """The cells the moved checkpoint is saved from and loaded into: the same recipe on
        another number of ranks (the rest train the missing ranks' batches as micro-batches) or
        on another mesh; ``move`` none on both."""
        same = replace(self, move="none", crossload="")
        if self.move == "mesh":
            return same, replace(same, mesh="hsdp" if self.mesh == "fsdp" else "fsdp")
        half = replace(same, ranks=self.ranks // 2, microbatches=2 * self.microbatches)
        return (same, half) if self.move == "shrink" else (half, same)

    def eval_labels(self, step: int) -> list[str]:
        """The evaluation forwards of ``step``, in order: ``mb{k}`` after micro-batch k's backward
        (every one but the last), or ``after-step`` after the optimizer step; the ranks and the
        reference both follow this list."""
        if self.eval == "between-microbatches":
            return [f"mb{k}" for k in range(self.microbatches - 1)]
        if self.eval == "between-steps":
            return ["after-step"]
        return []

    def segments(self, step: int) -> list[str]:
        """The segments of ``step``'s loop the worker counts collectives in (each judged on its own,
        :mod:`parity.judge.collectives`): each micro-batch's forward and backward, state dicts
        and evaluation forwards where the cell takes them, the optimizer step."""
        labels = [f"mb{mb}/{phase}" for mb in range(self.microbatches) for phase in ("forward", "backward")]
        labels += ["state-dict"] if self.state_dict_points(step) else []
        labels += ["eval"] if self.eval_labels(step) else []
        return labels + ["optimizer"]

    def state_dict_points(self, step: int) -> list[str]:
        """Where the cell's own training takes state dicts in ``step`` (:mod:`parity.execute.state_dicts`),
        each kind of point once, early enough that training follows it: after the first optimizer
        step, after the first evaluation forward, between the forward and the backward of the last
        step's first micro-batch."""
        first_eval = next((label for k in range(self.steps) for label in self.eval_labels(k)), None)
        return ((["after-step"] if step == 0 else [])
                + ([f"after-eval-{first_eval}"] if step == 0 and first_eval else [])
                + (["after-forward"] if step == self.steps - 1 else []))

    @staticmethod
    def state_dict_apis(point: str) -> tuple[str, ...]:
        """The APIs read at ``point`` (:data:`STATE_DICT_APIS`)."""
        return STATE_DICT_APIS if point == "after-forward" else STATE_DICT_APIS[:1]

    def topology(self) -> Topology:
        return Topology(name=self.mesh, world=self.ranks)

    @property
    def whole_tensors(self) -> bool:
        """Ranks record whole tensors, not their dim-0 shards: a 2-D composition's shards, and
        shards on another dimension than 0, do not concatenate along dim 0."""
        return self.mesh != "fsdp" or self.placement != "dim0"

    @property
    def accumulating(self) -> bool:
        """Unsharded gradients accumulate across micro-batches (no reduction until the last)."""
        return self.sync == "last" and self.microbatches > 1

    def synchronizes(self, mb: int) -> bool:
        """Whether micro-batch ``mb``'s backward reduces its gradients: every one, or the last only
        while accumulating (what the recipe sets gradient sync to)."""
        return mb == self.microbatches - 1 or not self.accumulating

    @cached_property
    def id(self) -> str:
        """The cell's name in every record (cached: a cell is frozen, and judging names it once
        per record -- tens of thousands of times in a matrix)."""
        parts = [
            self.fixture, self.path, f"r{self.ranks}", f"mb{self.microbatches}-{self.sync}",
            f"ac-{self.checkpointing}", f"reshard-{'on' if self.reshard else 'off'}",
            f"out-{self.output_dtype}", f"s{self.seed}",
        ]
        parts += [f"{tag}-{getattr(self, k)}" for k, tag in RECIPE_AXES.items() if getattr(self, k) != getattr(Cell, k)]
        if self.faults:
            parts.append("fault-" + "+".join(self.faults))
        return "/".join(parts)

    @property
    def lifecycle(self) -> bool:
        """Whether this cell also runs the checkpoint save/load/resume lifecycle (DCP):
        single micro-batch, no activation checkpointing, seed 0 (a fixed, documented slice)."""
        return self.microbatches == 1 and self.checkpointing == "none" and self.seed == 0 and self.steps >= 2

    @property
    def resume_step(self) -> int:
        """The step the checkpoint lifecycle's resumed runs repeat: steps before it run, then the
        checkpoint is saved and loaded. The middle of the cell's steps, so a longer cell saves
        non-trivial optimizer state (step counters, moments after several updates)."""
        return max(1, self.steps // 2)

    @property
    def pair_id(self) -> str:
        """The cell id without its path: cells of different paths sharing it are compared."""
        return pair_of(self.id, self.path)

    def precision(self) -> PrecisionConfig:
        return PrecisionConfig(
            param_dtype=parse_dtype(self.param_dtype, what="param_dtype"),
            reduce_dtype=parse_dtype(self.reduce_dtype, what="reduce_dtype", allow_natural=True),
            output_dtype=parse_dtype(self.output_dtype, what="output_dtype", allow_natural=True),
        )

    @property
    def crossload_targets(self) -> list[str]:
        """Paths the lifecycle loads this cell's checkpoint into besides its own: ``crossload``
        (comma-separated; the runner gives a baseline every other path of the run), else the
        baseline (for the baseline itself: none)."""
        if self.crossload:
            return self.crossload.split(",")
        return [self.baseline] if self.path != self.baseline else []

    @property
    def load_targets(self) -> list[str]:
        """Every path the lifecycle (and a moving checkpoint) loads this cell's checkpoint into:
        its own, then :attr:`crossload_targets`. The ranks report each; the judges owe each."""
        return [self.path] + [t for t in self.crossload_targets if t != self.path]

    def axes(self) -> dict:
        """The cell's axis values by name (what ``-k`` and ``skip.when`` read), without the
        run-level fields; dtypes by name, ``reshard`` as ``on`` / ``off``."""
        d = {name: getattr(self, name) for name in self.__dataclass_fields__ if name not in _RUN_LEVEL}
        d["reshard"] = "on" if self.reshard else "off"
        precision = self.precision()
        d["output_dtype"] = dtype_name(precision.output_dtype)
        d["reduce_dtype"] = dtype_name(precision.reduce_dtype)
        return d
