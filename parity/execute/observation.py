"""What a rank observed while running one cell, as plain CPU data for the judge.

Workers only observe; the parent judges. Every field is filled in exactly one place
(named in its docstring).
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field

import torch

from parity.model.plan import PrecisionPlan
from parity.model.trace import Trace
from parity.paths.base import ShardReport


def value_sums(t: torch.Tensor) -> tuple[float, float, float]:
    """How a gathered parameter is recorded and judged (:attr:`ContractsSeen.gathered`): the sum
    of its absolute values, the sum of its values and a sum weighted by position (element ``i``
    times ``i mod 1021 + 1``), all in FP64 -- the last changes when the same values come in
    another order (shards concatenated wrongly), which the first two cannot see."""
    with torch.no_grad():
        values = t.detach().double().flatten()
        weights = torch.arange(values.numel(), dtype=torch.float64, device=values.device) % 1021 + 1
        return float(values.abs().sum()), float(values.sum()), float((values * weights).sum())


@dataclass(kw_only=True)
class NamesSnapshot:
    """The model's names and identities at one stage (:func:`parity.execute.probes.names_snapshot`)."""

    params: list[str]
    """``named_parameters()`` FQNs, canonical, in order."""
    state_dict: list[str] | None
    """``state_dict()`` keys, canonical, in order; None where reading them would change the run
    (right after the first forward: :func:`parity.execute.probes.lazy_init_snapshot`)."""
    ids: dict[str, int]
    """FQN -> ``id()`` of the parameter object."""
    storage: dict[str, str]
    """FQN -> parameter dtype name."""
    modules: dict[str, list[str]]
    """Module FQN -> qualified class names of its MRO (only the class itself before sharding)."""
    placements: dict[str, str] = field(default_factory=dict)
    """FQN -> the DTensor placements of a sharded parameter (``Shard(dim=0)``, ...)."""


@dataclass(kw_only=True)
class BufferSeen:
    """One floating buffer of the sharded model, as this rank holds it."""

    dtype: str
    value: torch.Tensor


@dataclass(kw_only=True)
class MarkerSeen:
    """One FP32-marked tensor after a buffer-replacing move and a BF16 conversion."""

    kind: str
    after_move: bool
    dtype: str


@dataclass(kw_only=True)
class Resumed:
    """The step after loading the lifecycle's checkpoint into one path (:mod:`.lifecycle`)."""

    taken: str = ""
    skip: str = ""
    """Why this path could not be loaded into (it cannot shard the model)."""
    error: str = ""
    """What failed while saving, loading into or training this path (an ERROR record beside
    the cell's other evidence, never in place of it)."""
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    optim: dict[str, dict] = field(default_factory=dict)
    collectives: dict[tuple[int, str, str], list[int]] = field(default_factory=dict)
    """What ``torch.distributed`` issued while saving (``checkpoint/save``: the path's own run
    only), loading (``checkpoint/load``) and in the resumed step (its segments, as in
    :attr:`ContractsSeen.collectives`), keyed (step, segment, kind) -> bytes of each call."""
    saved: dict[str, tuple[object, tuple]] = field(default_factory=dict)
    """The cell's own path: every entry as this rank handed it to DCP, ``(value, region)``
    (:func:`parity.execute.lifecycle.pieces`)."""
    disturbed: list[str] = field(default_factory=list)
    """The cell's own path: the entries whose live value (or region) the save changed on this
    rank -- a training job carries on after it saves (expected: none)."""
    written: dict[str, bytes] = field(default_factory=dict)
    """Rank 0, the cell's own path: the checkpoint's files, name -> bytes, for the parent to read
    without DCP's loader (:func:`parity.execute.dcp_files.read`)."""
    unread: str = ""
    """Why the files could not be read back (``written`` is then empty)."""
    loaded: dict[str, tuple[object, tuple]] = field(default_factory=dict)
    """Every entry as this rank holds it right after loading into this path, before the resumed
    step, ``(value, region)`` (:func:`parity.execute.lifecycle.pieces`)."""
    held_grads: list[str] | None = None
    """The parameters holding a gradient right after the load (expected: none; None: not reported)."""
    lrs: tuple[list[float], list[float]] | None = None
    """The resumed step's learning rates (each param group's) and those set for the step after it
    (:attr:`Observation.lrs`); None: not reported."""
    regathered: dict[str, tuple] = field(default_factory=dict)
    """Every parameter as an all-gather after the resumed step hands it to compute, as
    :attr:`ContractsSeen.gathered` records it (:func:`parity.execute.lifecycle.regathered`)."""

    @property
    def save_failed(self) -> bool:
        """Rank 0's report, own path: the save itself failed (an error, no files written or said
        unread); the lifecycle then loads into no path."""
        return bool(self.error) and not self.written and not self.unread


#: The key of :attr:`Moved.straight` / :attr:`Moved.resumed` holding the global gradient norm
#: a clipping step clipped with (a 0-d float64 tensor).
NORM = "norm:global"
#: The key of :attr:`Moved.straight` / :attr:`Moved.resumed` holding the step's learning rates,
#: ``[stepped with, next]`` (each a list, one rate per param group; judged exactly, owed always).
RATES = "lr:rates"


@dataclass(kw_only=True)
class Moved:
    """A checkpoint saved on one layout and loaded into one path on another (:mod:`.moves`)."""

    save: str = ""
    """The saving layout, e.g. ``legacy on fsdp x 2 ranks``."""
    load: str = ""
    taken: str = ""
    skip: str = ""
    error: str = ""
    part: bool = True
    """Whether this rank is one of the loading layout's ranks."""
    before: dict[str, str] = field(default_factory=dict)
    """Entry -> layout (type, placements) in the freshly built model, before loading."""
    after: dict[str, str] = field(default_factory=dict)
    saved: dict[str, object] = field(default_factory=dict)
    """Rank 0, the cell's own path: every entry's whole value when it was saved."""
    loaded: dict[str, object] = field(default_factory=dict)
    """Rank 0: every entry's whole value after loading."""
    straight: dict[str, torch.Tensor] = field(default_factory=dict)
    """Rank 0, the cell's own path: ``grad:``/``param:`` FQN and optimizer entries after the
    saving layout's next step (whole)."""
    resumed: dict[str, torch.Tensor] = field(default_factory=dict)
    """Rank 0: the same after the loading layout's step."""
    held_grads: list[str] | None = None
    """Every loading rank: the parameters holding a gradient right after the load (as :class:`Resumed`'s)."""
    regathered: dict[str, tuple] = field(default_factory=dict)
    """Every loading rank: each parameter as an all-gather after the resumed step hands it over (as :class:`Resumed`'s)."""
    witness: dict[str, str] = field(default_factory=dict)
    """Every loading rank: ``loaded:KEY`` and ``resumed:KEY`` -> the digest of this rank's copy
    (:func:`parity.digests.value_sha256`), so each rank is held to rank 0's values."""
    collectives: dict[tuple[int, str, str], list[int]] = field(default_factory=dict)
    """What ``torch.distributed`` issued on this rank while saving (``checkpoint/save``: the cell's
    own path, ranks of the saving layout) and loading (``checkpoint/load``), as in
    :attr:`Resumed.collectives`."""


@dataclass
class PackedShards:
    """Sharded gradients of one micro-batch, packed into one FP64 tensor (exact for every
    gradient dtype), so that an observation carries one tensor per micro-batch, not one per
    parameter: FQN -> (offset in the whole parameter, local shape, start in ``values``)."""

    values: torch.Tensor
    index: dict[str, tuple[tuple[int, ...], tuple[int, ...], int]]

    @classmethod
    def pack(cls, shards: dict[str, tuple[tuple[int, ...], torch.Tensor]]) -> "PackedShards":
        index, start = {}, 0
        for fqn, (offset, t) in shards.items():
            index[fqn] = (tuple(offset), tuple(t.shape), start)
            start += t.numel()
        flat = [t.reshape(-1).double() for _, t in shards.values()]
        return cls(torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64), index)

    def get(self, fqn: str, default=None):
        if fqn not in self.index:
            return default
        offset, shape, start = self.index[fqn]
        n = math.prod(shape)
        return offset, self.values[start:start + n].reshape(shape)


@dataclass(kw_only=True)
class ContractsSeen:
    """Contract observations (:mod:`parity.execute.probes` and :mod:`.lifecycle`)."""

    unsharded: NamesSnapshot | None = None
    """Before sharding (original classes only)."""
    sharded: NamesSnapshot | None = None
    lazy_init: NamesSnapshot | None = None
    trained: NamesSnapshot | None = None
    compute: dict[str, str] = field(default_factory=dict)
    """Parameter FQN (per module alias) -> dtype read inside forward."""
    gathered: dict[int, dict[str, tuple[str, float, float]]] = field(default_factory=dict)
    """Step -> parameter FQN (per module alias) -> (dtype, sum of |values|, sum of values) of the
    parameter as its module's forward read it in the step's first micro-batch (all-gathered); a
    tensor-parallel shard's also says where its piece sits, ``((offset, length), ...)``
    (:func:`parity.execute.probes.gathered_read`)."""
    all_gathers: dict[int, dict[str, dict[str, list[tuple[str, float, float]]]]] = field(default_factory=dict)
    """Per step, per segment of the loop (``mb1/forward``, ``mb0/backward`` ...), per parameter:
    each distinct (dtype, sum of |values|, sum of values[, region of a TP shard]) an all-gather's
    output held once FSDP copied it out -- every all-gather of the training loop, later
    micro-batches' forwards and backward re-gathers included."""
    policies: dict[str, dict[str, object]] = field(default_factory=dict)
    """Unit root -> the MixedPrecisionPolicy fields FSDP holds."""
    boundaries: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    """Module FQN -> {"in": [...], "out": [...]} floating dtypes (the first forward)."""
    boundary_variants: dict[str, dict[str, list[list[str]]]] = field(default_factory=dict)
    """Module FQN -> {"in": [...], "out": [...]}: every distinct dtype list seen in any forward of
    the cell's own training (micro-batches, evaluations, activation-checkpoint recomputes)."""
    reduce: dict[str, list[str]] = field(default_factory=dict)
    """Parameter FQN -> dtypes its gradient was reduced in."""
    reduce_observable: bool = True
    accum: dict[str, list[str]] = field(default_factory=dict)
    """Parameter FQN -> dtypes of its unsharded gradient while sync was off."""
    accum_regions: dict[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    """FQN -> where this rank's piece of a tensor-parallel weight's unsharded gradient (in
    ``accumulated``) sits in the whole, ``((offset, length), ...)`` (torch's placement rule)."""
    accumulated: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)
    """(step, micro-batch) -> parameter FQN -> what that micro-batch's reductions took as input on
    this rank, where its backward synchronized, or its unsharded accumulated gradient after it,
    inside a no-sync window (unscaled, in FP64 where a loss scale was divided out; a
    tensor-parallel weight's is this rank's TP piece, placed by ``accum_regions``)."""
    shards: dict[tuple[int, int], "PackedShards"] = field(default_factory=dict)
    """(step, micro-batch) -> this rank's sharded gradients as the reductions of every
    synchronizing backward left them (reduce-scatter, HSDP's replica all-reduce and the
    accumulation into ``.grad``), unscaled: ``.get(FQN)`` -> (the shard's offset in the whole
    parameter, its values)."""
    partials: dict[tuple[int, int], "PackedShards"] = field(default_factory=dict)
    """HSDP: (step, micro-batch) -> what each all-reduce across replicas took on this rank (the
    shard group's reduce-scattered partial, unscaled), per parameter: ``.get(FQN)`` -> (offset,
    values)."""
    buffers: dict[str, dict[str, BufferSeen]] = field(default_factory=dict)
    """Stage (``sharded``, ``trained``) -> buffer FQN -> dtype and value on this rank."""
    markers: dict[str, MarkerSeen] = field(default_factory=dict)
    resume_step: int = 0
    """The step a resumed run repeats; ``optim`` is the state right after it."""
    optim: dict[str, dict] | None = None
    """FQN -> optimizer state (local shards) at ``resume_step``."""
    resume: dict[str, Resumed] | None = None
    """Target path -> what the resumed run saw."""
    moved: dict[str, Moved] | None = None
    """Target path -> the moved checkpoint's evidence (:mod:`parity.execute.moves`); None: no move."""
    replicas: dict[str, list[str]] = field(default_factory=dict)
    """HSDP: parameter FQN -> dtypes of the all-reduce across replicas."""
    owner_reduce: dict[str, set[str]] = field(default_factory=dict)
    """FSDP-ignored parameter FQN -> "dtype over group" of its owner's reduction."""
    tp_reduce: dict[str, list[str]] = field(default_factory=dict)
    """``module@forward`` / ``module@backward`` -> dtypes of its tensor-parallel all-reduces."""
    tp_partials: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)
    """``(step, mb)`` -> ``MODULE@forward|backward`` -> what this rank's first tensor-parallel
    all-reduce there took in that micro-batch (its local partial sum: a rowwise output, a colwise
    input gradient)."""
    quant: list[dict[str, object]] = field(default_factory=list)
    """Per step, quantized parameter FQN -> its :class:`~parity.model.quantized.GatherStats`."""
    collectives: dict[tuple[int, str, str], list[int]] = field(default_factory=dict)
    """(step, segment, kind) -> the bytes of each call, in order, over the cell's own training
    (how many calls: its length): segments ``mb{k}/forward``, ``mb{k}/backward``, ``state-dict``,
    ``eval``, ``optimizer`` (:mod:`.collectives`). What travels: a reduction in BF16 has half the
    bytes of one in FP32."""
    ownership: dict[str, dict[str, str]] = field(default_factory=dict)
    """Stage (``sharded``, ``trained``) -> parameter FQN -> who holds it and how
    (:func:`parity.execute.probes.ownership`)."""
    compiles: list[tuple[int, str]] | None = None
    """Compiled blocks (:mod:`parity.model.compiling`): where in the cell's own training each graph was
    compiled, (step, segment); None: nothing was compiled."""
    graph_runs: dict[tuple[int, str], int] = field(default_factory=dict)
    """Compiled blocks: (step, segment) -> how many times a compiled graph ran forward there."""
    block_runs: dict[tuple[int, str, str], int] = field(default_factory=dict)
    """Compiled blocks: (step, segment, block) -> the graph runs there while that block's compiled
    call was running (a block run eagerly has none)."""
    module_runs: dict[tuple[int, str, str], list[int]] | None = None
    """Activation checkpointing (:mod:`parity.execute.recompute`): (step, segment, module) ->
    [forward calls, calls whose output required gradient, calls of its checkpoint wrapper, matmuls
    run inside it (``selective`` only)] of each watched module (:data:`parity.execute.recompute.Runs`); None: not watched (compiled
    blocks)."""
    unshard: dict[tuple[int, int], dict[str, str]] = field(default_factory=dict)
    """``unshard = "explicit"``: (step, micro-batch) -> unit root -> its state right after the
    recipe's ``unshard()`` calls, before the forward (:func:`parity.execute.evaluation.gather_states`)."""
    after_forward: dict[tuple[int, int], dict[str, str]] = field(default_factory=dict)
    """(step, micro-batch) -> unit -> its parameters' sharded state right after that training
    forward, before its backward (:func:`parity.execute.evaluation.unit_states`): what
    ``reshard_after_forward`` left (``reshard.forward``)."""
    after_backward: dict[tuple[int, int], dict[str, str]] = field(default_factory=dict)
    """``reshard_backward = "last"``: (step, micro-batch) -> unit root -> its sharded state right
    after that micro-batch's backward (:func:`parity.execute.evaluation.unit_states`)."""
    grads_held: dict[tuple[int, int], tuple[bool, list[str]]] = field(default_factory=dict)
    """(step, micro-batch) -> (whether that backward synchronized, the managed parameters whose
    unsharded parameter still held a gradient right after it: :func:`parity.execute.probes.unsharded_grads_held`)."""
    last_backward: dict[tuple[int, int], bool] = field(default_factory=dict)
    """``finalize = "flagged"``: (step, micro-batch) -> whether the root's state holds that
    micro-batch's backward to be the last (``set_is_last_backward``), read before it runs."""
    watched: tuple[str, ...] = ()
    """The modules whose forwards ``module_runs`` counts (none: the model declares no blocks)."""


@dataclass(kw_only=True)
class EvalSeen:
    """One evaluation forward of this rank (:mod:`parity.execute.evaluation`)."""

    step: int
    label: str
    """``mb{k}``: after micro-batch k's backward; ``after-step``: after the optimizer step."""
    output: torch.Tensor
    units: dict[str, str] = field(default_factory=dict)
    """Unit root -> its parameters' sharded state right after the forward (``sharded``,
    ``unsharded``, ``sharded_post_forward``; several, comma-joined, if they disagree)."""
    resharded: dict[str, str] | None = None
    """Under ``unshard = "explicit"``: the same after the recipe's ``reshard()`` of every unit."""
    restored: dict[str, str] | None = None
    """Under ``unshard = "explicit"``: unit root -> its ``reshard_after_forward`` after the phase."""


@dataclass(kw_only=True)
class EntrySeen:
    """One parameter as a state dict (or the model) holds it on this rank."""

    kind: str
    """``DTensor`` or ``Tensor``."""
    placements: str
    dtype: str
    value: torch.Tensor


@dataclass(kw_only=True)
class StateDictSeen:
    """The state dicts taken at one point of the training (:mod:`parity.execute.state_dicts`)."""

    step: int
    point: str
    """``after-step``, ``after-forward`` (between a forward and its backward), ``after-eval``."""
    masters: dict[str, EntrySeen] = field(default_factory=dict)
    """Parameter FQN -> the sharded parameter the optimizer steps, at that moment."""
    entries: dict[str, dict[str, EntrySeen]] = field(default_factory=dict)
    """API (``state_dict``, ``get_model_state_dict``) -> parameter FQN -> its entry."""


@dataclass(kw_only=True)
class Observation:
    rank: int
    whole: bool = False
    """Tensors are whole on every rank (2-D compositions), not this rank's dim-0 shards."""
    plan: PrecisionPlan | None = None
    report: ShardReport | None = None
    expected_error: str = ""
    expected_params: tuple[str, ...] = ()
    """The parameters the declared isolation error named (``IsolationError.params``)."""
    outputs: list[torch.Tensor] = field(default_factory=list)
    """Per (step, micro-batch), this rank's model output."""
    input_grads: list[torch.Tensor | None] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Per step, fqn -> local gradient shard (full tensor for ignored parameters): what the
    optimizer steps with (unscaled and clipped)."""
    reduced: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Per step of a clipping or loss-scaled cell, fqn -> the gradient as the reduction left it,
    before the scaler unscaled and clipping scaled it, divided by the loss scale (a power of
    two: exact). Empty for other cells, whose ``grads`` are that gradient."""
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Per step, fqn -> local parameter shard after the optimizer step."""
    moments: list[dict[str, dict[str, torch.Tensor]]] = field(default_factory=list)
    """Per step, optimizer state key (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``) -> fqn ->
    the local shard of that state after the optimizer step (scalars such as ``step`` left out)."""
    state_dicts: list[StateDictSeen] = field(default_factory=list)
    """State dicts taken during the cell's own training, in order."""
    evals: list[EvalSeen] = field(default_factory=list)
    """Evaluation forwards, in the order they ran."""
    grad_norms: list[float] = field(default_factory=list)
    """Per step, the global gradient norm before clipping."""
    clipped_norms: list[float] = field(default_factory=list)
    """Per step of a clipping cell, the global gradient norm after clipping."""
    lrs: list[tuple[list[float], list[float]]] = field(default_factory=list)
    """Per step, each param group's learning rate as the optimizer step took it (read at its own
    pre-step hook, which runs after any global one), and as the scheduler left it for the next step."""
    contracts: ContractsSeen = field(default_factory=ContractsSeen)
    traces: dict[int, Trace] = field(default_factory=dict)
    """A traced run: per micro-batch of the traced step, per-module outputs and input gradients."""
    op_log: dict = field(default_factory=dict)
    """Rank 0 of a traced run with ``op_log``: ``log`` (DebugMode's serialized log of the traced
    step) or ``note`` (why there is none); :mod:`parity.execute.oplog`."""
    timings: dict[str, float] = field(default_factory=dict)

    def after_training(self) -> "LifecyclePart":
        """What the checkpoint lifecycle adds to this observation (it runs after everything else is
        observed): a rank sends the rest first (:func:`parity.execute.pool._worker`), so a
        lifecycle that kills the rank loses only its own evidence."""
        return LifecyclePart(resume=self.contracts.resume, moved=self.contracts.moved,
                             seconds=self.timings.get("checkpoint"))

    def lifecycle_lost(self, path: str, reason: str) -> None:
        """The checkpoint lifecycle of this rank never reported (its rank died or hung): an error
        against ``path``, judged like a save that failed, beside the training evidence."""
        self.contracts.resume = {path: Resumed(error=f"the checkpoint lifecycle did not finish: {reason}")}


@dataclass(kw_only=True)
class LifecyclePart:
    """The checkpoint lifecycle's evidence, sent after the rest of an :class:`Observation`."""

    resume: dict[str, Resumed] | None
    moved: dict[str, Moved] | None
    seconds: float | None

    def onto(self, obs: Observation) -> Observation:
        """``obs`` (sent earlier by the same rank for the same cell) made whole."""
        obs.contracts.resume, obs.contracts.moved = self.resume, self.moved
        if self.seconds is not None:
            obs.timings["checkpoint"] = self.seconds
        return obs
