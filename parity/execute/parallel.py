"""Worker side of a mesh composition (:mod:`parity.model.topology`): the device mesh, the
fixture's tensor- and expert-parallel plans applied before FSDP, and what a composition
changes about observing a rank (full tensors, the gradient norm across meshes, reductions
by another parallelism's owner, tensor-parallel reductions)."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from parity.execute import collectives
from parity.model.dtypes import dtype_name
from parity.model.plan import tp_reduction_key
from parity.model.quantized import main_weight
from parity.model.spec import Fixture
from parity.model.topology import Topology
from parity.paths.units import module_index

_MESHES: dict[tuple, object] = {}


def device_mesh(topo: Topology, world_mesh, device_type: str):
    """The composition's mesh, made once per process (creating one is a collective)."""
    if topo.name == "fsdp":
        return world_mesh
    key = (topo.name, topo.world, device_type)
    if key not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _MESHES[key] = init_device_mesh(device_type, topo.shape, mesh_dim_names=topo.dims)
    return _MESHES[key]


def fsdp_mesh(topo: Topology, mesh, world_mesh):
    """What ``fully_shard`` gets: the 2-D mesh for HSDP, the data-parallel dimension under
    TP, every rank under EP (the experts are not FSDP's)."""
    if topo.name == "hsdp":
        return mesh
    return mesh["dp"] if topo.name == "fsdp+tp" else world_mesh


def parallelize(model: nn.Module, fixture: Fixture, topo: Topology, mesh) -> dict[str, str]:
    """Apply the fixture's TP plan (``fsdp+tp``) or let its EP modules keep their experts
    (``ep``); returns parameter FQN -> owner (``tp-colwise``, ``tp-rowwise``, ``ep``)."""
    owners: dict[str, str] = {}
    if topo.tp > 1:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        parallelize_module(model, mesh["tp"], {fqn: styles[s]() for fqn, s in fixture.tensor_parallel.items()})
        owners = {f"{fqn}.weight": f"tp-{s}" for fqn, s in fixture.tensor_parallel.items()}
    if topo.ep > 1:
        modules = dict(model.named_modules())
        for fqn in fixture.expert_parallel:
            modules[fqn].shard_experts(mesh)
            owners[f"{fqn}.experts"] = "ep"
    return owners


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for a DTensor), detached, on the CPU."""
    if isinstance(t, DTensor):
        with collectives.unseen():  # parity's read, not the recipe's exchange
            t = t.full_tensor()
    return main_weight(t).detach().cpu().clone()


def _mesh_key(t: DTensor) -> tuple:
    mesh = t.device_mesh
    return mesh.mesh_dim_names, tuple(mesh.mesh.flatten().tolist())


def global_grad_norm(params: list[nn.Parameter]) -> float:
    """The 2-norm of all gradients: sharded ones per mesh (FSDP's, FSDP x TP's and an expert
    owner's live on different meshes, which one norm computation cannot mix), plain
    (replicated) ones as they are."""
    groups: dict[tuple, list[nn.Parameter]] = {}
    plain = []
    for p in params:
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor):
            groups.setdefault(_mesh_key(p.grad), []).append(p)
        else:
            plain.append(p)
    total = 0.0
    for group in groups.values():
        n = torch.nn.utils.clip_grad_norm_(group, max_norm=math.inf)
        total += float(n.full_tensor() if isinstance(n, DTensor) else n) ** 2
    if plain:
        total += float(torch.nn.utils.get_total_norm([p.grad for p in plain])) ** 2
    return math.sqrt(total)


def clip_gradients(params: list[nn.Parameter], max_norm: float, norm: float) -> None:
    """Scale every gradient by ``min(1, max_norm / (norm + 1e-6))`` with ``norm`` the global norm
    (:func:`global_grad_norm`), as ``clip_grad_norm_`` would: one call per gradient mesh, each
    given the global norm, since no one norm computation spans the meshes."""
    groups: dict[tuple, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            key = _mesh_key(p.grad) if isinstance(p.grad, DTensor) else ()
            groups.setdefault(key, []).append(p)
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, torch.tensor(norm))


def owner_reduce(p: nn.Parameter, *, world: int, reduction: str, group=None) -> tuple[str, str]:
    """Reduce an FSDP-ignored parameter's gradient the way its owner does; returns (group,
    dtype) as observed. An expert-parallel owner's experts already summed their tokens over
    ``ep`` (the combine's backward), so it all-reduces over ``dp``, its replicas; an emulated
    owner of a replicated parameter all-reduces over every rank of ``group`` (default: all)."""
    grad = p.grad
    if isinstance(grad, DTensor):
        local, group, label = grad.to_local(), grad.device_mesh.get_group("dp"), "dp"
    else:
        local, label = grad, "world"
    dist.all_reduce(local, group=group)
    if reduction == "mean":
        local.div_(world)
    return label, dtype_name(local.dtype)


class TPReductions:
    """Dtypes of the tensor-parallel reductions (Partial -> Replicate all-reduces), per TP
    module and direction: a rowwise layer reduces its output in forward, a colwise layer its
    input gradient in backward; and what the first of each took on this rank in every
    micro-batch (``partials[(step, mb)][KEY]``: its local partial sum). Recorded inside a
    micro-batch's :meth:`window` (its forward and backward, never an evaluation's)."""

    def __init__(self, model: nn.Module, owners: dict[str, str]):
        import torch.distributed._functional_collectives as funcol

        self.seen: dict[str, set[str]] = {}
        self.partials: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.active = False
        self._slot: dict[str, torch.Tensor] = {}
        self._current: list[str] = []
        self._funcol, self._orig = funcol, funcol.all_reduce
        self._handles = []
        modules = module_index(model)  # canonical names: a checkpoint wrapper's inner module under its own
        for fqn, owner in owners.items():
            if owner.startswith("tp-"):
                self._watch(modules[fqn.rpartition(".")[0]], tp_reduction_key(fqn, owner))
        me = self

        def all_reduce(t, *args, **kwargs):
            if me.active:
                where = me._current[-1] if me._current else "<unattributed>"
                me.seen.setdefault(where, set()).add(dtype_name(t.dtype))
                if where not in me._slot:  # the first: a recompute's is the same forward again
                    me._slot[where] = t.detach().cpu().clone()
            return me._orig(t, *args, **kwargs)

        funcol.all_reduce = all_reduce

    def _watch(self, mod: nn.Module, key: str) -> None:
        if key.endswith("@forward"):  # rowwise: TP's output hook (registered first) all-reduces inside this window
            self._handles.append(mod.register_forward_pre_hook(lambda m, a: self._current.append(key)))
            self._handles.append(mod.register_forward_hook(lambda m, a, o: self._current.pop() and None))
            return

        def mark_input(m, args):  # runs after TP's input hook: args[0] is the replicated DTensor
            x = args[0]
            if self.active and isinstance(x, torch.Tensor) and x.requires_grad:
                # its gradient arrives just before the backward of TP's input redistribution
                x.register_hook(lambda g: self._current.append(key))

        self._handles.append(mod.register_forward_pre_hook(mark_input))

    @contextlib.contextmanager
    def window(self, step: int, mb: int):
        self.active, self._current[:] = True, []
        self._slot = self.partials.setdefault((step, mb), {})
        try:
            yield
        finally:
            self.active = False

    def close(self) -> dict[str, list[str]]:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._funcol.all_reduce = self._orig
        return {k: sorted(v) for k, v in self.seen.items()}
