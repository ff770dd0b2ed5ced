"""``run``: the options in effect (given, recorded by an interrupted run, defaults), the cells they
select, and the run itself (on its own ranks, or as a torchrun peer)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

from parity.arguments import RANK_COUNTS
from parity.arguments import csv_list as _csv
from parity.cli.parser import AXIS_OPTIONS, RUN_DEFAULTS, RUN_IDENTITY, _run_arguments
from parity.errors import EXIT_OUTPUT, OutputError, UsageError

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
    check_recorded(recorded, f"--resume {args.resume}", "start a new run with --overwrite")
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


def check_recorded(recorded: dict, who: str, fix: str) -> None:
    """A :class:`UsageError` for the first option ``run.json`` records as a value that option
    cannot take (the file was edited): ``--resume`` and ``gate --from`` would select cells by it."""
    wrong = [k for k in RUN_IDENTITY if k in recorded and not _as_parsed(k, recorded[k])]
    if wrong:
        raise UsageError(f"{who}: run.json records {wrong[0]} {recorded[wrong[0]]!r}, which that option cannot be "
                         f"(the file was edited); {fix}")


def _as_parsed(key: str, value) -> bool:
    """Whether ``value`` (recorded in ``run.json``) is what ``run``'s option ``key`` parses to: the same
    argument types and choices decide (no second table of option types)."""
    action = _run_actions()[key]
    if isinstance(action, argparse._AppendAction):  # recorded as a list, empty when not given
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if value is None:
        return True
    if action.nargs == 0:  # a flag
        return isinstance(value, bool)
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
    from parity.paths import check_path, path_names, registry

    matrix = load(opts["matrix"], tuple(opts["model"]))
    cells = list(matrix.cells)
    paths = _csv(opts["paths"], "--paths", path_names())
    ranks = _csv(opts["ranks"], "--ranks", list(RANK_COUNTS), int)
    faults = check_faults(opts["fault"])
    baseline = check_path(opts["baseline"])
    if paths:  # the path axis becomes exactly these paths, for every pair group of the matrix
        groups = list(dict.fromkeys(dataclasses.replace(c, path=paths[0]) for c in cells))
        cells = [dataclasses.replace(g, path=p) for g in groups for p in paths]
    if ranks:
        cells = [c for c in cells if c.ranks in ranks]
    given = {k: opts[k] for k in (*AXIS_OPTIONS, "steps") if opts[k] is not None}
    if given:  # cells that differed only in a value now given once are one cell
        seen, unique = set(), []
        for c in (_given(c, given) for c in cells):
            if c.id not in seen:
                seen.add(c.id)
                unique.append(c)
        cells = unique
    cells = [dataclasses.replace(c, faults=tuple(faults), baseline=baseline) for c in cells]
    registry.check_carried(sorted({c.path for c in cells} | {baseline}))
    return matrix, select(cells, opts["filter"])


def _given(cell, given: dict):
    """``cell`` with the axis values the command line gives; a cell those values cannot make names
    the options."""
    try:
        return dataclasses.replace(cell, **given)
    except UsageError as exc:
        options = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in given.items())
        raise UsageError(f"{options} cannot run {cell.id}: {exc}") from None


def _nonempty(matrix, cells) -> None:
    """Listed or run, an empty selection is a typo in ``-k`` (or a narrowing option), not a result."""
    if not cells:
        raise UsageError(f"no cells selected from matrix {matrix.name!r}; loosen -k/--paths/--ranks")


def _execute(args, opts: dict, matrix, cells) -> int:
    from parity.execute.torchrun import TorchrunExecutor, under_torchrun, writes_results
    from parity.runner import RunOptions, resolve_device, run_cells

    _nonempty(matrix, cells)
    if opts["junit"] is not None and writes_results():
        from parity.report.outdir import writable_file

        writable_file(opts["junit"], "--junit", opts["out"])
    from parity.report.identity import difference, identity

    device = resolve_device(opts["device"])
    selection, shard = cells, {}
    if opts["shard"]:
        cells, shard = _part_of(cells, opts["shard"], matrix.name)
    manifest = {"options": {k: opts[k] for k in RUN_IDENTITY}, "torch": _torch_version(), "device": device,
                "cells": [c.id for c in cells], **shard, **identity(matrix.path, selection)}
    if under_torchrun():  # such a run does not resume (its cells' skips follow the launch)
        manifest["launch"] = "torchrun"
    if args.resume:
        from parity.report.outdir import read_manifest

        if under_torchrun():
            raise UsageError("--resume is not supported under torchrun; resume without torchrun or rerun the matrix")
        recorded = read_manifest(args.resume)
        if recorded.get("launch") == "torchrun":
            raise UsageError(f"--resume {args.resume}: that run ran under torchrun, whose runs do not resume (its "
                             "skips follow the launch); run the matrix again with --overwrite")
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
    # the whole selection's models, so every part of a sharded run records the same
    manifest["model_warnings"] = check_models(selection)
    options = RunOptions(out_dir=opts["out"], device=device, timeout=opts["timeout"], fp64=opts["fp64"],
                         title=matrix.name, manifest=manifest, overwrite=args.overwrite, resume=bool(args.resume),
                         require_native=opts["require_native"], junit=opts["junit"] or "", op_log=bool(opts["op_log"]))
    if under_torchrun():
        executor = TorchrunExecutor(device, opts["timeout"])
        skip = lambda c: matrix.skip_reason(c) or executor.skip_reason(c)  # noqa: E731
        try:
            code = run_cells(cells, options, skip_reason=skip, executor=executor)
        except (UsageError, OutputError) as exc:
            executor.refuse(2 if isinstance(exc, UsageError) else EXIT_OUTPUT)
            raise
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


#: The meshes that compose FSDP with another parallelism, and the field a model declares it with.
_COMPOSED = {"fsdp+tp": ("tensor_parallel", "tensor parallelism"), "ep": ("expert_parallel", "expert parallelism")}


def _composable(fixture, meshes: set[str]) -> None:
    """A cell on ``fsdp+tp`` or ``ep`` claims that composition: a model declaring no TP plan (no
    expert-parallel modules) would run FSDP alone on that mesh and pass as if composed."""
    for mesh in sorted(meshes & set(_COMPOSED)):
        field, what = _COMPOSED[mesh]
        if not getattr(fixture, field):
            raise UsageError(f"model {fixture.name!r} declares no {what} (Fixture.{field}), so its cells on mesh "
                             f"{mesh!r} would run FSDP alone and claim the composition; declare it, or leave them out "
                             f"(-k \"mesh != '{mesh}'\")")


def check_models(cells, warn: bool = True) -> dict[str, dict]:
    """Each model of the run, built once here before any cell: one forward and backward
    (:func:`~parity.model.registry.exercised`, a :class:`UsageError` for a model every cell would
    fail on), then (``warn``) a warning per pattern a model class declares FP32 that matches
    nothing (``Fixture.keep_fp32`` is checked when the model loads) and per tensor the two FP32
    name rules resolve differently (the plan follows the model's ``fp32_rule``; the other reading
    is one a user may expect). Returns, per model warned about, ``{"notes": [...],
    "fp32_unselected": bool}`` for ``run.json``: the gate notes them, and ``fp32_unselected`` --
    its class declares FP32 patterns that select nothing, its resolved plan computes nothing in
    FP32 and ``Fixture.expect_fp32`` does not say that nothing is meant to be -- is no GO (nothing
    exercised the per-parameter override)."""
    from parity.model.plan import fp32_disagreements, unmatched_declared, unmatched_note
    from parity.model.registry import built, exercised, expect_keys, get_fixture
    from parity.model.spec import unknown_expect_keys

    half = {(c.fixture, c.source) for c in cells if c.param_dtype == "float16"}
    found: dict[str, dict] = {}
    for name, source in dict.fromkeys((c.fixture, c.source) for c in cells):
        fixture = get_fixture(name, source)
        _composable(fixture, {c.mesh for c in cells if (c.fixture, c.source) == (name, source)})
        try:
            model, ignored = built(fixture, "run")
        except UsageError:
            continue  # its cells build it on their ranks and record the failure as ERROR
        exercised(fixture, model, "run")
        if not warn:
            continue
        notes = [f"Fixture.expect[{key!r}] names no path installed here nor a contract; it applies to no cell of "
                 "this run" for key in unknown_expect_keys(fixture, expect_keys())]
        unmatched = unmatched_declared(model, fixture.fp32_rule, (name, source) in half)
        notes += [unmatched_note(pattern, fixture.fp32_rule, owner) for owner, pattern in unmatched]
        notes += [f"{fqn} is {'FP32' if by_framework else 'not FP32'} under transformers' name rule and "
                  f"{'not ' if by_framework else ''}FP32 under whole name parts; the plan follows "
                  f"fp32_rule={fixture.fp32_rule!r} (see python -m parity plan)"
                  for fqn, by_framework, _ in fp32_disagreements(model, fixture.keep_fp32)]
        for note in notes:
            print(f"parity: warning: {name}: {note}", file=sys.stderr)
        if notes:
            unselected = bool(unmatched) and fixture.expect_fp32 is None and not _plans_fp32(
                fixture, model, ignored, (name, source) in half)
            found[name] = {"notes": notes, "fp32_unselected": unselected}
    return found


def _plans_fp32(fixture, model, ignored, half: bool) -> bool:
    """Whether the model's resolved plan computes anything in FP32 -- by any rule (a declared
    name, a marker, a recorded dtype), read from the plan itself, not from the name lists."""
    import torch

    from parity.judge.plan import declared_fp32
    from parity.model.plan import PrecisionConfig

    config = PrecisionConfig(param_dtype=torch.float16 if half else torch.bfloat16)
    return bool(declared_fp32(fixture.resolve(model, config, ignored)))


def cmd_run(args) -> int:
    opts = _run_settings(args, RUN_DEFAULTS)
    matrix, cells = _select(opts)
    if args.list:
        _nonempty(matrix, cells)
        from parity.runner import resolve_device

        resolve_device(opts["device"])  # a device the run could not use is refused here too
    if args.list and opts["shard"]:
        cells = _part_of(cells, opts["shard"], matrix.name)[0]
    if args.list:
        for c in cells:
            reason = matrix.skip_reason(c)
            print(c.id + (f"  [SKIP: {reason}]" if reason else ""))
        print(f"{len(cells)} cells")
        return 0
    from parity.execute.torchrun import agreed

    return max(0, agreed(_execute(args, opts, matrix, cells)))  # under torchrun every rank exits with the verdict


def _torch_version() -> str:
    import torch

    return torch.__version__
