"""Faults in the checkpoint lifecycle: DCP's state-dict helpers and what FSDP does while a
checkpoint is saved or loaded."""

from __future__ import annotations

import torch

from parity.faults.patches import swap_attr


def step_counter_restarts():
    """Loading an optimizer state dict restarts every parameter's AdamW ``step`` at 1 (a loader
    that rebuilds the counter instead of restoring it): bias correction after the resume is that
    of step 1. A checkpoint saved after one step holds 1 anyway: only a later resume shows it."""
    from torch.distributed.checkpoint import state_dict as sd

    def make(orig):
        def set_state_dict(model, optimizers, **kwargs):
            out = orig(model, optimizers, **kwargs)
            for state in optimizers.state.values():
                if "step" in state:
                    state["step"] = torch.ones_like(state["step"]) if isinstance(state["step"], torch.Tensor) else 1
            return out
        return set_state_dict
    return swap_attr(sd, "set_state_dict", make)


def load_keeps_live_hyperparameters():
    """Setting a loaded optimizer state dict restores each parameter's state but leaves the
    optimizer's param groups (lr, betas, eps, weight decay) as they were: a resumed job trains
    with whatever the fresh optimizer held. The same recipe's fresh optimizer holds the same
    values, so only hyperparameters blanked before the load show it."""
    from torch.distributed.checkpoint import state_dict as sd

    def make(orig):
        def set_state_dict(model, optimizers, **kwargs):
            kept = [{k: v for k, v in group.items() if k != "params"} for group in optimizers.param_groups]
            out = orig(model, optimizers, **kwargs)
            for group, values in zip(optimizers.param_groups, kept):
                group.update(values)
            return out
        return set_state_dict
    return swap_attr(sd, "set_state_dict", make)


def load_splits_gather_input():
    """After a load, each parameter FSDP manages holds a new local shard while FSDP's all-gather
    input stays the old one (``FSDPParam.reset_sharded_param`` does nothing, neither after the
    load nor at the lazy init that would re-point it): the load wrote the old storage, so the
    resumed step gathers the loaded values; the optimizer then steps the new shard, and every
    later all-gather hands compute the stale loaded values."""
    from torch.distributed.checkpoint import state_dict as sd

    from parity.paths.apply import fsdp_params

    def make(orig):
        def set_state_dict(model, optimizers, **kwargs):
            out = orig(model, optimizers, **kwargs)
            for _, fsdp_param in fsdp_params(model):
                sharded = fsdp_param.sharded_param
                sharded._local_tensor = sharded._local_tensor.clone()
                fsdp_param.reset_sharded_param = lambda: None
            return out
        return set_state_dict
    return swap_attr(sd, "set_state_dict", make)


def load_keeps_zero_grads():
    """DCP's helper that creates a fresh optimizer's state (one step of zero gradients at learning
    rate 0) never frees the zero gradients: every parameter holds a full gradient from load time
    on. Numerically invisible -- the next backward adds to zeros -- memory the job never asked for."""
    from torch.distributed.checkpoint import state_dict as sd

    def make(orig):
        def init(optim):
            optim.zero_grad = lambda set_to_none=True: None
            try:
                return orig(optim)
            finally:
                del optim.zero_grad
        return init
    return swap_attr(sd, "_init_optim_state", make)


def load_regathers():
    """After loading a sharded state dict, every FSDP unit is all-gathered and resharded (a loader
    that refreshes the unsharded parameters from the loaded shards): numerically invisible --
    the shards hold what was loaded either way -- one all-gather per unit and the memory of an
    unsharded unit at load time, which a sharded checkpoint exists to avoid."""
    from torch.distributed.checkpoint import state_dict as sd
    from torch.distributed.fsdp import FSDPModule

    def make(orig):
        def set_state_dict(model, optimizers, **kwargs):
            out = orig(model, optimizers, **kwargs)
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.unshard()
                    module.reshard()
            return out
        return set_state_dict
    return swap_attr(sd, "set_state_dict", make)


def load_reads_tensors_only():
    """DCP's load plans reads for tensor entries only: every other entry (the optimizer's
    hyperparameters, a scaler's state) keeps what the destination held. A fresh optimizer of the
    same recipe holds the same values, so only a destination blanked before the load shows it."""
    from torch.distributed.checkpoint import default_planner
    from torch.distributed.checkpoint.planner import LoadItemType

    def make(orig):
        def create_local_plan(self):
            plan = orig(self)
            plan.items = [i for i in plan.items if i.type != LoadItemType.BYTE_IO]
            return plan
        return create_local_plan
    return swap_attr(default_planner.DefaultLoadPlanner, "create_local_plan", make)


def resharded_read_at_zero():
    """DCP reads every chunk of a resharded load at offset 0: a saved shard lands at the start
    of its destination and a destination reads the start of its saved shard
    (``narrow_tensor_by_index`` without the offsets). A load on the layout it was saved from
    reads whole chunks (offsets 0) and is unaffected."""
    from torch.distributed.checkpoint import default_planner, filesystem

    def make(orig):
        def narrow(tensor, offsets, sizes):
            return orig(tensor, torch.Size([0] * len(offsets)), sizes)
        return narrow
    undo = [swap_attr(default_planner, "narrow_tensor_by_index", make),
            swap_attr(filesystem, "narrow_tensor_by_index", make)]
    return lambda: [u() for u in reversed(undo)]


def save_rounds_moments():
    """DCP's save planner hands the writer every optimizer moment rounded to BF16 (a writer that
    narrows floating-point state to save space): the training state is right, the checkpoint is
    not, and a run resumed from it steps from rounded moments."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    def make(orig):
        def resolve_data(self, write_item):
            data = orig(self, write_item)
            fqn = write_item.index.fqn
            if isinstance(data, torch.Tensor) and fqn.startswith("optim.state.") and data.is_floating_point() \
                    and not fqn.endswith(".step"):
                return data.to(torch.bfloat16).to(data.dtype)
            return data
        return resolve_data
    return swap_attr(DefaultSavePlanner, "resolve_data", make)


#: Models the checkpoint lifecycle built since its scope opened (:func:`owner_reduces_to_rank0`).
_BUILT = [0]


def owner_reduces_to_rank0():
    """After resuming, the owner of FSDP-ignored parameters reduces their gradients to rank 0
    only (``dist.reduce`` where ``all_reduce`` was meant): rank 0 steps with the reduced
    gradient, every other rank with what its buffer holds, and the replicas part -- only
    another rank than rank 0 shows it. The lifecycle's first model (the one that trains and
    saves) reduces as it should; :func:`loaded_models_marked` marks the ones built to load."""
    import torch.distributed as dist

    from parity.execute import parallel

    _BUILT[0] = 0

    def make(orig):
        def owner_reduce(p, **kwargs):
            if not getattr(p, "_parity_reduce_to_first", False):
                return orig(p, **kwargs)
            real = dist.all_reduce

            def to_first(t, group=None, **rest):
                return dist.reduce(t, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
            dist.all_reduce = to_first
            try:
                return orig(p, **kwargs)
            finally:
                dist.all_reduce = real
        return owner_reduce
    return swap_attr(parallel, "owner_reduce", make)


def loaded_models_marked(value, rank: int, world: int, model, **_):
    """At each sharded model of the lifecycle: every model after the first is one a checkpoint
    loads into; its parameters take :func:`owner_reduces_to_rank0`'s faulty reduction."""
    _BUILT[0] += 1
    if _BUILT[0] > 1:
        for p in model.parameters():
            p._parity_reduce_to_first = True
    return value


def save_narrows_live_moments():
    """DCP's save, after writing, leaves the live optimizer moments rounded to BF16 (a writer that
    narrows state it already wrote, to free memory): the checkpoint is right, the job that
    trains on after saving is not -- and every run resumed from the files looks fine."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    def make(orig):
        def save(state_dict, *args, **kwargs):
            out = orig(state_dict, *args, **kwargs)
            for entry in state_dict.get("optim", {}).get("state", {}).values():
                for key, t in entry.items():
                    local = t.to_local() if isinstance(t, DTensor) else t
                    if key != "step" and isinstance(local, torch.Tensor) and local.is_floating_point():
                        with torch.no_grad():
                            local.copy_(local.to(torch.bfloat16))
            return out
        return save
    return swap_attr(dcp, "save", make)


def scheduler_load_ignored():
    """Loading a learning-rate scheduler's state dict keeps the fresh scheduler's (a recipe whose
    checkpoint restores the model and optimizer but not its scheduler): the optimizer's param groups
    carry the resumed step's rate across the load, so the step itself is right, and every rate
    after it restarts from the schedule's start."""
    from torch.optim.lr_scheduler import LambdaLR

    def make(orig):
        def load_state_dict(self, state_dict):
            return None
        return load_state_dict
    return swap_attr(LambdaLR, "load_state_dict", make)
