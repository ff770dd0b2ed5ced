"""The ``stage`` record: the failing records of a cell ordered as training runs, the earliest
named (issue 22). The faults' own stages are held to it in ``tests/test_faults.py``."""

from parity.judge.record import Record, Verdict
from parity.judge.stages import STAGE_OF, STAGES, coordinates, first_stage, stage_of

BASE = dict(cell="c", fixture="kda", path="native")


def _r(check, name="x", step="", verdict=Verdict.FAIL, ratio=2.0):
    return Record(**BASE, check=check, name=name, step=step, verdict=verdict, ratio=ratio)


def test_a_correct_cell_has_no_stage():
    assert first_stage([_r("grad", step=0, verdict=Verdict.PASS), _r("coverage")], 2, BASE) is None


def test_the_earliest_stage_wins_over_the_largest_ratio():
    """A reduction fault reaches the optimizer and every later step: the collectives of step 0
    are named, not the parameter with the larger ratio."""
    rows = [_r("param", "w", 0, ratio=900.0), _r("output", "rank0/mb0", 1, ratio=50.0),
            _r("grad", "w", 0, ratio=3.0), _r("dtype.reduce", "w", ratio=float("inf"))]
    got = first_stage(rows, 2, BASE)
    assert (got.check, got.name, got.step, got.verdict) == ("stage", "collectives", 0, Verdict.FAIL)
    assert got.detail.startswith("first divergent stage: collectives at step 0: dtype.reduce w")
    assert "held before it: setup, gather at step 0, forward at step 0, backward at step 0" in got.detail


def test_the_checks_that_held_within_the_stage_are_named():
    """HSDP: the shard group's partial held and the shard after the replica all-reduce did not --
    the fault sits between them; checks of other stages or steps are not listed."""
    rows = [_r("grad.shard", "w", 0, ratio=4.0), _r("grad.partial", "w", 0, verdict=Verdict.PASS),
            _r("grad.partial", "w", 1, verdict=Verdict.PASS), _r("grad", "w", 0, verdict=Verdict.PASS)]
    got = first_stage(rows, 2, BASE)
    assert got.detail.endswith("; held within it: grad.partial"), got.detail


def test_a_later_step_says_the_earlier_steps_held():
    got = first_stage([_r("output", "rank1/mb0", 2), _r("checkpoint.same", "native:grad:w")], 3, BASE)
    assert (got.name, got.step) == ("forward", 2) and "held before it: setup, steps 0-1, gather at step 2" in got.detail


def test_setup_and_after_training_records_by_their_names():
    assert stage_of(_r("identity", "parameters@sharded")) == "setup"
    assert stage_of(_r("identity", "parameters@lazy_init")) == "forward"  # read after step 0's first forward
    assert stage_of(_r("names", "named_parameters@trained")) == "trained"
    got = first_stage([_r("names", "named_parameters@trained"), _r("checkpoint.same", "w")], 2, BASE)
    assert (got.name, got.step) == ("trained", "")


def test_every_staged_check_has_a_known_stage_and_the_run_has_none():
    assert set(STAGE_OF.values()) <= set(STAGES)
    assert first_stage([_r("run", "cell", verdict=Verdict.ERROR), _r("divergence")], 2, BASE) is None


def test_the_optimizer_segments_collectives_come_after_the_backwards_reductions():
    """A scaler that skips the sharded gradients' found-inf agreement fails the optimizer
    segment's ``collectives`` and the norm: located at ``gradients``, where it acts."""
    assert stage_of(_r("collectives", "optimizer", 0)) == "gradients"
    assert stage_of(_r("collectives", "mb0/backward", 0)) == "collectives"
    got = first_stage([_r("collectives", "optimizer", 0), _r("grad_norm", "global", 0)], 2, BASE)
    assert (got.name, got.step) == ("gradients", 0)


def test_the_stage_names_the_rank_and_micro_batch_its_record_names():
    row = Record(**BASE, check="tp.partial", name="mlp.up@backward", step=1, verdict=Verdict.FAIL, ratio=9.0,
                 detail="rank 2, tp chunk 0 of data rank 1, micro-batch 1: 2 x u(float32) x 0.001")
    got = first_stage([row], 2, BASE)
    assert got.detail.startswith("first divergent stage: backward at step 1, micro-batch 1, rank 2: "
                                 "tp.partial mlp.up@backward (ratio 9);"), got.detail
    assert coordinates(_r("output", "rank1/mb0")) == (1, 0)
    assert coordinates(_r("collectives", "mb2/backward")) == (None, 2)
    # a record judging a whole tensor names neither
    assert first_stage([_r("grad", "w", 0)], 2, BASE).detail.startswith("first divergent stage: gradients at step 0: grad w")


def test_within_a_stage_the_first_micro_batch_then_the_first_check_wins_over_the_worst():
    """A fault in micro-batch 0's accumulation is named there, not at micro-batch 2's larger
    ratio; within one micro-batch the reduce-scatter's input comes before the shard it left."""
    rows = [Record(**BASE, check="grad.accum", name="w", step=0, verdict=Verdict.FAIL, ratio=900.0,
                   detail="rank 1 after micro-batch 2"),
            Record(**BASE, check="grad.shard", name="v", step=0, verdict=Verdict.FAIL, ratio=5.0,
                   detail="rank 0 after micro-batch 0"),
            Record(**BASE, check="grad.accum", name="u", step=0, verdict=Verdict.FAIL, ratio=3.0,
                   detail="rank 1 after micro-batch 0")]
    got = first_stage(rows, 2, BASE)
    assert got.detail.startswith("first divergent stage: collectives at step 0, micro-batch 0, rank 1: grad.accum u"), \
        got.detail


def test_the_checkpoint_is_three_stages_save_load_and_the_resumed_step():
    """A checkpoint whose files differ from what was handed to the save is named at the save; one
    loaded wrong at the load, however large the resumed step's ratios; collectives by phase."""
    assert STAGES[-3:] == ("checkpoint-save", "checkpoint-load", "resumed")
    saved = _r("checkpoint.saved", "entry:optim/w/exp_avg")
    loaded = _r("checkpoint.loaded", "native:entry:optim/w/exp_avg")
    resumed = _r("checkpoint.same", "native:param:w", ratio=1e9)
    assert first_stage([resumed, loaded, saved], 2, BASE).name == "checkpoint-save"
    assert first_stage([resumed, loaded], 2, BASE).name == "checkpoint-load"
    assert first_stage([resumed], 2, BASE).name == "resumed"
    # which step's checkpoint: the lifecycle stages once named none (review, twenty-second stop)
    assert first_stage([resumed, loaded], 4, BASE, resume_step=2).detail.startswith(
        "first divergent stage: checkpoint-load (the checkpoint saved after step 1, resumed at step 2)")
    assert [stage_of(_r("checkpoint.collectives", f"native:{p}")) for p in ("save", "load", "step")] == \
        ["checkpoint-save", "checkpoint-load", "resumed"]
    assert stage_of(_r("checkpoint.moved", "legacy:entry:model/w")) == "checkpoint-load"
    assert stage_of(_r("checkpoint.moved", "legacy:param:w")) == "resumed"
    failed = Record(**BASE, check="checkpoint.same", name="native", verdict=Verdict.ERROR,
                    detail="checkpoint from native: rank 0: loading into native failed: KeyError")
    assert stage_of(failed) == "checkpoint-load"


def test_a_record_filed_under_another_cell_locates_nothing_here():
    """A load of this cell's checkpoint that failed in another path is that path's ERROR (filed
    under its cell): this cell, whose own records all held, has no divergent stage."""
    elsewhere = Record(**{**BASE, "cell": "c-raises", "path": "raises"}, check="checkpoint.cross", name="raises",
                       verdict=Verdict.ERROR)
    assert first_stage([_r("grad", "w", 0, verdict=Verdict.PASS), elsewhere], 2, BASE) is None
    assert first_stage([elsewhere, _r("grad", "w", 0)], 2, BASE).name == "gradients"


def test_a_stage_failing_on_every_rank_says_so():
    """Every rank is a witness: a fault on both ranks named rank 1 alone, as if rank 0 held (review)."""
    both = [_r("output", "rank0/mb0", 0, ratio=3.0), _r("output", "rank1/mb0", 0, ratio=5.0)]
    got = first_stage(both, 2, BASE)
    assert "forward at step 0, micro-batch 0, rank 1: output rank1/mb0 (ratio 5); rank 0 failed at this stage too;" \
        in got.detail, got.detail
    assert "failed at this stage too" not in first_stage(both[1:], 2, BASE).detail


def test_a_shard_over_its_allowance_on_every_rank_names_them_all():
    """``grad.shard`` writes one record per parameter, for its worst rank, naming the other ranks
    over the allowance: the stage record counts them as witnesses too (review)."""
    from parity.judge.shards import ALSO

    shard = Record(**BASE, check="grad.shard", name="w", step=0, verdict=Verdict.FAIL, ratio=5.0,
                   detail=f"rank 1 after micro-batch 0, shard at [16, 0]: 2 x u(float32); {ALSO} 0, 2")
    assert "rank 1: grad.shard w (ratio 5); ranks 0, 2 failed at this stage too;" in \
        first_stage([shard], 2, BASE).detail
    alone = Record(**{**shard.__dict__, "detail": "rank 1 after micro-batch 0, shard at [16, 0]: 2 x u(float32)"})
    assert "failed at this stage too" not in first_stage([alone], 2, BASE).detail
