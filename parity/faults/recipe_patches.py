"""Faults only one training configuration reveals (meta-device init, activation checkpointing
around units, uneven shards, unused parameters, a freeze change, float16, clipping, evaluation
forwards, state dicts, no-sync windows, backward re-gathers): each breaks FSDP,
DCP or the gradient scaler the way a real bug there would. Registered in
:data:`parity.faults.FAULTS` with the axis values under which they must stay silent."""

from __future__ import annotations

import contextlib

import torch

from parity.faults.patches import after_each_gather, fsdp_classes, swap_attr


def recompute_skips_input_cast():
    """FSDP's pre-forward during an activation-checkpoint recompute (the unit already in
    PRE_BACKWARD) unshards but returns the inputs uncast, as FSDP2 once did."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    def make(orig):
        def _pre_forward(self, module, args, kwargs):
            if self._training_state != TrainingState.PRE_BACKWARD:
                return orig(self, module, args, kwargs)
            cast = self._cast_forward_inputs
            self._cast_forward_inputs = lambda a, k: (a, k)
            try:
                return orig(self, module, args, kwargs)
            finally:
                self._cast_forward_inputs = cast
        return _pre_forward
    return swap_attr(fsdp_classes()[1], "_pre_forward", make)


def meta_init_misplaced_shard():
    """Loading a full state dict into a meta-initialized sharded model gives rank 1 rank 0's
    rows of the first sharded parameter (a scatter offset bug in the loader)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from torch.distributed.checkpoint import state_dict as dcp_state_dict

    def make(orig):
        def set_model_state_dict(model, state, **kwargs):
            name, param = next((n, p) for n, p in model.named_parameters() if isinstance(p, DTensor))
            full = state[name].detach().clone()  # the loader turns the dict's values into shards
            out = orig(model, state, **kwargs)
            local = param.to_local()
            if dist.get_rank() == 1 and local.shape[0]:
                with torch.no_grad():
                    local.copy_(full[: local.shape[0]].to(local.dtype))
            return out
        return set_model_state_dict
    return swap_attr(dcp_state_dict, "set_model_state_dict", make)


def uneven_grad_row():
    """For unevenly sharded parameters the reduce-scatter output is unpadded one row short
    on the last rank: its last real gradient row is left zero (FSDPParam.to_sharded_dtensor
    as foreach_reduce calls it)."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    reducing: list[bool] = []

    def to_dtensor(orig):
        def to_sharded_dtensor(self, tensor):
            world = dist.get_world_size()
            if reducing and self._orig_size[0] % world and dist.get_rank() == world - 1 and tensor.shape[0]:
                tensor = tensor.clone()
                tensor[-1].zero_()
            return orig(self, tensor)
        return to_sharded_dtensor

    def reduce(orig):
        def foreach_reduce(*args, **kwargs):
            reducing.append(True)
            try:
                return orig(*args, **kwargs)
            finally:
                reducing.pop()
        return foreach_reduce
    undo = [swap_attr(fsdp_classes()[0], "to_sharded_dtensor", to_dtensor),
            swap_attr(_fsdp_param_group, "foreach_reduce", reduce)]
    return lambda: [u() for u in reversed(undo)]


def unused_drops_accumulated():
    """With unused-parameter reduction on, a parameter that got no gradient in the micro-batch
    that synchronizes is reduced as zero, dropping what earlier micro-batches accumulated
    without synchronization (FSDPParamGroup._get_unsharded_grad_to_reduce)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    def forward(orig):
        def pre_forward(self, *args, **kwargs):
            self._parity_seen = None  # the next backward's first pre-backward records
            return orig(self, *args, **kwargs)
        return pre_forward

    def pre(orig):
        def pre_backward(self, *args, **kwargs):
            # once per backward: a unit whose output holds two tensors that need gradients (a
            # model returning its hidden states beside its logits) gets its pre-backward again
            # midway, after some of its gradients were written
            if getattr(self, "_parity_seen", None) is None:
                self._parity_seen = {
                    id(fp): (id(g), g._version) for fp in self.fsdp_params
                    if hasattr(fp, "_unsharded_param") and (g := fp.unsharded_param.grad) is not None
                }
            return orig(self, *args, **kwargs)
        return pre_backward

    def get(orig):
        def _get_unsharded_grad_to_reduce(self, param):
            g = param.unsharded_param.grad if hasattr(param, "_unsharded_param") else None
            seen = (getattr(self, "_parity_seen", None) or {}).get(id(param))
            if g is not None and seen == (id(g), g._version) and self.reduce_scatter_unused_params:
                return param.unsharded_zero_grad_data  # untouched this backward: treated as unused
            return orig(self, param)
        return _get_unsharded_grad_to_reduce
    undo = [swap_attr(FSDPParamGroup, "pre_forward", forward), swap_attr(FSDPParamGroup, "pre_backward", pre),
            swap_attr(FSDPParamGroup, "_get_unsharded_grad_to_reduce", get)]
    return lambda: [u() for u in reversed(undo)]


def unfrozen_stays_frozen():
    """FSDP keeps each unsharded parameter's requires_grad as it was at the first all-gather:
    parameters unfrozen later never get a gradient (_fsdp_param.set_requires_grad_if_needed)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    return swap_attr(_fsdp_param, "set_requires_grad_if_needed", lambda orig: lambda src, dst: None)


def scaler_skips_dtensor():
    """The gradient scaler unscales plain gradients only: sharded (DTensor) gradients keep the
    loss scale (ShardedGradScaler._unscale_grads_)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from torch.distributed.tensor import DTensor

    def make(orig):
        def _unscale_grads_(self, optimizer, *args, **kwargs):
            hidden = [(p, p.grad) for g in optimizer.param_groups for p in g["params"] if isinstance(p.grad, DTensor)]
            for p, _ in hidden:
                p.grad = None
            try:
                return orig(self, optimizer, *args, **kwargs)
            finally:
                for p, grad in hidden:
                    p.grad = grad
        return _unscale_grads_
    return swap_attr(ShardedGradScaler, "_unscale_grads_", make)


def clip_local_norm():
    """Clipping scales each rank's gradient shards by a coefficient from that rank's own shards'
    norm, not the global norm it was given (a DTensor norm left un-reduced): the shards of one
    gradient are scaled differently. A max-norm above every norm clips nothing either way."""
    from torch.distributed.tensor import DTensor

    def make(orig):
        def clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
            params = list(parameters)
            local = [p.grad.to_local() for p in params if isinstance(p.grad, DTensor)]
            if local:
                total_norm = torch.nn.utils.get_total_norm(local)
            return orig(params, max_norm, total_norm, foreach)
        return clip_grads_with_norm_
    return swap_attr(torch.nn.utils, "clip_grads_with_norm_", make)


def decay_frozen():
    """AdamW applies its decoupled weight decay to every parameter of a group, those without a
    gradient (frozen) included. A BF16 frozen weight rounds back to itself (lr x wd = 1e-5 is
    below half its ulp); an FP32 one moves."""

    def make(orig):
        def step(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            with torch.no_grad():
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is None:
                            p.mul_(1 - group["lr"] * group["weight_decay"])
            return out
        return step
    return swap_attr(torch.optim.AdamW, "step", make)


def adamw_step_shared():
    """AdamW's per-parameter step counters are one tensor: each step advances it once per
    parameter, and every parameter's bias correction runs ahead of the steps it has taken."""

    def make(orig):
        def step(self, *args, **kwargs):
            counters = [st for st in self.state.values() if "step" in st]
            for st in counters[1:]:
                st["step"] = counters[0]["step"]
            return orig(self, *args, **kwargs)
        return step
    return swap_attr(torch.optim.AdamW, "step", make)


def _param_group():
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    return FSDPParamGroup


@contextlib.contextmanager
def _reshard_skipped(group):
    """``group.reshard()`` frees nothing while open (an instance attribute shadows the method)."""
    group.reshard = lambda: None
    try:
        yield
    finally:
        del group.reshard


def eval_skips_reshard():
    """FSDP's post-forward reshards only when gradients are enabled: a no_grad (evaluation)
    forward leaves every unit unsharded whatever ``reshard_after_forward`` says, so the memory
    an evaluation loop frees is never freed (the next training forward is unaffected)."""

    def make(orig):
        def post_forward(self, module, input, output):
            if torch.is_grad_enabled():
                return orig(self, module, input, output)
            with _reshard_skipped(self):
                return orig(self, module, input, output)
        return post_forward
    return swap_attr(_param_group(), "post_forward", make)


def post_backward_keeps_gathered():
    """FSDP's post-backward frees nothing: every unit stays gathered after its backward, so the
    next micro-batch's forward gathers nothing (the same weights, until the optimizer step) and
    a step's first forward computes with the weights from before the optimizer step unless
    something else resharded them (a state dict's pre-save hook)."""

    def make(orig):
        def post_backward(self, *args, **kwargs):
            with _reshard_skipped(self):
                return orig(self, *args, **kwargs)
        return post_backward
    return swap_attr(_param_group(), "post_backward", make)


def eval_stale_after_step():
    """A no_grad forward reads the unsharded parameters of the last training forward instead of
    all-gathering the current shards (a stale unsharded cache): an evaluation right after the
    optimizer step sees the weights before it; between micro-batches nothing has changed yet."""
    last: dict[int, torch.Tensor] = {}

    def make_post(orig):
        def post_forward(self, module, input, output):
            if torch.is_grad_enabled():
                for fp in self.fsdp_params:
                    last[id(fp)] = fp.unsharded_param.detach().clone()
            return orig(self, module, input, output)
        return post_forward

    def make_pre(orig):
        def pre_forward(self, module, args, kwargs):
            out = orig(self, module, args, kwargs)
            if not torch.is_grad_enabled():
                with torch.no_grad():
                    for fp in self.fsdp_params:
                        if id(fp) in last:
                            fp.unsharded_param.copy_(last[id(fp)])
            return out
        return pre_forward
    undo = [swap_attr(_param_group(), "post_forward", make_post), swap_attr(_param_group(), "pre_forward", make_pre)]
    return lambda: [u() for u in reversed(undo)]


def frozen_unit_reduces_bf16():
    """A unit whose parameters are all frozen at its first forward (lazy init) fixes its reduce
    dtype to ``param_dtype``: after the recipe unfreezes it, its gradients are reduced in BF16
    (FSDPParamGroup._init_mp_dtypes, as a reported FSDP2 bug did)."""

    import dataclasses

    def make(orig):
        def _init_mp_dtypes(self):
            if any(p.sharded_param.requires_grad for p in self.fsdp_params):
                return orig(self)
            policies = [p.mp_policy for p in self.fsdp_params]
            for p in self.fsdp_params:  # resolved as if the policy reduced in param_dtype
                p.mp_policy = dataclasses.replace(p.mp_policy, reduce_dtype=p.mp_policy.param_dtype)
            try:
                return orig(self)
            finally:
                for p, policy in zip(self.fsdp_params, policies):
                    p.mp_policy = policy
        return _init_mp_dtypes
    return swap_attr(_param_group(), "_init_mp_dtypes", make)


def state_dict_skips_reshard():
    """FSDP registers no state-dict pre-save hook (FSDPParamGroup._register_state_dict_hooks):
    a state dict taken while a unit is unsharded -- between a forward and its backward with
    reshard off, or after an evaluation forward -- holds the unsharded parameters in their
    compute dtype instead of the sharded FP32 masters."""

    def make(orig):
        def _register_state_dict_hooks(self):
            return None
        return _register_state_dict_hooks
    return swap_attr(_param_group(), "_register_state_dict_hooks", make)


def early_reduce_scatter():
    """Inside a ``set_requires_gradient_sync(False)`` window FSDP's post-backward still issues a
    reduce-scatter (of a zero buffer it then drops): numerically invisible, one wasted collective
    per unit and micro-batch -- what the accumulation window exists to avoid."""
    import torch.distributed as dist

    def make(orig):
        def post_backward(self, *unused):
            out = orig(self, *unused)
            if not self.reduce_grads and self._reduce_scatter_process_group.size() > 1:
                group = self._reduce_scatter_process_group
                on = self.device  # NCCL takes tensors on the group's device
                scratch = torch.zeros(group.size(), dtype=torch.float32, device=on)
                dist.reduce_scatter_tensor(torch.zeros(1, device=on), scratch, group=group)
            return out
        return post_backward
    return swap_attr(_param_group(), "post_backward", make)


def eval_skips_output_cast():
    """Under ``no_grad`` FSDP returns the outermost unit's output uncast (FSDPState._cast_output_dtype):
    an evaluation forward's output keeps the compute dtype whatever ``output_dtype`` asks for."""
    from parity.faults.patches import fsdp_classes

    def make(orig):
        def _cast_output_dtype(self, output):
            return orig(self, output) if torch.is_grad_enabled() else output
        return _cast_output_dtype
    return swap_attr(fsdp_classes()[1], "_cast_output_dtype", make)


def window_replays_accumulation():
    """Inside a no-sync window FSDP adds a unit's unsharded gradients to themselves once more after
    a micro-batch's backward (a replayed accumulation, FSDPParamGroup._set_unsharded_grad_dtypes):
    the window holds twice what its micro-batches computed, and the reduction sends that."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    def make(orig):
        def _set_unsharded_grad_dtypes(self, defer_upcast):
            orig(self, defer_upcast)
            if self.reduce_grads:
                return
            for fsdp_param in self.fsdp_params:
                param = getattr(fsdp_param, "_unsharded_param", None)
                if param is not None and param.grad is not None:
                    param.grad.add_(param.grad)
        return _set_unsharded_grad_dtypes
    return swap_attr(FSDPParamGroup, "_set_unsharded_grad_dtypes", make)


def backward_gather_stale():
    """FSDP's backward all-gather hands compute the values its first backward gathered (a copy-out
    buffer reused across steps, FSDPParamGroup.wait_for_unshard): every step after the first
    computes its gradients with the initial weights while its forward reads the current ones.
    With reshard off nothing is gathered again in backward."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    def stale(group):
        if group._training_state != TrainingState.PRE_BACKWARD:
            return
        first = group.__dict__.setdefault("_parity_first_backward", {})
        for fsdp_param in group.fsdp_params:
            unsharded = fsdp_param.unsharded_param
            if id(fsdp_param) in first:
                unsharded.data.copy_(first[id(fsdp_param)])
            else:
                first[id(fsdp_param)] = unsharded.detach().clone()
    return after_each_gather(stale)


def scheduler_counts_ahead():
    """``LambdaLR`` takes each step's factor one step early (``lr_lambda(last_epoch + 1)``): every
    rate is the next step's, the first step's included."""
    from torch.optim.lr_scheduler import LambdaLR

    def make(orig):
        def get_lr(self):
            return [base * fn(self.last_epoch + 1) for fn, base in zip(self.lr_lambdas, self.base_lrs)]
        return get_lr
    return swap_attr(LambdaLR, "get_lr", make)


def scheduler_steps_before_optimizer():
    """The recipe moves its scheduler on right before each optimizer step (a hook on the
    optimizer) instead of after it: every step takes the next step's rate, while the rate the
    scheduler leaves after the step is the one it should leave."""
    from torch.optim.lr_scheduler import LambdaLR

    real, inside = LambdaLR.step, []

    @contextlib.contextmanager
    def stepping():  # the scheduler's own steps run; the recipe's call after the optimizer step does not
        inside.append(True)
        try:
            yield
        finally:
            inside.pop()

    def step(self, *args, **kwargs):
        return real(self, *args, **kwargs) if inside else None

    def before(sched):
        with stepping():
            real(sched)

    def make(orig):
        def __init__(self, optimizer, *args, **kwargs):
            with stepping():  # the scheduler's own first step sets the starting rate
                orig(self, optimizer, *args, **kwargs)
            optimizer.register_step_pre_hook(lambda opt, a, k: before(self))
        return __init__
    undo_init = swap_attr(LambdaLR, "__init__", make)
    undo_step = swap_attr(LambdaLR, "step", lambda orig: step)
    return lambda: (undo_step(), undo_init())
