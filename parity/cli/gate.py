"""``gate`` and ``merge``: decide GO / NO-GO / PARTIAL per model on a run's records, and what a
run's evidence covers of the complete matrix it names (docs/gate.md)."""

from __future__ import annotations

import hashlib
import os
import re
import sys

from parity.cli.parser import AXIS_OPTIONS, RUN_DEFAULTS
from parity.cli.run import _execute, _run_settings, _select, check_recorded
from parity.errors import UsageError
from parity.interrupt import Signals

#: Run options whose value, when given, may make a run narrower than its matrix; cell ids
#: show what ``-k``/``--ranks``/``--paths`` and the axis options left out, but not ``--steps``.
NARROWING = ("filter", "ranks", "paths", "steps", "shard", *AXIS_OPTIONS)
_FLAGS = {"filter": "-k", **{k: "--" + k.replace("_", "-") for k in ("ranks", "paths", "steps", "shard", *AXIS_OPTIONS)}}


_FAULT_TAG = re.compile(r"/fault-[^/]+$")


def _scope(opts: dict | None, ran: list[str], manifest: dict | None = None) -> dict:
    """What a gate's evidence covers against the complete matrix its run names: the matrix,
    a digest of its complete cell list, the options that narrowed it, the counts run vs
    expected and the cells left out. ``complete`` only when every cell of the matrix ran with
    the matrix's step count and no fault (docs/gate.md, rule "complete matrix"), and not as one
    part of a split run. The matrix is read again: a matrix or model file whose contents differ
    from the run's (``run.json``'s ``sources``) is a :class:`UsageError` -- the run would be
    judged against a matrix it did not run."""
    if not isinstance(opts, dict) or not opts.get("matrix"):
        return {"complete": False, "left_out": ["the run records no options (not run by parity run/gate)"]}
    opts = {**RUN_DEFAULTS, **opts}
    full = {**opts, **{k: None for k in NARROWING}, "fault": []}
    matrix, cells = _select(full)
    _unchanged(matrix, cells, (manifest or {}).get("sources"))
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
    part = (manifest or {}).get("shard")
    if isinstance(part, dict) and not (manifest or {}).get("merged"):
        left_out.append(f"one part ({part.get('index')}/{part.get('count')}) of a split run: merge the parts "
                        "(parity merge ... --gate) to decide on the matrix")
    digest = hashlib.sha256(f"steps={steps}\n".encode() + "\n".join(expected).encode()).hexdigest()[:16]
    return {"complete": not left_out, "left_out": left_out, "matrix": matrix.name, "matrix_digest": digest,
            "cells_expected": len(expected), "cells_run": len(ran & set(expected)), "steps": opts["steps"] or steps,
            "options": {_FLAGS[k]: v for k, v in given.items()}, "faults": list(opts["fault"])}


def _unchanged(matrix, cells, sources) -> None:
    """The files the gate reads again hold what the run read: the matrix file by content (the
    run may have been checked out elsewhere: its digest must be among ``run.json``'s ``sources``),
    a model file the run recorded at the same path by that path's digest (a narrowed run read
    only its cells' model files: the others it never recorded). A run that recorded no digests is
    not checked."""
    if not isinstance(sources, dict):
        return
    from parity.report.identity import identity

    recorded = set(map(str, sources.values()))
    matrix_file = os.path.realpath(matrix.path) if matrix.path else ""
    for path, digest in identity(matrix.path, cells)["sources"].items():
        changed = digest not in recorded if path == matrix_file else path in sources and sources[path] != digest
        if changed:
            raise UsageError(f"gate: {path} is not the file the run read (its SHA-256 is not the one run.json "
                             "records): the run would be judged against a matrix or model it did not run; restore "
                             "it, or run the gate again")


def _skipped(records: list) -> int:
    """How many of the run's cells recorded nothing but SKIP, the least severe verdict (counted
    among ``cells_run``: they were selected and decided on, not checked)."""
    from parity.judge.record import Verdict
    from parity.report.summary import cell_verdicts

    return sum(v == Verdict.SKIP for v in cell_verdicts(records).values())


def _gate_baseline(directory: str | None) -> dict | None:
    """The digest ``gate --compare-to`` compares with (a complete run's), or ``None``."""
    if not directory:
        return None
    from parity.report.compare import digest_of

    baseline = digest_of(directory, "--compare-to", baseline=True)
    if not baseline.get("cells"):  # a bench's rows: every one would read as this run's regression
        raise UsageError(f"--compare-to {directory}: holds a bench's rows, not a matrix run's cells: not the same "
                         "kind of results; give a complete run's directory or its digest")
    return baseline


def _same_matrix(directory: str | None, baseline: dict | None, matrix: str) -> None:
    """A gate compares like with like: ``--compare-to``'s results must be of the matrix it judges."""
    if baseline and baseline.get("matrix") and matrix and baseline["matrix"] != matrix:
        raise UsageError(f"--compare-to {directory}: those results are of matrix {baseline['matrix']!r}, this gate "
                         f"judges {matrix!r}; compare like with like (gate --matrix {baseline['matrix']})")


def cmd_gate(args) -> int:
    """Run a matrix (or read ``--from DIR``) and decide GO / NO-GO / PARTIAL per model."""
    from parity.paths import check_path
    from parity.report import outdir

    candidate = check_path(args.candidate)
    if args.fault:
        raise UsageError("gate refuses --fault: a decision must rest on an unmodified torch; "
                         "test the checks with python -m parity run --fault NAME")
    baseline = _gate_baseline(args.compare_to)  # before any work: a missing baseline fails now, not after the run
    if args.from_dir:
        _only_judging(args)  # --baseline included: that run's baseline is judged as it ran
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
    if opts["baseline"] == candidate:  # the baseline the run will use: given, recorded (--resume) or the default
        raise UsageError(f"gate: the baseline path {candidate} is the candidate: a gate compares the candidate with "
                         "another path; name another with --baseline (or another --candidate)")
    _same_matrix(args.compare_to, baseline, opts["matrix"])
    matrix, cells = _select(opts)
    from parity.execute.torchrun import agreed, writes_results

    # the run's cells and files, then the gate's; under torchrun its peers keep the default handlers
    with Signals(enabled=writes_results()) as signals:
        code = _execute(args, opts, matrix, cells)
        if code < 0:  # a torchrun peer: rank 0 decides, and every rank exits with its decision
            return max(0, agreed(code))
        return agreed(_after_run(args, opts, code, candidate, baseline, signals))


def _after_run(args, opts: dict, code: int, candidate: str, baseline: dict | None, signals: Signals) -> int:
    """The gate's exit code once its run (``code``) ended: the decision, unless the run was
    interrupted or is one part of a split run."""
    from parity.report import outdir

    out = opts["out"]
    manifest = outdir.read_manifest(out)
    if manifest.get("status") != "complete":
        return code  # interrupted: the run already said so
    if opts["shard"]:  # one part decides nothing: the merged parts do
        print(f"gate: part {opts['shard']} recorded in {out}; decide on every part: "
              f"python -m parity merge PART_DIRS... --out DIR --gate")
        return code
    return _decide(args, out, manifest, candidate, baseline, signals)


def _only_judging(args) -> None:
    """``gate --from DIR`` judges that run as it ran and writes beside it: an option that selects,
    runs or places cells would be ignored, so it is refused instead (one line, exit 2). ``--junit``
    applies: the gate writes that run's cases and its decisions there (checked writable first)."""
    given = [k for k in (*RUN_DEFAULTS, "overwrite", "resume") if getattr(args, k, None) not in (None, [], False)
             and k != "junit"]
    if given:
        flag = "-k" if given[0] == "filter" else "--" + given[0].replace("_", "-")
        raise UsageError(f"gate --from {args.from_dir} judges that run as it ran (its gate files go beside it): "
                         f"{flag} does not apply; drop it, or run a new gate with it (python -m parity gate {flag} ... --out DIR)")
    if args.junit is not None:
        from parity.report.outdir import writable_file

        writable_file(args.junit, "--junit", args.from_dir)


def _decide(args, out: str, manifest: dict, candidate: str, baseline: dict | None, signals: Signals) -> int:
    """Judge ``out``'s records (against ``baseline``, ``--compare-to``'s digest, when given) and
    the scope of its run, write the gate's files, print the decisions."""
    from parity.errors import writing
    from parity.report import gate, outdir

    check_recorded(manifest.get("options") or {}, f"gate: {out}", "rerun the matrix into a new --out")
    records = outdir.complete_records(out, manifest, "gate")
    decisions = gate.evaluate(records, candidate)
    if not decisions:  # no model to decide on: no decision would be written, and JUnit would hold no failure
        raise UsageError(f"gate: {out} holds no records, so no model to decide on; run the matrix into a new --out")
    if baseline is not None:
        from parity.report.compare import compare, concerns, digest_of

        bad, _ = compare(baseline, digest_of(out, "gate"))
        # a regression of a model the new run lacks (its cells gone) concerns every decision made without it
        orphans = [b for b in bad if not any(concerns(b, d.model) for d in decisions)]
        for d in decisions:
            mine = [b for b in bad if concerns(b, d.model)] + orphans
            if mine:
                gate.no_go(d, f"regressed against {args.compare_to}: " + "; ".join(mine[:5]))
    gate.apply_model_warnings(decisions, manifest.get("model_warnings"))
    scope = _scope(manifest.get("options"), list(manifest.get("cells") or []), manifest)
    scope["cells_skipped"] = _skipped(records)
    gate.apply_scope(decisions, scope)
    env = manifest.get("environment") or {}
    meta = {"candidate": candidate, "baseline": str((manifest.get("options") or {}).get("baseline") or "legacy"),
            "torch": manifest.get("torch", ""), "results": out,
            "matrix": scope.get("matrix", ""), "cells": len(manifest.get("cells", [])), "records": len(records),
            "scope": scope, "device": manifest.get("device", ""),
            "versions": {k: env.get(k, "") for k in ("torch", "cuda", "nccl", "python")}}
    from parity.report.html import write_html

    with writing(out):
        gate.write(out, decisions, records, meta=meta)
        write_html(out, records)
    if getattr(args, "junit", None):  # the run's cases and, one per model, the decision the exit code is
        from parity.report.junit import write_junit

        with writing(args.junit):
            write_junit(args.junit, records, suite=scope.get("matrix") or "gate", decisions=[
                (d.model, d.decision, gate.is_go([d]), "; ".join(d.reasons or d.notes)) for d in decisions])
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
    from parity.report import fuzz_merge
    from parity.report.merge import merge
    from parity.runner import verdict_code

    fuzz = [d for d in args.parts if fuzz_merge.is_part(d)]
    if fuzz:
        if len(fuzz) != len(args.parts):
            other = next(d for d in args.parts if d not in fuzz)
            raise UsageError(f"merge: {fuzz[0]} is a fuzz campaign's part and {other} is not; merge a run's "
                             "parts or a campaign's parts, not both")
        if args.gate or args.junit is not None:
            raise UsageError("merge: --gate and --junit decide on a matrix run's records; a fuzz campaign's "
                             "merged verdict is its exit code and fuzz.md")
        return fuzz_merge.merge(args.parts, args.out, overwrite=args.overwrite)
    if args.junit is not None:
        from parity.report.outdir import writable_file

        writable_file(args.junit, "--junit", args.out, *args.parts)  # a part's own files included
    if args.gate:  # bad input is refused before the parts are merged
        from parity.paths import check_path

        candidate = check_path(args.candidate)
    with Signals() as signals:
        manifest, records = merge(args.parts, args.out, overwrite=args.overwrite, junit=args.junit or "")
        print(f"merge: {manifest['merged']['parts']} parts, {len(manifest['cells'])} cells, {len(records)} records "
              f"in {args.out}")
        if args.gate:
            return _decide(args, args.out, manifest, candidate, None, signals)
        if signals():  # arrived while the merged files were written: they were completed first
            print(f"parity: interrupted by {signals.name} while merging (the merged files are complete)",
                  file=sys.stderr)
            return signals.code
    return verdict_code(records)
