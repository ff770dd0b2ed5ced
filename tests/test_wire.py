"""An observation crosses from a rank to the parent with every value, dtype and shape intact."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parity.execute.wire import from_bytes, to_bytes

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool, torch.complex64]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad \
        and bool(torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 and a.is_floating_point() else a,
                             b.view(torch.uint8) if b.dtype.itemsize == 1 and b.is_floating_point() else b))


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(DTYPES), shape=st.lists(st.integers(0, 4), max_size=3), seed=st.integers(0, 2**16))
def test_every_dtype_and_shape_arrives_unchanged(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=g) * 100).to(dtype)
    back = from_bytes(to_bytes({"t": t, "noncontiguous": t.T if t.dim() == 2 else t}))
    assert _same(back["t"], t)
    assert _same(back["noncontiguous"], t.T if t.dim() == 2 else t)


def test_views_objects_and_what_torch_pickles_itself():
    base = torch.arange(12.0).reshape(3, 4)
    param = torch.nn.Parameter(torch.ones(2))
    graded = torch.ones(3, requires_grad=True)
    obs = {"view": base[1:, ::2], "base": base, "again": base, "param": param, "graded": graded,
           "zero_dim": torch.tensor(2.5, dtype=torch.bfloat16),
           "one_strided": base[:1, 1], "neg": torch.ones(2).neg()._neg_view()}
    back = from_bytes(to_bytes(obs))
    assert back["again"] is back["base"]  # one object stays one object
    assert torch.equal(back["view"], base[1:, ::2]) and torch.equal(back["base"], base)
    assert type(back["param"]) is torch.nn.Parameter and torch.equal(back["param"], param)
    assert back["graded"].requires_grad and torch.equal(back["graded"], graded)
    assert torch.equal(back["one_strided"], base[:1, 1])  # one element, stride 4: still its own bytes
    assert back["zero_dim"].shape == () and back["zero_dim"].item() == 2.5
    assert torch.equal(back["neg"], torch.ones(2)) and not back["neg"].is_neg()
