"""``python -m parity``: ``plan``, ``run`` and ``fixtures``.

Bad input exits 2 with one line naming the thing and the valid choices.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from parity.errors import UsageError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="parity", description="FSDP2 mixed-precision parity harness")
    sub = p.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="print a fixture's precision plan and both paths' units")
    plan.add_argument("--fixture", required=True)
    plan.add_argument("--param-dtype", default="bfloat16")
    plan.add_argument("--reduce-dtype", default="float32")
    plan.add_argument("--output-dtype", default="natural")
    sub.add_parser("fixtures", help="list fixtures and matrices")
    run = sub.add_parser("run", help="run a matrix of cells and judge them")
    run.add_argument("--matrix", default="smoke", help="matrix name (fixtures/matrices) or .toml path")
    run.add_argument("--paths", help="comma list: legacy,native")
    run.add_argument("--ranks", help="comma list of rank counts, e.g. 1,2")
    run.add_argument("-k", dest="filter", help="expression over axis values, e.g. \"fixture == 'kda' and ranks == 2\"")
    run.add_argument("--out", default="results/latest", help="output directory")
    run.add_argument("--seed", type=int, help="run every cell with this seed instead of the matrix's")
    run.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    run.add_argument("--timeout", type=float, default=60.0, help="seconds per cell before TIMEOUT")
    run.add_argument("--fp64", action="store_true", help="also record errors against an FP64 reference")
    run.add_argument("--fault", action="append", default=[], help="inject a deliberate fault (testing the checks)")
    run.add_argument("--list", action="store_true", help="print the selected cells and exit")
    return p


def _csv(value: str | None, what: str, valid: list, conv=str) -> list | None:
    if value is None:
        return None
    items = []
    for raw in value.split(","):
        try:
            item = conv(raw.strip())
        except ValueError:
            item = None
        if item not in valid:
            raise UsageError(f"{what}: unknown value {raw.strip()!r}; valid: {', '.join(map(str, valid))}")
        items.append(item)
    return items


def cmd_plan(args) -> int:
    from parity.dtypes import parse_dtype
    from parity.fixture import get_fixture
    from parity.paths import plan_sharding
    from parity.plan import PrecisionConfig, resolve_plan

    fixture = get_fixture(args.fixture)
    config = PrecisionConfig(
        param_dtype=parse_dtype(args.param_dtype, what="--param-dtype"),
        reduce_dtype=parse_dtype(args.reduce_dtype, what="--reduce-dtype", allow_natural=True),
        output_dtype=parse_dtype(args.output_dtype, what="--output-dtype", allow_natural=True),
    )
    model = fixture.make(0)
    plan = resolve_plan(model, config, fixture.ignored(model))
    print(f"fixture {fixture.name}: {fixture.description}\n")
    print(plan.table())
    for path in ("legacy", "native"):
        print()
        try:
            print(plan_sharding(model, fixture.unit_roots, plan, path).describe())
        except ValueError as exc:
            print(f"path requested={path}: error: {exc}")
    return 0


def cmd_fixtures(args) -> int:
    from parity.fixture import registry
    from parity.matrix import available, load

    for f in registry().values():
        print(f"{f.name:<14} {f.description}")
    print()
    for name in available():
        m = load(name)
        print(f"{name:<14} {len(m.cells):>5} cells  {m.description}")
    return 0


def cmd_run(args) -> int:
    from parity.cellspec import FAULTS
    from parity.launch import TorchrunExecutor, under_torchrun
    from parity.matrix import load, select
    from parity.paths import PATHS
    from parity.runner import RunOptions, resolve_device, run_cells

    matrix = load(args.matrix)
    cells = list(matrix.cells)
    paths = _csv(args.paths, "--paths", list(PATHS))
    ranks = _csv(args.ranks, "--ranks", [1, 2, 4, 8], int)
    for fault in args.fault:
        if fault not in FAULTS:
            raise UsageError(f"--fault: unknown value {fault!r}; valid: {', '.join(FAULTS)}")
    if paths:
        cells = [c for c in cells if c.path in paths]
    if ranks:
        cells = [c for c in cells if c.ranks in ranks]
    if args.seed is not None:
        seen, unique = set(), []
        for c in (dataclasses.replace(c, seed=args.seed) for c in cells):
            if c.id not in seen:
                seen.add(c.id)
                unique.append(c)
        cells = unique
    if args.fault:
        cells = [dataclasses.replace(c, faults=tuple(args.fault)) for c in cells]
    cells = select(cells, args.filter)
    if args.list:
        for c in cells:
            reason = matrix.skip_reason(c)
            print(c.id + (f"  [SKIP: {reason}]" if reason else ""))
        print(f"{len(cells)} cells")
        return 0
    if not cells:
        raise UsageError(f"no cells selected from matrix {matrix.name!r}; loosen -k/--paths/--ranks")
    device = resolve_device(args.device)
    options = RunOptions(out_dir=args.out, device=device, timeout=args.timeout, fp64=args.fp64, title=matrix.name)
    if under_torchrun():
        executor = TorchrunExecutor(device)
        skip = lambda c: matrix.skip_reason(c) or executor.skip_reason(c)  # noqa: E731
        code = run_cells(cells, options, skip_reason=skip, executor=executor)
        return code if executor.rank == 0 else 0
    return run_cells(cells, options, skip_reason=matrix.skip_reason)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return {"plan": cmd_plan, "run": cmd_run, "fixtures": cmd_fixtures}[args.command](args)
    except UsageError as exc:
        print(f"parity: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
