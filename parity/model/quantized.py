"""Quantized weight groups on CPU: an FP32 main weight whose FSDP2 all-gather carries FP8.

:class:`QuantizedWeight` wraps the FP32 main weight (what the optimizer steps and
checkpoints hold) and implements FSDP2's all-gather extension, the mechanism torchao's
float8 training uses:

- ``fsdp_pre_all_gather``: the local shard, quantized (E4M3, :mod:`parity.model.formats`) --
  once per version of the main weight, so once per optimizer step however many all-gathers
  the step issues (reshard, activation recompute). Tensorwise scales come from the *global*
  amax (an all-reduce MAX over the shard group); MX exponents (E8M0, one byte per block) are
  all-gathered beside the elements. Inputs have the padded shard size (uneven shards).
- ``fsdp_post_all_gather``: the dequantized unsharded weight in the compute dtype.

Every all-gather is recorded (:class:`GatherStats`) for the ``quant.*`` contracts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from parity.digests import value_sha256
from parity.model import formats as F
from parity.model.dtypes import dtype_name

aten = torch.ops.aten
#: Ops whose outputs stay wrapped: what FSDP2 does to a parameter while sharding it (chunk,
#: pad with new_zeros, narrow, copy) and views of it; any other op returns plain tensors.
_KEEP = {aten.split.Tensor, aten.split_with_sizes.default, aten.slice.Tensor, aten.new_zeros.default,
         aten.copy_.default, aten.view.default, aten.as_strided.default, aten.empty_like.default,
         aten._to_copy.default, aten.clone.default, aten.alias.default, aten.detach.default}


#: Per main-weight storage (every wrapper aliasing it: FSDP's shard, the DTensor's local view,
#: the optimizer's): how often it was written, and what its all-gathers did this step. Inside
#: ``__torch_dispatch__`` autograd's version counters do not move, so writes are counted here.
_VERSIONS: dict[int, int] = {}
_STATS: dict[int, GatherStats] = {}


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@dataclass(kw_only=True)
class GatherStats:
    """What one rank saw of one weight during one optimizer step."""

    quantized: int = 0
    """Quantizations of the main weight (expected: 1 per step)."""
    gathers: int = 0
    stale: int = 0
    """All-gathers that sent a quantization of an older main weight than the current one."""
    payload: list[str] = field(default_factory=list)
    """``dtype:bytes`` of what this rank contributed per all-gather (elements, then exponents)."""
    scales: list[float] = field(default_factory=list)
    """Tensorwise: the scale each rank's shard was quantized with (as this rank received them),
    every all-gather's in turn: ``gathers * scale_ranks`` of them."""
    scale_ranks: int = 0
    """Tensorwise: how many ranks each all-gather received a scale from (the shard group's size)."""
    digests: list[str] = field(default_factory=list)
    """The :func:`fingerprint` of the dequantized unsharded weight after every all-gather of the step."""
    exponents: torch.Tensor | None = None
    """MX: the E8M0 block exponents of the whole weight as the step's first dequantization used
    them (what the GEMM consumed, read after the all-gather, not what a rank sent)."""


class QuantizedWeight(torch.Tensor):
    @staticmethod
    def __new__(cls, data: torch.Tensor, fmt: str):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(), dtype=data.dtype,
                                                   device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor, fmt: str):
        self._data, self.fmt = data, fmt
        self._cache: tuple | None = None  # (version, elements, scale) of the last quantization

    def __repr__(self):
        return f"QuantizedWeight({self.fmt}, {self._data!r})"

    def __tensor_flatten__(self):
        return ["_data"], (self.fmt,)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return QuantizedWeight(inner["_data"], meta[0])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        fmt = next(a.fmt for a in tree_leaves((args, kwargs or {})) if isinstance(a, QuantizedWeight))
        out = func(*tree_map(main_weight, args), **tree_map(main_weight, kwargs or {}))
        for i, arg in enumerate(func._schema.arguments):  # a write to a main weight: a new version
            value = args[i] if i < len(args) else (kwargs or {}).get(arg.name)
            if isinstance(value, QuantizedWeight) and arg.alias_info is not None and arg.alias_info.is_write:
                _VERSIONS[_key(value._data)] = _VERSIONS.get(_key(value._data), 0) + 1
        if func not in _KEEP:
            return out
        if func is aten.new_zeros.default:  # fresh storage (FSDP's padded shard): a fresh record
            _VERSIONS[_key(out)], _STATS[_key(out)] = 0, GatherStats()
        return tree_map(lambda t: QuantizedWeight(t, fmt) if isinstance(t, torch.Tensor) else t, out)

    @property
    def stats(self) -> GatherStats:
        return _STATS.setdefault(_key(self._data), GatherStats())

    # --- FSDP2 all-gather extension -------------------------------------------------------

    # Each step of quantizing is a method, so a fault can replace exactly one of them.

    def _outdated(self, version: int) -> bool:
        """The cached quantization is of an older main weight (the optimizer stepped it)."""
        return self._cache[0] != version

    def _global_amax(self, amax: torch.Tensor, mesh) -> torch.Tensor:
        if mesh.size() > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
        return amax

    def _block_scales(self, data: torch.Tensor) -> torch.Tensor:
        """MX: one power-of-two scale per (row, block of ``BLOCK`` columns) of the shard's
        whole rows -- FSDP's dim-0 shards never cut such a block."""
        return F.power_of_two_scale(F.block_amax(data))

    def _quantize(self, mesh) -> tuple[torch.Tensor, torch.Tensor]:
        data = self._data
        version = _VERSIONS.get(_key(data), 0)
        if self._cache is None or self._outdated(version):
            if self.fmt == "mxfp8":
                scale = self._block_scales(data) if data.numel() else data.new_zeros(0, data.shape[-1] // F.BLOCK)
            else:
                scale = F.power_of_two_scale(self._global_amax(data.abs().amax() if data.numel()
                                                               else data.new_zeros(()), mesh))
            self._cache = (version, F.quantize(data, self.fmt, scale) if data.numel() else data.to(F.ELEMENT), scale)
            self.stats.quantized += 1
        self.stats.stale += self._cache[0] != version
        return self._cache[1], self._cache[2]

    def _payload(self, elements: torch.Tensor, scale: torch.Tensor, padded: int, shape) -> torch.Tensor:
        """The all-gather input: E4M3 bytes of the shard, padded to the padded shard size."""
        payload = torch.zeros(padded, *shape[1:], dtype=torch.uint8, device=self._data.device)
        payload[: elements.shape[0]] = elements.view(torch.uint8)
        return payload

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        elements, scale = self._quantize(mesh)
        padded = math.ceil(outer_size[0] / mesh.size())
        payload = self._payload(elements, scale, padded, outer_size)
        self.stats.gathers += 1
        self.stats.payload.append(f"{dtype_name(payload.dtype)}:{payload.numel() * payload.element_size()}")
        if self.fmt == "mxfp8":  # E8M0 exponents, one byte per block, gathered beside the elements
            exps = torch.full((padded, outer_size[-1] // F.BLOCK), 127, dtype=torch.uint8, device=self._data.device)
            exps[: scale.shape[0]] = (torch.log2(scale) + 127).to(torch.uint8)
            self.stats.payload.append(f"uint8:{exps.numel()}")
            gathered = [torch.empty_like(exps) for _ in range(mesh.size())]
            dist.all_gather(gathered, exps, group=mesh.get_group())
            every = torch.cat(gathered)
            meta = torch.exp2(every.float() - 127)
        else:
            gathered = [torch.empty(1, device=self._data.device) for _ in range(mesh.size())]
            dist.all_gather(gathered, scale.reshape(1).float(), group=mesh.get_group())
            meta = torch.cat(gathered)  # each rank's scale: equal when the amax was global
            self.stats.scales += meta.tolist()
            self.stats.scale_ranks = mesh.size()
        return (payload,), (meta, padded, outer_size[0])

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (payload,), (meta, padded, rows) = outputs, metadata
        if payload.dtype == torch.bfloat16:
            weight = payload.to(param_dtype)
        elif self.fmt == "mxfp8":
            weight = F.dequantize(payload.view(F.ELEMENT), self.fmt, meta, param_dtype)
            if self.stats.exponents is None:  # what the dequantization consumed, not what was sent
                self.stats.exponents = (torch.log2(meta[:rows]) + 127).to(torch.uint8)
        else:  # tensorwise: each rank's rows with the scale that rank used
            chunks = payload.view(F.ELEMENT).split(padded)
            weight = torch.cat([F.dequantize(c, self.fmt, s, param_dtype) for c, s in zip(chunks, meta)])
        self.stats.digests.append(fingerprint(weight[:rows]))
        if out is not None:  # a later all-gather refills the storage autograd saved: same version
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(weight[: out.shape[0]])
            return None
        return weight, (weight,)


def fingerprint(w: torch.Tensor) -> str:
    """The exact values of a weight, element by element and in place, whatever dtype holds them
    (:func:`parity.digests.value_sha256` of its FP32 copy): two weights share it only if they are
    equal (a sum of magnitudes would miss a moved row or a flipped sign)."""
    return value_sha256(w.detach().float())


def main_weight(t):
    """The FP32 main weight inside a :class:`QuantizedWeight`; anything else as it is."""
    return t._data if isinstance(t, QuantizedWeight) else t


def quantize_weights(model: nn.Module, formats: dict[str, str]) -> None:
    """Replace each planned parameter (FQN -> format) with its :class:`QuantizedWeight`."""
    modules = dict(model.named_modules())
    for fqn, fmt in formats.items():
        owner, _, name = fqn.rpartition(".")
        p = getattr(modules[owner], name)
        setattr(modules[owner], name, nn.Parameter(QuantizedWeight(p.detach(), fmt), requires_grad=p.requires_grad))


def local_weight(p: torch.Tensor) -> QuantizedWeight | None:
    """The rank's :class:`QuantizedWeight` inside a sharded parameter, if it is one."""
    t = p.to_local() if hasattr(p, "to_local") else p
    return t if isinstance(t, QuantizedWeight) else None


def plain_state(state: dict) -> dict:
    """A model state dict whose quantized weights are their FP32 main weights (sharing storage):
    what a checkpoint holds. DCP loads into them in place, i.e. into the main weights."""
    from torch.distributed.tensor import DTensor

    def plain(v):
        if isinstance(v, DTensor) and isinstance(v.to_local(), QuantizedWeight):
            return DTensor.from_local(main_weight(v.to_local()), v.device_mesh, v.placements, shape=v.shape,
                                      stride=v.stride(), run_check=False)
        return main_weight(v)
    return {k: plain(v) for k, v in state.items()}


def take_stats(params: dict[str, nn.Parameter]) -> dict[str, GatherStats]:
    """Per quantized parameter, what this step saw; counters restart for the next step."""
    out = {}
    for fqn, p in params.items():
        q = local_weight(p)
        if q is not None:
            out[fqn] = _STATS.pop(_key(q._data), GatherStats())
    return out
