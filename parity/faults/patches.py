"""How each deliberate fault breaks things: patches of FSDP, torch and DCP internals (the
way a real bug there would behave), of a sharding helper's policy, and hooks at the
worker's sites. The registry (:data:`parity.faults.FAULTS`) says which is which."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
from torch import nn


def swap_attr(owner, name: str, make: Callable) -> Callable[[], None]:
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    return lambda: setattr(owner, name, original)


def fsdp_classes():
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_state

    return _fsdp_param.FSDPParam, _fsdp_state.FSDPState


def after_each_gather(action: Callable) -> Callable[[], None]:
    """Patch ``FSDPParamGroup.wait_for_unshard`` so that ``action(group)`` runs under
    ``torch.no_grad()`` right after an all-gather's result is copied out to compute (not when
    the group was already unsharded); returns the undo."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    def make(orig):
        def wait_for_unshard(self, *args, **kwargs):
            gathering = bool(getattr(self, "_all_gather_result", None))
            out = orig(self, *args, **kwargs)
            if gathering:
                with torch.no_grad():
                    action(self)
            return out
        return wait_for_unshard
    return swap_attr(FSDPParamGroup, "wait_for_unshard", make)


# --- FSDP-side: dtype resolution, casts, gradient finalization -----------------------------


def drop_override():
    def make(orig):
        def init_dtype_attrs(self, mp_policy):
            orig(self, mp_policy)
            if self.orig_dtype == torch.float32 and self.param_dtype is None:
                self.param_dtype = torch.bfloat16  # FSDP ignores "keep FP32"
        return init_dtype_attrs
    return swap_attr(fsdp_classes()[0], "init_dtype_attrs", make)


def holder_dt_bias_bf16():
    seen = []

    def make(orig):
        def init_dtype_attrs(self, mp_policy):
            orig(self, mp_policy)
            if self._module_info.param_name == "dt_bias":
                seen.append(self)
                if len(seen) % 2 == 0:  # the second holder's dt_bias only (one per block, in unit order)
                    self.param_dtype = torch.bfloat16
        return init_dtype_attrs
    return swap_attr(fsdp_classes()[0], "init_dtype_attrs", make)


def bf16_reduce():
    def make(orig):
        def init_dtype_attrs(self, mp_policy):
            orig(self, mp_policy)
            if self.orig_dtype.is_floating_point:
                self.reduce_dtype = torch.bfloat16  # FSDP reduces in BF16 whatever the policy says
        return init_dtype_attrs
    return swap_attr(fsdp_classes()[0], "init_dtype_attrs", make)


def bf16_reduce_tied():
    def make(orig):
        def init_dtype_attrs(self, mp_policy):
            orig(self, mp_policy)
            if self._param_fqn == "embed.weight":  # only the tied embedding/head reduces in BF16
                self.reduce_dtype = torch.bfloat16
        return init_dtype_attrs
    return swap_attr(fsdp_classes()[0], "init_dtype_attrs", make)


def fsdp_rank_dependent_dtype():
    import dataclasses

    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    def make(orig):
        def _resolve_for_param(self, param):
            resolved = orig(self, param)
            if dist.get_rank() == 1:  # rank 1 keeps every parameter in its own dtype
                resolved = dataclasses.replace(resolved, param_dtype=param.dtype)
            return resolved
        return _resolve_for_param
    return swap_attr(MixedPrecisionPolicy, "_resolve_for_param", make)


def drop_output_dtype():
    return swap_attr(fsdp_classes()[1], "_cast_output_dtype", lambda orig: lambda self, output: output)


def output_cast_first_only():
    """FSDP casts only the first element of a unit's tuple output to ``output_dtype``: the rest
    keep the compute dtype (a cast that reads ``output[0]`` where it should map the tree)."""
    def make(orig):
        def _cast_output_dtype(self, output):
            if isinstance(output, tuple) and output:
                return (orig(self, output[0]), *output[1:])
            return orig(self, output)
        return _cast_output_dtype
    return swap_attr(fsdp_classes()[1], "_cast_output_dtype", make)


class ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * (1 + 1e-2)


def perturb_input_grad():
    import torch.distributed as dist

    def make(orig):
        def _cast_forward_inputs(self, args, kwargs):
            args, kwargs = orig(self, args, kwargs)
            if self._is_root and dist.get_rank() == 0:  # the cast's backward is wrong on rank 0
                args = tuple(ScaleGrad.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a
                             for a in args)
            return args, kwargs
        return _cast_forward_inputs
    return swap_attr(fsdp_classes()[1], "_cast_forward_inputs", make)


def detach_input():
    def make(orig):
        def _cast_forward_inputs(self, args, kwargs):
            args, kwargs = orig(self, args, kwargs)
            if self._is_root:  # the root's cast cuts the input out of the graph
                args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
            return args, kwargs
        return _cast_forward_inputs
    return swap_attr(fsdp_classes()[1], "_cast_forward_inputs", make)


def hide_reduction():
    from parity.paths import apply

    return swap_attr(apply, "reduction_module", lambda orig: lambda: None)  # a build without the module


def resolver_misses_strict_name():
    from parity.model import plan

    def make(orig):
        def matches(fqn, pattern, rule="transformers"):
            return False if pattern == "dt_bias" else orig(fqn, pattern, rule)  # one declared name is lost
        return matches
    return swap_attr(plan, "matches", make)


def perturb_grad():
    def make(orig):
        def _root_post_backward_final_callback(self):
            orig(self)
            for state in self._state_ctx.all_states:
                for group in state._fsdp_param_groups:
                    for fp in group.fsdp_params:
                        if fp.sharded_param.grad is not None:
                            fp.sharded_param.grad.mul_(1 + 1e-4)  # one finalized gradient is off
                            return
        return _root_post_backward_final_callback
    return swap_attr(fsdp_classes()[1], "_root_post_backward_final_callback", make)


# --- torch-side: the norm and the optimizer ------------------------------------------------


def scale_grad_norm():
    return swap_attr(torch.nn.utils, "clip_grad_norm_", lambda orig: lambda *a, **k: orig(*a, **k) * 1.01)


def rank1_grad_norm():
    import torch.distributed as dist

    def make(orig):
        def clip_grad_norm_(*a, **k):
            norm = orig(*a, **k)
            return norm * 1.01 if dist.get_rank() == 1 else norm  # only rank 1's global norm is off
        return clip_grad_norm_
    return swap_attr(torch.nn.utils, "clip_grad_norm_", make)


def rank1_gather_corrupt():
    """Rank 1's all-gather hands compute ``blocks.1.q_proj.weight`` 1 % off, every time it gathers
    it (FSDPParamGroup.wait_for_unshard: a copy-out that goes wrong on one rank); rank 0 is right."""
    import torch.distributed as dist

    def corrupt(group):
        if dist.get_rank() == 1:
            for fsdp_param in group.fsdp_params:
                if (fsdp_param._param_fqn or "").endswith("blocks.1.q_proj.weight"):
                    fsdp_param.unsharded_param.data.mul_(1.01)
    return after_each_gather(corrupt)


def perturb_param():
    def make(orig):
        def step(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            with torch.no_grad():
                self.param_groups[0]["params"][0].mul_(1 + 1e-4)  # one update is off
            return out
        return step
    return swap_attr(torch.optim.AdamW, "step", make)


def eval_resets_sync():
    """A forward without gradients turns gradient synchronization back on for every unit
    (FSDPState._root_pre_forward): an evaluation inside a no-sync window makes the rest of the
    window reduce every micro-batch. A recipe that sets the flag before each micro-batch sets it
    off again and never sees it (``flags = "each"``)."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    def make(orig):
        def _root_pre_forward(self, module, args, kwargs):
            if not torch.is_grad_enabled():
                for state in self._state_ctx.all_states:
                    for group in getattr(state, "_fsdp_param_groups", None) or []:
                        group.reduce_grads = group.all_reduce_grads = True
            return orig(self, module, args, kwargs)
        return _root_pre_forward
    return swap_attr(FSDPState, "_root_pre_forward", make)


def unsharded_grad_kept():
    """FSDP takes each unsharded gradient for its reduce-scatter and leaves a zeroed full-size one
    on the unsharded parameter instead of freeing it (FSDPParamGroup._take_unsharded_grads_to_reduce):
    the next backward accumulates into zeros, so every value is right, and every unit holds a
    full-size gradient per parameter for the rest of training."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    def make(orig):
        def _take_unsharded_grads_to_reduce(self):
            kept = {id(fp): fp.unsharded_param.grad for fp in self.fsdp_params if hasattr(fp, "_unsharded_param")}
            taken = orig(self)
            for fp in taken[0]:
                if kept.get(id(fp)) is not None:
                    fp.unsharded_param.grad = torch.zeros_like(kept[id(fp)])
            return taken
        return _take_unsharded_grads_to_reduce
    return swap_attr(FSDPParamGroup, "_take_unsharded_grads_to_reduce", make)


def rank1_step_passes_over_param():
    """Rank 1's optimizer step passes over the first parameter of its first group (``AdamW.step``:
    a grouping that drops one parameter on one rank): that rank's shard of it is never updated
    and holds no optimizer state, while rank 0's is right."""
    import torch.distributed as dist

    def make(orig):
        def step(self, *args, **kwargs):
            first = self.param_groups[0]["params"][0]
            hidden = first.grad if dist.get_rank() == 1 else None
            if hidden is not None:
                first.grad = None
            try:
                return orig(self, *args, **kwargs)
            finally:
                if hidden is not None:
                    first.grad = hidden
        return step
    return swap_attr(torch.optim.AdamW, "step", make)


def moments_held_bf16():
    """AdamW's moments are rounded to BF16 precision after every step (``AdamW.step``: state held
    at the compute dtype's precision): each step's update is computed right, then the state it
    keeps for the next step is rounded -- the parameters go wrong one step later."""
    def make(orig):
        def step(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            with torch.no_grad():
                for state in self.state.values():
                    for key in ("exp_avg", "exp_avg_sq"):
                        if key in state:
                            state[key].copy_(state[key].to(torch.bfloat16))
            return out
        return step
    return swap_attr(torch.optim.AdamW, "step", make)


# --- DCP-side: state-dict mapping ----------------------------------------------------------


def misfile_optimizer_state():
    from torch.distributed.checkpoint import state_dict as sd

    def make(orig):
        def get_state_dict(model, optimizers, **kwargs):
            msd, osd = orig(model, optimizers, **kwargs)
            state = osd["state"]
            keys = [k for k in state if "exp_avg" in state[k]]
            shape = state[keys[0]]["exp_avg"].shape
            other = next(k for k in keys if state[k]["exp_avg"].shape != shape)
            state[other] = state.pop(keys[0])  # filed by position under the wrong FQN
            return msd, osd
        return get_state_dict
    return swap_attr(sd, "get_state_dict", make)


def swap_optimizer_state():
    from torch.distributed.checkpoint import state_dict as sd

    def make(orig):
        def set_state_dict(model, optimizers, **kwargs):
            out = orig(model, optimizers, **kwargs)
            state = optimizers.state
            params = [p for p in state if "exp_avg" in state[p]]
            for i, a in enumerate(params):
                for b in params[i + 1:]:
                    if a.shape == b.shape:  # two same-shape parameters swap their state
                        state[a], state[b] = state[b], state[a]
                        return out
            return out
        return set_state_dict
    return swap_attr(sd, "set_state_dict", make)


# --- a sharding helper's bug: the policy it hands to FSDP ----------------------------------


def cast_child_inputs():
    from parity.paths import units

    def make(orig):
        def unit_policy(unit, params):
            import dataclasses

            pol = orig(unit, params)
            return dataclasses.replace(pol, cast_forward_inputs=True)  # FP32 children cast inputs too
        return unit_policy
    return swap_attr(units, "unit_policy", make)


def cast_buffers():
    import torch.distributed.fsdp as fsdp

    def make(orig):
        def fully_shard(module, *args, **kwargs):
            out = orig(module, *args, **kwargs)
            for mod in module.modules() if isinstance(module, nn.Module) else ():
                for k, b in mod._buffers.items():  # as ``module.to(param_dtype)`` would
                    if b is not None and b.is_floating_point():
                        mod._buffers[k] = b.to(torch.bfloat16)
            return out
        return fully_shard
    return swap_attr(fsdp, "fully_shard", make)


class Wrapper(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self._fsdp_wrapped_module = inner

    def forward(self, *args, **kwargs):
        return self._fsdp_wrapped_module(*args, **kwargs)


def wrap_module():
    import torch.distributed.fsdp as fsdp

    def make(orig):
        def fully_shard(module, *args, **kwargs):
            out = orig(module, *args, **kwargs)
            if isinstance(module, nn.Module) and isinstance(getattr(module, "head", None), nn.Module):
                module.head = Wrapper(module.head)  # the root's head ends up inside a wrapper
            return out
        return fully_shard
    return swap_attr(fsdp, "fully_shard", make)


def rank_dependent_units():
    """A sharding helper whose units depend on the rank: on rank 1 native's plan leaves the last
    block inside the root's unit. Every parameter resolves the same dtypes on both ranks; only the
    units differ, so the ranks all-gather different buffers."""
    import dataclasses

    import torch.distributed as dist
    from parity.paths.native import NativePath

    def make(orig):
        def plan(self, *args, **kwargs):
            report = orig(self, *args, **kwargs)
            if not (dist.is_initialized() and dist.get_rank() == 1):
                return report
            *units, block, root = report.units
            merged = dataclasses.replace(root, params=root.params + block.params,
                                         overrides=root.overrides + block.overrides)
            return dataclasses.replace(report, units=(*units, merged))
        return plan
    return swap_attr(NativePath, "plan", make)


def skip_rank_check():
    from parity.paths import apply

    return swap_attr(apply, "check_rank_consistency", lambda orig: lambda *a, **k: None)


# --- the model and its metadata ------------------------------------------------------------


def lose_buffer_marker():
    """Markers kept on the tensor itself (the naive design): a buffer-replacing move drops them."""
    from parity.model import markers

    def store(owner: nn.Module, local: str) -> None:
        tensor = owner._parameters.get(local, owner._buffers.get(local))
        tensor._parity_keep_fp32 = True

    def stored(owner: nn.Module) -> set[str]:
        items = list(owner._parameters.items()) + list(owner._buffers.items())
        return {k for k, t in items if t is not None and getattr(t, "_parity_keep_fp32", False)}

    undo = [swap_attr(markers, "_store", lambda o: store), swap_attr(markers, "_stored", lambda o: stored)]
    return lambda: [u() for u in undo]


def rank_dependent(plan, rank: int, world: int, **_):
    if rank != 1:
        return plan
    victim = next(t for t in plan.params if t.trainable and t.compute != t.storage)
    return plan.replace(victim.fqn, compute=victim.storage)


def perturb_output(value, rank: int, world: int, model: nn.Module, **_):
    calls = []

    def hook(module, args, out):
        if rank == 0 and not calls:
            calls.append(1)
            first = out if isinstance(out, torch.Tensor) else out[0]  # a tuple's logits
            moved = first + 1e-2 * first.detach().abs().max()
            return moved if isinstance(out, torch.Tensor) else (moved, *out[1:])
        calls.append(1)
    model.register_forward_hook(hook)
    return value


def first_param(model: nn.Module):
    name, param = next(iter(model.named_parameters()))
    owner_name, _, local = name.rpartition(".")
    return model.get_submodule(owner_name), local, param


def rename(value, rank, world, model, **_):
    owner, local, _ = first_param(model)
    owner._parameters[local + "_renamed"] = owner._parameters.pop(local)
    return value


def replace(value, rank, world, model, **_):
    owner, local, param = first_param(model)
    owner._parameters[local] = nn.Parameter(param.detach().clone())
    return value


def cast_storage(value, rank, world, model, **_):
    _, _, param = first_param(model)
    param.data = param.data.to(torch.bfloat16 if param.dtype != torch.bfloat16 else torch.float32)
    return value


def crash(value, rank, world, **_):
    if rank == world - 1:
        os._exit(17)
    return value


def crash_building_legacy(value, rank, world, path, **_):
    if path == "legacy" and rank == world - 1:
        os._exit(17)
    return value


def hang(value, rank, world, **_):
    time.sleep(10_000)


def raise_error(value, rank, world, **_):
    raise RuntimeError("deliberate fault: raise")
