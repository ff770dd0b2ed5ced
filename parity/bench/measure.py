"""Worker side of ``parity bench``: one cell's training step, measured on one rank.

- **collectives**: every collective FSDP (and the step around it) issues during one measured
  step, counted where it is issued (``torch.distributed.all_gather_single``,
  ``reduce_scatter_single``, ``all_reduce``, ...), by kind and phase: ``forward`` (outside
  autograd's backward), ``backward`` (inside it: re-gathers and reductions launched there),
  ``after`` (the rest: the final reduction, an ignored parameter's owner). Bytes are the
  larger buffer of each call (all-gather output, reduce-scatter input, all-reduce tensor).
  DTensor's functional collectives (the gradient norm's all-reduce) bypass these functions
  and are not counted.
- **packing**: CPU time the profiler records in FSDP's copy-in / copy-out / chunk-cat ops
  (``fsdp::all_gather_copy_in``, ``fsdp::split_with_sizes_copy``, ``fsdp::chunk_cat*``) over
  one profiled step;
- **memory**: on CUDA ``max_memory_allocated`` / ``max_memory_reserved`` after a reset; on
  CPU the profiler's allocation records over one step (bytes allocated, a sum, not a peak)
  and the process's peak RSS (interpreter and torch included): labelled as such;
- **step time**: ``warmup`` unmeasured steps, then ``steps`` steps, each between barriers
  (and ``cuda.synchronize``).
"""

from __future__ import annotations

import resource
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parity.execute import collectives
from parity.execute.observation import Observation
from parity.execute.training import build, train_step
from parity.faults import Injector
from parity.matrix.cell import Cell

#: Profiler op names that are FSDP's packing (copy into / out of the collective buffers).
PACKING = ("fsdp::all_gather_copy_in", "fsdp::split_with_sizes_copy", "fsdp::chunk_cat")


@dataclass(frozen=True, kw_only=True)
class BenchTask:
    cell: Cell
    warmup: int = 2
    steps: int = 10

    def run_on_rank(self, task, **kwargs) -> "BenchResult":
        """What a rank-pool worker calls (the pool knows cells, not benchmarks)."""
        return measure_rank(task, **kwargs)


@dataclass(kw_only=True)
class BenchResult:
    rank: int
    taken: str = ""
    units: int = 0
    collectives: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    """(kind, phase) -> [count, bytes] over one step."""
    packing_s: dict[str, float] = field(default_factory=dict)
    step_s: list[float] = field(default_factory=list)
    memory: dict[str, float] = field(default_factory=dict)


def _phase() -> str:
    if torch._C._current_graph_task_id() != -1:
        return "backward"
    return "forward" if _in_forward[0] else "after"


_in_forward = [False]


def counting(calls: dict):
    """Collectives by (kind, phase), each call's bytes (:func:`parity.execute.collectives.counting`)."""
    return collectives.counting(calls, lambda kind: (kind, _phase()))


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    if dist.get_world_size() > 1:
        dist.barrier()


class _ForwardMarker:
    """Marks the model's forward so collectives there count as ``forward``."""

    def __init__(self, model):
        # prepended: the root's own pre-forward (its all-gather) runs after this one
        self.handles = [model.register_forward_pre_hook(lambda m, a: _in_forward.__setitem__(0, True), prepend=True),
                        model.register_forward_hook(lambda m, a, o: _in_forward.__setitem__(0, False))]

    def remove(self):
        for h in self.handles:
            h.remove()


def measure_rank(task: BenchTask, *, rank: int, world: int, mesh, device, heartbeat=lambda what: None) -> BenchResult:
    cell = task.cell
    inject = Injector((), rank=rank, world=world)
    s = build(cell, cell.path, mesh=mesh, device=device, inject=inject)
    out = BenchResult(rank=rank, taken=s.report.taken, units=len(s.report.units))
    obs = Observation(rank=rank)

    def step(k: int) -> None:
        train_step(cell, s, k, rank=rank, world=world, device=device, obs=obs)
        obs.outputs.clear(), obs.input_grads.clear(), obs.grads.clear(), obs.reduced.clear(), obs.params.clear()
        obs.lrs.clear()

    for k in range(task.warmup):
        step(k)
        heartbeat(f"warm-up {k}")
    for k in range(task.steps):
        _sync(device)
        t0 = time.perf_counter()
        step(task.warmup + k)
        _sync(device)
        out.step_s.append(time.perf_counter() - t0)
        heartbeat(f"step {k}")
    marker = _ForwardMarker(s.model)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    from torch.profiler import ProfilerActivity, profile

    calls: dict = {}
    with counting(calls), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(task.warmup + task.steps)
    out.collectives = collectives.totals(calls)
    marker.remove()
    for ev in prof.key_averages():
        if ev.key.startswith(PACKING):
            out.packing_s[ev.key] = out.packing_s.get(ev.key, 0.0) + ev.cpu_time_total / 1e6
    if cuda:
        out.memory = {"cuda max_memory_allocated MiB": torch.cuda.max_memory_allocated() / 2**20,
                      "cuda max_memory_reserved MiB": torch.cuda.max_memory_reserved() / 2**20}
    else:
        allocated = sum(max(ev.cpu_memory_usage, 0) for ev in prof.events() if ev.cpu_memory_usage)
        out.memory = {"cpu profiler allocations in one step MiB (sum, not a peak)": allocated / 2**20,
                      "cpu process peak RSS MiB (interpreter and torch included)":
                          resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    heartbeat("measured")
    return out


def collective_totals(results: list[BenchResult]) -> Counter:
    """Rank 0's counts (every rank issues the same collectives)."""
    return Counter({k: v[0] for k, v in results[0].collectives.items()})
