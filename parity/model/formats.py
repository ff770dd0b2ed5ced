"""Weight formats (pure): how an FP32 main weight becomes the FP8 weight that is all-gathered.

``none``            the weight is all-gathered in the compute dtype, as any other.
``fp8-tensorwise``  E4M3 elements, one power-of-two scale per tensor from its *global* amax.
``mxfp8``           E4M3 elements, one power-of-two scale per block of :data:`BLOCK` elements
                    along the reduction dimension (the last: a Linear weight's input features).

Scales are powers of two (E8M0 for MX, rounded for tensorwise), so a dequantized element is
exactly representable in BF16 and a GEMM in the compute dtype on the dequantized weight is an
exact emulation of the FP8 GEMM for the values it sees. A scale is the smallest power of two
that saturates no element (``ceil(log2(amax / 448))``); the OCP MX specification's
``floor(log2(amax)) - 8`` is one exponent smaller where the amax's mantissa exceeds 1.75 and
saturates those elements, so an extension following it differs here by design. The format's precision is E4M3's:
unit roundoff 2^-4 relative to the element's scale (:data:`E4M3_UNIT_ROUNDOFF`).
"""

from __future__ import annotations

import torch

FORMATS = ("none", "fp8-tensorwise", "mxfp8")
QUANTIZED = FORMATS[1:]
BLOCK = 32
E4M3_MAX = 448.0
E4M3_UNIT_ROUNDOFF = 2.0 ** -4
ELEMENT = torch.float8_e4m3fn


def power_of_two_scale(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two ``s`` with ``amax / s <= E4M3_MAX`` (1 for an all-zero block)."""
    amax = amax.double()
    scale = torch.exp2(torch.ceil(torch.log2(amax.clamp_min(torch.finfo(torch.float32).tiny) / E4M3_MAX)))
    return torch.where(amax > 0, scale, torch.ones_like(scale)).float()


def block_amax(w: torch.Tensor) -> torch.Tensor:
    """MXFP8: per row, the amax of each ``BLOCK``-element block of the last dimension."""
    rows = w.reshape(-1, w.shape[-1])
    return rows.abs().reshape(rows.shape[0], -1, BLOCK).amax(dim=-1)


def quantize(w: torch.Tensor, fmt: str, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 elements of ``w`` divided by ``scale`` (a scalar tensor for tensorwise, one per
    block for MX); saturating, round-to-nearest-even."""
    w = w.float()
    if fmt == "mxfp8":
        rows = w.reshape(-1, w.shape[-1]).reshape(-1, w.shape[-1] // BLOCK, BLOCK)
        q = rows / scale.unsqueeze(-1)
        return q.clamp(-E4M3_MAX, E4M3_MAX).to(ELEMENT).reshape(w.shape)
    return (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(ELEMENT)


def dequantize(q: torch.Tensor, fmt: str, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if fmt == "mxfp8":
        rows = q.float().reshape(-1, q.shape[-1] // BLOCK, BLOCK) * scale.unsqueeze(-1)
        return rows.reshape(q.shape).to(dtype)
    return (q.float() * scale).to(dtype)


def scales_of(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """The scale(s) of the whole tensor: tensorwise from its amax, MX per block."""
    return power_of_two_scale(block_amax(w) if fmt == "mxfp8" else w.abs().amax())


def fake_quantize(w: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """What a GEMM sees of ``w`` in ``fmt`` (the reference quantizes the whole tensor at once)."""
    if fmt == "none":
        return w.to(dtype)
    scale = scales_of(w.detach(), fmt)
    return dequantize(quantize(w.detach(), fmt, scale), fmt, scale, dtype)


def layout(modules: tuple[str, ...], weights: str) -> dict[str, str]:
    """Parameter FQN -> format for a cell's ``weights`` axis value over the quantizable
    Linear layers ``modules`` (``mixed``: tensorwise and MX alternate in this order)."""
    if weights == "none":
        return {}
    if weights == "mixed":
        return {f"{m}.weight": QUANTIZED[i % 2] for i, m in enumerate(modules)}
    return {f"{m}.weight": weights for m in modules}
