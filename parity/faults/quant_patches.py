"""Faults of quantized weight groups (FP8 all-gather): each replaces one step of
:class:`parity.model.quantized.QuantizedWeight` the way a reported bug class would -- the
amax reduced over the wrong group, a stale quantized copy after the optimizer step, MX
blocks cut by a shard boundary, the FP8 all-gather switched off (for every weight or one)."""

from __future__ import annotations

import types

import torch

from parity.faults.patches import swap_attr


def _weight():
    from parity.model.quantized import QuantizedWeight

    return QuantizedWeight


def local_amax():
    """Tensorwise scales from each shard's own amax: the all-reduce over the shard group is skipped."""
    return swap_attr(_weight(), "_global_amax", lambda orig: lambda self, amax, mesh: amax)


def stale_quantized_copy():
    """The quantized copy is never invalidated: after the optimizer step the all-gather still
    sends the first step's FP8 weight."""
    return swap_attr(_weight(), "_outdated", lambda orig: lambda self, version: False)


def mx_tiles_cut_by_shard():
    """MX scales from 32 x 32 tiles of the local shard: a dim-0 shard boundary cuts the tiles
    (the whole tensor's tiles would straddle it) and each row's exponent comes from other rows."""
    from parity.model import formats as F

    def make(orig):
        def _block_scales(self, data):
            rows = data.shape[0]
            amax = F.block_amax(data)  # [rows, blocks]
            tiles = torch.stack([amax[i:i + F.BLOCK].amax(dim=0) for i in range(0, rows, F.BLOCK)])
            return F.power_of_two_scale(tiles.repeat_interleave(F.BLOCK, dim=0)[:rows])
        return _block_scales
    return swap_attr(_weight(), "_block_scales", make)


def _bf16_payload(self, elements, scale, padded, shape):
    """The dequantized shard in BF16, padded as the FP8 payload would be."""
    from parity.model import formats as F

    payload = torch.zeros(padded, *shape[1:], dtype=torch.bfloat16, device=elements.device)
    if elements.numel():
        payload[: elements.shape[0]] = F.dequantize(elements, self.fmt, scale, torch.bfloat16)
    return payload


def fp8_gather_off():
    """The all-gather carries the dequantized weight in BF16 (FP8 all-gather off): the same
    values at twice the bytes."""
    return swap_attr(_weight(), "_payload", lambda orig: _bf16_payload)


def fp8_gather_off_one_weight(value, rank: int, world: int, model, **_):
    """At the sharded model: one weight's extension -- the first block's first projection --
    sends BF16, every other weight E4M3: its unit all-gathers more bytes than the plan says
    while the unit of the same size beside it all-gathers the right ones."""
    weight = model.blocks[0].up.weight
    local = getattr(weight, "_local_tensor", weight)  # what FSDP calls the extension's hooks on
    local._payload = types.MethodType(_bf16_payload, local)
    return value


def mx_exponents_misaligned():
    """The all-gather is right, the receiving side is not: each row block is dequantized with
    its neighbour's gathered exponents (what the GEMM consumes differs from what was sent)."""
    def make(orig):
        def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
            meta, padded, rows = metadata
            if self.fmt == "mxfp8":
                meta = torch.roll(meta, 1, dims=0)
            return orig(self, outputs, (meta, padded, rows), param_dtype, out=out)
        return fsdp_post_all_gather
    return swap_attr(_weight(), "fsdp_post_all_gather", make)


def fp8_payload_misreported():
    """The weight's extension says it sends E4M3 but hands FSDP the dequantized weight in BF16
    (:func:`fp8_gather_off`, reporting ``uint8`` bytes in its statistics): the numbers stay
    right, the wire carries twice the bytes -- only a measurement on the wire, and the receiving
    side (it consumes no MX exponents), see it."""
    undo_payload = fp8_gather_off()

    def make(orig):
        def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
            out = orig(self, mesh, outer_size, outer_stride, module, mp_policy)
            first = len(self.stats.payload) - (2 if self.fmt == "mxfp8" else 1)
            dtype, size = self.stats.payload[first].split(":")
            if dtype == "bfloat16":
                self.stats.payload[first] = f"uint8:{int(size) // 2}"  # the claim: one byte per element
            return out
        return fsdp_pre_all_gather
    undo = swap_attr(_weight(), "fsdp_pre_all_gather", make)

    def restore():
        undo()
        undo_payload()
    return restore
