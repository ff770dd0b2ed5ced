"""The independent reference: one process, no FSDP, no DTensor, no torch.distributed.

It trains a fresh instance of the fixture (same seed, same initial weights) by *emulating*
the precision plan and the unit boundaries of a path's report:

- each emulated rank's micro-batch runs with parameters cast to their planned compute
  dtype (via ``torch.func.functional_call``) and floating inputs/outputs cast at unit
  boundaries exactly as each unit's policy says;
- gradients are accumulated and averaged across emulated ranks in the reduce dtype, in
  the order the sync mode implies (reduce every micro-batch, or accumulate unsharded and
  reduce once), then kept in the parameter's gradient dtype (its ``grad_dtype``, else storage);
- ignored parameters keep their storage dtype and are averaged (or summed, as the fixture's
  ``ignored_reduction`` says) by their emulated owner;
- float16 scales the loss by the recipe's power-of-two loss scale and unscales the reduced
  gradients (exact), skipping a step whose gradients overflowed, as the gradient scaler does;
- a model with ``unused_params`` gives every trainable parameter a gradient (zero when no
  rank used it), as ``set_reduce_scatter_unused_params(True)`` does; parameters unfrozen
  by the recipe join at their step;
- a quantized weight (FP8 all-gather) is quantized as a whole tensor from its FP32 value
  (global amax, MX blocks of whole rows) and dequantized into its compute dtype; its gradient
  goes to the FP32 weight unchanged (straight through), as FSDP's reduce-scatter sends it;
- mesh compositions: data ranks, HSDP's shard-group sums then replicas (partial sums held in
  the reduce dtype under ``replicas-last``), TP layers chunk by chunk (:mod:`.emulate`);
- one FP32 optimizer step (:func:`parity.model.recipe.make_optimizer`) per optimizer step, at the
  schedule's rate for that step (:func:`parity.model.recipe.set_lr`, no scheduler object).

``mode="fp64"`` runs the same loop with every tensor in FP64 and no boundary casts: the
"true" values, reported for information only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch.torch_version import TorchVersion
from torch import nn
from torch.func import functional_call

from parity.judge.emulate import Partials, emulate_tensor_parallel, ordered_sum, shard_group_divisor
from parity.matrix.cell import Cell
from parity.model.boundaries import float_buffers, hookable_modules, params_read, record_boundaries
from parity.model.compiling import CompileLog, compiled_blocks, unit_break
from parity.model.formats import fake_quantize
from parity.model.plan import PrecisionPlan, canonical_fqn
from parity.model.recipe import (clip_coefficient, loss_divisor, loss_scale, make_optimizer, owner_reduction,
                                 rescales_gradients, set_lr, state_tensors)
from parity.model.spec import Fixture
from parity.model.trace import Trace
from parity.model.trace import install as install_trace
from parity.paths.base import ShardReport
from parity.paths.units import module_index


@dataclass(kw_only=True)
class ReferenceRun:
    outputs: list[list[torch.Tensor]] = field(default_factory=list)
    """Per (step, micro-batch), one output per emulated rank."""
    input_grads: list[list[torch.Tensor | None]] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    nonzero: dict[str, bool] = field(default_factory=dict)
    """Parameter FQN -> whether any gradient autograd computed for it (in any step, micro-batch or
    rank; not the zeros filled in for an unused one) held a nonzero element."""
    grad_scale: list[dict[str, float]] = field(default_factory=list)
    """Per step, fqn -> the sum over the terms entering the gradient of each term's largest
    element (in the gradient's units: divided as the reduction divides). Every summation
    allowance of that step's gradients takes it as its scale, not the sum's own largest element:
    terms that cancel leave a small sum but their roundings (:meth:`terms_scale`)."""
    grad_terms: int = 1
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    """Per step, the global gradient norm before clipping."""
    reduced: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Per step of a clipping or loss-scaled cell, each gradient before clipping (unscaled)."""
    clip_coefs: list[float] = field(default_factory=list)
    """Per step of a clipping cell, the coefficient the gradients were scaled by."""
    clipped_norms: list[float] = field(default_factory=list)
    """Per step of a clipping cell, the global gradient norm after clipping."""
    accumulated: dict[tuple[int, int], list[dict[str, tuple[torch.Tensor, float]]]] = field(default_factory=dict)
    """(step, micro-batch) -> per emulated rank, each FSDP-managed parameter's unsharded gradient
    accumulated (reduce dtype) after that micro-batch of a no-sync window (after the last: what
    the window's reduction takes as input), or, where every backward synchronizes, that
    micro-batch's own gradient (the reduction's input); with the sum of the max |term|
    accumulated so far."""
    shards: dict[tuple[int, int], dict[str, tuple[torch.Tensor, float]]] = field(default_factory=dict)
    """(step, micro-batch) -> each FSDP-managed parameter's whole gradient (kept dtype) as the
    reductions of every synchronizing backward up to that micro-batch left it, before unscaling
    and clipping (each rank holds its shard of it), with the sum of the max |term| so far."""
    partials: dict[tuple[int, int], dict[str, tuple[list[torch.Tensor], float, int]]] = field(default_factory=dict)
    """HSDP: (step, micro-batch) of each all-reduce across replicas -> each FSDP-managed
    parameter's shard-group partials as it takes them (one whole tensor per shard group, reduce
    dtype, divided as FSDP divides there: :func:`parity.judge.emulate.shard_group_divisor`),
    with a bound on the sum of |terms| and how many terms each sums."""
    tp_partials: dict[tuple[int, int, int], dict[str, dict[int, torch.Tensor]]] = field(default_factory=dict)
    """FSDP x TP: (step, micro-batch, emulated data rank) -> ``MODULE@forward|backward`` -> TP
    chunk -> what that chunk's rank takes into the layer's all-reduce (:class:`Partials`)."""
    evals: dict[tuple[int, str], list[torch.Tensor]] = field(default_factory=dict)
    """(step, label) of each evaluation forward -> one output per emulated rank."""
    boundaries: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    graph_runs: dict[tuple[int, str], int] = field(default_factory=dict)
    """Compiled blocks: (step, segment) -> compiled graphs run forward there, over every emulated
    rank (``mb{k}/forward``, ``eval``)."""
    buffers: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    """``initial`` / ``trained`` -> floating buffer FQN -> value (the unsharded model's)."""
    read: list[set[str]] = field(default_factory=list)
    """Per emulated data rank, the parameters the training forwards of its batches read, by the
    name the reading module gives them (tied aliases apart): a module's own and its children's
    (``F.conv1d(x, self.conv.weight)``), as a rank notes them for ``dtype.compute``. A routed
    expert no token of a rank's batches reaches is not among them."""

    def terms_scale(self, step: int, *, clipped: bool = False) -> dict[str, float]:
        """``step``'s :attr:`grad_scale` (empty where the reference did not reach that step);
        ``clipped``: times that step's clipping coefficient, the scale of the gradients as a
        clipping step leaves them (empty where the reference did not clip that step)."""
        scales = self.grad_scale[step] if 0 <= step < len(self.grad_scale) else {}
        if not clipped:
            return scales
        coef = self.clip_coefs[step] if 0 <= step < len(self.clip_coefs) else None
        return {f: s * coef for f, s in scales.items()} if coef is not None else {}


def _readers(model: nn.Module, read: list[set[str]], reading: list) -> list:
    """Pre-hooks filling ``read[reading[0]]`` while ``reading[0]`` names the data rank whose
    training forward runs (None: no forward of the loop runs)."""
    def hook(name: str):
        def note(module, args):
            if reading[0] is not None:
                read[reading[0]].update(key for key, _, _ in params_read(name, module))
        return note
    # not in compiled blocks: a hook there would run inside the graph and recompile it per rank
    # (``dtype.compute`` reads those modules from the all-gathers instead)
    return [m.register_forward_pre_hook(hook(canonical_fqn(n))) for n, m in hookable_modules(model)]


def _cast_floats(obj, dtype):
    """``obj``'s floating tensors cast to ``dtype``, its containers kept as the types they are (a
    Hugging Face ``ModelOutput``, a dataclass, a named tuple), as FSDP's own casts keep them."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _cast_floats(getattr(obj, f.name), dtype)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, tuple):
        items = [_cast_floats(o, dtype) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [_cast_floats(o, dtype) for o in obj]
    if isinstance(obj, dict):
        cast = type(obj)() if type(obj) is not dict else {}
        for k, v in obj.items():
            cast[k] = _cast_floats(v, dtype)
        return cast
    return obj


def _input_cast(dtype: torch.dtype | None):
    """A forward pre-hook casting floating inputs to ``dtype`` (None: changing nothing)."""
    return lambda m, a, k: None if dtype is None else (_cast_floats(a, dtype), _cast_floats(k, dtype))


def _output_cast(dtype: torch.dtype | None):
    """A forward hook casting floating outputs to ``dtype`` (None: changing nothing)."""
    return lambda m, a, out: None if dtype is None else _cast_floats(out, dtype)


def _boundary_hooks(model: nn.Module, report: ShardReport, compiled: CompileLog | None = None) -> list:
    """Each unit's policy casts at its modules' boundaries; with compiled blocks, hooks at every unit
    module run eagerly (:func:`parity.model.compiling.unit_break`), splitting the graphs where
    FSDP's own (dynamo-disabled) hooks split them."""
    modules = module_index(model)
    wrap = unit_break if compiled is not None else (lambda hook: hook)
    handles = []
    for unit in report.units:
        cast_in = unit.param_dtype if unit.cast_forward_inputs else None
        for name in unit.modules:
            mod = modules[name]
            if cast_in is not None or compiled is not None:
                handles.append(mod.register_forward_pre_hook(wrap(_input_cast(cast_in)), with_kwargs=True))
            if unit.output_dtype is not None or compiled is not None:
                handles.append(mod.register_forward_hook(wrap(_output_cast(unit.output_dtype))))
    return handles


def _group_sums(by_rank: dict[int, torch.Tensor], rd: torch.dtype, groups: list[list[int]]) -> list[torch.Tensor]:
    """Each shard group's sum in the reduce dtype (the reduce-scatter), in rank order."""
    parts = ([by_rank[r].to(rd) for r in group if r in by_rank] for group in groups)
    return [ordered_sum(p) for p in parts if p]


def _unscaled(grad: torch.Tensor, reduce_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """A scaled gradient in the reduce dtype, divided by the loss scale (exact there): FSDP
    reduces the scaled gradient and the scaler divides afterwards; with a power-of-two scale
    the two orders give the same values. Unscaled gradients keep their own dtype."""
    return grad if scale == 1.0 else grad.to(reduce_dtype) / scale


def _clip(run: ReferenceRun, params: list[nn.Parameter], max_norm: float, norm: float, fp64: bool) -> None:
    """The recipe's clipping, by the same function and the same FP32 coefficient as the ranks'
    (:func:`parity.execute.parallel.clip_gradients`); FP64 keeps its own norm in FP64."""
    total = torch.tensor(norm, dtype=torch.float64 if fp64 else torch.float32)
    run.clip_coefs.append(clip_coefficient(max_norm, total))
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    run.clipped_norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])))


def _keep_shards(run: ReferenceRun, key: tuple[int, int], grads: dict[str, torch.Tensor], scales: dict) -> None:
    """Each FSDP-managed parameter's gradient as the reductions up to micro-batch ``key`` left it
    (:attr:`ReferenceRun.shards`)."""
    run.shards[key] = {f: (g.detach().cpu().clone(), scales[f]) for f, g in grads.items()}


def _keep_partial(run: ReferenceRun, key: tuple[int, int], fqn: str, sums: list[torch.Tensor], divisor: float,
                  scale: float, terms: int) -> None:
    """One parameter's shard-group sums as HSDP's all-reduce across replicas takes them
    (:attr:`ReferenceRun.partials`)."""
    run.partials.setdefault(key, {})[fqn] = ([(s / divisor).detach().cpu() for s in sums], scale / divisor, terms)


def _keep_accumulated(run: ReferenceRun, key: tuple[int, int], unsynced: list[dict], scales: list[dict],
                      entries: dict) -> None:
    """What each emulated rank has accumulated (FSDP-managed parameters) after micro-batch ``key``,
    as the ranks record it after that micro-batch's backward. A parameter no micro-batch of the
    window used yet on that rank holds no gradient there (the zeros an unused parameter is
    reduced as are the reduce-scatter's, not the window's): it has no term of any size."""
    run.accumulated[key] = [{f: (u[f].detach().cpu().clone(), s) for f, s in sc.items()
                             if s > 0 and entries[f].ownership == "managed"} for u, sc in zip(unsynced, scales)]


def _fsdp_grad_dtypes(leaves: dict[str, torch.Tensor], entries: dict, *, first_unsynced: bool) -> None:
    """Each FSDP-managed, untied leaf's gradient dtype as FSDP (torch >= 2.15) sets its unsharded
    parameter's during a backward (``FSDPParamGroup._set_unsharded_grad_dtypes``): a reduce dtype
    wider than the compute dtype only on the first micro-batch of a no-sync window
    (``first_unsynced``: each use cast up and accumulated there), ``None`` on every other backward
    -- autograd then keeps the gradient in the dtype the op produced: FP32 where a BF16 weight
    meets an FP32 activation (``weight * hidden.float()`` in an RMSNorm), where the unset default
    would round it to BF16 -- and a reduce dtype that is not wider, always. Tied parameters are
    :func:`_per_use`'s. Earlier torch builds have no ``grad_dtype``: nothing is set."""
    if not _accumulates_each_use():
        return
    for f, leaf in leaves.items():
        t = entries[f]
        if not (leaf.requires_grad and t.ownership == "managed" and t.reduce is not None and not t.tie_group):
            continue
        if t.reduce == leaf.dtype:
            continue
        wider = torch.finfo(t.reduce).bits > torch.finfo(leaf.dtype).bits
        leaf.grad_dtype = t.reduce if first_unsynced or not wider else None


def _per_use(copies: dict[str, torch.Tensor], entries: dict) -> dict[str, torch.Tensor]:
    """A leaf of its own for every alias of a tied weight (the same values as its canonical copy)."""
    return {a: copies[f].detach().clone().requires_grad_(copies[f].requires_grad)
            for f, t in entries.items() for a in t.tie_group[1:]}


def _accumulates_each_use() -> bool:
    """Whether FSDP accumulates each use of a tied weight on its own on the first micro-batch
    without sync (torch 2.15, which accumulates in the unsharded parameter's own gradient).
    Earlier builds keep a separate accumulator (``unsharded_accumulated_grad``) that receives
    what autograd summed in the compute dtype, on every micro-batch: measured on torch 2.13,
    where the per-use emulation put ``lm``'s tied gradient one BF16 rounding away."""
    return TorchVersion(torch.__version__) >= (2, 15)


def run_reference(
    cell: Cell, fixture: Fixture, plan: PrecisionPlan, report: ShardReport, *,
    device: torch.device | str = "cpu", mode: str = "emulate",
    resync: list[dict[str, torch.Tensor]] | None = None, trace: dict[tuple[int, int], Trace] | None = None,
    clip_norms: list[float] | None = None, trace_step: int = 0,
) -> ReferenceRun:
    """``resync[k]``: the sharded run's parameters after step k. When given, step k+1 starts
    from them, so every step is compared from identical weights: an allowed difference
    (e.g. a tied gradient) is not carried forward and amplified by Adam into later steps.
    ``clip_norms[k]``: the norm a clipping cell's step k clips with (the sharded run's, judged
    by ``grad_norm`` on its own), so clipped gradients are compared under one coefficient;
    None: the reference's own norm. ``trace`` receives each emulated rank's micro-batches of
    ``trace_step``, module by module, keyed ``(rank, micro-batch)`` (:mod:`parity.model.trace`)."""
    fp64 = mode == "fp64"
    model = fixture.make(cell.seed).to(device)
    masters: dict[str, nn.Parameter] = dict(model.named_parameters())
    if fp64:
        for p in masters.values():
            p.data = p.data.double()
        for mod in model.modules():
            for k, b in mod._buffers.items():
                if b is not None and b.is_floating_point():
                    mod._buffers[k] = b.double()
    entries = {t.fqn: t for t in plan.params}
    trainable = [f for f, t in entries.items() if t.requires_grad]
    for f in trainable:  # the plan's gradient dtype, not the model's attribute (another oracle checks that)
        masters[f].grad_dtype = torch.float64 if fp64 else entries[f].kept_grad
    opt = make_optimizer([masters[f] for f in trainable], cell.optimizer)
    scale = 1.0 if fp64 else loss_scale(plan.config.param_dtype)
    compiled = None if fp64 else compiled_blocks(cell, model, fixture.blocks)  # the recipe's graphs, not FP64's
    handles = [] if fp64 else _boundary_hooks(model, report, compiled)
    where = [(-1, "outside")]  # the segment of the loop a compiled graph runs in
    if compiled is not None:
        compiled.where = lambda: where[0]
    topo = cell.topology()
    world, micro = topo.data_world, cell.microbatches
    divisor = loss_divisor(cell.reduction, world)
    mean = world if world > 1 and divisor == 1 else 1  # what the reduction divides the sum by
    groups = topo.replica_groups()
    accumulate_unsharded = cell.accumulating
    # a tied weight's uses on the first micro-batch without sync: FSDP (2.15) moves each use's
    # compute-dtype gradient into the reduce-dtype accumulator on its own (the accumulator does
    # not exist yet), where autograd would sum them in the compute dtype; later micro-batches sum
    # them in autograd first. Emulated with one leaf per use, not with a wider allowance.
    per_use = accumulate_unsharded and not fp64 and _accumulates_each_use() and any(t.tie_group for t in plan.params)
    entries_by_alias = {a: t.fqn for t in plan.params for a in t.tie_group[1:]}
    managed = {f for f in trainable if entries[f].ownership == "managed"}
    deferred = cell.sync == "replicas-last" and micro > 1
    hsdp = len(groups) > 1 and not fp64  # the replica all-reduce's inputs are kept

    def divided(f) -> float:
        force_sum = cell.reduction == "sum"
        return shard_group_divisor(reduce_dtype(f), len(groups[0]), world, 1.0 if force_sum else None, force_sum)
    tp_partials = Partials() if topo.tp > 1 and not fp64 else None
    handles += [] if fp64 else emulate_tensor_parallel(model, plan, topo.tp, tp_partials)
    run = ReferenceRun(grad_terms=world * micro)
    run.buffers["initial"] = float_buffers(model)
    reading: list[int | None] = [None]
    if not fp64:
        run.read = [set() for _ in range(world)]
        handles += _readers(model, run.read, reading)

    def compute_dtype(f):
        return torch.float64 if fp64 else entries[f].compute

    def reduce_dtype(f):
        t = entries[f]
        return torch.float64 if fp64 else t.sum_dtype

    def read(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What a forward reads: each value in its compute dtype, a quantized weight quantized as a
        whole tensor and dequantized (the same on every rank and micro-batch)."""
        return {f: values[f].detach().to(device=device, dtype=compute_dtype(f)) if fp64 or t.format == "none"
                else fake_quantize(values[f].detach(), t.format, compute_dtype(f)) for f, t in entries.items()}

    def evaluate(step: int, label: str, weights: dict[str, torch.Tensor]) -> None:
        """An evaluation forward per emulated rank, on the ranks' eval batches, with ``weights``. Only
        the run that follows the sharded one (``resync``) is compared on them: the others skip it."""
        if resync is None:
            return
        index = cell.eval_labels(step).index(label)
        outs = []
        where[0] = (step, "eval")
        with torch.no_grad():
            for rank in range(world):
                batch = fixture.eval_batch(cell.seed, step, rank, index).to(device)
                inputs = tuple(_cast_floats(x, torch.float64) if fp64 else x for x in batch.inputs)
                outs.append(fixture.output(functional_call(model, weights, inputs)).cpu())
        run.evals[(step, label)] = outs

    for step in range(cell.steps):
        if resync is not None and step > 0:
            with torch.no_grad():
                for f, p in resync[step - 1].items():
                    if f in masters:  # a name the model does not have fails the names check
                        masters[f].copy_(p.to(device=masters[f].device, dtype=masters[f].dtype))
        # what this step's forwards read: masters in their compute dtype, a quantized weight
        # quantized as a whole tensor and dequantized (the same on every rank and micro-batch)
        seen = read(masters)
        synced: dict[str, torch.Tensor] = {}  # sharded gradient, its kept (gradient) dtype
        partial: dict[str, list] = {}  # per replica group, reduce dtype (``replicas-last``)
        unsynced = [dict() for _ in range(world)]  # per-rank accumulation, reduce dtype
        unsynced_scale = [dict() for _ in range(world)]  # per rank: sum of max |term| accumulated
        terms_scale = {f: 0.0 for f in trainable}
        for mb in range(micro):
            outs, in_grads, per_rank = [], [], []
            for rank in range(world):
                batch = fixture.batch(cell.seed, step, rank, mb).to(device)
                inputs = tuple(_cast_floats(x, torch.float64) if fp64 else x for x in batch.inputs)
                if not fixture.token_input:
                    inputs = tuple(x.detach().requires_grad_() for x in inputs)
                copies = {f: seen[f].detach().requires_grad_(t.requires_grad and step >= t.trainable_from)
                          for f, t in entries.items()}
                uses = _per_use(copies, entries) if per_use and mb == 0 else {}
                if not fp64:
                    _fsdp_grad_dtypes(copies, entries, first_unsynced=accumulate_unsharded and mb == 0)
                rec = record_boundaries(model, run.boundaries) if step == rank == mb == 0 else []
                if tp_partials is not None:  # what each TP reduction takes, every micro-batch
                    tp_partials.on, tp_partials.seen = True, {}
                if trace is not None and step == trace_step:
                    rec += install_trace(model, trace.setdefault((rank, mb), Trace()))
                where[0] = (step, f"mb{mb}/forward")
                reading[0] = rank
                out = fixture.output(functional_call(model, {**copies, **uses}, inputs, tie_weights=not uses))
                reading[0] = None
                for h in rec:
                    h.remove()
                loss = fixture.loss(out, batch.target) / micro
                if divisor != 1:  # the recipe normalizes over the ranks itself; the reduction sums
                    loss = loss / divisor
                (loss * scale).backward()
                if tp_partials is not None:
                    run.tp_partials[(step, mb, rank)], tp_partials.on = tp_partials.seen, False
                outs.append(out.detach().cpu())  # results live on the CPU, like the ranks'
                in_grads.append(None if fixture.token_input else inputs[0].grad.cpu() / scale)
                got = {f: copies[f].grad for f in trainable if copies[f].grad is not None}
                for alias, leaf in uses.items():  # each use's gradient rounded apart, summed in reduce dtype
                    f = entries_by_alias[alias]
                    if leaf.grad is not None:
                        own = got.get(f)
                        got[f] = leaf.grad.to(reduce_dtype(f)) + (own.to(reduce_dtype(f)) if own is not None else 0)
                per_rank.append({f: _unscaled(g, reduce_dtype(f), scale) for f, g in got.items()})
                for f, g in got.items():
                    run.nonzero[f] = run.nonzero.get(f, False) or bool(torch.any(g != 0))
                if fixture.unused_params:  # every rank reduces every trainable tensor
                    for f in trainable:
                        if copies[f].requires_grad and f not in per_rank[-1] and entries[f].ownership == "managed":
                            per_rank[-1][f] = torch.zeros_like(copies[f], dtype=reduce_dtype(f))
            run.outputs.append(outs)
            run.input_grads.append(in_grads)
            if cell.eval == "between-microbatches" and mb < micro - 1:
                evaluate(step, f"mb{mb}", seen)
            for f in trainable:
                grads = [g[f] for g in per_rank if f in g]
                if not grads:
                    continue
                for g in grads:
                    terms_scale[f] += float(g.double().abs().max()) / mean
                rd = reduce_dtype(f)
                if entries[f].ownership == "ignored" or accumulate_unsharded:
                    for r, g in enumerate(per_rank):
                        if f in g:
                            prev = unsynced[r].get(f)
                            unsynced[r][f] = g[f].to(rd) if prev is None else prev + g[f].to(rd)
                            unsynced_scale[r][f] = unsynced_scale[r].get(f, 0.0) + float(g[f].double().abs().max())
                    continue
                sums = _group_sums({r: g[f] for r, g in enumerate(per_rank) if f in g}, rd, groups)
                if deferred:  # HSDP without the replica all-reduce: shard-group sums held in rd
                    held = partial.pop(f, None)
                    sums = sums if held is None else [h + s for h, s in zip(held, sums)]
                    if mb < micro - 1:
                        partial[f] = sums
                        continue
                if hsdp and f in managed:
                    _keep_partial(run, (step, mb), f, sums, divided(f), terms_scale[f] * max(mean, 1),
                                  len(groups[0]) * (mb + 1 if deferred else 1))
                total = ordered_sum(sums)  # across replicas (HSDP); one group otherwise
                reduced = (total / mean if mean > 1 else total).to(masters[f].grad_dtype)
                synced[f] = reduced if f not in synced else synced[f] + reduced
            if synced and not fp64 and not accumulate_unsharded:  # what this backward's reductions left
                _keep_shards(run, (step, mb), {f: g for f, g in synced.items() if f in managed}, terms_scale)
            if accumulate_unsharded and not fp64:  # the last: the window's reduce-scatter input
                _keep_accumulated(run, (step, mb), unsynced, unsynced_scale, entries)
            elif not fp64:  # every backward synchronizes: each rank's reduce-scatter input is its own
                _keep_accumulated(run, (step, mb), per_rank,
                                  [{f: float(g.double().abs().max()) for f, g in r.items()} for r in per_rank], entries)
        for f in trainable:
            if f in synced:
                masters[f].grad = synced[f]
            elif any(f in u for u in unsynced):
                total = ordered_sum([u[f] for u in unsynced if f in u])
                summed = entries[f].ownership == "ignored" and owner_reduction(cell.reduction, fixture.ignored_reduction) == "sum"
                masters[f].grad = (total / mean if mean > 1 and not summed else total).to(masters[f].grad_dtype)
        if accumulate_unsharded and hsdp:  # the window's shard-group sums, after its last backward
            for f in sorted(managed):
                held = {r: u[f] for r, u in enumerate(unsynced) if f in u}
                if held:
                    _keep_partial(run, (step, micro - 1), f, _group_sums(held, reduce_dtype(f), groups), divided(f),
                                  terms_scale[f] * max(mean, 1), len(groups[0]) * micro)
        if accumulate_unsharded and not fp64:  # the window's reduction, after its last backward
            _keep_shards(run, (step, micro - 1), {f: masters[f].grad for f in trainable
                                                  if f in managed and masters[f].grad is not None}, terms_scale)
        grads = [masters[f].grad for f in trainable if masters[f].grad is not None]
        # the gradient scaler skips a step whose gradients overflowed
        skip_step = scale != 1.0 and not all(bool(g.isfinite().all()) for g in grads)
        run.grad_norms.append(float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0)
        if rescales_gradients(cell.clip, plan.config.param_dtype):  # as the ranks record it
            run.reduced.append({f: masters[f].grad.detach().cpu().clone() for f in trainable
                                if masters[f].grad is not None})
        if cell.clip and grads:
            _clip(run, [masters[f] for f in trainable], cell.clip,
                  clip_norms[step] if clip_norms is not None and step < len(clip_norms) else run.grad_norms[-1], fp64)
        elif cell.clip:  # nothing trains this step: nothing clipped, a norm of 0 after it (as the ranks read it)
            run.clip_coefs.append(1.0)  # the lists stay one entry per step
            run.clipped_norms.append(0.0)
        run.grads.append({f: masters[f].grad.detach().cpu().clone() for f in trainable if masters[f].grad is not None})
        run.grad_scale.append(terms_scale)
        set_lr(opt, cell.schedule, step)
        if not skip_step:
            opt.step()
        else:
            scale /= 2  # ShardedGradScaler.update() backs off after an overflow
        opt.zero_grad()
        run.params.append({f: masters[f].detach().cpu().clone() for f in entries})
        if cell.eval == "between-steps":  # with the run's weights after this step, when following it
            after = resync[step] if resync is not None and step < len(resync) else masters
            evaluate(step, "after-step", read({f: after.get(f, masters[f]) for f in entries}))
    for h in handles:
        h.remove()
    run.graph_runs = dict(compiled.calls) if compiled is not None else {}
    run.buffers["trained"] = float_buffers(model)
    return run


def replay_optimizer(
    cell: Cell, fixture: Fixture, plan: PrecisionPlan, grads: list[dict[str, torch.Tensor]],
    params: list[dict[str, torch.Tensor]], *, device: torch.device | str = "cpu",
    moments: list | None = None,
) -> list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    """The reference optimizer stepped on *observed* gradients, each step starting from the
    *observed* parameters after the previous one: (before, after) parameters per step.

    Post-step parameters are judged against this, so the parameter check isolates one
    optimizer step (sharded AdamW, its state, master dtypes) from gradient differences, which
    the gradient check judges on its own. Adam's moments depend on gradients only, so the
    replayed optimizer state follows the sharded one exactly; ``moments``, when given, receives
    it after every step (:func:`parity.model.recipe.state_tensors`).
    """
    model = fixture.make(cell.seed).to(device)
    masters = dict(model.named_parameters())
    trainable = [t.fqn for t in plan.params if t.requires_grad]
    for t in plan.params:
        if t.requires_grad:
            masters[t.fqn].grad_dtype = t.kept_grad
    opt = make_optimizer([masters[f] for f in trainable], cell.optimizer)
    scaled = loss_scale(plan.config.param_dtype) != 1.0
    out = []
    for step, step_grads in enumerate(grads):
        if step > 0:
            with torch.no_grad():
                for f, p in params[step - 1].items():
                    if f in masters:
                        masters[f].copy_(p.to(device=masters[f].device, dtype=masters[f].dtype))
        before = {t.fqn: masters[t.fqn].detach().cpu().clone() for t in plan.params}
        for f in trainable:
            g = step_grads.get(f)
            masters[f].grad = None if g is None else g.to(device=masters[f].device, dtype=masters[f].grad_dtype)
        set_lr(opt, cell.schedule, step)
        if not (scaled and any(not bool(g.isfinite().all()) for g in step_grads.values())):
            opt.step()
        opt.zero_grad()
        out.append((before, {t.fqn: masters[t.fqn].detach().cpu().clone() for t in plan.params}))
        if moments is not None:
            moments.append(state_tensors(opt, {id(p): f for f, p in masters.items()}))
    return out
