"""``python -m parity merge DIR... --out DIR``: the parts of a sharded run (``--shard I/N``) as one run.

A part's ``run.json`` records ``shard``: its index and count, the digest of the whole
selection, the selection's cell ids (in the order a single run lists them) and its pair groups
in the order a single run executes them. Merging refuses, with one line and exit code 2, parts
that are not of one run: another selection or split, other options (``--baseline``, ``--fp64``,
a knob), another torch, parity, device or model file, an unfinished part, a part given twice, a
part missing, a cell held twice or by no part, or
a part whose ``cells.csv`` is not what it recorded (cut, emptied or appended to: its length differs
from its ``progress.jsonl``'s, or a cell it ran has no record).

The merged directory is what one run of the whole selection writes: its ``cells.csv`` holds
the parts' records group by group in the single run's order (a pair group always runs whole in
one part, so its rows are copied as they were written), and ``summary.md``, ``report.html``
and JUnit are written from them by the same code a run uses; ``progress.jsonl`` records each
group's end, as a run's does. Only timings differ: ``timings.json``
holds the parts' phases summed (``wall`` is the sum of the parts' walls, not the elapsed time).
Its ``run.json`` is a complete run's without ``shard`` (``gate --from`` judges it like any run),
plus ``merged``: the parts' directories.
"""

from __future__ import annotations

import json
import os
from collections import Counter

from parity.errors import UsageError, text_file, writing
from parity.judge.record import Record
from parity.matrix.shard import ids_digest
from parity.report import fuzz_merge, outdir
from parity.report.html import write_html
from parity.report.junit import write_junit
from parity.report.records import RecordWriter
from parity.report.summary import summary_markdown

#: run.json entries every part of one run shares (besides the shard's selection digest); each part
#: records ``model_warnings`` for the whole selection, so another reading of a model (another
#: transformers on that machine) shows as a difference.
SAME = ("torch", "device", "parity", "sources", "model_warnings")


def _compared(key: str, value):
    """What of a ``SAME`` entry must agree: for ``sources`` the files' contents, not where they lie
    (each CI job may check the repository out at another path)."""
    if key == "sources" and isinstance(value, dict):
        return sorted(map(str, value.values()))
    return value


def _part(directory: str) -> dict:
    manifest = outdir.read_manifest(directory, "rerun that part (run --shard I/N)")
    shard = manifest.get("shard")
    if not isinstance(shard, dict) or not {"index", "count", "digest", "selection", "groups", "cell_groups"} <= set(shard):
        raise UsageError(f"merge: {directory} is not a part of a sharded run (no shard in its run.json); "
                         "give directories written by run --shard I/N")
    bad = _malformed(shard, manifest.get("cells"))
    if bad:
        raise UsageError(f"merge: {directory}/run.json: shard.{bad}; rerun that part (run --shard I/N)")
    if manifest.get("status") != "complete":
        raise UsageError(f"merge: part {shard['index']}/{shard['count']} in {directory} is "
                         f"{manifest.get('status', 'unfinished')}; finish it with python -m parity run --resume {directory}")
    if not os.path.isfile(os.path.join(directory, outdir.CELLS)):
        raise UsageError(f"merge: {directory} has no {outdir.CELLS}; rerun that part")
    return manifest


def _malformed(shard: dict, cells) -> str:
    """What is wrong with a part's ``shard`` entry (``""``: nothing): its index and count are
    integers, 1 <= index <= count; its digest a string; selection, groups and cell_groups lists
    of strings, one cell group per cell ``run.json`` lists."""
    def strings(v):
        return isinstance(v, list) and all(isinstance(x, str) for x in v)

    ints = all(isinstance(shard[k], int) and not isinstance(shard[k], bool) for k in ("index", "count"))
    if not ints or not 1 <= shard["index"] <= shard["count"]:
        return f"index / count must be integers with 1 <= index <= count, not {shard['index']!r} / {shard['count']!r}"
    if not isinstance(shard["digest"], str):
        return f"digest must be a string, not {_short(shard['digest'])}"
    for key in ("selection", "groups", "cell_groups"):
        if not strings(shard[key]):
            return f"{key} must be a list of strings, not {_short(shard[key])}"
    if isinstance(cells, list) and len(shard["cell_groups"]) != len(cells):
        return f"cell_groups holds {len(shard['cell_groups'])} groups for {len(cells)} cells"
    if len(set(shard["groups"])) != len(shard["groups"]):  # its rows would be written twice
        return "groups names a pair group twice"
    if ids_digest(shard["selection"]) != shard["digest"]:  # an edited list would merge as a smaller run
        return f"selection is not the selection its digest {_short(shard['digest'])} names"
    return ""


def _records(directory: str, manifest: dict) -> list[Record]:
    """A part's records, as it recorded them (:func:`parity.report.outdir.complete_records`)."""
    shard = manifest["shard"]
    return outdir.complete_records(directory, manifest, "merge",
                                   f"rerun part {shard['index']}/{shard['count']} into a new --out")


def check_parts(directories: list[str]) -> list[tuple[str, dict]]:
    """(directory, manifest) of every part, index order, after every check in the module docstring."""
    if not directories:
        raise UsageError("merge: give the directories of every part (run --shard I/N --out DIR)")
    parts = [(d, _part(d)) for d in directories]
    first_dir, first = parts[0]
    count = first["shard"]["count"]
    for d, m in parts[1:]:
        if m["shard"]["count"] != count or m["shard"]["digest"] != first["shard"]["digest"]:
            raise UsageError(f"merge: {d} is part {m['shard']['index']}/{m['shard']['count']} of selection "
                             f"{m['shard']['digest']}, {first_dir} is part {first['shard']['index']}/{count} of "
                             f"{first['shard']['digest']}; merge the parts of one run only")
        if m["shard"]["groups"] != first["shard"]["groups"]:  # the merged run's order: every part records it
            raise UsageError(f"merge: {d} and {first_dir} record different pair-group orders (shard.groups); "
                             "rerun the parts of one run")
        options, first_options = _options(m), _options(first)
        if options != first_options:
            key = next(k for k in sorted({*options, *first_options}) if options.get(k) != first_options.get(k))
            raise UsageError(f"merge: {d} and {first_dir} were run with different --{key.replace('_', '-')} "
                             f"({_short(options.get(key))} vs {_short(first_options.get(key))}); run every part "
                             "with the same options")
        for key in SAME:
            if _compared(key, m.get(key)) != _compared(key, first.get(key)):
                raise UsageError(f"merge: {d} and {first_dir} differ in {key} ({_short(m.get(key))} vs "
                                 f"{_short(first.get(key))}); run every part with the same torch, parity and models")
    seen: dict[int, str] = {}
    for d, m in parts:
        i = m["shard"]["index"]
        if i in seen:
            raise UsageError(f"merge: part {i}/{count} given twice ({seen[i]} and {d}); give each part once")
        seen[i] = d
    missing = [i for i in range(1, count + 1) if i not in seen]
    if missing:
        raise UsageError(f"merge: part {missing[0]}/{count} is missing ({len(missing)} of {count} parts not given); "
                         "give every part's directory")
    held = Counter(c for _, m in parts for c in m.get("cells", []))
    selection = first["shard"]["selection"]
    twice = [c for c, n in held.items() if n > 1]
    absent = [c for c in selection if c not in held]
    extra = [c for c in held if c not in set(selection)]
    for cells, what in ((twice, "is held by two parts"), (absent, "is held by no part"), (extra, "is not in the selection")):
        if cells:
            raise UsageError(f"merge: cell {cells[0]} {what} ({len(cells)} such); rerun the parts of one run")
    return sorted(parts, key=lambda p: p[1]["shard"]["index"])


def _options(manifest: dict) -> dict:
    """The options that define what a part computes (``run.json``'s, those ``--resume`` keeps), less
    ``shard``, which differs between parts of one run by design; ``matrix`` by its name, whose file
    may lie at another path on another machine (the shard digest already pins the selection, the
    name is the merged run's title)."""
    options = {k: v for k, v in (manifest.get("options") or {}).items() if k != "shard"}
    if isinstance(options.get("matrix"), str):  # its name (the merged run's title): not where its file lies
        options["matrix"] = os.path.basename(options["matrix"]).removesuffix(".toml")
    if isinstance(options.get("model"), list):  # a model file, too, lies where each job checked it out
        options["model"] = [_where_free(m) for m in options["model"]]
    return options


def _where_free(source):
    """``--model`` ``DIR/FILE.py:factory`` as ``FILE.py:factory``: the files' contents are compared
    through ``sources`` (:data:`SAME`)."""
    if not isinstance(source, str):
        return source
    file, colon, factory = source.rpartition(":") if ":" in source else (source, "", "")
    return os.path.basename(file) + colon + factory


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


def merged_blocks(directories: list[str], manifests: list[dict]) -> list[tuple[str, list[Record]]]:
    """Every part's records by pair group, the groups in the single run's order."""
    blocks: dict[str, list[Record]] = {}
    for directory, m in zip(directories, manifests):
        group_of = dict(zip(m["cells"], m["shard"]["cell_groups"]))
        for r in _records(directory, m):
            blocks.setdefault(group_of.get(r.cell, r.cell), []).append(r)
    order = manifests[0]["shard"]["groups"]
    unknown = [g for g in blocks if g not in set(order)]
    if unknown:
        raise UsageError(f"merge: records of {unknown[0]} belong to no pair group of the selection; rerun that part")
    return [(g, blocks[g]) for g in order if g in blocks]


def merge(directories: list[str], out: str, *, overwrite: bool = False, junit: str = "") -> tuple[dict, list[Record]]:
    """Write the merged results directory; returns its manifest and records."""
    by_dir = {os.path.realpath(d): d for d in directories}
    if os.path.realpath(out) in by_dir:
        raise UsageError(f"merge: --out {out} is one of the parts; write the merged run elsewhere")
    if fuzz_merge.is_part(out):  # the other kind of results: never side by side
        raise UsageError(f"merge: --out {out} holds a fuzz campaign's results; write the merged run elsewhere")
    parts = check_parts(directories)
    ordered, manifests = [d for d, _ in parts], [m for _, m in parts]
    blocks = merged_blocks(ordered, manifests)
    records = [r for _, block in blocks for r in block]
    first = manifests[0]
    shard = first["shard"]
    options = {**first.get("options", {}), "shard": None}
    manifest = {k: v for k, v in first.items() if k not in ("shard", "status", "cells", "options")}
    manifest.update(options=options, cells=list(shard["selection"]),
                    merged={"parts": len(manifests), "from": [os.path.abspath(d) for d in ordered]})
    timings = Counter()
    for d in ordered:
        path = os.path.join(d, "timings.json")
        data = outdir.read_json(path, "rerun that part") if os.path.isfile(path) else {}
        timings.update({k: v for k, v in data.items() if isinstance(v, (int, float)) and k != "per_cell"})
    timings["per_cell"] = timings["wall"] / max(1, timings["cells"])
    with outdir.locked(out):
        outdir.prepare(out, manifest, overwrite=overwrite, resumable=False)
        writer = RecordWriter(os.path.join(out, outdir.CELLS))
        progress = []
        with writing(writer.path):
            for group, block in blocks:  # a single run's progress.jsonl: each group's byte end
                writer.write(block, sync=False)
                progress.append({"group": group, "bytes": writer.tell()})
            writer.sync()
        writer.close()
        outdir.write_progress(out, outdir.with_digests(out, progress))
        for d, m in zip(ordered, manifests):
            outdir.copy_traces(d, out, m["cells"])
        title = str(shard.get("title") or options.get("matrix") or "run")
        with writing(os.path.join(out, "summary.md")), text_file(os.path.join(out, "summary.md")) as fh:
            fh.write(summary_markdown(records, title=title, timings=dict(timings), cells_total=len(shard["selection"]),
                                     faults=options.get("fault") or (), results_dir=out))
        with writing(os.path.join(out, "timings.json")), text_file(os.path.join(out, "timings.json")) as fh:
            json.dump(dict(timings), fh, indent=2)
        with writing(os.path.join(out, "report.html")):
            write_html(out, records, {**manifest, "status": "complete"})
        if junit:
            with writing(junit):
                write_junit(junit, records, suite=title)
        outdir.write_manifest(out, {**manifest, "status": "complete"})
    return {**manifest, "status": "complete"}, records
