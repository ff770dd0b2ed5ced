"""Build a sharded model for a cell and train it, step by step, recording what it saw.

Used by the worker for the cell itself and by the checkpoint lifecycle for its fresh
models, so both train exactly the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from parity.errors import UsageError
from parity.execute import collectives, evaluation, knobs, parallel, probes, state_dicts
from parity.execute.checkpointing import apply_checkpointing, checkpoint_units
from parity.execute.materialize import materialize
from parity.execute.observation import Observation
from parity.faults import Injector
from parity.matrix.cell import Cell
from parity.model.compiling import CompileLog, compiled_blocks
from parity.model.formats import layout
from parity.model.plan import PrecisionPlan, canonical_fqn
from parity.model.quantized import main_weight, quantize_weights, take_stats
from parity.model.recipe import (folded_divisors, loss_scale, make_optimizer, make_scheduler, owner_reduction,
                                 rescales_gradients, state_tensors)
from parity.model.registry import get_fixture
from parity.paths import ShardReport, apply_sharding, plan_sharding
from parity.paths.reads import check_fixture_reads

#: Called with a short label whenever the worker makes progress (hang detection).
Heartbeat = Callable[[str], None]


def within(phase: str, heartbeat: Heartbeat) -> Heartbeat:
    """Report ``phase`` now, and every later report as part of it (where a rank was when it went
    silent or died: ``checkpoint lifecycle: loading into legacy; step 1 micro-batch 0``)."""
    heartbeat(phase)
    return lambda what: heartbeat(f"{phase}; {what}")


def _local(t: torch.Tensor) -> torch.Tensor:
    t = t.to_local() if isinstance(t, DTensor) else t
    return main_weight(t).detach().cpu().clone()


def observed(cell: Cell):
    """How a rank records tensors: its local shards on a 1-D mesh (the judge concatenates
    them); whole tensors on a 2-D composition, whose shards do not concatenate along dim 0."""
    return parallel.full if cell.whole_tensors else _local


@dataclass(kw_only=True)
class Sharded:
    """A freshly built, sharded model with its optimizer."""

    model: nn.Module
    plan: PrecisionPlan
    report: ShardReport
    ignored: set
    opt: torch.optim.Optimizer
    params: list[nn.Parameter]
    names: dict[int, str]
    scaler: object | None = None
    """float16: the sharded gradient scaler (found-inf agreed across ranks)."""
    owners: dict[str, str] = field(default_factory=dict)
    """Parameter FQN -> tensor/expert-parallel owner (:func:`parity.execute.parallel.parallelize`)."""
    group: object | None = None
    """The process group of a model trained on fewer ranks than the job's (None: every rank)."""
    compiled: CompileLog | None = None
    """The blocks compiled before sharding and the graphs they ran (None: eager)."""
    sched: object | None = None
    """The recipe's learning-rate scheduler (None: a constant rate)."""


def build(cell: Cell, path: str, *, mesh, device, inject: Injector, obs: Observation | None = None) -> Sharded:
    """Model -> plan -> (activation checkpointing) -> sharding along ``path`` -> (meta:
    materialize) -> optimizer. Raises :class:`IsolationError` when a dtype-split path
    cannot shard the model."""
    fixture = get_fixture(cell.fixture, cell.source)
    meta = cell.init == "meta"
    topo = cell.topology()
    composed = parallel.device_mesh(topo, mesh, torch.device(device).type)
    group = _subgroup(mesh)  # rank agreement, found-inf and owner reductions run over the model's ranks
    model = fixture.make(cell.seed, "meta" if meta else device)
    owners = parallel.parallelize(model, fixture, topo, composed)  # before FSDP, as recipes do
    ignored = fixture.ignored(model)  # after: expert parallelism replaced the experts
    formats = layout(fixture.quantizable, cell.weights)
    if cell.weights != "none" and not formats:
        raise UsageError(f"weights {cell.weights!r}: fixture {cell.fixture!r} declares no quantizable layers "
                         "(Fixture.quantizable); run it with weights 'none'")
    quantize_weights(model, formats)  # before FSDP: it shards the wrapper and calls its all-gather hooks
    plan = fixture.resolve(model, cell.precision(), ignored, parallel=owners, formats=formats)
    if obs is not None:
        obs.plan = plan
    plan = inject.site("plan", plan)
    apply_checkpointing(model, cell.checkpointing, fixture.blocks)
    compiled = compiled_blocks(cell, model, fixture.blocks)  # before sharding, as recipes compile
    report = knobs.units(cell, plan_sharding(model, fixture.unit_roots, plan, path, ignored))
    _check_reads(cell, fixture, report)
    if obs is not None:
        obs.report = report
        obs.contracts.unsharded = probes.before_sharding(model)
    apply_sharding(model, report, plan, mesh=parallel.fsdp_mesh(topo, composed, mesh),
                   reshard_after_forward=knobs.reshard_after_forward(cell), ignored=ignored, group=group,
                   **knobs.sharding_options(cell))
    if meta:
        materialize(model, fixture.make(cell.seed), device)
        ignored = fixture.ignored(model)  # to_empty gave the plain (ignored) parameters new objects
    if fixture.unused_params:
        model.set_reduce_scatter_unused_params(True)
    knobs.apply(cell, model, fixture.blocks, fixture.backward_free)
    if cell.checkpointing == "outer":
        checkpoint_units(model, report)
    inject.site("sharded", model=model, path=path)
    params = list(model.parameters())
    scale = loss_scale(plan.config.param_dtype)
    scaler = None
    if scale != 1.0:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler(device=torch.device(device).type, init_scale=scale,
                                   **({"process_group": group} if group is not None else {}))
    opt = make_optimizer(params, cell.optimizer)
    return Sharded(
        model=model, plan=plan, report=report, ignored=ignored, opt=opt,
        params=params, names={id(p): canonical_fqn(n) for n, p in model.named_parameters()}, scaler=scaler,
        owners=owners, group=group, compiled=compiled, sched=make_scheduler(opt, cell.schedule),
    )


#: (fixture, source, seed, units) whose forward reads every parameter inside its unit's forward.
_READS_CHECKED: set = set()


def _check_reads(cell: Cell, fixture, report: ShardReport) -> None:
    """Units the path created must hold parameters only their own forward reads
    (:mod:`parity.paths.reads`); checked once per worker per model and set of units."""
    key = (cell.fixture, cell.source, cell.seed, tuple((u.modules, u.params) for u in report.units))
    if key in _READS_CHECKED:
        return
    check_fixture_reads(fixture, cell.seed, report)
    _READS_CHECKED.add(key)


def _subgroup(mesh):
    """The process group of a model trained on fewer ranks than the job has (a checkpoint that
    moves, :mod:`parity.execute.moves`); None when it trains on all of them."""
    import torch.distributed as dist

    if mesh is None or not dist.is_initialized() or mesh.ndim != 1 or mesh.size() == dist.get_world_size():
        return None
    return mesh.get_group()


def _forward(cell: Cell, model: nn.Module, inputs: tuple[torch.Tensor, ...]):
    """``outer`` checkpointing also wraps the root unit: the model call itself."""
    if cell.checkpointing == "outer":
        from torch.utils.checkpoint import checkpoint

        return checkpoint(model, *inputs, use_reentrant=False)
    return model(*inputs)


def freeze_schedule(s: Sharded, step: int) -> None:
    """The recipe's freeze schedule at ``step``: a parameter the plan trains from a later step is
    frozen until then. A resumed run applies the schedule of the step its checkpoint was saved
    after before loading it, as a recipe restores its freeze state before its optimizer state
    (DCP's optimizer state dict holds trainable parameters only)."""
    for p in s.params:
        t = s.plan.get(s.names[id(p)])
        if t is not None and t.trainable_from:
            p.requires_grad_(step >= t.trainable_from)


def _evaluate(cell: Cell, s: Sharded, fixture, step: int, label: str, rank: int, device, obs: Observation, *,
              state_dicts: bool) -> None:
    """An evaluation forward (:mod:`parity.execute.evaluation`) on this rank's own eval batch;
    the cell's own training (not the checkpoint lifecycle's) then takes a state dict."""
    index = cell.eval_labels(step).index(label)
    batch = fixture.eval_batch(cell.seed, step, cell.topology().data_rank(rank), index).to(device)
    with knobs.evaluation_phase(cell, s.model) as end:
        seen = evaluation.evaluate(s.model, s.report, batch.inputs, fixture.output, step=step, label=label, end=end)
    seen.output = _local(seen.output)
    obs.evals.append(seen)
    if state_dicts and f"after-eval-{label}" in cell.state_dict_points(step):
        _state_dicts(cell, s, step, f"after-eval-{label}", obs)


def _state_dicts(cell: Cell, s: Sharded, step: int, point: str, obs: Observation) -> None:
    obs.state_dicts.append(state_dicts.take(s.model, s.params, s.names, observed(cell), step=step, point=point))


def train_step(cell: Cell, s: Sharded, step: int, *, rank: int, world: int, device, obs: Observation,
               recorder=None, heartbeat: Heartbeat | None = None, tp: parallel.TPReductions | None = None,
               data: Callable[[int, int], tuple[int, int]] | None = None, keep=None,
               segments: collectives.Segments | None = None, state_dicts: bool | None = None,
               fold: int = 1) -> None:
    """One optimizer step over the cell's micro-batches; appends what it saw to ``obs``.
    ``data`` maps (rank, micro-batch) to the (data rank, micro-batch) whose batch it trains
    (default: its own); ``fold`` how many data ranks' batches each rank trains (a layout on
    fewer ranks, :mod:`parity.execute.moves`): each micro-batch's loss is then divided as on
    the full layout (by ``cell.microbatches // fold`` and :func:`parity.model.recipe.folded_divisors`)
    and the step's reduced gradients as that says -- so every micro-batch's backward computes
    the numbers it computes there, and only the order of the sum differs; ``keep`` how tensors are recorded (default: :func:`observed`);
    ``segments`` labels the collectives it issues by segment of the loop (default: the
    recorder's); ``state_dicts`` whether it takes the cell's state dicts where the loop takes them
    (default: when it records; a resumed run repeats its step with them, as the loop ran it)."""
    fixture = get_fixture(cell.fixture, cell.source)
    topo, keep = cell.topology(), keep or observed(cell)
    data = data or (lambda r, m: (topo.data_rank(r), m))
    freeze_schedule(s, step)
    divisor, after = folded_divisors(cell.reduction, topo.data_world, fold)

    segments = segments or (recorder.segments if recorder else None)
    taking = recorder is not None if state_dicts is None else state_dicts

    def segment(label: str):
        return segments.segment(step, label) if segments else contextlib.nullcontext()
    reductions = segments.reductions if segments else contextlib.nullcontext
    with segment(BETWEEN):  # whatever runs between the named segments is counted too
        _microbatches(cell, s, step, fixture, segment, taking, reductions=reductions, rank=rank, world=world,
                      device=device, obs=obs, recorder=recorder, heartbeat=heartbeat, tp=tp, data=data, keep=keep,
                      divisor=divisor, fold=fold, after=after)


#: The segment label of what a step runs outside its named segments (the loss, the recorder's reads):
#: nothing there issues a collective.
BETWEEN = "between segments"


def _microbatches(cell: Cell, s: Sharded, step: int, fixture, segment, taking: bool, *, reductions, rank: int, world: int,
                  device, obs: Observation, recorder, heartbeat, tp, data, keep, divisor, fold, after) -> None:
    """The body of :func:`train_step`: its micro-batches, the optimizer step, evaluations and state
    dicts, each in its segment."""
    for mb in range(cell.microbatches):
        last = mb == cell.microbatches - 1
        synced = cell.synchronizes(mb)
        knobs.before_microbatch(cell, s.model, mb)
        if cell.finalize == "flagged":  # what the backward will read: the root state's context
            obs.contracts.last_backward[(step, mb)] = bool(s.model._get_fsdp_state()._state_ctx.is_last_backward)
        batch = fixture.batch(cell.seed, step, *data(rank, mb)).to(device)
        inputs = batch.inputs
        if not fixture.token_input:
            inputs = tuple(x.requires_grad_() for x in inputs)
        with tp.window(step, mb) if tp else contextlib.nullcontext():
            with recorder.phase(step, mb) if recorder else contextlib.nullcontext(), segment(f"mb{mb}/forward"):
                knobs.before_forward(cell, s.model)
                if cell.unshard == "explicit":
                    obs.contracts.unshard[(step, mb)] = evaluation.gather_states(s.model, s.report)
                out = fixture.output(_forward(cell, s.model, inputs))
            obs.contracts.after_forward[(step, mb)] = evaluation.unit_states(s.model, s.report)
            loss = fixture.loss(out, batch.target) / (cell.microbatches // fold)
            if divisor != 1:
                loss = loss / divisor
            if taking and mb == 0 and "after-forward" in cell.state_dict_points(step):  # before its backward
                with segment("state-dict"):
                    _state_dicts(cell, s, step, "after-forward", obs)
            if recorder:  # a backward that synchronizes: read what its reductions take
                recorder.reading_reduce = synced
            with segment(f"mb{mb}/backward"):
                (s.scaler.scale(loss) if s.scaler else loss).backward()
                knobs.after_backward(cell, s.model, synced)
            obs.contracts.grads_held[(step, mb)] = (synced, probes.unsharded_grads_held(s.model))
            if cell.reshard_backward == "last":
                obs.contracts.after_backward[(step, mb)] = evaluation.unit_states(s.model, s.report)
        obs.outputs.append(_local(out))
        grad = None if fixture.token_input else inputs[0].grad
        if grad is not None and s.scaler:
            grad = grad / s.scaler.get_scale()  # a power of two: exact
        obs.input_grads.append(None if grad is None else _local(grad))
        if recorder:
            recorder.reading_reduce = False
            recorder.after_backward(s.model, step, mb, synced, s.scaler.get_scale() if s.scaler else 1.0)
        if heartbeat:
            heartbeat(f"step {step} micro-batch {mb}")
        if not last and cell.eval == "between-microbatches":
            with segment("eval"):
                _evaluate(cell, s, fixture, step, f"mb{mb}", rank, device, obs, state_dicts=taking)
    with segment("optimizer"):
        _finish_step(cell, s, step, world=world, obs=obs, keep=keep, fixture=fixture, fold=after,
                     reductions=reductions)
    if taking and "after-step" in cell.state_dict_points(step):
        with segment("state-dict"):
            _state_dicts(cell, s, step, "after-step", obs)
    if cell.eval == "between-steps":
        with segment("eval"):
            _evaluate(cell, s, fixture, step, "after-step", rank, device, obs, state_dicts=taking)


def rates(opt: torch.optim.Optimizer) -> list[float]:
    """Each param group's learning rate, as the next ``step()`` would take it."""
    return [float(group["lr"]) for group in opt.param_groups]


def _optimizer_step(s: Sharded) -> list[float]:
    """The optimizer step (through the gradient scaler in float16, which skips a step whose
    gradients overflowed, as the reference does); returns the rates it took, read at the
    optimizer's own pre-step hook, which runs after any global one (a skipped step: the rates
    it would have taken)."""
    took = [rates(s.opt)]
    hook = s.opt.register_step_pre_hook(lambda opt, args, kwargs: took.append(rates(opt)))
    try:
        if s.scaler:
            s.scaler.step(s.opt)
            s.scaler.update()
        else:
            s.opt.step()
    finally:
        hook.remove()
    return took[-1]


def _finish_step(cell: Cell, s: Sharded, step: int, *, world: int, obs: Observation, keep, fixture,
                 fold: int = 1, reductions=contextlib.nullcontext) -> None:
    """After the last micro-batch: the ignored parameters' owner reduction, the average over
    folded data ranks (``fold``, :func:`train_step`), (unscaling,) the
    gradient norm (and clipping), the optimizer step and the scheduler's; records gradients (as
    reduced, when unscaling or clipping changes them after, and as stepped with), parameters and
    the step's learning rates (:attr:`~parity.execute.observation.Observation.lrs`)."""
    # the emulated owner of ignored parameters reduces their gradients, in the model's order:
    # a set's order follows object addresses, which differ across ranks (same-shape
    # parameters would be summed with each other's gradients, found by the fuzz campaign)
    for p in (p for p in s.params if p in s.ignored):
        if p.grad is not None and world > 1:
            group, dtype = parallel.owner_reduce(
                p, world=world, reduction=owner_reduction(cell.reduction, fixture.ignored_reduction), group=s.group)
            obs.contracts.owner_reduce.setdefault(s.names[id(p)], set()).add(f"{dtype} over {group}")
    if fold != 1:  # a power of two (layouts halve): exact
        for p in s.params:
            if p.grad is not None:
                p.grad.div_(fold)
    if rescales_gradients(cell.clip, s.plan.config.param_dtype):  # the reduction's output, before that
        factor = s.scaler.get_scale() if s.scaler else 1.0
        obs.reduced.append({s.names[id(p)]: probes.unscaled(keep(p.grad), factor) for p in s.params if p.grad is not None})
    with reductions():  # the step's own exchanges (the optimizer's update owes none)
        if s.scaler:
            s.scaler.unscale_(s.opt)
        norm = parallel.global_grad_norm(s.params)
        if cell.clip:  # the recipe's clipping, then what it left: the global norm after it
            parallel.clip_gradients(s.params, cell.clip, norm)
    obs.grad_norms.append(norm)
    if cell.clip:
        with collectives.unseen():  # parity's read, not the recipe's all-reduce
            obs.clipped_norms.append(parallel.global_grad_norm(s.params))
    obs.grads.append({s.names[id(p)]: keep(p.grad) for p in s.params if p.grad is not None})
    took = _optimizer_step(s)
    s.opt.zero_grad()
    if s.sched is not None:  # once per optimizer step; this recipe moves it on after a skipped step too
        s.sched.step()
    obs.lrs.append((took, rates(s.opt)))
    obs.params.append({s.names[id(p)]: keep(p) for p in s.params})
    obs.moments.append(state_tensors(s.opt, s.names, keep))
    if cell.weights != "none":  # what each quantized weight's all-gathers did this step
        obs.contracts.quant.append(take_stats({s.names[id(p)]: p for p in s.params}))
