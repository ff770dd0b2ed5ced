"""Commands that read and write no run: ``plan``, ``fixtures``, ``report``, ``compare``, ``repro``."""

from __future__ import annotations

from parity.cli.parser import RUN_DEFAULTS
from parity.cli.run import _select
from parity.errors import UsageError

def _models_for_plan(args) -> list:
    from parity.model.registry import get_fixture, load_source

    if not args.fixture and not args.model:
        raise UsageError("plan: give --fixture NAME, --model pkg.module:factory, or both (a model of that source)")
    if args.model and not args.fixture:
        return list(load_source(args.model))  # every model the factory returns
    if args.model:  # a model of that source: a built-in of the same name would be planned in its place
        names = [f.name for f in load_source(args.model)]
        if args.fixture not in names:
            raise UsageError(f"plan: --model {args.model} describes no model named {args.fixture!r} (it has: "
                             f"{', '.join(names)}); drop --fixture or name one of its models")
    return [get_fixture(args.fixture, args.model or "")]


def cmd_plan(args) -> int:
    from parity.model.dtypes import parse_dtype
    from parity.model.plan import PrecisionConfig

    config = PrecisionConfig(
        param_dtype=parse_dtype(args.param_dtype, what="--param-dtype"),
        reduce_dtype=parse_dtype(args.reduce_dtype, what="--reduce-dtype", allow_natural=True),
        output_dtype=parse_dtype(args.output_dtype, what="--output-dtype", allow_natural=True),
    )
    code = 0
    for i, fixture in enumerate(_models_for_plan(args)):
        text, differs = _describe_plan(fixture, config)
        print(("\n" if i else "") + text)
        code = code or int(differs)
    return code  # 1: a declaration other than the plan, or a path whose plan() crashed


def _describe_plan(fixture, config) -> tuple[str, bool]:
    """The resolved plan, the model's own FP32 declaration beside it, the tensors the two
    FP32 name rules resolve differently, and every path's units; and whether something is
    wrong: the declaration (``Fixture.expect_fp32``) differs from the plan, or a path's own
    ``plan()`` crashed (a bug of that path's code; a path's refusal, e.g. an isolation error,
    is its answer and shown, not a failure of ``plan``)."""
    import torch

    from parity.judge.plan import declared_fp32
    from parity.model.plan import fp32_disagreements, unmatched_declared, unmatched_note
    from parity.paths import path_names, plan_sharding
    from parity.paths.reads import check_fixture_reads

    from parity.model.registry import built, exercised

    exercised(fixture, built(fixture, "plan")[0], "plan")  # on its own build: the plan reads a model never run
    model, ignored = built(fixture, "plan")
    plan = fixture.resolve(model, config, ignored)
    out = [f"fixture {fixture.name}: {fixture.description}", "", plan.table(), ""]
    resolved = declared_fp32(plan)
    differ = []
    if fixture.expect_fp32 is None:
        out.append(f"FP32 (rule {fixture.fp32_rule}): {', '.join(sorted(resolved)) or 'none'}; "
                   "declared: not declared (Fixture.expect_fp32)")
    else:
        declared = set(fixture.expect_fp32)
        differ = sorted(resolved ^ declared)
        out.append(f"FP32 (rule {fixture.fp32_rule}): {', '.join(sorted(resolved)) or 'none'}; declared "
                   + ("the same" if not differ else f"differently for {', '.join(differ)} (the plan check fails)"))
    for owner, pattern in unmatched_declared(model, fixture.fp32_rule, config.param_dtype == torch.float16):
        out.append(f"note: {unmatched_note(pattern, fixture.fp32_rule, owner)}")
    for fqn, by_framework, by_tokens in fp32_disagreements(model, fixture.keep_fp32):
        out.append(f"rules disagree: {fqn} is {'FP32' if by_framework else 'not FP32'} under transformers' rule, "
                   f"{'FP32' if by_tokens else 'not FP32'} under whole name parts (Fixture.fp32_rule)")
    crashed = False
    for path in path_names():
        out.append("")
        try:
            report = plan_sharding(model, fixture.unit_roots, plan, path, ignored)
            check_fixture_reads(fixture, 0, report)  # a parameter read outside its unit: a cell's refusal too
            out.append(report.describe())
        except ValueError as exc:  # an isolation error, a usage error: the path's own refusal
            out.append(f"path requested={path}: error: {exc}")
        except Exception as exc:  # noqa: BLE001 - a path plugin's bug: said here, the other paths still shown
            crashed = True
            out.append(f"path requested={path}: error: its plan() failed: {type(exc).__name__}: "
                       f"{str(exc).splitlines()[0] if str(exc) else ''} (a fault of that path's code)")
    return "\n".join(out), bool(differ) or crashed


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


def cmd_report(args) -> int:
    from parity.report.html import report_dir

    print(report_dir(args.dir))
    return 0


def cmd_compare(args) -> int:
    from parity.report.compare import compare_dirs

    return compare_dirs(args.old, args.new, factor=args.factor, write_digest=args.write_digest or "")


def cmd_repro(args) -> int:
    """Write (or print) the reproducer of one cell of ``--from``'s run (:mod:`parity.report.repro`)."""
    from parity.cli.run import check_recorded
    from parity.report.outdir import read_manifest, writable_file
    from parity.report.repro import find_cells, script

    if args.out:  # never over the results it reads; checked before the script is built
        writable_file(args.out, "--out", "", args.from_dir, example="repro.py")

    options = read_manifest(args.from_dir).get("options") or {}
    check_recorded(options, f"repro: {args.from_dir}", "rerun the matrix into a new --out")  # an edited run.json
    text = script(find_cells(args.cell, args.from_dir, lambda options: _select({**RUN_DEFAULTS, **options})[1]),
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
