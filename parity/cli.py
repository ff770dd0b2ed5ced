"""``python -m parity``: ``plan``, ``run``, ``gate``, ``merge``, ``bench``, ``compare``, ``report``, ``fuzz``, ``fixtures``.

Exit codes (README, "Exit codes"): 0 only with evidence (the work done, nothing wrong found; a
closed stdout does not change it); 1 a bad verdict (a cell FAIL/ERROR/TIMEOUT/INCONCLUSIVE, a
NO-GO or PARTIAL gate, a regression); 2 bad input, refused before any work (one line naming the
thing and the fix; a model source exiting at import, an output directory in use, a ``--resume``
of something that changed); 74 a result file could not be written (disk full:
:class:`~parity.errors.OutputError`); 130/143 interrupted by SIGINT/SIGTERM (:mod:`parity.interrupt`),
whatever the command.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import os
import re
import sys

from parity.arguments import csv_list as _csv
from parity.arguments import max_norm as _max_norm
from parity.arguments import positive as _positive
from parity.arguments import seed as _seed
from parity.arguments import shard as _shard
from parity.arguments import steps as _steps
from parity.bench.run import add_bench_arguments, bench_command
from parity.errors import EXIT_OUTPUT, OutputError, UsageError
from parity.fuzz import add_fuzz_arguments, fuzz_command
from parity.interrupt import Interrupted, Signals, exit_code, raising
from parity.matrix.cell import EVALS, INITS, KNOB_VALUES, MOVES, OPTIMIZERS, PARAM_DTYPES, REDUCE_DTYPES, WEIGHTS
from parity.model.topology import MESHES

#: Recipe knobs, as run options (:mod:`parity.execute.knobs`), with what each sets.
KNOB_HELP = {
    "reduction": "gradient reduction (sum: the loss is divided by the data-parallel ranks and FSDP sums, "
                 "set_gradient_divide_factor(1.0))",
    "prefetch": "prefetching (explicit: each block unit prefetches the next in forward, the previous in backward)",
    "reshard_backward": "resharding after backward (last: units stay gathered across a step's micro-batches, "
                        "set_reshard_after_backward)",
    "placement": "shard placement (dim1: shard_placement_fn shards parameters of two or more dimensions on "
                 "dimension 1)",
    "cast_inputs": "input casting (model: every unit's cast_forward_inputs=False, the model casts its own inputs; "
                   "needs Fixture.casts_inputs)",
    "unshard_in_backward": "backward all-gathers (needed: set_unshard_in_backward(False) on Fixture.backward_free "
                           "units, e.g. an embedding)",
    "unshard": "gathering (explicit: every unit's unshard(async_op=True) before each forward; evaluation with "
               "set_reshard_after_forward(False), then reshard())",
    "finalize": "backward finalization (flagged: set_is_last_backward per micro-batch; manual: "
                "set_manual_backward_finalization + finalize_backward(async_op=True))",
    "offload": "offloading (cpu: CPUOffloadPolicy on every fully_shard call; on a CPU device FSDP still takes its "
               "offload branches)",
    "reshard_to": "resharding after forward (half: reshard_after_forward as an int, half the ranks; 4 or more ranks)",
}
KNOB_OPTIONS = tuple(KNOB_HELP)
#: Run options that set one axis for every cell (replacing the matrix's values).
AXIS_OPTIONS = ("seed", "param_dtype", "reduce_dtype", "optimizer", "init", "mesh", "weights", "clip", "eval", "move",
                *KNOB_OPTIONS)
#: ``run`` options that define what a run computes; ``--resume`` requires them unchanged.
RUN_IDENTITY = ("matrix", "paths", "ranks", "filter", "seed", "steps", "fault", "model", "baseline", "device",
                "fp64", "require_native", "param_dtype", "reduce_dtype", "optimizer", "init", "mesh", "weights",
                "clip", "eval", "move", *KNOB_OPTIONS, "shard")
RUN_DEFAULTS = {"matrix": "smoke", "paths": None, "ranks": None, "filter": None, "seed": None, "steps": None,
                "param_dtype": None, "reduce_dtype": None, "optimizer": None, "init": None, "mesh": None, "weights": None,
                "clip": None, "eval": None, "move": None, **dict.fromkeys(KNOB_OPTIONS), "fault": [], "shard": None,
                "model": [], "baseline": "legacy", "device": "auto", "fp64": False, "require_native": False,
                "timeout": 60.0, "out": "results/latest", "junit": None}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, instead of argparse's usage block
        raise UsageError(f"{message} (see {self.prog} --help)")


def _run_arguments(p: argparse.ArgumentParser, matrix: str, out: str = "results/latest") -> None:
    """Options shared by ``run`` and ``gate`` (what to run and how)."""
    p.add_argument("--matrix", help=f"matrix name (fixtures/matrices) or .toml path (default: {matrix})")
    p.add_argument("--model", action="append", help="plugin model source; replaces the matrix's fixture axis")
    p.add_argument("--paths", help="comma list of registered paths replacing the matrix's path axis, e.g. legacy,native")
    p.add_argument("--baseline", help="path every other path is compared with (default: legacy)")
    p.add_argument("--ranks", help="comma list of rank counts, e.g. 1,2")
    p.add_argument("-k", dest="filter", help="expression over axis values, e.g. \"fixture == 'kda' and ranks == 2\"")
    p.add_argument("--out", help=f"output directory (default: {out})")
    p.add_argument("--overwrite", action="store_true", help="replace another run's results in --out")
    p.add_argument("--resume", metavar="DIR", help="continue the interrupted run recorded in DIR")
    p.add_argument("--seed", type=_seed, help="run every cell with this seed instead of the matrix's")
    p.add_argument("--steps", type=_steps, help="optimizer steps per cell instead of the matrix's (at most 1000)")
    p.add_argument("--param-dtype", choices=PARAM_DTYPES, help="every cell's param_dtype (float16 adds a loss scale)")
    p.add_argument("--reduce-dtype", choices=REDUCE_DTYPES, help="every cell's reduce_dtype (natural: None)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, help="every cell's optimizer")
    p.add_argument("--init", choices=INITS, help="every cell's initialization (meta: build on meta, to_empty, load)")
    p.add_argument("--mesh", choices=MESHES, help="every cell's composition (hsdp, fsdp+tp, ep need 4 ranks)")
    p.add_argument("--weights", choices=WEIGHTS, help="every cell's weight format of the quantizable layers")
    p.add_argument("--clip", type=_max_norm, metavar="MAX_NORM",
                   help="every cell clips its gradients to this global norm (0: no clipping)")
    p.add_argument("--eval", choices=EVALS, help="every cell's evaluation forwards (no_grad, model.eval())")
    p.add_argument("--move", choices=MOVES, help="every cell's moving checkpoint (shrink 2->1, grow 1->2, mesh "
                   "fsdp<->hsdp); none where the cell runs no checkpoint lifecycle")
    for knob, what in KNOB_HELP.items():
        p.add_argument("--" + knob.replace("_", "-"), choices=KNOB_VALUES[knob], help=f"every cell's {what}")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    p.add_argument("--timeout", type=_positive, help="seconds without progress before a cell is a TIMEOUT (60)")
    p.add_argument("--fp64", action="store_true", default=None, help="also record errors against an FP64 reference")
    p.add_argument("--fault", action="append", help="inject a deliberate fault (testing the checks)")
    p.add_argument("--junit", metavar="FILE", help="also write JUnit XML (one test case per cell x check)")
    p.add_argument("--require-native", action="store_true", default=None,
                   help="a fallback the fixture does not declare (unsupported build included) is a FAIL")
    p.add_argument("--shard", type=_shard, metavar="I/N",
                   help="run part I of N of the selection (CI fan-out; join the parts with parity merge)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="parity", description="FSDP2 mixed-precision parity harness")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser,
                           metavar="{plan,run,gate,merge,repro,bench,compare,report,fuzz,fixtures}")
    plan = sub.add_parser("plan", help="print a model's precision plan and every path's units")
    plan.add_argument("--fixture", help="registered model name (parity fixtures)")
    plan.add_argument("--model", help="plugin model: pkg.module:factory or path/file.py:factory")
    plan.add_argument("--param-dtype", default="bfloat16")
    plan.add_argument("--reduce-dtype", default="float32")
    plan.add_argument("--output-dtype", default="natural")
    sub.add_parser("fixtures", help="list models, paths and matrices")
    run = sub.add_parser("run", help="run a matrix of cells and judge them")
    _run_arguments(run, "smoke")
    run.add_argument("--list", action="store_true", help="print the selected cells and exit")
    gate = sub.add_parser("gate", help="GO / NO-GO per model for enabling the native path")
    _run_arguments(gate, "default", "results/gate")
    gate.add_argument("--from", dest="from_dir", metavar="DIR", help="judge an existing results directory instead")
    gate.add_argument("--candidate", default="native", help="the path whose enabling is decided (native)")
    gate.add_argument("--compare-to", metavar="DIR", help="also NO-GO on a regression against these results "
                      "(parity compare; --baseline names the baseline *path*)")
    mrg = sub.add_parser("merge", help="join the parts of a sharded run (--shard I/N) into one results directory")
    mrg.add_argument("parts", nargs="+", metavar="DIR", help="every part's --out directory")
    mrg.add_argument("--out", required=True, help="the merged results directory")
    mrg.add_argument("--overwrite", action="store_true", help="replace another run's results in --out")
    mrg.add_argument("--junit", metavar="FILE", help="also write JUnit XML")
    mrg.add_argument("--gate", action="store_true", help="also decide GO / NO-GO (gate.json, gate.md) as gate --from does")
    mrg.add_argument("--candidate", default="native", help="with --gate: the path whose enabling is decided (native)")
    add_fuzz_arguments(sub)
    rpr = sub.add_parser("repro", help="write a self-contained script re-running one cell of a results directory")
    rpr.add_argument("cell", metavar="CELL_ID", help="a cell id as cells.csv names it")
    rpr.add_argument("--from", dest="from_dir", required=True, metavar="DIR", help="the run's --out directory")
    rpr.add_argument("--out", metavar="FILE", help="where to write the script (default: print it)")
    rep = sub.add_parser("report", help="(re)write DIR/report.html from a results directory")
    rep.add_argument("dir", help="a parity results directory (cells.csv; gate.json and bench.md if present)")
    cmp = sub.add_parser("compare", help="two result directories side by side; exit 1 on a regression")
    cmp.add_argument("old", help="baseline results directory (cells.csv / bench.csv, or a digest.json)")
    cmp.add_argument("new", help="results directory to judge")
    cmp.add_argument("--factor", type=_positive, default=2.0, help="a check's worst ratio may grow this much (2)")
    cmp.add_argument("--write-digest", metavar="DIR", help="also write NEW's digest.json into DIR (a baseline)")
    add_bench_arguments(sub)
    return p


def _models_for_plan(args) -> list:
    from parity.model.registry import get_fixture, load_source

    if not args.fixture and not args.model:
        raise UsageError("plan: give --fixture NAME, --model pkg.module:factory, or both (a model of that source)")
    if args.model and not args.fixture:
        return list(load_source(args.model))  # every model the factory returns
    return [get_fixture(args.fixture, args.model or "")]


def cmd_plan(args) -> int:
    from parity.model.dtypes import parse_dtype
    from parity.model.plan import PrecisionConfig

    config = PrecisionConfig(
        param_dtype=parse_dtype(args.param_dtype, what="--param-dtype"),
        reduce_dtype=parse_dtype(args.reduce_dtype, what="--reduce-dtype", allow_natural=True),
        output_dtype=parse_dtype(args.output_dtype, what="--output-dtype", allow_natural=True),
    )
    for i, fixture in enumerate(_models_for_plan(args)):
        print(("\n" if i else "") + _describe_plan(fixture, config))
    return 0


def _describe_plan(fixture, config) -> str:
    """The resolved plan, the model's own FP32 declaration beside it, the tensors the two
    FP32 name rules resolve differently, and every path's units."""
    from parity.judge.plan import declared_fp32
    from parity.model.plan import canonical_fqn, fp32_disagreements, matches
    from parity.paths import path_names, plan_sharding

    model = fixture.make(0)
    ignored = fixture.ignored(model)
    plan = fixture.resolve(model, config, ignored)
    out = [f"fixture {fixture.name}: {fixture.description}", "", plan.table(), ""]
    resolved = declared_fp32(plan)
    if fixture.expect_fp32 is None:
        out.append(f"FP32 (rule {fixture.fp32_rule}): {', '.join(sorted(resolved)) or 'none'}; "
                   "declared: not declared (Fixture.expect_fp32)")
    else:
        declared = set(fixture.expect_fp32)
        differ = sorted(resolved ^ declared)
        out.append(f"FP32 (rule {fixture.fp32_rule}): {', '.join(sorted(resolved)) or 'none'}; declared "
                   + ("the same" if not differ else f"differently for {', '.join(differ)} (the plan check fails)"))
    tensors = [canonical_fqn(n) for n, _ in [*model.named_parameters(), *model.named_buffers()]]
    for pattern in fixture.keep_fp32:  # a generic pattern may select nothing; a typo always does
        if not any(matches(fqn, pattern, fixture.fp32_rule) for fqn in tensors):
            out.append(f"note: Fixture.keep_fp32 pattern {pattern!r} selects no parameter or buffer "
                       f"(rule {fixture.fp32_rule}); a typo keeps nothing in FP32 (Fixture.expect_fp32 would catch it)")
    for fqn, by_framework, by_tokens in fp32_disagreements(model, fixture.keep_fp32):
        out.append(f"rules disagree: {fqn} is {'FP32' if by_framework else 'not FP32'} under transformers' rule, "
                   f"{'FP32' if by_tokens else 'not FP32'} under whole name parts (Fixture.fp32_rule)")
    for path in path_names():
        out.append("")
        try:
            out.append(plan_sharding(model, fixture.unit_roots, plan, path, ignored).describe())
        except ValueError as exc:
            out.append(f"path requested={path}: error: {exc}")
    return "\n".join(out)


def cmd_fixtures(args) -> int:
    from parity.matrix import available, load
    from parity.model.registry import registry
    from parity.paths import paths

    for f in registry().values():
        print(f"{f.name:<14} {f.description}")
    print()
    for name, path in paths().items():
        fallback = f", falls back to {path.fallback}" if path.fallback else ""
        print(f"{name:<14} path ({path.contract}{fallback})")
    print()
    for name in available():
        try:
            m = load(name)
        except UsageError as exc:  # e.g. a matrix of optional plugin models not installed here
            print(f"{name:<14} {'-':>5}        unavailable here: {exc}")
            continue
        print(f"{name:<14} {len(m.cells):>5} cells  {m.description}")
    return 0


def _run_settings(args, defaults: dict) -> dict:
    """The effective run options: given > recorded (``--resume``) > defaults."""
    given = {k: getattr(args, k) for k in defaults if getattr(args, k) not in (None, [])}
    if not args.resume:
        return {**defaults, **given}
    from parity.report.outdir import read_manifest

    if "out" in given and os.path.abspath(given["out"]) != os.path.abspath(args.resume):
        raise UsageError(f"--resume {args.resume} writes into that directory; drop --out {given['out']}")
    if args.overwrite:
        raise UsageError("--resume continues a run and --overwrite replaces one; give only one of them")
    recorded = read_manifest(args.resume).get("options")
    if not isinstance(recorded, dict):
        raise UsageError(f"--resume {args.resume}: run.json records no options (not a parity run directory)")
    wrong = [k for k in RUN_IDENTITY if k in recorded and not _as_parsed(k, recorded[k])]
    if wrong:
        raise UsageError(f"--resume {args.resume}: run.json records {wrong[0]} {recorded[wrong[0]]!r}, which that "
                         "option cannot be (the file was edited); start a new run with --overwrite")
    for key, value in given.items():
        if key in RUN_IDENTITY and recorded.get(key) != value:
            raise UsageError(f"--resume {args.resume}: {key} differs from the interrupted run's "
                             f"({recorded.get(key)!r} recorded, {value!r} given); drop it or start a new run")
    return {**defaults, **recorded, **given, "out": args.resume}


@functools.cache
def _run_actions() -> dict[str, argparse.Action]:
    p = argparse.ArgumentParser()
    _run_arguments(p, "smoke")
    return {a.dest: a for a in p._actions}


def _as_parsed(key: str, value) -> bool:
    """Whether ``value`` (recorded in ``run.json``) is what ``run``'s option ``key`` parses to: the same
    argument types and choices decide (no second table of option types)."""
    action = _run_actions()[key]
    if value is None:
        return True
    if action.nargs == 0:  # a flag
        return isinstance(value, bool)
    if isinstance(action, argparse._AppendAction):
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return False
    try:
        parsed = (action.type or str)(str(value))
    except (argparse.ArgumentTypeError, ValueError):
        return False
    return parsed == value and (not action.choices or value in action.choices)


def _select(opts: dict):
    """(matrix, cells) the options select."""
    from parity.faults import check_faults
    from parity.matrix import load, select
    from parity.paths import check_path, path_names

    matrix = load(opts["matrix"], tuple(opts["model"]))
    cells = list(matrix.cells)
    paths = _csv(opts["paths"], "--paths", path_names())
    ranks = _csv(opts["ranks"], "--ranks", [1, 2, 4, 8], int)
    faults = check_faults(opts["fault"])
    baseline = check_path(opts["baseline"])
    if paths:  # the path axis becomes exactly these paths, for every pair group of the matrix
        groups = list(dict.fromkeys(dataclasses.replace(c, path=paths[0]) for c in cells))
        cells = [dataclasses.replace(g, path=p) for g in groups for p in paths]
    if ranks:
        cells = [c for c in cells if c.ranks in ranks]
    given = {k: opts[k] for k in AXIS_OPTIONS if opts[k] is not None}
    if given:
        seen, unique = set(), []
        for c in (dataclasses.replace(c, **given) for c in cells):
            if c.id not in seen:
                seen.add(c.id)
                unique.append(c)
        cells = unique
    if opts["steps"] is not None:
        cells = [dataclasses.replace(c, steps=opts["steps"]) for c in cells]
    cells = [dataclasses.replace(c, faults=tuple(faults), baseline=baseline) for c in cells]
    return matrix, select(cells, opts["filter"])


def _execute(args, opts: dict, matrix, cells) -> int:
    from parity.execute.torchrun import TorchrunExecutor, under_torchrun
    from parity.runner import RunOptions, resolve_device, run_cells

    if not cells:
        raise UsageError(f"no cells selected from matrix {matrix.name!r}; loosen -k/--paths/--ranks")
    if opts["junit"]:
        from parity.report.outdir import writable_file

        writable_file(opts["junit"], "--junit")
    from parity.report.identity import difference, identity

    device = resolve_device(opts["device"])
    selection, shard = cells, {}
    if opts["shard"]:
        cells, shard = _part_of(cells, opts["shard"], matrix.name)
    manifest = {"options": {k: opts[k] for k in RUN_IDENTITY}, "torch": _torch_version(), "device": device,
                "cells": [c.id for c in cells], **shard, **identity(matrix.path, selection)}
    if args.resume:
        from parity.report.outdir import read_manifest

        if under_torchrun():
            raise UsageError("--resume is not supported under torchrun; resume without torchrun or rerun the matrix")
        recorded = read_manifest(args.resume)
        for key in ("torch", "device"):
            if recorded.get(key) != manifest[key]:
                raise UsageError(f"--resume {args.resume}: the interrupted run used {key} {recorded.get(key)!r}, this "
                                 f"one would use {manifest[key]!r}; resume where it ran or start a new run")
        if recorded.get("cells") != manifest["cells"]:
            raise UsageError(f"--resume {args.resume}: the matrix now selects different cells than the interrupted "
                             "run (the matrix file or a plugin changed); start a new run with --overwrite")
        changed = difference(recorded, manifest)
        if changed:
            raise UsageError(f"--resume {args.resume}: {changed}; resume with the parity, model and matrix files "
                             "it ran with, or start a new run with --overwrite")
    _warn_rule_disagreements(cells)
    options = RunOptions(out_dir=opts["out"], device=device, timeout=opts["timeout"], fp64=opts["fp64"],
                         title=matrix.name, manifest=manifest, overwrite=args.overwrite, resume=bool(args.resume),
                         require_native=opts["require_native"], junit=opts["junit"] or "")
    if under_torchrun():
        executor = TorchrunExecutor(device)
        skip = lambda c: matrix.skip_reason(c) or executor.skip_reason(c)  # noqa: E731
        code = run_cells(cells, options, skip_reason=skip, executor=executor)
        return code if executor.rank == 0 else -1
    return run_cells(cells, options, skip_reason=matrix.skip_reason)


def _part_of(cells, text: str, title: str) -> tuple[list, dict]:
    """The cells of part ``text`` ("I/N") and its ``run.json`` entry (:func:`parity.matrix.shard.part_of`)."""
    from parity.matrix.shard import parse_shard, part_of

    shard = parse_shard(text)
    part, record = part_of(cells, shard, title)
    if not part:  # a small selection over many parts: nothing owed here, the merge checks the whole
        print(f"parity: --shard {shard}: this part holds none of the selection's {len(cells)} cells "
              "(fewer pair groups than parts take); it records an empty part for parity merge", file=sys.stderr)
    return part, {"shard": record}


def _warn_rule_disagreements(cells) -> None:
    """A warning per tensor the two FP32 name rules resolve differently, per model of the run:
    the plan follows the model's ``fp32_rule``; the other reading is one a user may expect."""
    from parity.model.plan import fp32_disagreements
    from parity.model.registry import get_fixture

    for name, source in dict.fromkeys((c.fixture, c.source) for c in cells):
        fixture = get_fixture(name, source)
        for fqn, by_framework, _ in fp32_disagreements(fixture.make(0), fixture.keep_fp32):
            print(f"parity: warning: {name}: {fqn} is {'FP32' if by_framework else 'not FP32'} under transformers' "
                  f"name rule and {'not ' if by_framework else ''}FP32 under whole name parts; the plan follows "
                  f"fp32_rule={fixture.fp32_rule!r} (see python -m parity plan)", file=sys.stderr)


def cmd_run(args) -> int:
    opts = _run_settings(args, RUN_DEFAULTS)
    matrix, cells = _select(opts)
    if args.list and opts["shard"]:
        cells = _part_of(cells, opts["shard"], matrix.name)[0]
    if args.list:
        for c in cells:
            reason = matrix.skip_reason(c)
            print(c.id + (f"  [SKIP: {reason}]" if reason else ""))
        print(f"{len(cells)} cells")
        return 0
    return max(0, _execute(args, opts, matrix, cells))


#: Run options whose value, when given, may make a run narrower than its matrix; cell ids
#: show what ``-k``/``--ranks``/``--paths`` and the axis options left out, but not ``--steps``.
NARROWING = ("filter", "ranks", "paths", "steps", "shard", *AXIS_OPTIONS)
_FLAGS = {"filter": "-k", **{k: "--" + k.replace("_", "-") for k in ("ranks", "paths", "steps", "shard", *AXIS_OPTIONS)}}


_FAULT_TAG = re.compile(r"/fault-[^/]+$")


def _scope(opts: dict | None, ran: list[str]) -> dict:
    """What a gate's evidence covers against the complete matrix its run names: the matrix,
    a digest of its complete cell list, the options that narrowed it, the counts run vs
    expected and the cells left out. ``complete`` only when every cell of the matrix ran with
    the matrix's step count and no fault (docs/gate.md, rule "complete matrix")."""
    if not isinstance(opts, dict) or not opts.get("matrix"):
        return {"complete": False, "left_out": ["the run records no options (not run by parity run/gate)"]}
    opts = {**RUN_DEFAULTS, **opts}
    full = {**opts, **{k: None for k in NARROWING}, "fault": []}
    matrix, cells = _select(full)
    expected = sorted(c.id for c in cells)
    steps = cells[0].steps if cells else 0
    ran = {_FAULT_TAG.sub("", c) for c in ran}  # an injected fault is reported below, not as a missing cell
    missing = sorted(set(expected) - ran)
    given = {k: opts[k] for k in NARROWING if opts.get(k) not in (None, [])}
    left_out = [f"{len(missing)} of {len(expected)} cells not run (e.g. {missing[0]})"] if missing else []
    if given.get("steps") not in (None, steps):
        left_out.append(f"--steps {given['steps']} instead of the matrix's {steps}")
    if opts["fault"]:
        left_out.append(f"faults injected: {', '.join(opts['fault'])}")
    digest = hashlib.sha256(f"steps={steps}\n".encode() + "\n".join(expected).encode()).hexdigest()[:16]
    return {"complete": not left_out, "left_out": left_out, "matrix": matrix.name, "matrix_digest": digest,
            "cells_expected": len(expected), "cells_run": len(ran & set(expected)), "steps": opts["steps"] or steps,
            "options": {_FLAGS[k]: v for k, v in given.items()}, "faults": list(opts["fault"])}


def _gate_baseline(directory: str | None) -> dict | None:
    """The digest ``gate --compare-to`` compares with (a complete run's), or ``None``."""
    if not directory:
        return None
    from parity.report.compare import digest_of

    return digest_of(directory, "--compare-to", baseline=True)


def _same_matrix(directory: str | None, baseline: dict | None, matrix: str) -> None:
    """A gate compares like with like: ``--compare-to``'s results must be of the matrix it judges."""
    if baseline and baseline.get("matrix") and matrix and baseline["matrix"] != matrix:
        raise UsageError(f"--compare-to {directory}: those results are of matrix {baseline['matrix']!r}, this gate "
                         f"judges {matrix!r}; compare like with like (gate --matrix {baseline['matrix']})")


def cmd_gate(args) -> int:
    """Run a matrix (or read ``--from DIR``) and decide GO / NO-GO / PARTIAL per model."""
    from parity.execute.torchrun import under_torchrun
    from parity.paths import check_path
    from parity.report import outdir

    candidate = check_path(args.candidate)
    if args.fault:
        raise UsageError("gate refuses --fault: a decision must rest on an unmodified torch; "
                         "test the checks with python -m parity run --fault NAME")
    baseline = _gate_baseline(args.compare_to)  # before any work: a missing baseline fails now, not after the run
    if args.from_dir:
        out = args.from_dir
        if not os.path.isfile(os.path.join(out, outdir.CELLS)):
            raise UsageError(f"--from {out}: no {outdir.CELLS} there; give the --out directory of a parity run")
        manifest = outdir.read_manifest(out)
        if manifest.get("status") != "complete":
            raise UsageError(f"--from {out}: that run is {manifest.get('status', 'unfinished')}; "
                             f"finish it with python -m parity run --resume {out}")
        _same_matrix(args.compare_to, baseline, str((manifest.get("options") or {}).get("matrix", "")))
        with Signals() as signals:
            return _decide(args, out, manifest, candidate, baseline, signals)
    opts = _run_settings(args, {**RUN_DEFAULTS, "matrix": "default", "out": "results/gate"})
    _same_matrix(args.compare_to, baseline, opts["matrix"])
    matrix, cells = _select(opts)
    with Signals(enabled=not under_torchrun()) as signals:  # the run's cells and files, then the gate's
        code = _execute(args, opts, matrix, cells)
        if code < 0:
            return 0  # a torchrun peer: rank 0 decides
        out = opts["out"]
        manifest = outdir.read_manifest(out)
        if manifest.get("status") != "complete":
            return code  # interrupted: the run already said so
        if opts["shard"]:  # one part decides nothing: the merged parts do
            print(f"gate: part {opts['shard']} recorded in {out}; decide on every part: "
                  f"python -m parity merge PART_DIRS... --out DIR --gate")
            return code
        return _decide(args, out, manifest, candidate, baseline, signals)


def _decide(args, out: str, manifest: dict, candidate: str, baseline: dict | None, signals: Signals) -> int:
    """Judge ``out``'s records (against ``baseline``, ``--compare-to``'s digest, when given) and
    the scope of its run, write the gate's files, print the decisions."""
    from parity.errors import writing
    from parity.report import gate, outdir
    from parity.report.records import read_records

    records = read_records(os.path.join(out, outdir.CELLS))
    decisions = gate.evaluate(records, candidate)
    if baseline is not None:
        from parity.report.compare import compare, concerns, digest_of

        bad, _ = compare(baseline, digest_of(out, "gate"))
        for d in decisions:
            mine = [b for b in bad if concerns(b, d.model)]
            if mine:
                d.decision = gate.NO_GO
                d.reasons.append(f"regressed against {args.compare_to}: " + "; ".join(mine[:5]))
    scope = _scope(manifest.get("options"), list(manifest.get("cells") or []))
    gate.apply_scope(decisions, scope)
    env = manifest.get("environment") or {}
    meta = {"candidate": candidate, "torch": manifest.get("torch", ""), "results": out,
            "matrix": scope.get("matrix", ""), "cells": len(manifest.get("cells", [])), "records": len(records),
            "scope": scope, "device": manifest.get("device", ""),
            "versions": {k: env.get(k, "") for k in ("torch", "cuda", "nccl", "python")}}
    from parity.report.html import write_html

    with writing(out):
        gate.write(out, decisions, records, meta=meta)
        write_html(out, records)
    from parity.report.gate import clip

    width = max((len(d.model) for d in decisions), default=5)
    matrix = scope.get("matrix", "")
    for d in decisions:
        why = "; ".join(d.reasons or d.notes)
        decided = f"{d.decision} ({matrix})" if matrix else d.decision
        print(f"{d.model:<{width}}  {decided:<14}  {clip(why, 200, 'gate.md has every reason')}")
    print(f"gate: {out}/gate.md, {out}/gate.json")
    if signals():  # arrived while the gate's files were written: they were completed first
        print(f"parity: interrupted by {signals.name} while writing the gate's files (they are complete)",
              file=sys.stderr)
        return signals.code
    return 0 if gate.is_go(decisions) else 1


def cmd_merge(args) -> int:
    """Join a sharded run's parts (:mod:`parity.report.merge`); with ``--gate``, decide on them."""
    from parity.report.merge import merge
    from parity.runner import verdict_code

    if args.junit:
        from parity.report.outdir import writable_file

        writable_file(args.junit, "--junit")
    with Signals() as signals:
        manifest, records = merge(args.parts, args.out, overwrite=args.overwrite, junit=args.junit or "")
        print(f"merge: {manifest['merged']['parts']} parts, {len(manifest['cells'])} cells, {len(records)} records "
              f"in {args.out}")
        if args.gate:
            from parity.paths import check_path

            return _decide(args, args.out, manifest, check_path(args.candidate), None, signals)
    return verdict_code(records)


def cmd_report(args) -> int:
    from parity.report.html import report_dir

    print(report_dir(args.dir))
    return 0


def cmd_compare(args) -> int:
    from parity.report.compare import compare_dirs

    return compare_dirs(args.old, args.new, factor=args.factor, write_digest=args.write_digest or "")


def _torch_version() -> str:
    import torch

    return torch.__version__


class _PipeSafe:
    """``sys.stdout`` (and ``sys.stderr``) while a command runs: when the reader goes away
    (``parity gate | head -1``), what is left to print goes to ``os.devnull`` and the command
    finishes, so its exit code is still its verdict's (a NO-GO must not become 0 because nobody
    read the table)."""

    def __init__(self, stream):
        self._stream = stream

    def _closed(self) -> None:
        devnull = open(os.devnull, "w")
        try:  # the real stream's buffered rest (flushed at exit) goes nowhere instead of failing
            os.dup2(devnull.fileno(), self._stream.fileno())
        except (OSError, ValueError, AttributeError):  # no file descriptor behind it (a test's stream)
            pass
        self._stream = devnull

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._closed()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._closed()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _one_line(exc: Exception) -> str:
    """An error's message as the one line parity prints (user code's multi-line messages joined)."""
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def cmd_repro(args) -> int:
    """Write (or print) the reproducer of one cell of ``--from``'s run (:mod:`parity.report.repro`)."""
    from parity.report.repro import find_cell, script

    text = script(find_cell(args.cell, args.from_dir, lambda options: _select({**RUN_DEFAULTS, **options})[1]),
                  args.from_dir)
    if not args.out:
        print(text, end="")
        return 0
    try:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as exc:
        raise UsageError(f"--out {args.out}: cannot write ({exc.strerror}); choose a writable file") from None
    print(f"wrote {args.out}: python {args.out} re-runs {args.cell}")
    return 0


def _command(args) -> int:
    commands = {"plan": cmd_plan, "run": cmd_run, "gate": cmd_gate, "merge": cmd_merge, "bench": bench_command,
                "compare": cmd_compare, "repro": cmd_repro,
                "report": cmd_report, "fuzz": fuzz_command, "fixtures": cmd_fixtures}
    try:
        return commands[args.command](args)
    except SystemExit as exc:  # parity returns its codes; only user code (a model) exits
        if exc.code not in (0, None):
            raise
        raise UsageError(f"{args.command}: user code (a model) called sys.exit({exc.code!r}) while parity was "
                         "working; a model must not exit") from None


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit code (see the module docstring). A :class:`UsageError` is one line on
    stderr and exit code 2; a closed stdout or stderr changes nothing (:class:`_PipeSafe`)."""
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = safe = _PipeSafe(streams[0]), _PipeSafe(streams[1])  # ``2>&1 | head`` too
    from parity.execute.torchrun import under_torchrun

    try:
        with raising(enabled=not under_torchrun()):
            return _command(_parser().parse_args(argv))
    except UsageError as exc:
        print(f"parity: {_one_line(exc)}", file=sys.stderr)
        return 2
    except OutputError as exc:
        print(f"parity: {_one_line(exc)}", file=sys.stderr)
        return EXIT_OUTPUT
    except Interrupted as exc:  # outside a command's own safe points: nothing was being written
        print(f"parity: interrupted by {exc}", file=sys.stderr)
        return exit_code(exc.signum) if exc.signum else 130
    finally:
        for stream in safe:
            stream.flush()
        sys.stdout, sys.stderr = streams


if __name__ == "__main__":
    sys.exit(main())
