"""Observe contracts as they happen inside a sharded model (worker side).

- compute dtype: the parameter dtype each module sees in its forward (pre-hooks run after
  FSDP's own, so they read the all-gathered, unsharded parameter);
- reduction dtype: the input dtype of each reduce-scatter FSDP issues, attributed to the
  parameters being reduced (on 1 rank no collective runs: the reduce buffer's dtype);
- gradient-accumulation dtype: the unsharded gradient while synchronization is off;
- boundary dtypes: floating input/output dtypes of modules, as the module sees them;
- names and identity: FQNs, state-dict keys and parameter objects before sharding, after
  sharding, after lazy initialization and after training.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from parity.execute import collectives
from parity.execute.evaluation import post_forward
from parity.execute.observation import BufferSeen, ContractsSeen, NamesSnapshot, PackedShards, value_sums
from parity.model.boundaries import float_buffers, hookable_modules, params_read, record_boundaries, record_boundary_variants
from parity.model.dtypes import dtype_name
from parity.model.plan import canonical_fqn
from parity.model.topology import local_region
from parity.paths import apply
from parity.paths.base import ShardReport
from parity.paths.units import module_index


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def gathered_read(t: torch.Tensor) -> tuple:
    """How a parameter handed to compute is recorded (:attr:`ContractsSeen.gathered`): its dtype
    and :func:`value_sums`; of a tensor-parallel shard (a DTensor after FSDP's all-gather), the
    sums of this rank's local piece and where that piece sits in the whole tensor, ``((offset,
    length), ...)`` per dimension, by torch's own placement rule."""
    if not isinstance(t, DTensor):
        return (dtype_name(t.dtype), *value_sums(t))
    local = t.to_local()
    return (dtype_name(local.dtype), *value_sums(local), region(t))


def region(t: DTensor) -> tuple[tuple[int, int], ...]:
    """Where this rank's local piece of ``t`` sits in the whole tensor (:func:`local_region`)."""
    return local_region(t.shape, t.device_mesh.shape, t.device_mesh.get_coordinate(), t.placements)


def names_snapshot(model: nn.Module) -> NamesSnapshot:
    return NamesSnapshot(
        params=[canonical_fqn(n) for n, _ in model.named_parameters()],
        state_dict=[canonical_fqn(k) for k in model.state_dict()],
        ids={canonical_fqn(n): id(p) for n, p in model.named_parameters()},
        storage={canonical_fqn(n): dtype_name(p.dtype) for n, p in model.named_parameters()},
        modules={canonical_fqn(n): [_qualname(c) for c in type(m).__mro__] for n, m in model.named_modules()},
        placements={canonical_fqn(n): ",".join(map(str, p.placements)) for n, p in model.named_parameters()
                    if isinstance(p, DTensor)},
    )


def buffers_snapshot(model: nn.Module) -> dict[str, BufferSeen]:
    """Every floating buffer: dtype and a CPU copy of its value."""
    return {fqn: BufferSeen(dtype=dtype_name(b.dtype), value=b) for fqn, b in float_buffers(model).items()}


def before_sharding(model: nn.Module) -> NamesSnapshot:
    snap = names_snapshot(model)
    snap.modules = {k: v[:1] for k, v in snap.modules.items()}  # the original classes
    return snap


def unscaled(grad: torch.Tensor, scale: float) -> torch.Tensor:
    """A recorded gradient divided by the loss scale, in FP64: a power of two divides exactly
    there, not in float16, whose subnormals would round the quotient (a window's first term may
    still be one). ``grad`` itself where there is no scale."""
    return grad.double() / scale if scale != 1.0 else grad


def sharded_grads(model: nn.Module, fqn_of, scale: float = 1.0) -> PackedShards:
    """Each FSDP parameter's sharded gradient on this rank, as its reductions left it: FQN ->
    (the shard's offset in the whole parameter, its values divided by the loss ``scale``), packed.
    Offsets come from the gradient's own mesh and placements (uneven shards, dimension-1
    placements and HSDP's replicated dimension included)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for _, fp in apply.fsdp_params(model):
        grad = fp.sharded_param.grad
        if not isinstance(grad, DTensor):
            continue
        _, offset = compute_local_shape_and_global_offset(grad.shape, grad.device_mesh, grad.placements)
        out[fqn_of(fp)] = (tuple(int(o) for o in offset), unscaled(grad.to_local().detach().cpu(), scale))
    return PackedShards.pack(out)


def _shard_offset(fp) -> tuple[int, ...]:
    """Where an FSDP parameter's local shard sits in the whole parameter (its mesh and placements)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    p = fp.sharded_param
    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(int(o) for o in offset)


def replica_inputs(flat: torch.Tensor, fsdp_params) -> dict:
    """HSDP: what the all-reduce across replicas takes, per parameter -- the shard group's
    reduce-scattered partial, cut from FSDP's flat buffer as FSDP views it after the all-reduce
    (each parameter's padded shard in turn, its unpadded shard at the start): FSDP parameter ->
    (the shard's offset in the whole parameter, its values, copied)."""
    out, start, flat = {}, 0, flat.detach().reshape(-1)
    for fp in fsdp_params:
        n = math.prod(fp.sharded_size)
        out[fp] = (_shard_offset(fp), flat[start:start + n].reshape(fp.sharded_size).cpu().clone())
        start += fp.padded_sharded_param_size.numel()
    return out


def lazy_init_snapshot(model: nn.Module) -> NamesSnapshot:
    """Names and identities right after the first forward, without ``model.state_dict()``: its
    pre-save hook reshards every unit, and with reshard off that would change the backward this
    observation precedes (an extra all-gather the user's loop does not issue). Identities are
    the objects FSDP holds as each managed parameter's sharded parameter (with reshard off the
    module attributes are the unsharded ones until the backward); no state-dict keys."""
    modules = _module_names(model)
    sharded = {_managed_name(modules, fp): fp.sharded_param for _, fp in apply.fsdp_params(model)}
    named = [(canonical_fqn(n), p) for n, p in model.named_parameters()]
    return NamesSnapshot(
        params=[f for f, _ in named], state_dict=None, ids={f: id(sharded.get(f, p)) for f, p in named},
        storage={f: dtype_name(sharded.get(f, p).dtype) for f, p in named},
        modules={canonical_fqn(n): [_qualname(c) for c in type(m).__mro__] for n, m in model.named_modules()},
    )


def _module_names(model: nn.Module) -> dict[int, str]:
    """Each module's id -> its canonical FQN (what :func:`_managed_name` reads)."""
    return {id(m): canonical_fqn(n) for n, m in model.named_modules()}


def _managed_name(modules: dict[int, str], fp) -> str:
    """A managed parameter's FQN, from the module FSDP records it under (``modules``: id -> FQN)."""
    prefix = modules.get(id(fp._module_info.module), "")
    return f"{prefix}.{fp._module_info.param_name}" if prefix else fp._module_info.param_name


def unsharded_grads_held(model: nn.Module) -> list[str]:
    """The managed parameters whose unsharded parameter holds a gradient now: after a backward that
    synchronizes, FSDP has taken each for its reduce-scatter and freed it (``grad.freed``)."""
    held = [fp for _, fp in apply.fsdp_params(model) if getattr(getattr(fp, "_unsharded_param", None), "grad", None) is not None]
    if not held:  # the usual answer, read every micro-batch: no module names to index
        return []
    modules = _module_names(model)
    return list(dict.fromkeys(_managed_name(modules, fp) for fp in held))


def ownership(model: nn.Module) -> dict[str, str]:
    """Parameter FQN -> "fsdp" or "not fsdp"; its tensor- and expert-parallel placements;
    its dtype. What either path must leave as another parallelism made it."""
    managed = {id(fp.sharded_param) for _, fp in apply.fsdp_params(model)}
    out = {}
    for name, p in model.named_parameters():
        dims = dict(zip(p.device_mesh.mesh_dim_names or (), p.placements)) if isinstance(p, DTensor) else {}
        out[canonical_fqn(name)] = (f"{'fsdp' if id(p) in managed else 'not fsdp'}; tp={dims.get('tp', '-')}; "
                                    f"ep={dims.get('ep', '-')}; {dtype_name(p.dtype)}")
    return out


def applied_policies(model: nn.Module, report: ShardReport) -> dict[str, dict[str, object]]:
    """The MixedPrecisionPolicy each unit's FSDP state actually holds (read back, not planned),
    and, for a unit that holds parameters, the reduction knobs its parameter groups hold
    (:mod:`parity.execute.knobs`)."""
    modules = module_index(model)
    names = _module_names(model)
    out = {}
    for unit in report.units:
        state = modules[unit.modules[0]]._get_fsdp_state()
        pol = state._mp_policy
        out[unit.root] = {
            "param_dtype": dtype_name(pol.param_dtype), "reduce_dtype": dtype_name(pol.reduce_dtype),
            "output_dtype": dtype_name(pol.output_dtype), "cast_forward_inputs": pol.cast_forward_inputs,
        }
        groups = state._fsdp_param_groups
        if groups:
            out[unit.root]["gradient_divide_factor"] = ",".join(sorted({str(g.gradient_divide_factor) for g in groups}))
            out[unit.root]["force_sum_reduction_for_comms"] = ",".join(
                sorted({str(g.force_sum_reduction_for_comms) for g in groups}))
            out[unit.root]["reshard_after_forward"] = ",".join(sorted({post_forward(g) for g in groups}))
            out[unit.root]["offload"] = ",".join(
                sorted({"cpu" if fp.offload_to_cpu else "none" for g in groups for fp in g.fsdp_params}))
            out[unit.root]["unshard_in_backward"] = ",".join(sorted({str(g.unshard_in_backward) for g in groups}))
        for pass_, states in (("forward", state._states_to_forward_prefetch),
                              ("backward", state._states_to_backward_prefetch)):
            out[unit.root][f"{pass_}_prefetch"] = ",".join(names.get(id(s._modules[0]), "?") for s in states)
    return out



class Recorder:
    def __init__(self, model: nn.Module, report: ShardReport):
        self.model = model
        self.active = False
        self.reading = False
        """Set during every forward of the training loop: the parameters its modules read are
        noted (``compute``), whichever micro-batch first reaches them (a routed expert)."""
        self.at: tuple[int, int] | None = None
        """(step, micro-batch) while a forward of the loop runs (:meth:`phase`)."""
        self.compute: dict[str, str] = {}
        self._via_parent: dict[str, str] = {}
        """Parameters a module reads from a child whose own forward never runs (e.g.
        ``F.conv1d(x, self.conv1d.weight)``): seen when the parent's forward starts."""
        self.boundaries: dict[str, dict[str, list[str]]] = {}
        self.reduce: dict[str, set[str]] = {}
        self.replicas: dict[str, set[str]] = {}
        self.accum: dict[str, set[str]] = {}
        self.accumulated: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.regions: dict[str, tuple[tuple[int, int], ...]] = {}
        self.shards: dict[tuple[int, int], PackedShards] = {}
        self.reduce_observable = True
        self._orig_reduce = None
        self.sharded = names_snapshot(model)
        self.owned = ownership(model)
        self.buffers = {"sharded": buffers_snapshot(model)}
        self.lazy_init = None
        self.policies = applied_policies(model, report)
        self._handles = []
        self.segments = collectives.Segments()
        """Collectives per (step, segment of the training loop, kind) (:mod:`.collectives`)."""
        self._fqn_of = {id(p): canonical_fqn(n) for n, p in model.named_parameters()}
        self.gathered: dict[int, dict[str, tuple[str, float, float, float]]] = {}
        self._gather_step: int | None = None
        """The step whose first forward is running (its parameters are read as gathered); else None."""
        for name, mod in hookable_modules(model):  # a compiled block's: from the all-gathers
            self._handles.append(mod.register_forward_pre_hook(self._read_params(canonical_fqn(name))))
        self._handles += record_boundaries(model, self.boundaries, lambda: self.active)
        self.variants: dict[str, dict[str, set]] = {}
        self._handles += record_boundary_variants(model, self.variants)
        self.reading_reduce = False
        """Set by the training loop around a backward that synchronizes: each reduction's input is
        read (:meth:`after_backward` files it with a no-sync window's reads)."""
        self._reduce_inputs: dict[str, torch.Tensor] = {}
        self._replica_inputs: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}
        self.partials: dict[tuple[int, int], PackedShards] = {}
        """HSDP: (step, micro-batch) -> each replica all-reduce's input on this rank, per parameter."""
        self.all_gathers: dict[int, dict[str, dict[str, list[tuple[str, float, float]]]]] = {}
        """Step -> segment (``mb0/forward``, ``mb0/backward`` ...) -> FQN -> each distinct value an
        all-gather handed compute there (:data:`ContractsSeen.all_gathers`)."""
        self._orig_wait = None
        try:
            self._patch_reduce()
            self._patch_gathers()
        except BaseException:
            self.close()  # a half-patched torch must not outlive the cell in a reused worker
            raise

    def _read_params(self, fqn: str):
        def hook(module, args):
            if not self.reading and self._gather_step is None:  # outside the loop's forwards: nothing to read
                return
            if self._gather_step is not None:
                self._read_gathered(fqn, module)
                for child_name, child in module._modules.items():  # read by this module directly too
                    if child is not None:
                        self._read_gathered(canonical_fqn(f"{fqn}.{child_name}" if fqn else child_name), child)
            if self.reading:
                for key, own, p in params_read(fqn, module):
                    (self.compute if own else self._via_parent).setdefault(key, dtype_name(p.dtype))
        return hook

    def _read_gathered(self, fqn: str, module: nn.Module) -> None:
        """The values of ``module``'s own parameters as its forward reads them (unsharded by FSDP),
        once per step: their dtype and three FP64 sums (:data:`ContractsSeen.gathered`)."""
        seen = self.gathered.setdefault(self._gather_step, {})
        for local, p in module._parameters.items():
            key = f"{fqn}.{local}" if fqn else local
            if p is None or key in seen:
                continue
            seen[key] = gathered_read(p)

    def _patch_gathers(self) -> None:
        """Read every all-gather's output once FSDP has copied it out (``wait_for_unshard``):
        each parameter's unsharded value as compute gets it, in every forward and backward of
        the training loop (the first forward's module reads are :meth:`_read_gathered`)."""
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        self._group_cls, self._orig_wait = FSDPParamGroup, FSDPParamGroup.wait_for_unshard
        recorder, orig = self, self._orig_wait

        def wait_for_unshard(group, *args, **kwargs):
            pending = bool(getattr(group, "_all_gather_result", None))
            out = orig(group, *args, **kwargs)
            if pending:
                recorder._read_all_gather(group)
            return out
        FSDPParamGroup.wait_for_unshard = wait_for_unshard

    def _read_all_gather(self, group) -> None:
        step, label = self.segments.current
        if step < 0 or not label.startswith("mb"):  # evaluation forwards and state dicts: other masters
            return
        seen = self.all_gathers.setdefault(step, {}).setdefault(label, {})
        for fp in group.fsdp_params:
            t = fp.unsharded_param
            if type((t.to_local() if isinstance(t, DTensor) else t).data) is not torch.Tensor:  # a quantized copy
                continue
            fqn = self._fqn(fp)
            read = gathered_read(t)
            if read not in seen.setdefault(fqn, []):
                seen[fqn].append(read)

    def _patch_reduce(self) -> None:
        pg = apply.reduction_module()
        if pg is None:
            self.reduce_observable = False
            return
        self._pg, self._orig_reduce = pg, pg.foreach_reduce
        self._orig_rs, self._orig_ar = dist.reduce_scatter_single, dist.all_reduce
        current: list = []
        recorder = self

        def reduce_scatter_single(*args, **kwargs):
            inp = kwargs.get("input", args[1] if len(args) > 1 else None)
            for fp in current:
                recorder._note(recorder.reduce, fp, dtype_name(inp.dtype))
            return recorder._orig_rs(*args, **kwargs)

        def all_reduce(tensor, *args, **kwargs):  # HSDP: across replicas, inside foreach_reduce only
            for fp in current:
                recorder._note(recorder.replicas, fp, dtype_name(tensor.dtype))
            if current and recorder.reading_reduce:
                for fp, read in replica_inputs(tensor, current).items():
                    recorder._replica_inputs[recorder._fqn(fp)] = read
            return recorder._orig_ar(tensor, *args, **kwargs)

        def foreach_reduce(fsdp_params, *args, **kwargs):
            current[:] = list(fsdp_params)
            if recorder.reading_reduce and args:  # args[0]: the unsharded gradients it reduces
                for fp, grad in zip(fsdp_params, args[0]):  # a TP weight's: its local TP piece
                    fqn = recorder._fqn(fp)
                    recorder._reduce_inputs[fqn] = recorder._held(fqn, grad, fp.unsharded_param).detach().cpu().clone()
            out = recorder._orig_reduce(fsdp_params, *args, **kwargs)
            group = args[1] if len(args) > 1 else None
            if group is None or group.size() == 1:  # no collective: the buffer it would reduce
                for fp in current:
                    recorder._note(recorder.reduce, fp, dtype_name(out[0].dtype))
            partial = out[6] if len(out) > 6 else None
            if partial is not None:  # HSDP without all-reduce: sums held across micro-batches
                for fp in current:
                    recorder._note(recorder.accum, fp, dtype_name(partial.dtype))
            current.clear()
            return out

        pg.foreach_reduce = foreach_reduce
        dist.reduce_scatter_single = reduce_scatter_single
        dist.all_reduce = all_reduce

    def _fqn(self, fsdp_param) -> str:
        """An FSDP parameter's canonical FQN (FSDP's own name where the model's is not known)."""
        return self._fqn_of.get(id(fsdp_param.sharded_param), getattr(fsdp_param, "_param_fqn", "?"))

    def _held(self, fqn: str, grad: torch.Tensor, placed: torch.Tensor) -> torch.Tensor:
        """``grad`` as this rank holds it: of a tensor-parallel weight (``placed``, its unsharded
        parameter or gradient, a DTensor) the local piece, its region noted in :attr:`regions`."""
        if isinstance(placed, DTensor):
            self.regions[fqn] = region(placed)
        return grad.to_local() if isinstance(grad, DTensor) else grad

    def _note(self, table: dict[str, set[str]], fsdp_param, dtype: str) -> None:
        table.setdefault(self._fqn(fsdp_param), set()).add(dtype)

    @contextlib.contextmanager
    def phase(self, step: int, mb: int):
        """Record forward observations during the first forward only, the parameters each
        forward reads (their compute dtype, once), and the parameters as gathered during each
        step's first forward."""
        self.active = step == 0 and mb == 0
        self.reading = True
        self.at = (step, mb)
        self._gather_step = step if mb == 0 else None
        try:
            yield
        finally:
            self.active = self.reading = False
            self.at = None
            self._gather_step = None
        if step == 0 and mb == 0:
            self.lazy_init = lazy_init_snapshot(self.model)

    def after_backward(self, model: nn.Module, step: int, mb: int, synced: bool, scale: float = 1.0) -> None:
        """After a backward that synchronized: what its reductions took as input, read as they
        began. While sync is off: each unsharded gradient's dtype and value after micro-batch
        ``mb``'s backward. Values divided by the loss ``scale`` (a power of two: exact)."""
        if synced:
            if self._reduce_inputs:
                self.accumulated[(step, mb)] = {f: unscaled(v, scale) for f, v in self._reduce_inputs.items()}
            self._reduce_inputs = {}
            if self._replica_inputs:
                self.partials[(step, mb)] = PackedShards.pack(
                    {f: (offset, unscaled(v, scale)) for f, (offset, v) in self._replica_inputs.items()})
            self._replica_inputs = {}
            self.shards[(step, mb)] = sharded_grads(model, self._fqn, scale)
            return
        for _, fp in apply.fsdp_params(model):
            # torch <= 2.14 keeps a separate accumulator; 2.15 accumulates in the leaf's grad
            grad = getattr(fp, "unsharded_accumulated_grad", None)
            if grad is None and hasattr(fp, "_unsharded_param"):
                grad = fp.unsharded_param.grad
            if grad is not None:
                fqn = self._fqn_of.get(id(fp.sharded_param), "?")
                self.accum.setdefault(fqn, set()).add(dtype_name(grad.dtype))
                grad = self._held(fqn, grad, grad)  # a TP weight's: its local TP piece
                self.accumulated.setdefault((step, mb), {})[fqn] = unscaled(grad.detach().cpu().clone(), scale)

    def close(self) -> None:
        """Remove hooks and restore FSDP's reduction functions (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._orig_wait is not None:
            self._group_cls.wait_for_unshard, self._orig_wait = self._orig_wait, None
        if self.reduce_observable and self._orig_reduce is not None:
            self._pg.foreach_reduce = self._orig_reduce
            dist.reduce_scatter_single, dist.all_reduce = self._orig_rs, self._orig_ar
            self._orig_reduce = None

    def finish(self, model: nn.Module, seen: ContractsSeen) -> None:
        """Fill ``seen`` with everything recorded, plus the trained model's names."""
        self.close()
        seen.sharded, seen.lazy_init, seen.trained = self.sharded, self.lazy_init, names_snapshot(model)
        seen.compute = {**self._via_parent, **self.compute}
        seen.gathered, seen.all_gathers = self.gathered, self.all_gathers
        seen.policies = self.policies
        seen.boundaries = self.boundaries
        seen.boundary_variants = {m: {d: sorted(map(list, v)) for d, v in dirs.items()} for m, dirs in self.variants.items()}
        seen.reduce = {k: sorted(v) for k, v in self.reduce.items()}
        seen.replicas = {k: sorted(v) for k, v in self.replicas.items()}
        seen.ownership = {"sharded": self.owned, "trained": ownership(model)}
        seen.reduce_observable = self.reduce_observable
        seen.accum = {k: sorted(v) for k, v in self.accum.items()}
        seen.accumulated, seen.accum_regions = self.accumulated, self.regions
        seen.shards = self.shards
        seen.partials = self.partials
        seen.buffers = {**self.buffers, "trained": buffers_snapshot(model)}
