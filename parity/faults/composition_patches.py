"""Faults only a mesh composition reveals (HSDP, FSDP x TP, expert parallelism): each breaks
FSDP, DTensor or DCP where a reported bug sat -- a reduction in the wrong dtype, partial
sums held in BF16, a parameter another parallelism owns recast by FSDP, TP shards restored
from the wrong rank. Registered in :data:`parity.faults.FAULTS` with ``quiet`` axis values
(the 1-D mesh, or synchronizing every micro-batch) under which they must stay silent."""

from __future__ import annotations

import torch
from torch import nn

from parity.faults.patches import swap_attr


def _pg():
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    return _fsdp_param_group


def tp_partial_reduce_bf16():
    """DTensor reduces a Partial placement of an FP32 tensor in BF16 (``Partial._reduce_value``):
    TP's FP32 activations and input gradients lose precision in the all-reduce."""
    from torch.distributed.tensor.placement_types import Partial

    def make(orig):
        def _reduce_value(self, tensor, mesh, mesh_dim):
            if tensor.dtype != torch.float32 or tensor.dim() < 2:  # activations, not (stacked) norm pieces
                return orig(self, tensor, mesh, mesh_dim)
            return orig(self, tensor.to(torch.bfloat16), mesh, mesh_dim).to(torch.float32)
        return _reduce_value
    return swap_attr(Partial, "_reduce_value", make)


def tp_reduces_twice():
    """DTensor all-reduces a Partial activation or input gradient twice, the first result
    discarded (``Partial._reduce_value``): numerically invisible, one more collective each time."""
    from torch.distributed.tensor.placement_types import Partial

    def make(orig):
        def _reduce_value(self, tensor, mesh, mesh_dim):
            if tensor.dim() >= 2:  # activations, not (stacked) norm pieces
                _ = orig(self, tensor.clone(), mesh, mesh_dim) + 0  # waited on, then dropped
            return orig(self, tensor, mesh, mesh_dim)
        return _reduce_value
    return swap_attr(Partial, "_reduce_value", make)


def combine_backward_regathers():
    """The experts' reduce-scatter combine (``reduce_scatter_tensor_autograd``) all-gathers the
    gradient twice in its backward, the first result dropped: numerically invisible, one more
    exchange per backward -- an exchange torch issues from C++ in the unbroken op, which only a
    count at the dispatcher sees."""
    import torch.distributed._functional_collectives as funcol

    def make(orig):
        def reduce_scatter_tensor_autograd(tensor, reduce_op, scatter_dim, group, tag=""):
            class Regathered(torch.autograd.Function):
                @staticmethod
                def forward(ctx, x):
                    return x.view_as(x)

                @staticmethod
                def backward(ctx, grad):
                    _ = funcol.all_gather_tensor(grad.contiguous(), scatter_dim, group) + 0  # waited on, dropped
                    return grad
            return orig(Regathered.apply(tensor), reduce_op, scatter_dim, group, tag)
        return reduce_scatter_tensor_autograd
    return swap_attr(funcol, "reduce_scatter_tensor_autograd", make)


def hsdp_replica_reduce_bf16():
    """FSDP all-reduces HSDP gradients across replicas in BF16 (the reduce-scatter output is
    downcast for the all-reduce in ``foreach_reduce``)."""
    import torch.distributed as dist

    pg = _pg()

    def make(orig):
        def foreach_reduce(*args, **kwargs):
            inner = dist.all_reduce

            def all_reduce(tensor, *a, **k):
                low = tensor.to(torch.bfloat16)
                work = inner(low, *a, **k)
                tensor.copy_(low)
                return work
            dist.all_reduce = all_reduce
            try:
                return orig(*args, **kwargs)
            finally:
                dist.all_reduce = inner
        return foreach_reduce
    return swap_attr(pg, "foreach_reduce", make)


def _hsdp_sums_instead(which: int):
    """FSDP's HSDP reduction sums where it should average: in the reduce-scatter over the shard
    group (``which`` 2) or the all-reduce across replicas (3), as ``_get_gradient_divide_factors``
    hands ``foreach_reduce`` its ops."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    def make(orig):
        def _get_gradient_divide_factors(reduce_scatter_group, all_reduce_group, *args, **kwargs):
            factors = list(orig(reduce_scatter_group, all_reduce_group, *args, **kwargs))
            if all_reduce_group is not None and factors[which] == dist.ReduceOp.AVG:
                factors[which] = dist.ReduceOp.SUM
            return tuple(factors)
        return _get_gradient_divide_factors
    return swap_attr(_fsdp_collectives, "_get_gradient_divide_factors", make)


def hsdp_replica_sums():
    """FSDP averages HSDP gradients over the shard group only: the all-reduce across replicas
    sums, so every gradient is the number of replicas times too large -- the class of a reported
    bug, where a custom divide factor was applied differently on HSDP than on FSDP. Dtypes and
    counts are unchanged; only the values after the replica all-reduce show it."""
    return _hsdp_sums_instead(3)


def hsdp_shard_group_sums():
    """FSDP's reduce-scatter sums HSDP gradients over the shard group where it should average,
    and the all-reduce across replicas still averages: every gradient is the shard group's size
    times too large, and the all-reduce's input is where it starts (``grad.partial``), unlike
    :func:`hsdp_replica_sums`, whose partials are right."""
    return _hsdp_sums_instead(2)


def hsdp_partial_bf16():
    """HSDP without the replica all-reduce holds its reduce-scattered partial sums in BF16
    across micro-batches (``foreach_reduce``'s partial output)."""
    pg = _pg()

    def make(orig):
        def foreach_reduce(*args, **kwargs):
            out = orig(*args, **kwargs)
            if len(out) > 6 and out[6] is not None and out[6].dtype == torch.float32:
                out = (*out[:6], out[6].to(torch.bfloat16), *out[7:])
            return out
        return foreach_reduce
    return swap_attr(pg, "foreach_reduce", make)


def recast_foreign_params():
    """``fully_shard`` casts the ignored parameters that live on another parallelism's mesh
    (expert-parallel DTensors) to its ``param_dtype``, as a helper converting a whole unit would."""
    import torch.distributed.fsdp as fsdp
    from torch.distributed.tensor import DTensor

    def make(orig):
        def fully_shard(module, *args, mp_policy=None, ignored_params=None, **kwargs):
            out = orig(module, *args, mp_policy=mp_policy, ignored_params=ignored_params, **kwargs)
            low = getattr(mp_policy, "param_dtype", None)
            for p in ignored_params or ():
                if isinstance(p, DTensor) and low is not None and p.dtype != low:
                    torch.utils.swap_tensors(p, nn.Parameter(p.detach().to(low), requires_grad=p.requires_grad))
            return out
        return fully_shard
    return swap_attr(fsdp, "fully_shard", make)


def tp_shards_swapped_on_load():
    """DCP restores the first tensor-parallel weight with its ``tp`` shards exchanged between
    the tp ranks (``set_state_dict`` maps the 2-D mesh's shards in the wrong order)."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.checkpoint import state_dict as dcp_state_dict
    from torch.distributed.tensor import DTensor

    def make(orig):
        def set_state_dict(model, optimizers, **kwargs):
            out = orig(model, optimizers, **kwargs)
            for p in model.parameters():
                if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()):
                    tp = p.device_mesh["tp"]
                    local = p.to_local()
                    both = funcol.all_gather_tensor(local.detach().clone(), 0, tp.get_group()).chunk(tp.size())
                    with torch.no_grad():
                        local.copy_(both[(tp.get_local_rank() + 1) % tp.size()])
                    break
            return out
        return set_state_dict
    return swap_attr(dcp_state_dict, "set_state_dict", make)
