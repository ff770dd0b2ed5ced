"""Matrices as data: TOML files under ``fixtures/matrices/`` expanded into cells.

A matrix file::

    description = "..."
    models = ["pkg.module:factory"] # plugin models (optional); their names join the fixture axis
    steps = 2                       # optimizer steps per cell, when the steps axis is not given (not both)
    design = "product"              # or "covering"
    exhaustive = ["fixture", ...]   # covering only: axes taken as a full product;
                                    # every other axis is covered pairwise per (fixture, path)
    rotate = ["output_dtype"]       # covering only: axes cycled over the rows, not covered
    singly = ["move"]               # covering only: each value in some running cell, not in every pair
    [axes]
    fixture = ["kda", "lm"]
    path = ["legacy", "native"]
    ranks = [1, 2]
    accumulation = ["1", "3:every", "3:last"]   # micro-batches[:sync]
    checkpointing = ["none", "full", "selective"]
    reshard = [true, false]
    output_dtype = ["natural", "float32", "bfloat16", "float16"]
    seed = [0, 1]
    param_dtype = ["bfloat16", "float16"]       # float16 trains with a loss scale
    reduce_dtype = ["float32", "natural"]       # natural: None
    optimizer = ["adamw", "sgd"]
    schedule = ["constant", "decay"]            # the learning rate over the steps (LambdaLR)
    init = ["seeded", "meta"]
    clip = [0.0, 0.01]                          # gradient clipping's max-norm; 0.0: none
    eval = ["none", "between-steps", "between-microbatches"]   # no_grad evaluation forwards
    steps = [2, 4]                              # optimizer steps (the lifecycle resumes in the middle)
    move = ["none", "shrink", "grow", "mesh"]   # a checkpoint saved on one layout, loaded on another
    reduction = ["mean", "sum"]                 # recipe knobs (docs/matrices.md, "Recipe knobs")
    prefetch = ["none", "explicit"]
    reshard_backward = ["every", "last"]
    placement = ["dim0", "dim1"]
    cast_inputs = ["fsdp", "model"]
    unshard_in_backward = ["all", "needed"]

    [[skip]]                        # listed as SKIP with the reason, never dropped
    when = "ranks == 1 and sync == 'last'"
    reason = "..."                  # not empty: it is what the SKIP says

The file is UTF-8. A file naming no axis and no model is refused (it asks for nothing, not for
every default); so are two values that mean the same (``"1"`` and ``"1:every"``),
``exhaustive`` / ``rotate`` / ``singly`` without ``design = "covering"``, a rotated axis that is
exhaustive and a ``singly`` axis that is exhaustive or rotated. The recipe-knob and composition
axes (``mesh``, ``weights``, ``unshard``, ``finalize``, ``offload``, ``reshard_to``, ``compile``,
...) are listed by ``AXES`` and docs/matrices.md.
"""

from __future__ import annotations

import ast
import itertools
import os
import tomllib
import typing
from collections.abc import Callable
from dataclasses import dataclass

from parity.arguments import MAX_STEPS, RANK_COUNTS, SEEDS
from parity.errors import UsageError
from parity.matrix.design import accumulation, fixture_designs, row_cell
from parity.matrix.cell import (CHECKPOINTING, EVALS, INITS, KNOB_VALUES, MOVES, OPTIMIZERS, OUTPUT_DTYPES,
                                PARAM_DTYPES, RECIPE_AXES, REDUCE_DTYPES, SCHEDULES, WEIGHTS, Cell)
from parity.model.topology import MESHES

AXES = ("fixture", "path", "ranks", "accumulation", "checkpointing", "reshard", "output_dtype", "seed", *RECIPE_AXES)
#: The axes every covering design spans, declared or not (an undeclared one at its default value).
#: An axis added later joins a matrix's design only where its file declares it, so adding an
#: axis never reshuffles the cells of a matrix that does not use it (as :data:`RECIPE_AXES`'s
#: tags keep their ids).
DESIGN_AXES = AXES[:AXES.index("move") + 1]
#: What ``-k`` may name: the axes, with ``accumulation`` as its two cell fields.
FILTER_NAMES = ("fixture", "path", "ranks", "microbatches", "sync", *AXES[4:])
#: Axes whose values are checked against a fixed list.
_CHOICES = {"checkpointing": CHECKPOINTING, "output_dtype": OUTPUT_DTYPES, "param_dtype": PARAM_DTYPES,
            "reduce_dtype": REDUCE_DTYPES, "optimizer": OPTIMIZERS, "init": INITS, "mesh": MESHES,
            "weights": WEIGHTS, "eval": EVALS, "move": MOVES, "schedule": SCHEDULES, **KNOB_VALUES}
#: What a ``-k`` / ``skip.when`` expression may contain: comparisons of axis values and literals, joined by
#: ``and`` / ``or`` / ``not``, with ``+ - / //`` -- nothing whose cost grows with a number in it (``*``, ``**``,
#: ``%``, shifts), no calls, attributes, subscripts or comprehensions.
_FILTER_NODES = (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub, ast.UAdd,
                 ast.Compare, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.In, ast.NotIn, ast.Name,
                 ast.Load, ast.Constant, ast.Tuple, ast.List, ast.Set, ast.BinOp, ast.Add, ast.Sub, ast.Div,
                 ast.FloorDiv)
#: The longest ``-k`` / ``skip.when`` expression accepted (characters).
MAX_FILTER = 500
_CELL_TYPES = typing.get_type_hints(Cell)
#: TOML's names of the types a matrix file's values have.
_TOML_TYPES = {str: "string", int: "integer", bool: "boolean", float: "float", list: "array", dict: "table"}


def _matrix_dir() -> str:
    import parity_fixtures

    return os.path.join(os.path.dirname(parity_fixtures.__file__), "matrices")


def available() -> list[str]:
    return sorted(f.removesuffix(".toml") for f in os.listdir(_matrix_dir()) if f.endswith(".toml"))


@dataclass(frozen=True, kw_only=True)
class Matrix:
    name: str
    description: str
    cells: tuple[Cell, ...]
    skips: tuple[tuple[str, str], ...] = ()
    path: str = ""
    """The ``.toml`` file it was read from (its digest names the run in ``run.json``)."""
    """(filter expression, reason) pairs: matching cells are reported as SKIP."""

    def skip_reason(self, cell: Cell) -> str:
        for expr, reason in self.skips:
            if matches(cell, expr, "skip.when"):
                return reason
        return ""


def axis_type(axis: str) -> type:
    """The type of ``axis``'s values in a matrix file: its :class:`Cell` field's (``ranks = [true]`` is no
    rank count); ``accumulation`` (the fields ``microbatches`` and ``sync``) is written ``"K[:sync]"``."""
    return str if axis == "accumulation" else _CELL_TYPES[axis]


def _kind(value) -> str:
    """``value``'s TOML type with its article: ``an integer``, ``a table``."""
    name = _TOML_TYPES.get(type(value), type(value).__name__)
    return ("an " if name[0] in "aeiou" else "a ") + name


def _validate(source: str, axis: str, values, valid=None) -> list:
    """``values`` of ``axis``: a non-empty list of distinct :func:`axis_type` values, each in
    ``valid`` if given."""
    kind = axis_type(axis)
    choices = f"; valid: {', '.join(map(str, valid))}" if valid is not None else ""
    if not isinstance(values, list) or not values:
        raise UsageError(f"{source}: axes.{axis} must be a non-empty array of {_TOML_TYPES[kind]}s{choices}")
    wrong = [v for v in values if type(v) is not kind]
    if wrong:
        raise UsageError(f"{source}: axes.{axis} has {_short(wrong[0])}, {_kind(wrong[0])}; write "
                         f"{_TOML_TYPES[kind]}s{choices}")
    bad = [v for v in values if valid is not None and v not in valid]
    if bad:
        raise UsageError(f"{source}: axes.{axis} has unknown value {bad[0]!r}{choices}")
    twice = next((v for i, v in enumerate(values) if v in values[:i]), None)
    if twice is not None:  # as --paths / --ranks given twice: likely a typo for another value
        raise UsageError(f"{source}: axes.{axis} has {twice!r} twice; give each value once")
    return values


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _typed(source: str, key: str, value, kind: type, item: type | None = None):
    """``value`` of top-level ``key``, which must be a ``kind`` (a list of ``item``, when given)."""
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if ok and item is not None:
        ok = all(isinstance(v, item) for v in value)
    if not ok:
        want = _kind(kind()) + (f" of {_TOML_TYPES[item]}s" if item is not None else "")
        raise UsageError(f"{source}: {key} must be {want}, not {_kind(value)} ({_short(value)})")
    return value


#: Matrices expanded in this process, by file (path and contents), ``models`` and the registered
#: models and paths: a gate expands its matrix again to judge its scope, and ``full`` takes
#: seconds to expand.
_EXPANDED: dict[tuple, Matrix] = {}


def load(name_or_path: str, models: tuple[str, ...] = ()) -> Matrix:
    """Expand a matrix. ``models`` (``--model`` sources) replace its fixture axis. An unchanged
    file is expanded once per process."""
    path = name_or_path
    if not os.path.isfile(path):  # a folder of that name where parity runs is not a matrix file
        path = os.path.join(_matrix_dir(), f"{name_or_path}.toml")
    if not os.path.exists(path):
        raise UsageError(f"unknown matrix {name_or_path!r}; valid: {', '.join(available())} or a .toml file path")
    from parity.model.registry import registered
    from parity.paths import path_names

    try:
        with open(path, "rb") as fh:
            text = fh.read()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the matrix file ({exc.strerror or exc})") from None
    # the file's bytes, and what the expansion reads besides them: the registered models and paths
    key = (os.path.abspath(path), text, tuple(models), tuple(path_names()), tuple(registered()))
    if key not in _EXPANDED:
        _EXPANDED[key] = _expand(path, text, tuple(models))
    else:  # its model files as expanded: an edit since is refused, not run half old, half new
        from parity.model.registry import unchanged

        for source in dict.fromkeys(c.source for c in _EXPANDED[key].cells if c.source):
            unchanged(source)
    return _EXPANDED[key]


def _expand(path: str, text: bytes, models: tuple[str, ...]) -> Matrix:
    """:func:`load`'s work: check and expand ``text``, the matrix file at ``path``."""
    try:
        data = tomllib.loads(text.decode())  # as tomllib.load reads a binary file
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not UTF-8 text (byte {exc.start}); save the matrix file as UTF-8 "
                         "(TOML is UTF-8)") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: not valid TOML ({exc})") from None
    from parity.model.registry import registry
    from parity.paths import path_names

    keys = ("description", "models", "steps", "design", "exhaustive", "rotate", "singly", "axes", "skip")
    unknown = [k for k in data if k not in keys]
    if unknown:
        raise UsageError(f"{path}: unknown key {unknown[0]!r}; valid: {', '.join(keys)}")
    axes_in = _typed(path, "axes", data.get("axes", {}), dict)
    for key in axes_in:
        if key not in AXES:
            raise UsageError(f"{path}: unknown axis axes.{key}; valid: {', '.join(AXES)}")
    sources = _typed(path, "models", data.get("models", []), list, str)
    description = _typed(path, "description", data.get("description", ""), str)
    sources = [os.path.join(os.path.dirname(path), m) if m.partition(":")[0].endswith(".py") else m for m in sources]
    if models:
        sources = list(models)
        axes_in = {k: v for k, v in axes_in.items() if k != "fixture"}
    steps = _typed(path, "steps", data.get("steps", 2), int)
    if "steps" in data and "steps" in axes_in:
        raise UsageError(f"{path}: steps is given twice (steps = {steps} and axes.steps); keep one of them")
    if not 1 <= steps <= MAX_STEPS:
        raise UsageError(f"{path}: steps must be a positive integer up to {MAX_STEPS}, not {steps}")
    models = registry(tuple(sources), label="--model" if models else f"{path}: models entry")
    source_of = {m.name: m.source for m in models.values() if m.source}
    defaults = {"fixture": list(source_of) or list(models), "path": path_names(), "ranks": [1], "accumulation": ["1"],
                "checkpointing": ["none"], "reshard": [True], "output_dtype": ["natural"], "seed": [0],
                **{a: [getattr(Cell, a)] for a in RECIPE_AXES}, "steps": [steps]}
    axes = {a: axes_in.get(a, defaults[a]) for a in AXES}
    _validate(path, "fixture", axes["fixture"], list(models))
    _validate(path, "path", axes["path"], path_names())
    _validate(path, "ranks", axes["ranks"], list(RANK_COUNTS))
    _validate(path, "reshard", axes["reshard"], [True, False])
    for axis, choices in _CHOICES.items():
        _validate(path, axis, axes[axis], list(choices))
    outside = [s for s in _validate(path, "seed", axes["seed"]) if s not in SEEDS]
    if outside:
        raise UsageError(f"{path}: axes.seed has {outside[0]}; seeds run from {SEEDS.start} to {SEEDS.stop - 1} "
                         "(torch.manual_seed)")
    long = [n for n in _validate(path, "steps", axes["steps"]) if not 1 <= n <= MAX_STEPS]
    if long:
        raise UsageError(f"{path}: axes.steps has {long[0]}; write positive integers up to {MAX_STEPS}")
    unclipped = [c for c in _validate(path, "clip", axes["clip"]) if not 0.0 <= c < float("inf")]
    if unclipped:
        raise UsageError(f"{path}: axes.clip has {unclipped[0]}; write finite max-norms >= 0.0 (0.0: no clipping)")
    normal = {}
    for v in _validate(path, "accumulation", axes["accumulation"]):
        same = normal.setdefault(accumulation(path, v), v)
        if same != v:
            raise UsageError(f"{path}: axes.accumulation has {same!r} and {v!r}, the same value; keep one")
    design = _typed(path, "design", data.get("design", "product"), str)
    skips = _skips(path, data)
    if design != "covering":
        given = [k for k in ("exhaustive", "rotate", "singly") if k in data]
        if given:
            raise UsageError(f"{path}: {given[0]} applies to design = \"covering\" only; remove it or set design")
    if design == "product":
        rows = [dict(zip(AXES, vals)) for vals in itertools.product(*(axes[a] for a in AXES))]
    elif design == "covering":
        exhaustive = _typed(path, "exhaustive", data.get("exhaustive", ["fixture", "path"]), list, str)
        bad = [a for a in exhaustive if a not in AXES]
        if bad:
            raise UsageError(f"{path}: exhaustive has unknown axis {bad[0]!r}; valid: {', '.join(AXES)}")
        for must in ("fixture", "path"):
            if must not in exhaustive:
                exhaustive = [must, *exhaustive]
        # one covering per fixture, shared by the paths: pairs are covered for each
        # (fixture, path) and every legacy cell has its native twin to compare with
        rotate = _typed(path, "rotate", data.get("rotate", []), list, str)
        bad = [a for a in rotate if a not in AXES or a in exhaustive]
        if bad:
            raise UsageError(f"{path}: rotate has axis {bad[0]!r} that is unknown or exhaustive; valid: {', '.join(AXES)}")
        singly = _typed(path, "singly", data.get("singly", []), list, str)
        bad = [a for a in singly if a not in AXES or a in exhaustive or a in rotate]
        if bad:
            raise UsageError(f"{path}: singly has axis {bad[0]!r} that is unknown, exhaustive or rotated; valid: "
                             f"{', '.join(AXES)}")
        rest = {a: v for a, v in axes.items() if a not in ("fixture", "path", *rotate)
                and (a in DESIGN_AXES or a in axes_in)}
        designs = fixture_designs(rest, [a for a in AXES if a in exhaustive and a in rest], axes["fixture"],
                                  _listed(skips, axes["path"]) if skips else lambda f, row: False,
                                  {a: axes[a] for a in rotate}, tuple(a for a in singly if a in rest))
        rows = []
        for f in axes["fixture"]:
            for row in designs[f]:  # the axes neither designed nor rotated at their first values
                row = {**{a: axes[a][0] for a in AXES if a not in ("fixture", "path")}, **row}
                rows += [{**row, "fixture": f, "path": p} for p in axes["path"]]
    else:
        raise UsageError(f"{path}: design has unknown value {design!r}; valid: product, covering")
    cells, seen = [], set()
    for row in rows:
        micro, sync = accumulation(path, row["accumulation"])
        try:
            cell = Cell(
                fixture=row["fixture"], path=row["path"], ranks=row["ranks"], microbatches=micro, sync=sync,
                checkpointing=row["checkpointing"], reshard=row["reshard"], output_dtype=row["output_dtype"],
                seed=row["seed"], source=source_of.get(row["fixture"], ""), **{a: row[a] for a in RECIPE_AXES},
            )
        except UsageError as exc:  # a combination no cell can be: name the file and the row
            values = ", ".join(f"{a} = {row[a]!r}" for a in AXES if a in axes_in or a in ("ranks", "fixture"))
            raise UsageError(f"{path}: the combination {values} cannot run ({exc}); narrow the axes, or use "
                             'design = "covering", which leaves such combinations out') from None
        if cell.id not in seen:
            seen.add(cell.id)
            cells.append(cell)
    _evaluates(cells, [when for when, _ in skips], f"{path}: skip.when")
    if not data.get("axes") and not sources:  # an empty or truncated file asks for no default
        raise UsageError(f"{path}: the matrix names no axes and no models; give it an [axes] table with at least "
                         "one axis (docs/matrices.md)")
    name = os.path.basename(path).removesuffix(".toml")
    return Matrix(name=name, description=description, cells=tuple(cells), skips=tuple(skips),
                  path=os.path.abspath(path))


def _skips(path: str, data: dict) -> list[tuple[str, str]]:
    """The file's ``[[skip]]`` entries as (when, reason), each checked."""
    skips = []
    for entry in _typed(path, "skip", data.get("skip", []), list, dict):
        if set(entry) != {"when", "reason"}:
            raise UsageError(f"{path}: each [[skip]] needs exactly the keys when, reason")
        check_filter(_typed(path, "skip.when", entry["when"], str), f"{path}: skip.when")
        reason = _typed(path, "skip.reason", entry["reason"], str)
        if not reason.strip():  # an empty reason would read as "not skipped"
            raise UsageError(f"{path}: a [[skip]] reason is empty; say why its cells are skipped")
        skips.append((entry["when"], reason))
    return skips


def _listed(skips: list[tuple[str, str]], paths: list[str]) -> Callable[[str, dict], bool]:
    """Whether a skip lists the cell a design row makes for ``fixture`` on some path (a row
    whose cell cannot be made, or a skip it cannot evaluate, is left to the cells' own checks)."""
    def listed(fixture: str, row: dict) -> bool:
        for p in paths:
            cell = row_cell(row, fixture=fixture, path=p)
            for when, _ in skips if cell is not None else ():
                try:
                    if matches(cell, when, "skip.when"):
                        return True
                except UsageError:
                    continue
        return False
    return listed


def check_filter(expr: str, what: str = "-k") -> None:
    """Parse and trial-evaluate ``expr`` so bad input fails before anything runs. Its cost is bounded:
    at most :data:`MAX_FILTER` characters of :data:`_FILTER_NODES` (evaluating it is then linear in its
    length)."""
    if not isinstance(expr, str):
        raise UsageError(f"{what}: must be a string expression, not {_short(expr)}")
    if len(expr) > MAX_FILTER:
        raise UsageError(f"{what}: the expression has {len(expr)} characters, more than {MAX_FILTER}; "
                         "select with --paths / --ranks or a shorter expression")
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # ValueError: a NUL byte
        raise UsageError(f"{what}: cannot parse {_short(expr)}; "
                         "write e.g. \"fixture == 'kda' and ranks == 2\"") from None
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id not in FILTER_NAMES:
            raise UsageError(f"{what}: unknown name {node.id!r}; valid: {', '.join(FILTER_NAMES)}")
        if isinstance(node, (ast.Is, ast.IsNot)):  # identity of literals is not their value
            raise UsageError(f"{what}: write == / != instead of is / is not in {_short(expr)}")
        if not isinstance(node, _FILTER_NODES):
            raise UsageError(f"{what}: only comparisons of axis values joined by and / or / not (and + - / //) are "
                             f"allowed; {type(node).__name__} in {_short(expr)} is not")
    matches(Cell(fixture="kda", path="legacy"), expr, what)


def _evaluates(cells: list[Cell], exprs: list[str], what: str) -> None:
    """Evaluate every expression on every cell now, so one that fails on some cell only (a
    division by zero there) is bad input before anything runs, not an error in mid-run."""
    if not exprs:
        return
    codes = [(expr, compile(expr, "<filter>", "eval")) for expr in exprs]
    for cell in cells:
        for expr, code in codes:
            _evaluate(code, cell, f"{what}: cannot evaluate {expr!r} on cell {cell.id}")


def _evaluate(code, cell: Cell, failed: str) -> bool:
    """``code`` (a checked expression, compiled) on ``cell``'s axis values; any error is bad input,
    a :class:`UsageError` beginning with ``failed``."""
    values = {k: v for k, v in cell.axes().items() if k in FILTER_NAMES}
    try:
        return bool(eval(code, {"__builtins__": {}}, values))  # noqa: S307 - checked by check_filter
    except Exception as exc:  # noqa: BLE001 - any evaluation error is bad input
        raise UsageError(f"{failed} ({type(exc).__name__}: {exc})") from None


def matches(cell: Cell, expr: str, what: str = "-k") -> bool:
    return _evaluate(compile(expr, "<filter>", "eval"), cell, f"{what}: cannot evaluate {expr!r}")


def select(cells, expr: str | None):
    if not expr:
        return list(cells)
    check_filter(expr)
    return [c for c in cells if matches(c, expr)]
