"""The learning-rate schedule (``schedule`` axis): the recipe's ``LambdaLR`` against the schedule's
own formula, the axis and its run option, and a scheduled cell's checkpoint lifecycle -- the
scheduler saved, loaded into both paths and onto another layout, its rates after the resumed step
held to the uninterrupted run's."""

import pytest
import torch

import parity
from parity.errors import UsageError
from parity.matrix.cell import SCHEDULES, Cell
from parity.model.recipe import LR, make_scheduler, scheduled_lr


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_recipe_s_scheduler_gives_the_schedule_s_rates_bitwise(schedule):
    """Two oracles: ``LambdaLR`` as the recipe builds it, stepped once per optimizer step, and the
    schedule's formula the reference sets by hand agree bit for bit at every step, in every group."""
    groups = [{"params": [torch.nn.Parameter(torch.ones(2))]}, {"params": [torch.nn.Parameter(torch.ones(3))]}]
    opt = torch.optim.AdamW(groups, lr=LR)
    sched = make_scheduler(opt, schedule)
    assert (sched is None) == (schedule == "constant")
    rates = []
    for _ in range(12):
        rates.append([g["lr"] for g in opt.param_groups])
        opt.step()
        if sched is not None:
            sched.step()
    assert rates == [[scheduled_lr(schedule, k)] * 2 for k in range(12)]
    if schedule != "constant":  # every step's rate differs from the next: one step off shows
        assert len({r[0] for r in rates[:8]}) == 8 and min(r[0] for r in rates[:4]) >= LR / 2


def test_a_schedule_is_an_axis_a_tag_and_a_run_option():
    with pytest.raises(UsageError, match="schedule: unknown value 'cosine'; valid: constant, decay"):
        Cell(fixture="kda", path="native", schedule="cosine")
    assert Cell(fixture="kda", path="native", schedule="decay").id.endswith("/lr-decay")
    assert Cell(fixture="kda", path="native").id == Cell(fixture="kda", path="native", schedule="constant").id
    _, cells, _ = parity.select(matrix="smoke", filter="fixture == 'kda'", schedule="decay")
    assert cells and {c.schedule for c in cells} == {"decay"}


@pytest.mark.slow
def test_a_scheduled_checkpoint_resumes_the_schedule_on_both_paths_and_another_layout(tmp_path):
    """A 4-step cell saves after step 1's scheduler step and resumes step 2 on both paths; a grown
    checkpoint (1 -> 2 ranks) resumes it on the other layout. Green is earned: every step's rate was
    judged, the scheduler's state went through the files, and each resumed run's next rate -- the
    one trace of a scheduler the load did not restore -- was held to the uninterrupted run's."""
    result = parity.run(matrix="smoke", out=str(tmp_path / "lr"), quiet=True, schedule="decay",
                        filter="fixture == 'kda' and ranks == 2 and microbatches == 1", steps=4, move="grow")
    rows = result.cells
    assert result.code == 0, rows[rows["verdict"] != "PASS"][["check", "name", "detail"]].head().to_string()
    cells = set(rows["cell"])
    assert cells and all(c.endswith("/lr-decay") for c in cells)
    trained = {c for c in cells if "/legacy/" in c or "/native/" in c}  # the other: the pair's cross-path rows
    lr = rows[rows["check"] == "lr"]
    assert len(trained) == 2 and len(lr) == 4 * len(trained) and set(lr["verdict"]) == {"PASS"}
    resumed = rows[rows["check"].isin(["checkpoint.same", "checkpoint.cross"]) & rows["name"].str.endswith(":lr")]
    assert set(resumed["name"]) == {"legacy:lr", "native:lr"} and set(resumed["verdict"]) == {"PASS"}
    moved = rows[(rows["check"] == "checkpoint.moved") & rows["name"].str.endswith(":lr:rates")]
    assert set(moved["name"]) == {"legacy:lr:rates", "native:lr:rates"} and set(moved["verdict"]) == {"PASS"}
    entries = rows[rows["check"].isin(["checkpoint.saved", "checkpoint.loaded"])
                   & rows["name"].str.contains("scheduler/last_epoch")]
    assert len(entries) >= 3 and set(entries["verdict"]) == {"PASS"}
