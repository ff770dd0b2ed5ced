"""How a rank's observation crosses to the parent: one pickle, each plain CPU tensor as its raw bytes.

An observation holds a few hundred small tensors. ``torch.save`` writes each one as a record of a
zip archive and ``torch.load`` restores each through the serializer's per-tensor machinery (device
and fake-mode lookups): ~13 ms each way for 300 tensors of 128 elements; the parent, which every
rank waits on, spent a sixth of its CPU time on the ``configs`` matrix loading observations.
Plain CPU tensors (exactly :class:`torch.Tensor`, strided, no autograd) travel instead as
(bytes, dtype, shape): ~2 ms each way. Values, dtypes and shapes arrive unchanged, of every dtype (the bytes are the
elements' own); what does not arrive is storage sharing between different views (each arrives
as its own contiguous tensor; the same tensor object referenced twice stays one object, by
pickle's memo) and strides. Any other object -- a parameter, a DTensor, a CUDA tensor, a tensor
needing gradient -- is pickled as torch pickles it.
"""

from __future__ import annotations

import copyreg
import io
import pickle

import torch


def _tensor(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)


def _reduce(t: torch.Tensor):
    if t.device.type != "cpu" or t.requires_grad or t.layout != torch.strided or t.is_quantized:
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    flat = t.resolve_conj().resolve_neg().reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # one element counts as contiguous whatever its stride
        flat = flat.clone(memory_format=torch.contiguous_format)
    return _tensor, (flat.view(torch.uint8).numpy().tobytes(), str(t.dtype).removeprefix("torch."), tuple(t.shape))


_TABLE = {**copyreg.dispatch_table, torch.Tensor: _reduce}  # exact type: subclasses keep torch's pickling


def to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _TABLE
    pickler.dump(obj)
    return buf.getvalue()


def from_bytes(data: bytes):
    return pickle.loads(data)
