import itertools
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parity.errors import UsageError
from parity.matrix.design import covering
from parity.matrix.load import AXES, load, select


def test_smoke_is_every_fixture_path_rank_and_accumulation():
    m = load("smoke")
    assert len(m.cells) == 6 * 2 * 2 * 2
    assert {(c.microbatches, c.sync) for c in m.cells} == {(1, "every"), (3, "last")}
    assert {c.reshard for c in m.cells} == {True}
    by_pair = {}
    for c in m.cells:
        by_pair.setdefault(c.pair_id, set()).add(c.path)
    assert all(p == {"legacy", "native"} for p in by_pair.values())


def test_default_has_at_least_400_cells_and_every_axis_value():
    m = load("default")
    assert len(m.cells) >= 400
    assert {c.checkpointing for c in m.cells} == {"none", "full", "selective"}
    assert {(c.microbatches, c.sync) for c in m.cells} == {(1, "every"), (3, "every"), (3, "last")}
    assert {c.reshard for c in m.cells} == {True, False}
    assert {c.output_dtype for c in m.cells} == {"natural", "float32", "bfloat16", "float16"}
    assert {c.seed for c in m.cells} == {0, 1}
    assert {c.ranks for c in m.cells} == {1, 2}


def test_default_covers_every_pair_per_fixture_and_path():
    m = load("default")
    names = ["ranks", "accumulation", "checkpointing", "reshard", "output_dtype", "seed"]

    def value(c, a):
        return f"{c.microbatches}:{c.sync}" if a == "accumulation" else getattr(c, a)

    for fixture, path in itertools.product({c.fixture for c in m.cells}, ("legacy", "native")):
        group = [c for c in m.cells if c.fixture == fixture and c.path == path]
        for a, b in itertools.combinations(names, 2):
            want = {(x, y) for x in {value(c, a) for c in m.cells} for y in {value(c, b) for c in m.cells}}
            assert {(value(c, a), value(c, b)) for c in group} == want, (fixture, path, a, b)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 4), min_size=2, max_size=5),
    n_exhaustive=st.integers(0, 2),
)
def test_covering_design_covers_all_pairs(sizes, n_exhaustive):
    axes = {f"a{i}": list(range(n)) for i, n in enumerate(sizes)}
    exhaustive = list(axes)[:n_exhaustive]
    rows = covering(axes, exhaustive)
    for a, b in itertools.combinations(axes, 2):
        assert {(r[a], r[b]) for r in rows} == set(itertools.product(axes[a], axes[b]))
    base = set(itertools.product(*(axes[a] for a in exhaustive)))
    assert {tuple(r[a] for a in exhaustive) for r in rows} == base


def test_a_pair_one_exhaustive_combination_cannot_run_is_covered_where_another_can():
    """A move runs on two ranks only: the design once tried every missing pair at the first row's
    exhaustive values (one rank), and dropped it there as if no row could run it (review,
    twenty-second stop)."""
    axes = {"ranks": [1, 2], "clip": [0.0, 0.01], "move": ["none", "grow"], "eval": ["none", "between-steps"]}
    moving_on_one = lambda row: {"move"} if row.get("move") == "grow" and row.get("ranks") == 1 else set()  # noqa: E731
    rows = covering(axes, ["ranks"], moving_on_one)
    honest = [r for r in rows if not moving_on_one(r)]
    for other in ("clip", "eval"):
        assert {(r["move"], r[other]) for r in honest} == set(itertools.product(axes["move"], axes[other])), other


def test_a_singly_axis_has_each_value_run_not_every_pair():
    """A move runs only on the checkpoint lifecycle's one exhaustive combination: pairing it
    with every value of the others took default from 444 cells to 516, all of the costliest
    kind; ``singly`` runs each of its values, the other axes still pairwise."""
    axes = {"ranks": [1, 2], "clip": [0.0, 0.01], "eval": ["none", "a", "b"], "move": ["none", "grow", "shrink"]}
    one_rank = lambda row: {"move"} if row.get("move") != "none" and row.get("ranks") == 1 else set()  # noqa: E731
    rows = covering(axes, ["ranks"], one_rank, singly=("move",))
    honest = [r for r in rows if not one_rank(r)]
    assert {r["move"] for r in honest} == set(axes["move"])
    assert {(r["clip"], r["eval"]) for r in honest} == set(itertools.product(axes["clip"], axes["eval"]))
    assert len(rows) < len(covering(axes, ["ranks"], one_rank))


def test_a_skip_keeps_its_cells_listed_and_its_pairs_run_elsewhere():
    """Skips were applied after one shared design: a pair whose only row a skip lists for one
    fixture never ran there. That fixture now gets rows beside the listed ones."""
    from parity.matrix.design import fixture_designs

    axes = {"ranks": [1, 2], "param_dtype": ["bfloat16", "float16"], "optimizer": ["adamw", "sgd"],
            "clip": [0.0, 0.01]}
    listed = lambda f, row: f == "frozen" and row.get("param_dtype") == "float16"  # noqa: E731
    designs = fixture_designs(axes, ["ranks"], ["kda", "frozen"], listed)
    shared = designs["kda"]
    assert designs["frozen"][:len(shared)] == shared  # the listed rows stay, SKIP with their reason
    ran = [r for r in designs["frozen"] if not listed("frozen", r)]
    for a, b in (("ranks", "optimizer"), ("ranks", "clip"), ("optimizer", "clip")):
        assert {(r[a], r[b]) for r in ran} == set(itertools.product(axes[a], axes[b])), (a, b)


def test_a_skip_of_a_rotated_value_is_read_on_the_row_that_takes_it(tmp_path):
    """The skip-aware rows once read each row with its rotated axes at their defaults: a skip of
    a rotated value listed cells whose pairs then ran nowhere (review, twenty-second stop)."""
    path = tmp_path / "rot.toml"
    path.write_text('design = "covering"\nexhaustive = ["fixture", "path", "ranks"]\nrotate = ["output_dtype"]\n'
                    '[axes]\nfixture = ["kda", "lm"]\npath = ["native"]\nranks = [1, 2]\nreshard = [true, false]\n'
                    'clip = [0.0, 0.01]\noutput_dtype = ["natural", "float32"]\n[[skip]]\n'
                    'when = "fixture == \'lm\' and output_dtype == \'float32\' and clip == 0.01"\nreason = "r"\n')
    m = load(str(path))
    runs = [c for c in m.cells if c.fixture == "lm" and not m.skip_reason(c)]
    assert any(m.skip_reason(c) for c in m.cells)
    for a, b in (("ranks", "clip"), ("ranks", "reshard"), ("reshard", "clip")):
        assert {(getattr(c, a), getattr(c, b)) for c in runs} == {(x, y) for x in {getattr(c, a) for c in m.cells}
                                                                  for y in {getattr(c, b) for c in m.cells}}, (a, b)


def test_every_shipped_covering_runs_each_pair_for_each_fixture_and_path():
    """The claim docs/matrices.md makes, over the cells a matrix runs (not skipped): each pair of
    values of two free axes that some cell of the fixture and path can run (the other free axes
    at their first values) is run by one."""
    import tomllib

    from parity.matrix.design import row_cell
    from parity.matrix.load import _matrix_dir

    def runnable(m, row, f, p, a, b):
        cell = row_cell(row, fixture=f, path=p)
        return (cell is not None and getattr(cell, a) == row[a] and getattr(cell, b) == row[b]
                and not m.skip_reason(cell))

    import importlib.util

    hf = ("models",) if importlib.util.find_spec("transformers") else ()
    for name in ("default", "configs", "knobs", "schedules", "backward-free", "cast-inputs", "grad-dtype", *hf):
        with open(os.path.join(_matrix_dir(), f"{name}.toml"), "rb") as fh:
            data = tomllib.load(fh)
        m = load(name)
        axes = {"fixture": sorted({c.fixture for c in m.cells}), **data["axes"]}
        exhaustive = [a for a in data.get("exhaustive", []) if a not in ("fixture", "path")]
        singly = data.get("singly", [])
        free = [a for a in axes if a not in exhaustive + ["fixture", "path", "accumulation"] + data.get("rotate", [])
                + singly]
        runs = [c for c in m.cells if not m.skip_reason(c)]
        for f, p in itertools.product(axes["fixture"], axes["path"]):
            mine = [c for c in runs if c.fixture == f and c.path == p]
            for a in singly:  # each value runs (a move: where the checkpoint lifecycle does)
                assert {getattr(c, a) for c in mine} == set(axes[a]), (name, f, p, a)
            for a, b in itertools.combinations(free, 2):
                held = {(getattr(c, a), getattr(c, b)) for c in mine}
                for va, vb in itertools.product(axes[a], axes[b]):
                    if (va, vb) in held:
                        continue
                    can = any(runnable(m, {**dict(zip(exhaustive, base)), a: va, b: vb}, f, p, a, b)
                              for base in itertools.product(*(axes[x] for x in exhaustive)))
                    assert not can, (name, f, p, (a, va), (b, vb))


def test_filter_expressions():
    cells = load("smoke").cells
    picked = select(cells, "fixture == 'kda' and ranks == 2 and microbatches == 3")
    assert {(c.fixture, c.ranks, c.microbatches) for c in picked} == {("kda", 2, 3)}
    with pytest.raises(UsageError, match="unknown name 'rank'"):
        select(cells, "rank == 2")
    with pytest.raises(UsageError, match="cannot parse"):
        select(cells, "fixture ==")
    with pytest.raises(UsageError, match="only comparisons"):
        select(cells, "__import__('os')")


@pytest.mark.parametrize(
    "body, message",
    [
        ("[axes]\nfixture = ['nope']\n", "axes.fixture has unknown value 'nope'; valid: kda, lm"),
        ("[axes]\ncolour = ['red']\n", "unknown axis axes.colour; valid: fixture, path"),
        ("[axes]\naccumulation = ['3:sometimes']\n", "axes.accumulation has unknown value '3:sometimes'"),
        ("[axes]\noutput_dtype = ['float8']\n", "axes.output_dtype has unknown value 'float8'; valid: natural, float32"),
        ("design = 'random'\n", "design has unknown value 'random'; valid: product, covering"),
        ("singly = ['move']\n[axes]\nmove = ['none']\n", "singly applies to design = \"covering\" only"),
        ("design = 'covering'\nsingly = ['ranks']\nexhaustive = ['ranks']\n[axes]\nranks = [1]\n",
         "singly has axis 'ranks' that is unknown, exhaustive or rotated"),
        ("[axes\n", "not valid TOML"),
        ("steps = 0\n", "steps must be a positive integer"),
        ("[axes]\nclip = [-1.0]\n", "axes.clip has -1.0; write finite max-norms >= 0.0"),
        ("[axes]\nclip = [0]\n", "axes.clip has 0, an integer; write floats"),
        ("[axes]\nsteps = [0]\n", "axes.steps has 0; write positive integers up to 1000"),
        ("[[skip]]\nwhen = 'x == 1'\nreason = 'r'\n", "unknown name 'x'"),
    ],
)
def test_malformed_matrix_is_a_one_line_error_naming_file_and_key(tmp_path, body, message):
    path = tmp_path / "bad.toml"
    path.write_text(body)
    with pytest.raises(UsageError) as err:
        load(str(path))
    assert str(path) in str(err.value) and message in str(err.value)
    assert "\n" not in str(err.value)


def test_skips_are_listed_not_dropped(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text("[axes]\nfixture = ['kda']\nranks = [1, 2]\n[[skip]]\nwhen = 'ranks == 2'\nreason = 'two ranks not wanted here'\n")
    m = load(str(path))
    assert len(m.cells) == 4
    assert [m.skip_reason(c) for c in m.cells if c.ranks == 2] == ["two ranks not wanted here"] * 2


def test_axes_constant_is_the_documented_set():
    assert AXES == ("fixture", "path", "ranks", "accumulation", "checkpointing", "reshard", "output_dtype", "seed",
                    "param_dtype", "reduce_dtype", "optimizer", "init", "mesh", "weights", "clip", "eval", "steps", "move",
                    "reduction", "prefetch", "reshard_backward", "placement", "cast_inputs", "unshard_in_backward",
                    "unshard", "finalize", "offload", "reshard_to", "compile", "schedule", "flags")


def test_run_order_interleaves_rank_counts_and_keeps_groups_whole():
    """Each rank count's pair groups keep their order, a group runs whole with its baseline
    first, and the 1- and 2-rank groups alternate as their pools would reach them side by
    side, so the runner can keep both pools busy (every pool's next cell is close ahead)."""
    from parity.matrix.order import order_cells
    from parity.runner import LOOKAHEAD

    cells = list(load("default").cells)
    ordered = order_cells(cells)
    assert sorted(c.id for c in ordered) == sorted(c.id for c in cells)
    groups = list(dict.fromkeys(c.pair_id for c in ordered))
    for world in (1, 2):
        mine = [g for g in dict.fromkeys(c.pair_id for c in cells) if f"/r{world}/" in f"/{g}/"]
        assert [g for g in groups if g in set(mine)] == mine
    runs = [list(g) for _, g in itertools.groupby(ordered, key=lambda c: c.pair_id)]
    assert len(runs) == len(groups)  # a group's cells are adjacent
    assert all(run[0].path == run[0].baseline for run in runs)
    for i in range(len(ordered) - LOOKAHEAD):
        window = ordered[i + 1:i + 1 + LOOKAHEAD]
        left = {c.ranks for c in ordered[i + 1:]}
        assert left <= {c.ranks for c in window}, f"a pool's next cell is more than {LOOKAHEAD} cells after {i}"


def test_a_value_given_on_the_command_line_folds_the_cells_it_made_equal(tmp_path):
    from parity.cli import RUN_DEFAULTS, _select

    path = tmp_path / "s.toml"
    path.write_text('[axes]\nfixture = ["kda"]\nsteps = [2, 4]\nseed = [0, 1]\n')
    for options, cells in ({"steps": 3}, 4), ({"seed": 1}, 4), ({"steps": 3, "seed": 1}, 2):
        ids = [c.id for c in _select({**RUN_DEFAULTS, "matrix": str(path), **options})[1]]
        assert len(ids) == len(set(ids)) == cells, ids
