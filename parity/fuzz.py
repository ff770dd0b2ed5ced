"""``python -m parity fuzz``: hypothesis draws models (``parity_fixtures.generated``) and axis
values; each example runs on both paths through the same pipeline as any cell (plan, paths,
reference, checks), on rank pools kept across examples.

Property: no record is FAIL, ERROR or TIMEOUT (a path that cannot shard the model raises
the isolation error its spec declares, which is a PASS). INCONCLUSIVE records -- a check
whose allowance is as large as what it judges -- are not a false alarm of a bug but a blind
spot: the campaign counts the examples that have one and keeps going. A failing example is shrunk by hypothesis to a minimal model, saved as a
reproducer file (``parity run --model FILE:parity_model`` replays it).

``--shard I/N`` runs part I of a campaign fanned out over N CI jobs: its share of the examples
(``examples / N``, the remainder to the first parts) drawn with a seed derived from ``--seed``
and I/N (:func:`part_seed`), so the parts draw different models; ``fuzz.md`` names the part.

With ``--fault NAME`` the property is not asserted: every example runs with the fault and the
campaign counts the examples whose records flag it (sensitivity per 100 examples); it exits 1
when no example flagged it (nothing showed the checks can fail under it), 0 otherwise.

A later part (I > 1) skips hypothesis's first draw, its simplest example whatever the seed,
which part 1 runs: the parts would otherwise each run it (:func:`examples_of`).

SIGINT/SIGTERM (:mod:`parity.interrupt`) end the campaign after the example in progress is
abandoned: the pools are killed, the temporary folder removed, the examples that finished are
counted in ``fuzz.md`` and the smallest failing example found so far, if any, is written as
a reproducer; the exit code is 130/143.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace

import torch

from parity.errors import OutputError, text_file, writing
from parity.execute.pool import RankPool
from parity.interrupt import Interrupted, Signals
from parity.judge.record import Unpaired, Verdict
from parity.matrix.cell import Cell
from parity.report.records import read_records
from parity.report.summary import nothing_checked, ratio_distribution
from parity.runner import RunOptions, run_cells


class _Pools:
    """An executor for :func:`run_cells` that keeps one pool per rank count across runs."""

    rank = 0
    lost = ""  # its pools never lose a group for good: a crashed pool restarts
    launched = False  # its ranks are its own pools' (one GPU each), not a launcher's world

    def release(self) -> None:
        """Nothing waits on a run's end here (torchrun's peers do)."""

    def __init__(self, device: str, tmp: str, stop_requested):
        self.device, self.tmp, self.pools, self.stop_requested = device, tmp, {}, stop_requested

    def run(self, cell: Cell, timeout: float):
        if cell.ranks not in self.pools:
            self.pools[cell.ranks] = RankPool(cell.ranks, self.device, tmp=self.tmp, stop_requested=self.stop_requested)
        return self.pools[cell.ranks].run(cell, timeout)

    def skip_reason(self, cell: Cell) -> str:
        return ""

    def stop(self) -> None:
        for pool in self.pools.values():
            pool.stop(kill=True)


def part_seed(seed: int, index: int, count: int) -> int:
    """The hypothesis seed of part ``index`` of ``count`` (the campaign's own seed when unsplit)."""
    if count == 1:
        return seed
    import hashlib

    return int.from_bytes(hashlib.sha256(f"{seed}/{index}/{count}".encode()).digest()[:4], "big")


def examples_of(examples: int, seed: int, *, later_part: bool = False, ranks: tuple[int, ...] | None = None):
    """The decorator running ``body(spec, values)`` over ``examples`` generated models and axis
    values drawn with ``seed``, on ``ranks`` (a failing body is shrunk by hypothesis). Hypothesis draws its
    simplest example first whatever the seed: part 1 of a split campaign runs it, a
    ``later_part`` skips it (the parts would otherwise each run it instead of a model of their own)."""
    from hypothesis import HealthCheck, assume, given, settings
    from hypothesis import seed as fixed_seed

    from parity_fixtures.generated import axes, specs

    def wrap(body):
        drawn = [0]

        @settings(max_examples=examples, database=None, deadline=None, derandomize=False,
                  suppress_health_check=list(HealthCheck))
        @fixed_seed(seed)
        @given(spec=specs(), values=axes(ranks) if ranks else axes())
        def example(spec, values):
            drawn[0] += 1
            assume(not (later_part and drawn[0] == 1))
            body(spec, values)
        return example
    return wrap


def hostable_ranks(device: str) -> tuple[int, ...]:
    """The rank counts an example may draw: on CUDA no more ranks than visible GPUs (one rank per
    GPU), so no example is skipped for want of one -- a skipped example checks nothing."""
    from parity_fixtures.generated import RANKS

    return tuple(r for r in RANKS if r <= torch.cuda.device_count()) if device == "cuda" else RANKS


def campaign(*, examples: int, seed: int, out_dir: str, fault: str = "", device: str = "cpu",
             timeout: float = 120.0, shard: tuple[int, int] = (1, 1)) -> int:
    from parity.report.fuzz_merge import share_of

    os.makedirs(out_dir, exist_ok=True)
    index, count = shard
    share = share_of(examples, index, count)
    campaign_of = {"seed": seed, "examples": examples, "fault": fault, "index": index, "count": count,
                   "device": device, "timeout": timeout, "ranks": list(hostable_ranks(device))}
    # until this part ends, its manifest says so: a part killed mid-way never leaves an earlier
    # campaign's finished manifest in --out for a merge to count
    write_manifest(out_dir, {**campaign_of, "asked": share, "ran": 0, "code": None, "status": "running"})
    with Signals() as signals:
        return _campaign(examples=share, seed=part_seed(seed, index, count), out_dir=out_dir, fault=fault,
                         device=device, timeout=timeout, signals=signals, campaign_of=campaign_of,
                         part=f"part {index}/{count} of {examples} examples, seed {seed}" if count > 1 else "")


def _campaign(*, examples: int, seed: int, out_dir: str, fault: str, device: str, timeout: float,
              signals: Signals, campaign_of: dict, part: str = "") -> int:
    from parity_fixtures.generated import RANKS, replay_matrix, reproducer, source_for

    tmp = tempfile.mkdtemp(prefix="parity-fuzz-")
    pools = _Pools(device, tmp, signals)
    verdicts, judged, caught, inconclusive = Counter(), [], [], []
    last_failure: list[tuple] = []  # (spec, values, failing cell, its bad records): the smallest so far
    ran, tries = [0], [0]
    written: list[str] = []  # this campaign's reproducer files (fuzz.json lists these, no others)

    @examples_of(examples, seed, later_part=campaign_of["index"] > 1, ranks=tuple(campaign_of["ranks"]))
    def example(spec, values):
        signals.check()
        tries[0] += 1
        run_dir = os.path.join(tmp, f"example-{tries[0]}")
        cells = [Cell(fixture=spec["name"], path=p, source=source_for(spec), steps=2,
                      faults=(fault,) if fault else (), **values) for p in ("legacy", "native")]
        run_cells(cells, RunOptions(out_dir=run_dir, timeout=timeout, progress=False, title="fuzz"),
                  executor=pools)
        signals.check()  # the run stopped for a signal: its records are partial, not an example
        ran[0] += 1
        records = read_records(os.path.join(run_dir, "cells.csv"))
        shutil.rmtree(run_dir, ignore_errors=True)
        bad = [r for r in records if r.verdict in (Verdict.FAIL, Verdict.ERROR, Verdict.TIMEOUT)
               or (r.verdict == Verdict.UNPAIRED and r.name != Unpaired.EXPECTED_ISOLATION_ERROR)]
        unchecked = nothing_checked(records) if records else "the run wrote no records"
        blind = sorted({f"{r.check} {r.name}" for r in records if r.verdict == Verdict.INCONCLUSIVE})
        if blind:
            inconclusive.append(f"{spec['name']}: {', '.join(blind)}")
        verdicts.update(str(r.verdict) for r in records)
        judged.extend(replace(r, detail="") for r in records if isinstance(r.ratio, float))  # for the ratio table
        failing = _failing_cell(cells, bad)
        if fault:
            caught.append(bool(bad) or bool(blind))
            if failing and not last_failure:  # the first example the fault failed: its reproducer
                last_failure[:] = [(spec, values, *failing)]
            return
        if failing:
            last_failure[:] = [(spec, values, *failing)]
        assert not unchecked, f"{spec['name']} {values}: nothing was checked ({unchecked})"
        assert not bad, f"{spec['name']} {values}: " + "; ".join(
            f"{r.cell} {r.check} {r.name} {r.verdict}: {str(r.detail)[:200]}" for r in bad[:3])

    origin = f"the fuzz campaign (seed {seed}{', fault ' + fault if fault else ''}; torch {torch.__version__})"
    t0 = time.perf_counter()
    code, failure = 0, ""
    try:
        # run_cells prints a table and progress lines per example: the campaign reports instead
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            example()
    except Interrupted:
        if last_failure:  # interrupted while shrinking: the smallest failure found so far
            written += _write_reproducer(out_dir, *last_failure[-1], reproducer, replay_matrix, origin, timeout, fault=fault)
    except OutputError:  # a full disk is not a generated model's failure: exit 74
        raise
    except Exception as exc:  # noqa: BLE001 - a failing property, or hypothesis giving up on a flaky one
        code = 1
        if last_failure:
            written += _write_reproducer(out_dir, *last_failure[-1], reproducer, replay_matrix, origin, timeout, fault=fault)
        failure = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:600]}"
        print(f"  {failure}")
    finally:
        pools.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    if fault and last_failure:  # the fault's first failing example, in the same format
        written += _write_reproducer(out_dir, *last_failure[-1], reproducer, replay_matrix, origin, timeout,
                                     fault=fault)
    missed = bool(fault) and code == 0 and not signals() and not any(caught)
    code = 1 if missed else code  # a fault no example flagged: nothing here showed the checks can fail under it
    wall = time.perf_counter() - t0
    lines = [f"fuzz: {ran[0]} runs ({examples} examples asked, seed {seed}) in {wall:.1f} s: "
             f"{ran[0] / wall:.2f} runs/s" + (f"; fault {fault}" if fault else "") + (f"; {part}" if part else "")]
    if tuple(campaign_of["ranks"]) != RANKS:  # fewer GPUs than the 2-rank examples need: not drawn at all
        lines.append(f"ranks drawn: {campaign_of['ranks']} only ({torch.cuda.device_count()} GPU(s) visible)")
    if failure:
        lines.append(f"failed: {failure}")
    if fault:
        lines.append(f"fault {fault} flagged in {sum(caught)} of {len(caught)} examples "
                     f"({100 * sum(caught) / max(1, len(caught)):.0f} per 100)"
                     + ("; flagged in none: exit 1 (no example gave it a place to show, or no check saw it)"
                        if missed else ""))
    lines.append(f"runs with an INCONCLUSIVE record: {len(inconclusive)}"
                 + "".join(f"\n  {x}" for x in inconclusive[:20]))
    lines.append("records by verdict: " + ", ".join(f"{k} {v}" for k, v in sorted(verdicts.items())))
    lines += ratio_distribution(judged)
    if signals():
        lines.append(f"interrupted by {signals.name}: the counts above are of the {ran[0]} runs that finished")
    text = "\n".join(lines)
    print(text)
    path = os.path.join(out_dir, f"fuzz{'-' + fault if fault else ''}.md")
    with writing(path), text_file(path) as fh:
        fh.write(text + "\n")
    write_manifest(out_dir, {
        **campaign_of, "status": "complete", "asked": examples, "ran": ran[0], "code": signals.code if signals() else code,
        "interrupted": signals.name if signals() else "", "verdicts": dict(sorted(verdicts.items())),
        "inconclusive": inconclusive, "caught": sum(caught) if fault else None, "missed": missed, "text": text,
        "reproducers": sorted(set(written))})
    if signals():
        print(f"parity: interrupted by {signals.name} after {ran[0]} fuzz runs; what finished is in {path}",
              file=sys.stderr)
        return signals.code
    return code


def _not_a_run(out: str) -> None:
    """A campaign's files beside a run's results would make ``merge`` and ``report`` read the folder
    as either: refused (one line, exit 2). A previous campaign's files are removed first
    (:func:`parity.report.fuzz_merge.clear_campaign`)."""
    from parity.errors import UsageError
    from parity.report.outdir import run_files_in

    present = run_files_in(out)
    if present:
        raise UsageError(f"--out {out} holds a run's results ({', '.join(present)}); give the campaign its own "
                         "--out")


#: What a campaign (or one part of it) leaves beside ``fuzz.md``, for ``parity merge``.
MANIFEST = "fuzz.json"


def write_manifest(out_dir: str, fields: dict) -> None:
    """``fuzz.json``: the campaign (seed, examples, fault, device, timeout, this part's index and
    count), what the
    part asked and ran, its exit code, verdict counts, INCONCLUSIVE runs, the reproducers it
    wrote, and the torch, hypothesis and parity it ran with (:mod:`parity.report.fuzz_merge` reads it)."""
    import json

    import hypothesis

    from parity.report.identity import parity_version

    path = os.path.join(out_dir, MANIFEST)
    with writing(path), text_file(path) as fh:  # hypothesis: another version draws other models from a seed
        json.dump({"kind": "parity-fuzz/1", "reproducers": [], "generator": generator_digest(),
                   "hypothesis": hypothesis.__version__, **fields,
                   "torch": torch.__version__, "parity": parity_version()}, fh, indent=1)


def generator_digest() -> str:
    """Names the model generator's source: the SHA-256 of every file of ``parity_fixtures`` (the
    generated models reuse the hand-written fixtures' modules). Parts of one campaign share it."""
    import parity_fixtures

    from parity.digests import data_sha256, file_sha256

    folder = os.path.dirname(parity_fixtures.__file__)
    names = sorted(n for n in os.listdir(folder) if n.endswith(".py"))
    return data_sha256("\n".join(f"{n} {file_sha256(os.path.join(folder, n))}" for n in names).encode())


def _failing_cell(cells: list[Cell], bad: list) -> tuple[Cell | list[Cell], list] | None:
    """The first of ``cells`` with a failing record, and its failing records; else, when only
    their cross-path records failed (each path passed alone, the two disagree), both cells and
    those records: the reproducer re-runs the pair, as ``parity repro PAIR_ID`` does."""
    for cell in cells:
        mine = [r for r in bad if r.cell == cell.id]
        if mine:
            return cell, mine
    pair = [r for r in bad if r.cell == cells[0].pair_id]
    return (cells, pair) if pair else None


def _write_reproducer(out_dir: str, spec: dict, values: dict, cell: Cell | list[Cell], bad: list, reproducer, replay_matrix,
                      origin: str, timeout: float, fault: str = "") -> list[str]:
    """The failing example as a model file (``parity run --model FILE:parity_model``), a matrix
    replaying its axes, and a reproducer in ``parity repro``'s format re-running its failing cell
    under the campaign's ``timeout`` (a TIMEOUT re-run under the default could pass). Returns the
    three files' names."""
    from parity.report.repro import recorded_options, render

    with writing(os.path.join(out_dir, f"repro_{spec['name']}.py")):
        with text_file(os.path.join(out_dir, f"repro_{spec['name']}.py")) as fh:
            fh.write(render(cell, bad, origin, options=recorded_options({"timeout": timeout})))
    stem = os.path.join(out_dir, f"reproducer_{spec['name']}")
    with writing(stem + ".py"), text_file(stem + ".py") as fh:
        fh.write(reproducer(spec))
    with writing(stem + ".toml"), text_file(stem + ".toml") as fh:
        fh.write(replay_matrix(spec, values, os.path.basename(stem) + ".py"))
    replay = f"python -m parity run --matrix {stem}.toml --timeout {timeout:g}" + (f" --fault {fault}" if fault else "")
    print(f"fuzz: a generated model failed; reproducer: python {os.path.join(out_dir, 'repro_' + spec['name'])}.py "
          f"(model: {stem}.py; replay both paths: {replay})")
    return [f"repro_{spec['name']}.py", *(os.path.basename(stem) + ext for ext in (".py", ".toml"))]


def add_fuzz_arguments(sub) -> None:
    from parity.arguments import count, integer, path, positive, shard

    fz = sub.add_parser("fuzz", help="hypothesis-generated models on both paths (needs hypothesis)")
    fz.add_argument("--examples", type=count, default=25, help="generated examples (25)")
    fz.add_argument("--seed", type=integer, default=0, help="hypothesis seed (0)")
    fz.add_argument("--fault", help="inject this fault into every example and count the catches")
    fz.add_argument("--out", type=path, default="results/fuzz", help="where reproducers and fuzz.md go (results/fuzz)")
    fz.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    fz.add_argument("--timeout", type=positive, default=120.0, help="seconds without progress (120)")
    fz.add_argument("--shard", type=shard, metavar="I/N", help="run part I of N of the campaign (CI fan-out)")


def fuzz_command(args) -> int:
    from parity.errors import UsageError
    from parity.faults import check_faults
    from parity.report.outdir import usable
    from parity.runner import resolve_device

    try:
        import hypothesis  # noqa: F401
    except ImportError:
        raise UsageError("fuzz needs hypothesis: pip install 'parity[test]'") from None
    check_faults([args.fault] if args.fault else [])
    from parity.matrix.shard import parse_shard

    shard = parse_shard(args.shard) if args.shard else None
    if shard and args.examples < shard.count:
        raise UsageError(f"fuzz --shard {shard}: {args.examples} examples cannot fill {shard.count} parts; "
                         "ask for at least as many examples as parts")
    device = resolve_device(args.device)
    usable(args.out)  # before the campaign: its results must have somewhere to go
    _not_a_run(args.out)
    from parity.report.fuzz_merge import clear_campaign

    clear_campaign(args.out)  # an earlier campaign's report or reproducers never read as this one's
    return campaign(examples=args.examples, seed=args.seed, out_dir=args.out, fault=args.fault or "",
                    device=device, timeout=args.timeout,
                    shard=(shard.index, shard.count) if shard else (1, 1))
