import csv
import os

import pytest

from parity.matrix.cell import Cell
from parity.runner import RunOptions, run_cells


def read_records(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "cells.csv")) as fh:
        return list(csv.DictReader(fh))


@pytest.fixture
def run_matrix(tmp_path):
    """Run real cells (spawned gloo ranks) and return (exit code, records)."""

    def run(cells: list[Cell], *, timeout: float = 120.0, fp64: bool = False, name: str = "run"):
        out = str(tmp_path / name)
        run.last_out = out
        code = run_cells(cells, RunOptions(out_dir=out, timeout=timeout, fp64=fp64, progress=False))
        return code, read_records(out)

    return run


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A 1-rank gloo process group in this process and its mesh: a real FSDP run of one rank
    (:func:`parity.execute.worker.run_rank`) for tests that judge its observation directly."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def pytest_addoption(parser):
    parser.addoption("--doc-commands", action="store_true",
                     help="also run the costly commands the docs show, as written (minutes each; the nightly job)")


def pytest_collection_modifyitems(config, items):
    """The costly docs commands are deselected unless ``--doc-commands`` asks for them (the
    nightly job): a pull request's run reports them as deselected, not as 43 skips."""
    if config.getoption("--doc-commands"):
        return
    costly = [item for item in items if "doc_commands" in item.keywords]
    if costly:
        config.hook.pytest_deselected(items=costly)
        items[:] = [item for item in items if "doc_commands" not in item.keywords]
