"""Faults in FSDP's recipe knobs (the gradient divide factor, prefetching, the gradient dtype,
resharding after backward or to a smaller group, shard placement, input casting, unsharding in
backward, explicit unshard / reshard, last-backward finalization, CPU offload): each breaks the
knob the way a real bug would and stays silent where the knob is off. Registered in
:data:`parity.faults.FAULTS`."""

from __future__ import annotations

import torch

from parity.faults.patches import fsdp_classes, swap_attr


def divide_factor_dropped():
    """FSDP's reduction drops the unit's gradient divide factor and divides by the number of
    data-parallel ranks, as if none was set: a recipe that sums (``set_gradient_divide_factor(1.0)``)
    gets gradients divided by the world size. Silent where no factor is set."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    def make(orig):
        def _get_gradient_divide_factors(rs_group, ar_group, reduce_dtype, device_type="", factor=None, *rest):
            return orig(rs_group, ar_group, reduce_dtype, device_type, None, *rest)
        return _get_gradient_divide_factors
    return swap_attr(_fsdp_collectives, "_get_gradient_divide_factors", make)


def divide_factor_not_stored():
    """``FSDPModule.set_gradient_divide_factor`` stores nothing: every unit keeps averaging,
    and a recipe that sums gets gradients divided by the world size."""
    from torch.distributed.fsdp import FSDPModule

    return swap_attr(FSDPModule, "set_gradient_divide_factor", lambda orig: lambda self, factor: None)


def prefetch_regathers():
    """A unit prefetched in forward loses its pending all-gather (FSDPParamGroup._prefetch_unshard
    waits and drops the result), so its own pre-forward gathers it again: the numbers stay
    right, the forward all-gathers it twice. Only explicit prefetching prefetches in forward
    (FSDP's implicit prefetch is backward's): silent without it."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    original = FSDPParamGroup.__dict__["_prefetch_unshard"]  # the staticmethod itself: restored as one

    def _prefetch_unshard(target, pass_type):
        original.__func__(target, pass_type)
        if pass_type != "forward":
            return
        result, target._all_gather_result = target._all_gather_result, None
        if result is not None and result.all_gather_work is not None:
            result.all_gather_work.wait()
    FSDPParamGroup._prefetch_unshard = staticmethod(_prefetch_unshard)
    return lambda: setattr(FSDPParamGroup, "_prefetch_unshard", original)


def prefetch_not_stored():
    """``FSDPModule.set_modules_to_forward_prefetch`` stores nothing: the recipe's forward
    prefetching silently never happens (the numbers and collectives are those of no prefetch)."""
    from torch.distributed.fsdp import FSDPModule

    return swap_attr(FSDPModule, "set_modules_to_forward_prefetch", lambda orig: lambda self, modules: None)


def grad_dtype_dropped():
    """FSDP forgets each parameter's ``grad_dtype`` at lazy initialization and keeps its
    gradients in the storage dtype (``FSDPParam.init_dtype_attrs``): BF16 weights that should
    keep FP32 gradients get BF16 ones, rounded after the reduction."""
    def make(orig):
        def init_dtype_attrs(self, mp_policy):
            orig(self, mp_policy)
            if self.sharded_grad_dtype not in (None, self.orig_dtype):
                self.sharded_grad_dtype = self.orig_dtype
                self.sharded_param.grad_dtype = self.orig_dtype
        return init_dtype_attrs
    return swap_attr(fsdp_classes()[0], "init_dtype_attrs", make)


def reshard_after_backward_sticks():
    """``FSDPModule.set_reshard_after_backward(True)`` is ignored once a unit was told not to
    reshard: after a step's last backward the units stay gathered, and the next step computes
    with the weights from before the optimizer step (the gather it needed never happens)."""
    from torch.distributed.fsdp import FSDPModule

    def make(orig):
        def set_reshard_after_backward(self, reshard_after_backward, *, recurse=True):
            if reshard_after_backward:
                return None
            return orig(self, reshard_after_backward, recurse=recurse)
        return set_reshard_after_backward
    return swap_attr(FSDPModule, "set_reshard_after_backward", make)


def compiled_forward_dropped():
    """``fully_shard`` drops the compiled forward (``nn.Module._compiled_call_impl``) of every
    compiled module it wraps after the first: the later blocks run eagerly, computing the same
    numbers; the first block's graphs, split at the units' hooks, can make up the count."""
    import torch.distributed.fsdp as fsdp

    compiled = []

    def make(orig):
        def fully_shard(module, *args, **kwargs):
            out = orig(module, *args, **kwargs)
            if getattr(module, "_compiled_call_impl", None) is not None:
                compiled.append(module)
                if len(compiled) > 1:
                    module._compiled_call_impl = None
            return out
        return fully_shard
    return swap_attr(fsdp, "fully_shard", make)


def _fully_shard_drops(keyword: str):
    """``fully_shard`` ignores its ``keyword`` argument (FSDP's default takes its place)."""
    import torch.distributed.fsdp as fsdp

    def make(orig):
        def fully_shard(module, *args, **kwargs):
            kwargs.pop(keyword, None)
            return orig(module, *args, **kwargs)
        return fully_shard
    return swap_attr(fsdp, "fully_shard", make)


def placement_fn_dropped():
    """``fully_shard`` drops its ``shard_placement_fn``: every parameter is sharded on dimension 0
    whatever the recipe asked (the numbers are the same; memory layout and collectives are not
    what the recipe planned)."""
    return _fully_shard_drops("shard_placement_fn")


def casts_inputs_anyway():
    """FSDP casts a unit's floating forward inputs to its low-precision ``param_dtype`` even when
    its policy says ``cast_forward_inputs=False`` (``FSDPState._cast_forward_inputs``): a model
    that keeps an FP32 stream and casts for itself gets BF16 inputs."""
    import functools

    from torch.distributed.fsdp._fully_shard import _fsdp_state
    from torch.distributed.utils import _apply_to_tensors

    def make(orig):
        def _cast_forward_inputs(self, args, kwargs):
            dtype = self._mp_policy.param_dtype
            if self._mp_policy.cast_forward_inputs or dtype not in (torch.bfloat16, torch.float16):
                return orig(self, args, kwargs)
            cast = functools.partial(_fsdp_state._cast_fp_tensor, dtype)
            return _apply_to_tensors(cast, args), _apply_to_tensors(cast, kwargs)
        return _cast_forward_inputs
    return swap_attr(_fsdp_state.FSDPState, "_cast_forward_inputs", make)


def unshard_in_backward_not_stored():
    """``FSDPModule.set_unshard_in_backward(False)`` stores nothing: the embedding's unit is
    all-gathered again in backward (right numbers, a wasted gather per backward)."""
    from torch.distributed.fsdp import FSDPModule

    return swap_attr(FSDPModule, "set_unshard_in_backward", lambda orig: lambda self, unshard_in_backward: None)


def explicit_unshard_regathers():
    """``FSDPModule.unshard`` launches the all-gather but drops its result once it arrives
    (the handle waits on nothing), so every unit's own pre-forward gathers it again: right
    numbers, two all-gathers per unit per forward. Only a recipe that unshards by hand calls it."""
    from torch.distributed.fsdp import FSDPModule

    def make(orig):
        def unshard(self, async_op=False):
            handle = orig(self, async_op=True)
            for group in self._get_fsdp_state()._fsdp_param_groups:
                result, group._all_gather_result = group._all_gather_result, None
                if result is not None and result.all_gather_work is not None:
                    result.all_gather_work.wait()
            return handle if async_op else None
        return unshard
    return swap_attr(FSDPModule, "unshard", make)


def reshard_is_noop():
    """``FSDPModule.reshard`` frees nothing: a recipe that resharded its units by hand after an
    evaluation phase keeps every unit gathered (the memory it meant to free)."""
    from torch.distributed.fsdp import FSDPModule

    return swap_attr(FSDPModule, "reshard", lambda orig: lambda self: None)


def reshard_after_forward_sticks():
    """``FSDPModule.set_reshard_after_forward(True)`` is ignored once a unit was told False: after
    an evaluation phase the units keep every later forward's parameters gathered until backward."""
    from torch.distributed.fsdp import FSDPModule

    def make(orig):
        def set_reshard_after_forward(self, reshard_after_forward, recurse=True):
            if reshard_after_forward:
                return None
            return orig(self, reshard_after_forward, recurse)
        return set_reshard_after_forward
    return swap_attr(FSDPModule, "set_reshard_after_forward", make)


def not_last_backward_skips_sync():
    """``FSDPModule.set_is_last_backward(False)`` also turns gradient synchronization off: a
    backward flagged as not the last reduce-scatters nothing (its gradients wait, unsharded,
    for the last), although the recipe asked for a reduction after every micro-batch."""
    from torch.distributed.fsdp import FSDPModule

    def make(orig):
        def set_is_last_backward(self, is_last_backward):
            orig(self, is_last_backward)
            if not is_last_backward:
                self.set_requires_gradient_sync(False)
        return set_is_last_backward
    return swap_attr(FSDPModule, "set_is_last_backward", make)


def finalize_skips_pending():
    """``finalize_backward`` forgets the parameter groups whose post-backward it was left to (a
    unit whose forward inputs need no gradient, e.g. the root behind token ids): their
    gradients are never reduced, and no sharded gradient appears."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    def make(orig):
        def finalize_backward(self, *args, **kwargs):
            for state in self._state_ctx.all_states:
                for group in state._fsdp_param_groups:
                    group._post_backward_pending = False
            return orig(self, *args, **kwargs)
        return finalize_backward
    return swap_attr(FSDPState, "finalize_backward", make)


def offload_policy_dropped():
    """``fully_shard`` drops its ``offload_policy``: the recipe's parameters and gradients stay
    on the device (same numbers; the memory the recipe planned is not freed)."""
    return _fully_shard_drops("offload_policy")


def offload_copy_in_stale():
    """With CPU offloading, FSDP's all-gather copy-in reads a host copy of each shard taken at
    its first gather (``FSDPParam.all_gather_inputs``) instead of the shard the optimizer
    updates: every step after the first computes with the initial weights."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import _to_dtype_if_needed
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ShardedState

    prop = FSDPParam.__dict__["all_gather_inputs"]

    def all_gather_inputs(self):
        if (self.offload_to_cpu and self.sharded_state == ShardedState.SHARDED
                and not hasattr(self._sharded_local_tensor, "fsdp_pre_all_gather")):
            if not hasattr(self, "_parity_host_copy"):
                self._parity_host_copy = self._sharded_param_data.detach().clone()
            return [_to_dtype_if_needed(self._parity_host_copy.to(self.device), self.param_dtype)]
        return prop.fget(self)
    FSDPParam.all_gather_inputs = property(all_gather_inputs)
    return lambda: setattr(FSDPParam, "all_gather_inputs", prop)


def reshard_group_ignored():
    """``fully_shard`` takes an int ``reshard_after_forward`` as True: after forward every unit
    reshards over all its ranks instead of the smaller group the recipe chose (same numbers;
    backward all-gathers over every rank again)."""
    import torch.distributed.fsdp as fsdp

    def make(orig):
        def fully_shard(module, *args, reshard_after_forward=None, **kwargs):
            if not isinstance(reshard_after_forward, bool) and isinstance(reshard_after_forward, int):
                reshard_after_forward = True
            return orig(module, *args, reshard_after_forward=reshard_after_forward, **kwargs)
        return fully_shard
    return swap_attr(fsdp, "fully_shard", make)


def unsharded_layout_flips():
    """From a parameter's second all-gather on, FSDP's copy-out hands compute its unsharded
    matrices column-major (a fresh copy of the gathered values with transposed strides) instead
    of the row-major view the first gather set up: the values are the current ones, but a
    compiled block guards on strides and recompiles at every later forward's first gather.
    Eager computes the same numbers (silent without compile)."""
    from parity.faults.patches import after_each_gather

    def flip(group):
        for fsdp_param in group.fsdp_params:
            param = fsdp_param.unsharded_param
            view = fsdp_param.__dict__.setdefault("_parity_view", param.data)
            gathers = fsdp_param.__dict__.get("_parity_gathers", 0)
            if param.dim() == 2 and gathers:
                param.data = view.t().contiguous().t()
            fsdp_param._parity_gathers = gathers + 1
    return after_each_gather(flip)


def checkpoint_keeps_activations():
    """torch's composable ``checkpoint`` (``checkpoint_activation``) never enters its
    saved-tensor hooks: a checkpointed block keeps its activations and nothing runs again in
    backward (the same numbers, the memory checkpointing was meant to free held)."""
    from torch.distributed._composable import checkpoint_activation

    def make(orig):
        def keeps(module, args, kwargs, **options):
            yield
        return keeps
    return swap_attr(checkpoint_activation, "_checkpoint_without_reentrant_generator_impl", make)


def selective_policy_ignored():
    """torch's selective checkpoint caches nothing its policy asks to save
    (``_CachingTorchDispatchMode``): every op of a selectively checkpointed block, its matmuls
    included, runs again in backward (the same numbers, the compute the policy was meant to save
    spent)."""
    from torch.utils import checkpoint as ckpt

    def make(orig):
        def __init__(self, policy_fn, storage, *args, **kwargs):
            orig(self, lambda ctx, op, *a, **k: ckpt.CheckpointPolicy.PREFER_RECOMPUTE, storage, *args, **kwargs)
        return __init__
    return swap_attr(ckpt._CachingTorchDispatchMode, "__init__", make)


def explicit_unshard_issues_nothing():
    """``FSDPModule.unshard`` issues no all-gather and returns no handle: a recipe that gathers
    its units ahead of the forward overlaps nothing, and each unit's pre-forward gathers as if
    the recipe had not asked (the same numbers, the same all-gather count)."""
    from torch.distributed.fsdp import FSDPModule

    return swap_attr(FSDPModule, "unshard", lambda orig: lambda self, async_op=False: None)


def reshard_after_backward_not_stored():
    """``FSDPModule.set_reshard_after_backward`` stores nothing: a recipe that keeps its units
    gathered across a no-sync window's backwards frees and gathers them again each micro-batch."""
    from torch.distributed.fsdp import FSDPModule

    return swap_attr(FSDPModule, "set_reshard_after_backward",
                     lambda orig: lambda self, reshard_after_backward, *, recurse=True: None)


def is_last_backward_not_stored():
    """``FSDPModule.set_is_last_backward`` stores nothing: every backward is FSDP's last (its
    default), so a recipe that flags its micro-batches waits on pending reductions after each."""
    from torch.distributed.fsdp import FSDPModule

    return swap_attr(FSDPModule, "set_is_last_backward", lambda orig: lambda self, is_last_backward: None)


def _forward_reshard(make):
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    return swap_attr(FSDPParamGroup, "reshard", make)


def reshard_forward_skipped():
    """A unit set to reshard after forward keeps its parameters gathered until backward
    (``FSDPParamGroup.reshard`` returns early in the forward state): the setting reads ``on``,
    the numbers are the same, the backward gathers nothing again -- the memory reshard-on buys
    is gone. Silent with reshard off."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    def make(orig):
        def reshard(self):
            return None if self._training_state == TrainingState.FORWARD else orig(self)
        return reshard
    return _forward_reshard(make)


def reshard_off_reshards():
    """A unit set not to reshard after forward reshards anyway (``FSDPParamGroup.reshard``
    ignores ``reshard_after_forward`` in the forward state): the numbers are the same, each
    backward all-gathers the units again -- the all-gathers reshard-off saves are back. Silent
    with reshard on."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    def make(orig):
        def reshard(self):
            if self._training_state == TrainingState.FORWARD and not self._reshard_after_forward:
                return self._to_sharded()
            return orig(self)
        return reshard
    return _forward_reshard(make)
