"""Deliberate faults, as data: what each breaks, where, and which checks must flag it.

A check that cannot fail is a defect, so every kind of check has a fault here that makes it
fail; ``tests/test_faults.py`` is generated from :data:`FAULTS` and asserts that exactly the
declared checks flag each fault. Most faults break behaviour *beside* parity -- FSDP's
resolution of dtypes, its casts, its gradient finalization, torch's optimizer and norm, DCP's
state-dict mapping -- the way a real bug there would; a few stand in for a buggy sharding
helper or a broken model. Production modules never name a fault: they open a scope
(:meth:`Injector.active`) or pass a hook site (:meth:`Injector.site`), and this module
decides what happens there.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
from torch import nn

from parity.errors import UsageError

#: Scopes a worker opens: building and training the cell, the checkpoint lifecycle (which
#: trains fresh models and must see the same environment), the marker contract.
SCOPES = ("main", "lifecycle", "markers")
#: Where a broken environment (FSDP, torch, DCP, a helper) shows: everywhere the cell trains.
TRAINING = ("main", "lifecycle")
#: Hook sites a worker passes: before anything ("start"), the resolved plan ("plan", returns
#: a plan), the sharded model ("sharded"), the trained model ("trained").
SITES = ("start", "plan", "sharded", "trained")


@dataclass(frozen=True, kw_only=True)
class Fault:
    name: str
    where: str
    """What is broken and where, in one line."""
    flags: frozenset[str]
    """Checks whose records must turn FAIL (``run``: the cell turns ERROR/TIMEOUT)."""
    cell: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
    """Axis values of the cell the generated test runs (fixture, path, ranks, ...)."""
    patch: Callable[[], Callable[[], None]] | None = None
    """Installs the fault while one of ``scopes`` is open; returns the function that undoes it."""
    scopes: tuple[str, ...] = TRAINING
    site: str = ""
    hook: Callable | None = None
    """Called at ``site`` with (value, rank, world, **context); returns the value."""


def _swap_attr(owner, name: str, make: Callable) -> Callable[[], None]:
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    return lambda: setattr(owner, name, original)


def _fsdp():
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_state

    return _fsdp_param.FSDPParam, _fsdp_state.FSDPState


# --- FSDP-side: dtype resolution, casts, gradient finalization -----------------------------


def _drop_override():
    def make(orig):
        def init_dtype_attrs(self, mp_policy):
            orig(self, mp_policy)
            if self.orig_dtype == torch.float32 and self.param_dtype is None:
                self.param_dtype = torch.bfloat16  # FSDP ignores "keep FP32"
        return init_dtype_attrs
    return _swap_attr(_fsdp()[0], "init_dtype_attrs", make)


def _holder_dt_bias_bf16():
    seen = []

    def make(orig):
        def init_dtype_attrs(self, mp_policy):
            orig(self, mp_policy)
            if self._module_info.param_name == "dt_bias":
                seen.append(self)
                if len(seen) % 2 == 0:  # the second holder's dt_bias only (one per block, in unit order)
                    self.param_dtype = torch.bfloat16
        return init_dtype_attrs
    return _swap_attr(_fsdp()[0], "init_dtype_attrs", make)


def _bf16_reduce():
    def make(orig):
        def init_dtype_attrs(self, mp_policy):
            orig(self, mp_policy)
            if self.orig_dtype.is_floating_point:
                self.reduce_dtype = torch.bfloat16  # FSDP reduces in BF16 whatever the policy says
        return init_dtype_attrs
    return _swap_attr(_fsdp()[0], "init_dtype_attrs", make)


def _fsdp_rank_dependent_dtype():
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
    return _swap_attr(MixedPrecisionPolicy, "_resolve_for_param", make)


def _drop_output_dtype():
    return _swap_attr(_fsdp()[1], "_cast_output_dtype", lambda orig: lambda self, output: output)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * (1 + 1e-2)


def _perturb_input_grad():
    import torch.distributed as dist

    def make(orig):
        def _cast_forward_inputs(self, args, kwargs):
            args, kwargs = orig(self, args, kwargs)
            if self._is_root and dist.get_rank() == 0:  # the cast's backward is wrong on rank 0
                args = tuple(_ScaleGrad.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a
                             for a in args)
            return args, kwargs
        return _cast_forward_inputs
    return _swap_attr(_fsdp()[1], "_cast_forward_inputs", make)


def _perturb_grad():
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
    return _swap_attr(_fsdp()[1], "_root_post_backward_final_callback", make)


# --- torch-side: the norm and the optimizer ------------------------------------------------


def _scale_grad_norm():
    return _swap_attr(torch.nn.utils, "clip_grad_norm_", lambda orig: lambda *a, **k: orig(*a, **k) * 1.01)


def _perturb_param():
    def make(orig):
        def step(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            with torch.no_grad():
                self.param_groups[0]["params"][0].mul_(1 + 1e-4)  # one update is off
            return out
        return step
    return _swap_attr(torch.optim.AdamW, "step", make)


# --- DCP-side: state-dict mapping ----------------------------------------------------------


def _misfile_optimizer_state():
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
    return _swap_attr(sd, "get_state_dict", make)


def _swap_optimizer_state():
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
    return _swap_attr(sd, "set_state_dict", make)


# --- a sharding helper's bug: the policy it hands to FSDP ----------------------------------


def _cast_child_inputs():
    from parity.paths import units

    def make(orig):
        def unit_policy(unit, params):
            import dataclasses

            pol = orig(unit, params)
            return dataclasses.replace(pol, cast_forward_inputs=True)  # FP32 children cast inputs too
        return unit_policy
    return _swap_attr(units, "unit_policy", make)


def _cast_buffers():
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
    return _swap_attr(fsdp, "fully_shard", make)


class _Wrapper(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self._fsdp_wrapped_module = inner

    def forward(self, *args, **kwargs):
        return self._fsdp_wrapped_module(*args, **kwargs)


def _wrap_module():
    import torch.distributed.fsdp as fsdp

    def make(orig):
        def fully_shard(module, *args, **kwargs):
            out = orig(module, *args, **kwargs)
            if isinstance(module, nn.Module) and isinstance(getattr(module, "head", None), nn.Module):
                module.head = _Wrapper(module.head)  # the root's head ends up inside a wrapper
            return out
        return fully_shard
    return _swap_attr(fsdp, "fully_shard", make)


def _skip_rank_check():
    from parity.paths import apply

    return _swap_attr(apply, "check_rank_consistency", lambda orig: lambda *a, **k: None)


# --- the model and its metadata ------------------------------------------------------------


def _lose_buffer_marker():
    """Markers kept on the tensor itself (the naive design): a buffer-replacing move drops them."""
    from parity.model import markers

    def store(owner: nn.Module, local: str) -> None:
        tensor = owner._parameters.get(local, owner._buffers.get(local))
        tensor._parity_keep_fp32 = True

    def stored(owner: nn.Module) -> set[str]:
        items = list(owner._parameters.items()) + list(owner._buffers.items())
        return {k for k, t in items if t is not None and getattr(t, "_parity_keep_fp32", False)}

    undo = [_swap_attr(markers, "_store", lambda o: store), _swap_attr(markers, "_stored", lambda o: stored)]
    return lambda: [u() for u in undo]


def _rank_dependent(plan, rank: int, world: int, **_):
    if rank != 1:
        return plan
    victim = next(t for t in plan.params if t.trainable and t.compute != t.storage)
    return plan.replace(victim.fqn, compute=victim.storage)


def _perturb_output(value, rank: int, world: int, model: nn.Module, **_):
    calls = []

    def hook(module, args, out):
        if rank == 0 and not calls:
            calls.append(1)
            return out + 1e-2 * out.detach().abs().max()
        calls.append(1)
    model.register_forward_hook(hook)
    return value


def _first_param(model: nn.Module):
    name, param = next(iter(model.named_parameters()))
    owner_name, _, local = name.rpartition(".")
    return model.get_submodule(owner_name), local, param


def _rename(value, rank, world, model, **_):
    owner, local, _ = _first_param(model)
    owner._parameters[local + "_renamed"] = owner._parameters.pop(local)
    return value


def _replace(value, rank, world, model, **_):
    owner, local, param = _first_param(model)
    owner._parameters[local] = nn.Parameter(param.detach().clone())
    return value


def _cast_storage(value, rank, world, model, **_):
    _, _, param = _first_param(model)
    param.data = param.data.to(torch.bfloat16 if param.dtype != torch.bfloat16 else torch.float32)
    return value


def _crash(value, rank, world, **_):
    if rank == world - 1:
        os._exit(17)
    return value


def _hang(value, rank, world, **_):
    time.sleep(10_000)


def _raise(value, rank, world, **_):
    raise RuntimeError("deliberate fault: raise")


def _fault(name, where, flags, cell, **kw) -> Fault:
    return Fault(name=name, where=where, flags=frozenset(flags), cell=MappingProxyType(cell), **kw)


_KDA2 = {"fixture": "kda", "path": "native", "ranks": 2}
_MAIN = ("main",)  # only the cell's own training (its first forward, its trained model)
_ACCUM = {"microbatches": 3, "sync": "last"}

FAULTS: dict[str, Fault] = {f.name: f for f in (
    _fault("drop_override", "FSDP resolves FP32 parameters to BF16 compute (FSDPParam.init_dtype_attrs)",
           {"grad", "grad_norm", "trajectory", "dtype.compute", "divergence"}, _KDA2, patch=_drop_override),
    _fault("holder_dt_bias_bf16", "FSDP all-gathers one holder's FP32 dt_bias (blocks.1.holder) in BF16",
           {"grad", "grad_norm", "dtype.compute", "divergence"}, _KDA2, patch=_holder_dt_bias_bf16),
    _fault("bf16_reduce", "FSDP reduces every gradient in BF16 (FSDPParam.init_dtype_attrs)",
           {"grad", "grad_norm", "dtype.reduce", "dtype.accum"}, {**_KDA2, **_ACCUM}, patch=_bf16_reduce),
    _fault("drop_output_dtype", "FSDP skips the outermost unit's output cast (FSDPState._cast_output_dtype)",
           {"dtype.output", "dtype.boundary"}, {**_KDA2, "output_dtype": "float32"}, patch=_drop_output_dtype),
    _fault("perturb_input_grad", "the root's input cast has a wrong backward on rank 0 (FSDPState._cast_forward_inputs)",
           {"input_grad"}, _KDA2, patch=_perturb_input_grad),
    _fault("perturb_grad", "one finalized gradient is off by 1e-4 (FSDPState._root_post_backward_final_callback)",
           {"grad", "grad_norm"}, _KDA2, patch=_perturb_grad),
    _fault("scale_grad_norm", "the sharded global norm is 1% high (torch.nn.utils.clip_grad_norm_)",
           {"grad_norm"}, _KDA2, patch=_scale_grad_norm),
    _fault("perturb_param", "one optimizer update is off by 1e-4 (torch.optim.AdamW.step)",
           {"param"}, _KDA2, patch=_perturb_param),
    _fault("misfile_optimizer_state", "DCP files one parameter's optimizer state under another FQN (get_state_dict)",
           {"optim.state", "checkpoint.same", "checkpoint.cross"}, {"fixture": "frozen", "path": "legacy", "ranks": 2},
           patch=_misfile_optimizer_state, scopes=_MAIN),
    _fault("swap_optimizer_state", "DCP loads two same-shape parameters' optimizer states swapped (set_state_dict)",
           {"checkpoint.same", "checkpoint.cross"}, {"fixture": "frozen", "path": "native", "ranks": 2},
           patch=_swap_optimizer_state, scopes=("lifecycle",)),
    _fault("cast_child_inputs", "a sharding helper lets FP32 child units cast their inputs (unit policy)",
           {"unit.policy", "dtype.boundary"}, {**_KDA2, "path": "legacy"}, patch=_cast_child_inputs),
    _fault("cast_buffers", "fully_shard casts the floating buffers of what it shards to BF16",
           {"buffer", "grad", "grad_norm", "divergence"}, _KDA2, patch=_cast_buffers),
    _fault("wrap_module", "sharding the root leaves its head inside a wrapper (_fsdp_wrapped_module)",
           {"names", "identity", "dtype.storage", "dtype.compute", "dtype.reduce", "optim.state", "grad", "param",
            "trajectory"},
           _KDA2, patch=_wrap_module),
    _fault("lose_buffer_marker", "FP32 markers kept on tensors: a device move replaces buffers and drops them",
           {"marker"}, _KDA2, patch=_lose_buffer_marker, scopes=("markers",)),
    _fault("rank_dependent_override", "rank 1 resolves one parameter's compute dtype differently (the plan)",
           {"run"}, _KDA2, site="plan", hook=_rank_dependent),
    _fault("fsdp_rank_dependent_dtype",
           "FSDP resolves compute dtypes differently on rank 1 (MixedPrecisionPolicy._resolve_for_param)",
           {"run"}, _KDA2, patch=_fsdp_rank_dependent_dtype),
    _fault("rank_dependent_unchecked", "a rank-dependent plan with parity's rank check removed: gloo aborts",
           {"run"}, _KDA2, site="plan", hook=_rank_dependent, patch=_skip_rank_check),
    _fault("perturb_output", "the model's output on rank 0's first micro-batch is off by 1% of its max",
           # the lifecycle's own training is not perturbed, so resuming from it differs too
           {"output", "input_grad", "grad", "grad_norm", "trajectory", "divergence", "checkpoint.same",
            "checkpoint.cross"}, _KDA2,
           site="sharded", hook=_perturb_output, scopes=_MAIN),
    _fault("rename_param", "a parameter is renamed after training", {"names", "identity", "dtype.storage"}, _KDA2,
           site="trained", hook=_rename, scopes=_MAIN),
    _fault("replace_param", "a parameter object is replaced after training", {"identity"}, _KDA2,
           site="trained", hook=_replace, scopes=_MAIN),
    _fault("cast_storage", "a parameter's storage is cast after training", {"dtype.storage"}, _KDA2,
           site="trained", hook=_cast_storage, scopes=_MAIN),
    _fault("crash", "the last rank exits with code 17", {"run"}, _KDA2, site="start", hook=_crash, scopes=_MAIN),
    _fault("hang", "every rank sleeps forever", {"run"}, _KDA2, site="start", hook=_hang, scopes=_MAIN),
    _fault("raise", "every rank raises RuntimeError", {"run"}, _KDA2, site="start", hook=_raise, scopes=_MAIN),
)}


def check_faults(names) -> tuple[str, ...]:
    for name in names:
        if name not in FAULTS:
            raise UsageError(f"--fault: unknown value {name!r}; valid: {', '.join(FAULTS)}")
    return tuple(names)


class Injector:
    """The faults of one cell on one rank: patches per scope, hooks per site."""

    def __init__(self, names, *, rank: int, world: int):
        self.faults = [FAULTS[n] for n in names]
        self.rank, self.world = rank, world
        self.scope: str | None = None

    @contextlib.contextmanager
    def active(self, scope: str) -> Iterator[None]:
        """Patches of the faults active in ``scope``; hooks fire only inside their scopes."""
        undo = [f.patch() for f in self.faults if f.patch is not None and scope in f.scopes]
        outer, self.scope = self.scope, scope
        try:
            yield
        finally:
            self.scope = outer
            for u in reversed(undo):
                u()

    def site(self, name: str, value=None, **context):
        for f in self.faults:
            if f.site == name and self.scope in f.scopes:
                value = f.hook(value, rank=self.rank, world=self.world, **context)
        return value
