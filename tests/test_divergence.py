"""The first-divergence locator must be quiet on a correct run: a traced re-run of a cell with
nothing wrong names no module (it once named ``blocks.1.norm``, ``blocks.1.lora`` and
``blocks.1.adapter`` whatever the fault: a hook on a module's input summed the gradients of the
input's other readers, e.g. the residual connection, on one side only)."""

import dataclasses
import io
import os

import pytest
import torch

from parity.execute.pool import RankPool
from parity.judge.cell import base_fields
from parity.judge.divergence import locate
from parity.matrix.cell import Cell

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("divergence")]

#: The cells whose correct traces used to report a divergence.
CELLS = [("lm", "legacy"), ("mixed_storage", "native"), ("mixed_storage", "legacy"), ("frozen", "legacy")]


@pytest.mark.parametrize("ranks,step", [(1, 0), (2, 0), (2, 1)])
def test_the_traced_rerun_of_a_correct_cell_reports_nothing(ranks, step):
    """At step 0 from the initial weights; at a later step (where a cell's records diverged first)
    from the run's own weights after the step before, which the reference resyncs to."""
    pool = RankPool(ranks)
    try:
        for fixture, path in CELLS + ([("kda", "native")] if step else []):
            cell = Cell(fixture=fixture, path=path, ranks=ranks, microbatches=3, sync="last", trace=True,
                        trace_step=step)
            record = locate(cell, pool.run(cell, 120), base_fields(cell))
            assert record.verdict == "PASS" and record.step == step, f"{cell.id}: {record.detail}"
    finally:
        pool.stop()


def test_under_activation_checkpointing_both_orders_are_traced_and_clean():
    """A checkpointed block's modules run their forward again in backward: their input gradients
    are the recomputed tensors', traced (backward order) and clean on a correct cell."""
    pool = RankPool(1)
    try:
        cell = Cell(fixture="kda", path="native", ranks=1, steps=1, checkpointing="full", trace=True)
        document: dict = {}
        record = locate(cell, pool.run(cell, 120), base_fields(cell), document=document)
    finally:
        pool.stop()
    assert record.verdict == "PASS", record.detail
    grads = {t["module"] for t in document["tensors"] if t["kind"] == "input_grad" and "max_abs_diff" in t}
    assert {"blocks.0.q_proj", "blocks.1.holder", "blocks.1"} <= grads


def test_on_fsdp_x_tp_each_rank_s_slice_of_a_colwise_output_is_judged():
    """The traced re-run of a correct FSDP x TP cell reports nothing, and judges every rank's
    colwise output (its slice of the features) and rowwise input gradient (its Shard(-1)) against
    the same slice of the reference's, and the colwise input gradients the ranks hold as partial
    sums (before TP's all-reduce) against the emulated partial of their tp chunk."""
    pool = RankPool(4)
    try:
        cell = Cell(fixture="composed", path="native", ranks=4, mesh="fsdp+tp", steps=1, trace=True)
        document: dict = {}
        record = locate(cell, pool.run(cell, 180), base_fields(cell), document=document)
    finally:
        pool.stop()
    assert record.verdict == "PASS", record.detail
    colwise = [t for t in document["tensors"] if t["kind"] == "output" and t["module"].endswith("mlp.up")]
    assert len(colwise) == 8 and all(t["sharded"]["shape"][-1] * 2 == t["reference"]["shape"][-1]
                                     and t["max_abs_diff"] <= t["allowed"] for t in colwise)
    judged = {(t["kind"], t["module"]) for t in document["tensors"] if "max_abs_diff" in t}
    assert ("input_grad", "blocks.0.mlp.down") in judged  # a rowwise input's gradient: each rank's Shard(-1)
    partial = [t for t in document["tensors"] if t["kind"] == "input_grad" and t["module"].endswith("mlp.up")]
    assert len(partial) == 8 and all(t["sharded"]["placements"] == ["P(sum)"]
                                     and t["max_abs_diff"] <= t["allowed"] for t in partial)
    assert "not judged" not in record.detail


def test_on_fsdp_x_tp_the_colwise_partial_input_gradients_fail_when_backward_computes_with_stale_weights():
    """The judged Partial input gradients can fail: a backward all-gather that hands compute step
    0's weights again (FSDP-side fault) makes each colwise layer's partial at step 1 differ from
    the emulated chunk of the run's own weights."""
    pool = RankPool(4)
    try:
        cell = Cell(fixture="composed", path="native", ranks=4, mesh="fsdp+tp", trace=True, trace_step=1,
                    faults=("backward_gather_stale",))
        document: dict = {}
        record = locate(cell, pool.run(cell, 180), base_fields(cell), document=document)
    finally:
        pool.stop()
    assert record.verdict == "FAIL"
    partial = [t for t in document["tensors"] if t["kind"] == "input_grad" and t["module"].endswith("mlp.up")]
    assert len(partial) == 8 and all(t["sharded"]["placements"] == ["P(sum)"] for t in partial)
    assert any(t["max_abs_diff"] > t["allowed"] for t in partial)


@pytest.mark.parametrize("mesh", ["hsdp", "ep"])
def test_on_hsdp_and_expert_parallel_meshes_the_traced_rerun_of_a_correct_cell_reports_nothing(mesh):
    """Replicated shard groups (HSDP) and experts owned by another parallelism (EP): every rank's
    trace against its data rank's emulation is clean, both orders, nothing left unjudged."""
    pool = RankPool(4)
    try:
        cell = Cell(fixture="composed", path="native", ranks=4, mesh=mesh, microbatches=2, steps=1, trace=True)
        document: dict = {}
        record = locate(cell, pool.run(cell, 180), base_fields(cell), document=document)
    finally:
        pool.stop()
    assert record.verdict == "PASS" and "not judged" not in record.detail, record.detail
    judged = [t for t in document["tensors"] if "max_abs_diff" in t]
    assert {t["rank"] for t in judged} == {0, 1, 2, 3} and {t["kind"] for t in judged} == {"output", "input_grad"}


def test_a_failing_cell_leaves_its_trace_beside_its_records(tmp_path):
    """``traces/<cell>.json``: every traced module's tensors summarized on both sides (dtype, shape,
    SHA-256, statistics), with the difference and allowance the divergence record judged."""
    import json

    from parity.judge.divergence import TRACE_FORMAT
    from parity.report import outdir
    from parity.runner import RunOptions, run_cells
    from tests.conftest import read_records

    cell = Cell(fixture="kda", path="native", ranks=1, steps=1, faults=("perturb_output",))
    out = str(tmp_path / "run")
    assert run_cells([cell], RunOptions(out_dir=out, timeout=120, progress=False, op_log=True)) == 1
    located = next(r for r in read_records(out) if r["check"] == "divergence")
    doc = json.load(open(outdir.trace_path(out, cell.id)))
    assert doc["format"] == TRACE_FORMAT and doc["cell"] == cell.id and doc["tensors"]
    named = [t for t in doc["tensors"] if t["module"] == located["name"] and t["kind"] == "output"]
    assert named and named[0]["max_abs_diff"] > named[0]["allowed"]
    assert named[0]["sharded"]["sha256"] != named[0]["reference"]["sha256"]
    first = doc["tensors"][0]
    assert set(first["sharded"]) >= {"dtype", "shape", "sha256", "min", "max", "mean", "l2"}
    assert {(t["rank"], t["microbatch"]) for t in doc["tensors"]} == {(0, 0)}  # one rank, one micro-batch
    assert {t["stage"] for t in doc["stages"]} == {"gradients", "optimizer"}  # and the stages after backward
    # --op-log: rank 0's operators in DebugMode's own format, beside the trace
    from torch.utils._debug_mode import DebugMode

    logged = DebugMode.load_logs(os.path.join(os.path.dirname(outdir.trace_path(out, cell.id)), doc["op_log"]))
    assert any("addmm" in str(c) or "mm" in str(c) for c in logged)


def test_the_trace_holds_the_stages_after_backward_where_a_clipping_fault_shows_first():
    """``stages``: the traced step's gradients as reduced, as clipped, and the parameters after the
    update, each whole against the reference's from the same weights. Clipping each rank by its
    own shards' norm leaves the reduced gradients right and the clipped ones wrong."""
    from parity.faults import FAULTS

    cell = Cell(**FAULTS["clip_local_norm"].cell, faults=("clip_local_norm",), trace=True)
    pool = RankPool(cell.ranks)
    try:
        document: dict = {}
        locate(cell, pool.run(cell, 120), base_fields(cell), document=document)
    finally:
        pool.stop()
    stages: dict = {}
    for t in document["stages"]:
        assert t["step"] == 0 and set(t["reference"]) >= {"dtype", "shape", "sha256", "l2"}
        stages.setdefault(t["stage"], []).append(t)
    assert list(stages) == ["gradients", "clipping", "optimizer"]
    assert len({len(v) for v in stages.values()}) == 1  # every trained parameter at each stage
    worst = {stage: max(t["max_abs_diff"] for t in v) for stage, v in stages.items()}
    assert worst["gradients"] * 100 < worst["clipping"], worst


def test_two_op_logs_of_a_cell_diff_with_debugmodes_own_tool():
    """Two runs of one cell log the same hashes (views, collectives' in-flight outputs and fresh
    buffers are not hashed); a run on other data differs, from its first computed value."""
    from torch.utils._debug_mode import DebugMode

    def log(pool, cell):
        text = pool.run(cell, 120)[0].op_log["log"]
        return DebugMode.load_logs(io.StringIO(text))

    pool = RankPool(2)
    try:
        cell = Cell(fixture="kda", path="native", ranks=2, steps=1, trace=True, op_log=True)
        first, again = log(pool, cell), log(pool, cell)
        other = log(pool, dataclasses.replace(cell, seed=1))
    finally:
        pool.stop()
    assert any("all_gather" in str(c) for c in first) and any("reduce_scatter" in str(c) for c in first)
    assert DebugMode.check_hash_mismatches(first, again) == []
    moved = DebugMode.check_hash_mismatches(first, other)
    assert moved and all(m["rel_diff"] > 0 for m in moved[:1])


def test_a_trace_document_keeps_the_first_tensors_up_to_its_cap_and_counts_the_rest():
    import torch

    from parity.judge.divergence import trace_document
    from parity.model.trace import Trace

    def trace(scale):
        return Trace(outputs={f"m{i}": torch.full((2,), scale * i) for i in range(3)},
                     input_grads={f"m{i}": torch.ones(2) for i in reversed(range(3))})

    pairs = [(mb, 0, trace(1.0), trace(1.0)) for mb in range(2)]  # 12 tensors
    cell = Cell(fixture="kda", path="native")
    whole = trace_document(cell, pairs)
    assert len(whole["tensors"]) == 12 and whole["dropped"] == 0
    capped = trace_document(cell, pairs, cap=5)
    assert capped["tensors"] == whole["tensors"][:5] and capped["dropped"] == 7
    located = trace_document(cell, pairs, cap=5, keep={(1, 0, "input_grad", "m0")})  # the located one stays
    assert capped["tensors"] + [whole["tensors"][-1]] == located["tensors"] and located["dropped"] == 6


def test_a_module_that_returns_nan_or_a_coarser_dtype_than_the_reference_is_over():
    """A NaN difference is over every allowance, and the allowance is the reference's dtype's:
    an observed BF16 tensor where the reference holds FP32 does not widen its own."""
    from parity.judge import divergence
    want = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    nan = want.clone()
    nan[0, 0] = float("nan")
    for bad in (nan, want.to(torch.bfloat16)):
        over = divergence._first_over({"blocks.0": bad, "head": want}, {"blocks.0": want, "head": want}, set())
        assert over is not None and over[1] == "blocks.0" and over[4] > 1
    assert divergence._first_over({"head": want}, {"head": want}, set()) is None
