"""parity's own reader of DCP checkpoints (``checkpoint.saved`` / ``checkpoint.loaded`` read the
files without DCP's loader): every entry back, whole, from the files' bytes."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from parity.execute import dcp_files


def _state():
    g = torch.Generator().manual_seed(0)
    return {"model": {"blocks.0.w": torch.randn(4, 3, generator=g),
                      "blocks.0._checkpoint_wrapped_module.b": torch.randn(3, generator=g, dtype=torch.float64)},
            "optim": {"state": {"blocks.0.w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3, generator=g)}},
                      "param_groups": [{"lr": 0.1, "params": ["blocks.0.w", "blocks.0._checkpoint_wrapped_module.b"]}]},
            "scaler": {"scale": 1024.0}}


def test_every_entry_comes_back_whole_and_bitwise(tmp_path):
    state = _state()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path), sync_files=False), no_dist=True)
    got = dcp_files.read(dcp_files.files(str(tmp_path)))
    want = dcp_files.flat(state, lambda v: v)
    assert sorted(got) == sorted(want) == sorted([
        "model/blocks.0.w", "model/blocks.0.b", "optim/blocks.0.w/step", "optim/blocks.0.w/exp_avg",
        "optim/param_groups/0/lr", "optim/param_groups/0/params", "scaler/scale"])
    for k, v in want.items():
        assert torch.equal(got[k], v) and got[k].dtype == v.dtype if isinstance(v, torch.Tensor) else got[k] == v, k
    assert got["optim/param_groups/0/params"] == ["blocks.0.b", "blocks.0.w"]  # canonical FQNs, as a set


def test_a_checkpoint_missing_a_file_or_its_metadata_is_refused(tmp_path):
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(str(tmp_path), sync_files=False), no_dist=True)
    raw = dcp_files.files(str(tmp_path))
    with pytest.raises(ValueError, match="no .metadata"):
        dcp_files.read({k: v for k, v in raw.items() if k != ".metadata"})
    with pytest.raises(ValueError, match="which the checkpoint does not hold"):
        dcp_files.read({".metadata": raw[".metadata"]})
