"""``python -m parity merge DIR... --out DIR`` on the parts of a fuzz campaign (``fuzz --shard I/N``).

Each part's ``fuzz.json`` (:func:`parity.fuzz.write_manifest`) names its campaign (seed,
examples, fault, device, timeout), its index and count, what it ran and its exit code. Merging refuses, with one
line and exit code 2, parts of another campaign or split, another torch or parity, a part given
twice or missing, or a directory that is not a fuzz part. The merged directory holds one
``fuzz.md`` (the campaign's totals, then each part's line), ``fuzz.json`` and every part's
reproducers under ``part-I/``; the exit code is 0 only when every part finished its share with
exit code 0 (a part that failed, stopped or ran fewer examples than it asked makes it 1), and for
a ``--fault`` campaign only when some example flagged the fault. A part whose share is not its
due of ``examples``, or whose listed reproducer is gone, is refused (exit 2); an ``--out``
holding another campaign's files needs ``--overwrite``, which removes them first.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from collections import Counter

from parity.errors import UsageError, text_file, writing
from parity.report.outdir import CAMPAIGN as MANIFEST
#: Entries every part of one campaign shares (``generator``: the digest of the model generator's
#: source, which an uncommitted edit changes where ``parity``'s commit does not).
SAME = ("seed", "examples", "fault", "count", "torch", "parity", "generator")
#: What a campaign (or a merge of one) writes into its ``--out``: a later campaign there replaces
#: all of it, so no earlier campaign's report or reproducer reads as this one's.
CAMPAIGN_FILES = ("fuzz.json", "fuzz.md", "fuzz-*.md", "repro_*.py", "reproducer_*.py", "reproducer_*.toml")
#: What a merge adds: each part's reproducers under ``part-I/`` (removed by a later merge there,
#: unless it is one of that merge's own parts).
MERGED_DIRS = "part-*"


def share_of(examples: int, index: int, count: int) -> int:
    """Part ``index`` of ``count``'s due of a campaign's ``examples`` (the remainder to the first parts)."""
    return examples // count + (1 if index <= examples % count else 0)


def campaign_files_in(out: str, patterns: tuple[str, ...] = CAMPAIGN_FILES) -> list[str]:
    """The names in ``out`` an earlier campaign wrote (:data:`CAMPAIGN_FILES`), or ``patterns``."""
    names = os.listdir(out) if os.path.isdir(out) else []
    return sorted(n for n in names if any(fnmatch.fnmatch(n, pattern) for pattern in patterns))


#: What a merge copies into ``part-I/``: its parts' reproducers.
REPRODUCERS = tuple(p for p in CAMPAIGN_FILES if p.startswith("repro"))


def merged_copies_in(out: str) -> list[str]:
    """The ``part-I`` folders in ``out`` an earlier merge filled with its parts' reproducers: only
    where ``out`` holds a merged campaign (its :data:`MANIFEST` lists parts) and the folder holds
    reproducers and nothing else. A part kept there, a run's part or anything else is left alone."""
    try:
        with open(os.path.join(out, MANIFEST), encoding="utf-8") as fh:
            merged = json.load(fh).get("parts")
    except (OSError, ValueError, AttributeError):
        return []
    if not merged:
        return []

    def copies(folder: str) -> bool:
        names = os.listdir(folder) if os.path.isdir(folder) and not os.path.islink(folder) else []
        return bool(names) and all(os.path.isfile(os.path.join(folder, n)) and not os.path.islink(os.path.join(folder, n))
                                   and any(fnmatch.fnmatch(n, p) for p in REPRODUCERS) for n in names)

    return [n for n in campaign_files_in(out, (MERGED_DIRS,)) if copies(os.path.join(out, n))]


def clear_campaign(out: str, names: list[str] | None = None) -> None:
    """Remove ``names`` from ``out`` (files or folders; default: what an earlier campaign or merge
    wrote, :func:`campaign_files_in` and :func:`merged_copies_in`)."""
    for name in campaign_files_in(out) + merged_copies_in(out) if names is None else names:
        path = os.path.join(out, name)
        with writing(path):
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)


#: Options (and the hypothesis version) every part shares too, compared where written (a part from before they were written
#: has neither, and matches only another such part).
SAME_OPTIONS = ("device", "timeout", "hypothesis", "ranks")


def is_part(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, MANIFEST))


def _read(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise UsageError(f"merge: {path} is unreadable ({exc}); rerun that fuzz part") from None
    if not isinstance(data, dict) or data.get("kind") != "parity-fuzz/1" or not {*SAME, "index", "ran", "asked",
                                                                                  "code"} <= set(data):
        raise UsageError(f"merge: {path} is not a fuzz part's manifest; give directories written by fuzz --shard I/N")
    if data.get("parts"):  # a merge's own manifest: its index and count are the parts'
        raise UsageError(f"merge: {path} is a merged campaign, not a part; give the parts' directories "
                         "(fuzz --shard I/N)")
    bad = _malformed(data)
    if bad:
        raise UsageError(f"merge: {path}: {bad}; rerun that fuzz part")
    return data


#: The entries a merge counts with, and what each must be.
_COUNTS = ("index", "count", "examples", "asked", "ran")


def _malformed(data: dict) -> str:
    """What of a part's manifest a merge could not count with ("" when nothing)."""
    for key in ("fault", "interrupted"):
        if key in data and not isinstance(data[key], str):
            return f"{key} is {data[key]!r}, not text"
    for key in _COUNTS:
        if type(data[key]) is not int or data[key] < (1 if key in ("index", "count") else 0):
            return f"{key} is {data[key]!r}, not a count"
    if not data["index"] <= data["count"]:
        return f"index {data['index']} is beyond count {data['count']}"
    verdicts, listed = data.get("verdicts", {}), (data.get("inconclusive", []), data.get("reproducers", []))
    if not isinstance(verdicts, dict) or not all(type(v) is int for v in verdicts.values()):
        return f"verdicts is {verdicts!r}, not counts by verdict"
    if not all(isinstance(x, list) and all(isinstance(i, str) for i in x) for x in listed):
        return "inconclusive and reproducers must be lists of strings"
    if any(os.path.basename(f) != f or f in ("", ".", "..") for f in listed[1]):
        return "reproducers must be file names in the part's directory"
    if data.get("caught") is not None and type(data["caught"]) is not int:
        return f"caught is {data['caught']!r}, not a count"
    return ""


def check_parts(directories: list[str]) -> list[tuple[str, dict]]:
    """(directory, manifest) of every part, in index order, after the checks in the module docstring."""
    parts = [(d, _read(d)) for d in directories]
    first_dir, first = parts[0]
    for d, m in parts[1:]:
        for key in SAME + SAME_OPTIONS:
            if m.get(key) != first.get(key):
                raise UsageError(f"merge: {d} and {first_dir} differ in {key} ({m.get(key)!r} vs {first.get(key)!r}); "
                                 "merge the parts of one fuzz campaign, run with the same options, torch and parity")
    seen: dict[int, str] = {}
    for d, m in parts:
        if m["index"] in seen:
            raise UsageError(f"merge: fuzz part {m['index']}/{m['count']} given twice ({seen[m['index']]} and {d}); "
                             "give each part once")
        seen[m["index"]] = d
    missing = [i for i in range(1, first["count"] + 1) if i not in seen]
    if missing:
        raise UsageError(f"merge: fuzz part {missing[0]}/{first['count']} is missing ({len(missing)} of "
                         f"{first['count']} parts not given); give every part's directory")
    for d, m in parts:
        share = share_of(m["examples"], m["index"], m["count"])
        if m["asked"] != share:  # the parts' shares must add up to the campaign
            raise UsageError(f"merge: {d}/{MANIFEST}: part {m['index']}/{m['count']} asked {m['asked']} examples, its "
                             f"share of {m['examples']} is {share}; rerun that fuzz part")
        gone = [f for f in m.get("reproducers", []) if not os.path.isfile(os.path.join(d, f))]
        if gone:  # the part's evidence of a failure: never merged away in silence
            raise UsageError(f"merge: {d} lists reproducer {gone[0]} in {MANIFEST}, but the file is not there; "
                             "rerun that fuzz part")
    return sorted(parts, key=lambda p: p[1]["index"])


def _finished(m: dict) -> bool:
    """The part ran its share to the end: exit 0, or 1 only because its fault was flagged in none
    of its examples (``missed``: the merge weighs the campaign's catches as a whole)."""
    clean = m["code"] == 0 or (m["code"] == 1 and m.get("missed") is True)
    return m.get("status") == "complete" and clean and not m.get("interrupted") and m["ran"] >= m["asked"]


def _state(m: dict) -> str:
    if m.get("status") != "complete":
        return "never finished (killed, or still running)"
    if _finished(m):
        return "finished" + (" (its fault flagged in none of its examples)" if m.get("missed") else "")
    return "interrupted by " + m["interrupted"] if m.get("interrupted") else f"exit {m['code']}"


def merge(directories: list[str], out: str, *, overwrite: bool = False) -> int:
    """Write the merged campaign into ``out``; returns its exit code."""
    if any(os.path.realpath(d) == os.path.realpath(out) for d in directories):
        raise UsageError(f"merge: --out {out} is one of the parts; write the merged campaign elsewhere")
    from parity.report.outdir import run_files_in

    held = run_files_in(out)
    if held:  # the other kind of results: never side by side
        raise UsageError(f"merge: --out {out} holds a run's results ({', '.join(held)}); write the merged campaign "
                         "elsewhere")
    parts = check_parts(directories)
    from parity.report.outdir import usable

    usable(out)  # a file, or a folder under one: one line, before anything is cleared or written
    first = parts[0][1]
    name = f"fuzz{'-' + first['fault'] if first['fault'] else ''}.md"
    inputs = {os.path.realpath(d) for d in directories}
    earlier = sorted(campaign_files_in(out) + [n for n in merged_copies_in(out)  # never a part or a run's folder
                                               if os.path.realpath(os.path.join(out, n)) not in inputs])
    if earlier and not overwrite:
        raise UsageError(f"merge: --out {out} holds another campaign's files ({', '.join(earlier[:3])}); pass "
                         "--overwrite or choose another --out")
    clear_campaign(out, earlier)
    verdicts, inconclusive = Counter(), []
    for _, m in parts:
        verdicts.update(m.get("verdicts", {}))
        inconclusive += m.get("inconclusive", [])
    ran = sum(m["ran"] for _, m in parts)
    fault = first["fault"]
    caught = sum(m.get("caught") or 0 for _, m in parts)
    code = 0 if all(_finished(m) for _, m in parts) and not (fault and not caught) else 1
    lines = [f"fuzz: {ran} runs of a campaign of {first['examples']} examples (seed {first['seed']}"
             f"{', fault ' + fault if fault else ''}; torch {first['torch']}), merged from {len(parts)} parts: "
             + ("every part finished" if code == 0 else "NOT every part finished clean")]
    if fault:
        lines.append(f"fault {fault} flagged in {caught} of {ran} examples ({100 * caught / max(1, ran):.0f} per 100)"
                     + ("; flagged in none: exit 1" if not caught else ""))
    lines.append(f"runs with an INCONCLUSIVE record: {len(inconclusive)}" + "".join(f"\n  {x}" for x in inconclusive[:20]))
    lines.append("records by verdict: " + ", ".join(f"{k} {v}" for k, v in sorted(verdicts.items())))
    for d, m in parts:
        state = _state(m)
        extra = f"; reproducers in part-{m['index']}/: {', '.join(m['reproducers'])}" if m.get("reproducers") else ""
        lines.append(f"part {m['index']}/{m['count']}: {m['ran']} of {m['asked']} runs, {state} ({d}){extra}")
    text = "\n".join(lines)
    os.makedirs(out, exist_ok=True)
    for d, m in parts:
        for f in m.get("reproducers", []):  # each there (check_parts)
            os.makedirs(os.path.join(out, f"part-{m['index']}"), exist_ok=True)
            target = os.path.join(out, f"part-{m['index']}", f)
            if os.path.realpath(target) != os.path.realpath(os.path.join(d, f)):  # a part kept as out/part-I
                shutil.copy2(os.path.join(d, f), target)
    with writing(os.path.join(out, name)), text_file(os.path.join(out, name)) as fh:
        fh.write(text + "\n")
    merged = {**{k: first[k] for k in SAME}, **{k: first.get(k) for k in SAME_OPTIONS}, "kind": "parity-fuzz/1",
              "status": "complete", "index": None, "asked": first["examples"], "ran": ran, "code": code,
              "caught": caught if fault else None, "verdicts": dict(sorted(verdicts.items())), "inconclusive": inconclusive,
              "parts": [os.path.abspath(d) for d, _ in parts]}
    with writing(os.path.join(out, MANIFEST)), text_file(os.path.join(out, MANIFEST)) as fh:
        json.dump(merged, fh, indent=1)
    print(text)
    return code
