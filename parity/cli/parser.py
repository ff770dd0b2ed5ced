"""The command line's grammar: every command's options, and the run options a results
directory records (``run.json``) and ``--resume`` holds fixed."""

from __future__ import annotations

import argparse

from parity.arguments import growth_factor as _growth_factor
from parity.arguments import max_norm as _max_norm
from parity.arguments import path as _path
from parity.arguments import positive as _positive
from parity.arguments import seed as _seed
from parity.arguments import shard as _shard
from parity.arguments import steps as _steps
from parity.bench.run import add_bench_arguments
from parity.errors import UsageError
from parity.fuzz import add_fuzz_arguments
from parity.matrix.cell import (EVALS, INITS, KNOB_VALUES, MOVES, OPTIMIZERS, PARAM_DTYPES, REDUCE_DTYPES, SCHEDULES,
                                WEIGHTS)
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
    "compile": "block compilation (aot_eager / inductor: block.compile(backend=...) on every Fixture.blocks module "
               "before sharding; inductor needs a C++ compiler)",
    "flags": "per-micro-batch flags (changed: set_requires_gradient_sync and the knobs' flags set only before the "
             "first and the last micro-batch, not before each)",
}
KNOB_OPTIONS = tuple(KNOB_HELP)
#: Run options that set one axis for every cell (replacing the matrix's values).
AXIS_OPTIONS = ("seed", "param_dtype", "reduce_dtype", "optimizer", "schedule", "init", "mesh", "weights", "clip",
                "eval", "move", *KNOB_OPTIONS)
#: ``run`` options that define what a run computes (``timeout`` included: it decides TIMEOUT verdicts);
#: ``--resume`` requires them unchanged and ``merge`` the same in every part.
RUN_IDENTITY = ("matrix", "paths", "ranks", "filter", "seed", "steps", "fault", "model", "baseline", "device",
                "fp64", "require_native", "param_dtype", "reduce_dtype", "optimizer", "schedule", "init", "mesh",
                "weights", "clip", "eval", "move", *KNOB_OPTIONS, "shard", "timeout")
RUN_DEFAULTS = {"matrix": "smoke", "paths": None, "ranks": None, "filter": None, "seed": None, "steps": None,
                "param_dtype": None, "reduce_dtype": None, "optimizer": None, "schedule": None, "init": None,
                "mesh": None, "weights": None, "clip": None, "eval": None, "move": None, **dict.fromkeys(KNOB_OPTIONS),
                "fault": [], "shard": None, "model": [], "baseline": "legacy", "device": "auto", "fp64": False,
                "require_native": False, "timeout": 60.0, "out": "results/latest", "junit": None, "op_log": False}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, instead of argparse's usage block
        raise UsageError(f"{message} (see {self.prog} --help)") from None


def _run_arguments(p: argparse.ArgumentParser, matrix: str, out: str = "results/latest") -> None:
    """Options shared by ``run`` and ``gate`` (what to run and how)."""
    p.add_argument("--matrix", help=f"matrix name (fixtures/matrices) or .toml path (default: {matrix})")
    p.add_argument("--model", action="append", help="plugin model source; replaces the matrix's fixture axis")
    p.add_argument("--paths", help="comma list of registered paths replacing the matrix's path axis, e.g. legacy,native")
    p.add_argument("--baseline", help="path every other path is compared with (default: legacy)")
    p.add_argument("--ranks", help="comma list of rank counts, e.g. 1,2")
    p.add_argument("-k", dest="filter", help="expression over axis values, e.g. \"fixture == 'kda' and ranks == 2\"")
    p.add_argument("--out", type=_path, help=f"output directory (default: {out})")
    p.add_argument("--overwrite", action="store_true", help="replace another run's results in --out")
    p.add_argument("--resume", type=_path, metavar="DIR", help="continue the interrupted run recorded in DIR")
    p.add_argument("--seed", type=_seed, help="run every cell with this seed instead of the matrix's")
    p.add_argument("--steps", type=_steps, help="optimizer steps per cell instead of the matrix's (at most 1000)")
    p.add_argument("--param-dtype", choices=PARAM_DTYPES, help="every cell's param_dtype (float16 adds a loss scale)")
    p.add_argument("--reduce-dtype", choices=REDUCE_DTYPES, help="every cell's reduce_dtype (natural: None)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, help="every cell's optimizer")
    p.add_argument("--schedule", choices=SCHEDULES, help="every cell's learning-rate schedule (decay: LambdaLR, "
                   "linear towards zero, saved and loaded with the checkpoint)")
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
    p.add_argument("--junit", type=_path, metavar="FILE", help="also write JUnit XML (one test case per cell x check)")
    p.add_argument("--op-log", action="store_true", default=None,
                   help="failing cells' traced re-runs also write rank 0's operator log in DebugMode's format")
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
    gate.add_argument("--from", dest="from_dir", type=_path, metavar="DIR", help="judge an existing results directory instead")
    gate.add_argument("--candidate", default="native", help="the path whose enabling is decided (native)")
    gate.add_argument("--compare-to", type=_path, metavar="DIR", help="also NO-GO on a regression against these results "
                      "(parity compare; --baseline names the baseline *path*)")
    mrg = sub.add_parser("merge", help="join the parts of a sharded run or fuzz campaign (--shard I/N) into one "
                         "results directory")
    mrg.add_argument("parts", nargs="+", type=_path, metavar="DIR", help="every part's --out directory")
    mrg.add_argument("--out", required=True, type=_path, help="the merged results directory")
    mrg.add_argument("--overwrite", action="store_true", help="replace another run's results in --out")
    mrg.add_argument("--junit", type=_path, metavar="FILE", help="also write JUnit XML")
    mrg.add_argument("--gate", action="store_true", help="also decide GO / NO-GO (gate.json, gate.md) as gate --from does")
    mrg.add_argument("--candidate", default="native", help="with --gate: the path whose enabling is decided (native)")
    add_fuzz_arguments(sub)
    rpr = sub.add_parser("repro", help="write a self-contained script re-running one cell of a results directory")
    rpr.add_argument("cell", metavar="CELL_ID", help="a cell id as cells.csv names it")
    rpr.add_argument("--from", dest="from_dir", required=True, type=_path, metavar="DIR", help="the run's --out directory")
    rpr.add_argument("--out", type=_path, metavar="FILE", help="where to write the script (default: print it)")
    rep = sub.add_parser("report", help="(re)write DIR/report.html from a results directory")
    rep.add_argument("dir", type=_path, help="a parity results directory (cells.csv; gate.json and bench.md if present)")
    cmp = sub.add_parser("compare", help="two result directories side by side; exit 1 on a regression")
    cmp.add_argument("old", type=_path, help="baseline results directory (cells.csv / bench.csv, or a digest.json)")
    cmp.add_argument("new", type=_path, help="results directory to judge")
    cmp.add_argument("--factor", type=_growth_factor, default=2.0, help="a check's worst ratio may grow this much (2; >= 1)")
    cmp.add_argument("--write-digest", type=_path, metavar="DIR", help="also write NEW's digest.json into DIR (a baseline)")
    add_bench_arguments(sub)
    return p
