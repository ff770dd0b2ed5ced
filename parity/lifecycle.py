"""Contracts that need their own models (worker side): FP32 markers across a device move,
optimizer state by FQN, and the DCP checkpoint lifecycle (save, load into the same and the
other path, resume)."""

from __future__ import annotations

import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from parity.cellspec import Cell
from parity.dtypes import dtype_name
from parity.errors import IsolationError
from parity.fixture import get_fixture
from parity.markers import _MARK_ATTR, convert_except_marked, fp32_marked
from parity.plan import canonical_fqn


def _move(model: nn.Module, device) -> None:
    """A real device move on accelerators; on CPU, ``_apply`` with a copy, which replaces
    buffer objects exactly as a CPU->GPU move does."""
    if torch.device(device).type == "cpu":
        model._apply(lambda t: t.clone())
    else:
        model.to(device)


def marker_contract(cell: Cell, device, faults: frozenset[str]) -> dict:
    """Mark (fixture-declared), move, convert to BF16; report each marked tensor's dtype."""
    model = get_fixture(cell.fixture).make(cell.seed)
    marked = sorted(fp32_marked(model))
    naive = "lose_buffer_marker" in faults
    if naive:  # the naive alternative: a flag on the tensor itself
        tensors = dict(model.named_parameters()) | dict(model.named_buffers())
        for name in marked:
            tensors[name]._keep_fp32 = True
        for sub in model.modules():
            sub.__dict__.pop(_MARK_ATTR, None)
    _move(model, device)
    if naive:
        for _prefix, sub in model.named_modules():
            for local, t in list(sub._parameters.items()) + list(sub._buffers.items()):
                if t is not None and getattr(t, "_keep_fp32", False):
                    sub.__dict__.setdefault(_MARK_ATTR, set()).add(local)
    survived = fp32_marked(model)
    convert_except_marked(model, torch.bfloat16)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    return {
        name: {"after_move": name in survived, "dtype": dtype_name(tensors[name].dtype),
               "kind": "buffer" if name in dict(model.named_buffers()) else "param"}
        for name in marked
    }


def _local(t):
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.detach().cpu().clone() if isinstance(t, torch.Tensor) else t


def optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict]:
    """FQN -> {state key: local tensor or value}, as DCP's state-dict helpers map it."""
    _, osd = get_state_dict(model, opt)
    return {canonical_fqn(k): {sk: _local(v) for sk, v in st.items()} for k, st in osd["state"].items()}


def _swap_first_two_same_shape(opt: torch.optim.Optimizer) -> None:
    params = [p for p in opt.state if "exp_avg" in opt.state[p]]
    for i, a in enumerate(params):
        for b in params[i + 1:]:
            if a.shape == b.shape:
                opt.state[a], opt.state[b] = opt.state[b], opt.state[a]
                return


def misfile_state(opt: torch.optim.Optimizer) -> None:
    """Fault: file one parameter's state under a parameter of another shape (position bug)."""
    params = [p for p in opt.state if "exp_avg" in opt.state[p]]
    a = params[0]
    b = next(p for p in params if p.shape != a.shape)
    opt.state[b] = opt.state.pop(a)


#: Steps 0..RESUME_STEP-1 run before the checkpoint; step RESUME_STEP runs after loading it.
RESUME_STEP = 1


def resume(cell: Cell, *, rank: int, world: int, mesh, device, faults: frozenset[str]) -> dict:
    """Train ``RESUME_STEP`` steps, save (DCP); load into a fresh model on the same and on
    the other path; train one more step. What each resumed run saw is compared with the
    uninterrupted run's same step."""
    from parity.cell import Observation, build, train_step

    other = "native" if cell.path == "legacy" else "legacy"
    quiet = faults - {"perturb_output", "perturb_input_grad", "perturb_grad", "scale_grad_norm", "perturb_param"}
    ckpt_dir = [tempfile.mkdtemp(prefix="parity-dcp-") if rank == 0 else None]
    if world > 1:
        dist.broadcast_object_list(ckpt_dir, src=0)
    out: dict[str, dict] = {}
    try:
        first = build(cell, cell.path, rank=rank, mesh=mesh, device=device, faults=quiet)
        for step in range(RESUME_STEP):
            train_step(cell, first, step, rank=rank, world=world, device=device, faults=quiet, obs=Observation(rank=rank))
        msd, osd = get_state_dict(first.model, first.opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt_dir[0])
        for target in (cell.path, other):
            try:
                s = build(cell, target, rank=rank, mesh=mesh, device=device, faults=quiet)
            except IsolationError as exc:
                out[target] = {"skip": f"{target} cannot shard this fixture: {exc}"}
                continue
            msd, osd = get_state_dict(s.model, s.opt)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=ckpt_dir[0])
            set_state_dict(s.model, s.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            if "swap_optimizer_state" in faults:
                _swap_first_two_same_shape(s.opt)
            obs = Observation(rank=rank)
            train_step(cell, s, RESUME_STEP, rank=rank, world=world, device=device, faults=quiet, obs=obs)
            out[target] = {"taken": s.report.taken, "grads": obs.grads[0], "params": obs.params[0],
                           "optim": optimizer_state(s.model, s.opt)}
    finally:
        if world > 1:
            dist.barrier()
        if rank == 0:
            shutil.rmtree(ckpt_dir[0], ignore_errors=True)
    return out
