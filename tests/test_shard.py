"""``run --shard I/N`` and ``parity merge``: parts that together hold every cell once, merged into
what one run writes; parts of different runs, missing or doubled parts are refused."""

import csv
import dataclasses
import json
import os
import pathlib
import re
import shutil
import xml.etree.ElementTree as ET

import pytest

from parity.cli import main
from parity.matrix import load
from parity.matrix.cell import Cell
from parity.matrix.shard import SLACK, Shard, assign, expected_cost, parse_shard, select_part
from parity.errors import UsageError
from parity.report.outdir import with_digests

pytestmark = pytest.mark.xdist_group("shard")  # one worker runs the slice and its parts once

SLICE = ["--matrix", "smoke", "-k", "ranks == 2 and microbatches == 1"]


def _loads(cells, parts, n):
    loads = [0.0] * n
    for c in cells:
        loads[parts[c.pair_id] - 1] += expected_cost(c)
    return loads


@pytest.mark.parametrize("name, n", [("full", 2), ("full", 4), ("full", 8), ("default", 16), ("knobs", 8)])
def test_every_pair_group_lands_in_exactly_one_part_within_the_load_bound(name, n):
    cells = list(load(name).cells)
    held = [c.id for i in range(1, n + 1) for c in select_part(cells, Shard(i, n))]
    assert sorted(held) == sorted(c.id for c in cells)
    parts = assign(cells, n)
    for c in cells:  # a group's paths are compared with each other: never split
        assert parts[c.pair_id] == parts[dataclasses.replace(c, path="legacy").pair_id]
    loads = _loads(cells, parts, n)
    costs = {}
    for c in cells:
        costs[c.pair_id] = costs.get(c.pair_id, 0.0) + expected_cost(c)
    share = sum(loads) / n  # under the slack, or a group that fit nowhere on the least loaded part
    assert max(loads) <= max((1 + SLACK) * share, share + max(costs.values())) + 1e-9
    assert assign(list(reversed(cells)), n) == parts  # the matrix's order does not matter


def test_adding_or_removing_cells_elsewhere_moves_few_groups():
    cells = list(load("full").cells)
    before = assign(cells, 8)
    fewer = assign([c for c in cells if c.fixture != "frozen"], 8)
    more = assign(cells + [dataclasses.replace(c, seed=7) for c in cells if c.fixture == "kda"], 8)
    moved = [g for g in fewer if fewer[g] != before[g]] + [g for g in before if more[g] != before[g]]
    assert len(moved) <= 0.02 * len(before), moved[:5]


@pytest.mark.parametrize("text", ["0/4", "5/4", "4", "a/b", "1/0", "-1/2", "", "1_0/20", "+1/2", " 1/2", "\u0661/2", "9" * 5000 + "/2"])
def test_a_part_that_does_not_exist_is_a_usage_error(text):
    with pytest.raises(UsageError, match="I/N"):
        parse_shard(text)


@pytest.fixture(scope="session")  # once per test worker, even when xdist interleaves modules
def sharded(tmp_path_factory):
    """One run of a slice of smoke, the same slice in four parts, and the parts merged."""
    root = tmp_path_factory.mktemp("shard")
    whole = str(root / "whole")
    assert main(["run", *SLICE, "--out", whole, "--junit", str(root / "whole.xml")]) == 0
    parts = [str(root / f"part{i}") for i in range(1, 5)]
    for i, part in enumerate(parts, 1):
        assert main(["run", *SLICE, "--shard", f"{i}/4", "--out", part]) == 0
    merged = str(root / "merged")
    assert main(["merge", *parts, "--out", str(root / "plain"), "--junit", str(root / "plain.xml")]) == 0  # no gate
    shutil.copy(os.path.join(whole, "report.html"), root / "whole.html")  # before a gate --from rewrites it
    code = main(["merge", *reversed(parts), "--out", merged, "--gate", "--junit", str(root / "merged.xml")])
    return root, whole, parts, merged, code


def _read(path):
    with open(path) as fh:
        return fh.read()


def _untimed(text: str) -> str:
    return text.split("## Where the time went")[0]


def test_merged_parts_are_the_single_run(sharded):
    root, whole, parts, merged, code = sharded
    assert _read(os.path.join(merged, "cells.csv")) == _read(os.path.join(whole, "cells.csv"))
    assert _untimed(_read(os.path.join(merged, "summary.md"))) == _untimed(_read(os.path.join(whole, "summary.md")))
    assert re.sub(r'time="[^"]*"', "", _read(root / "plain.xml")) == re.sub(r'time="[^"]*"', "", _read(root / "whole.xml"))
    gated = ET.parse(root / "merged.xml").getroot()  # the run's cases, then each model's decision: exit 1, a failure
    decisions = [c for c in gated.iter("testcase") if c.get("classname") == "parity gate smoke"]
    assert code == 1 and decisions and all(c.find("failure").get("type") == "PARTIAL" for c in decisions)
    assert _read(os.path.join(merged, "progress.jsonl")) == _read(os.path.join(whole, "progress.jsonl"))
    run = json.loads(_read(os.path.join(merged, "run.json")))
    assert run["status"] == "complete" and "shard" not in run and run["merged"]["parts"] == 4
    assert run["cells"] == json.loads(_read(os.path.join(whole, "run.json")))["cells"]
    assert "Gate: enable" in _read(os.path.join(merged, "report.html"))
    here = lambda path, d: _read(path).replace(os.path.abspath(d), "DIR")  # noqa: E731 - the report names its folder
    assert here(root / "plain" / "report.html", root / "plain") == here(root / "whole.html", whole)
    assert "<td>status</td><td>complete</td>" in _read(root / "whole.html")


def test_a_gate_on_the_merged_parts_is_the_gate_on_one_run(sharded):
    root, whole, parts, merged, code = sharded
    assert main(["gate", "--from", whole]) == code == main(["gate", "--from", merged])
    a, b = (json.loads(_read(os.path.join(d, "gate.json"))) for d in (whole, merged))
    assert [(d["model"], d["decision"], d["reasons"]) for d in a["decisions"]] == \
        [(d["model"], d["decision"], d["reasons"]) for d in b["decisions"]]
    # the slice is narrowed by -k, so both gates are PARTIAL for the same reason
    assert a["scope"] == b["scope"] and not b["scope"]["complete"] and b["scope"]["cells_run"] == 12


def test_a_part_alone_is_not_the_whole_selection(sharded):
    root, whole, parts, merged, code = sharded
    run = json.loads(_read(os.path.join(parts[0], "run.json")))
    assert run["shard"]["index"] == 1 and run["shard"]["count"] == 4
    assert len(run["cells"]) < len(run["shard"]["selection"])
    gate = str(root / "gate-part")
    shutil.copytree(parts[0], gate)
    assert main(["gate", "--from", gate]) == 1  # PARTIAL: most cells of the matrix are not there
    scope = json.loads(_read(os.path.join(gate, "gate.json")))["scope"]
    assert scope["complete"] is False and "one part (1/4) of a split run" in " ".join(scope["left_out"])


def test_a_missing_doubled_or_foreign_part_is_refused(sharded, tmp_path, capsys):
    root, whole, parts, merged, code = sharded
    assert main(["merge", *parts[:3], "--out", str(tmp_path / "m1")]) == 2
    assert "part 4/4 is missing" in capsys.readouterr().err
    assert main(["merge", *parts, parts[1], "--out", str(tmp_path / "m2")]) == 2
    assert "part 2/4 given twice" in capsys.readouterr().err
    foreign = str(tmp_path / "foreign")  # a part of another selection (another matrix slice, split 1 way)
    assert main(["run", "--matrix", "smoke", "-k", "fixture == 'kda' and ranks == 1 and microbatches == 1",
                 "--shard", "1/1", "--out", foreign]) in (0, 1)
    assert main(["merge", *parts, foreign, "--out", str(tmp_path / "m3")]) == 2
    assert "merge the parts of one run only" in capsys.readouterr().err
    assert main(["merge", whole, "--out", str(tmp_path / "m4")]) == 2
    assert "not a part of a sharded run" in capsys.readouterr().err
    other = str(tmp_path / "other")  # part 2 of the same selection, run with another option
    assert main(["run", *SLICE, "--shard", "2/4", "--baseline", "native", "--out", other]) in (0, 1)
    capsys.readouterr()
    assert main(["merge", parts[0], other, *parts[2:], "--out", str(tmp_path / "m5"), "--gate"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "were run with different --baseline (native vs legacy)" in err, err
    assert not os.path.exists(tmp_path / "m1" / "cells.csv")
    # a JUnit file over one of the parts' own files would destroy the part (review: exit 0, run.json gone)
    before = _read(os.path.join(parts[0], "run.json"))
    assert main(["merge", *parts, "--out", str(tmp_path / "m6"), "--junit", os.path.join(parts[0], "run.json")]) == 2
    assert "is the results' own run.json" in capsys.readouterr().err
    assert _read(os.path.join(parts[0], "run.json")) == before


def test_a_signal_during_a_merge_is_its_exit_code_and_a_bad_candidate_is_refused_first(sharded, tmp_path, capsys,
                                                                                        monkeypatch):
    """A cancelled CI merge job does not report success: the merged files are completed, the exit
    code is the signal's; ``--gate --candidate`` naming no path is refused before anything is merged."""
    import signal

    from parity.report import merge as merging

    root, whole, parts, merged, code = sharded
    assert main(["merge", *parts, "--out", str(tmp_path / "bogus"), "--gate", "--candidate", "bogus"]) == 2
    assert "bogus" in capsys.readouterr().err and not os.path.exists(tmp_path / "bogus")
    real = merging.write_html

    def signalled(*args, **kwargs):  # SIGTERM arrives while the merged files are written
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(merging, "write_html", signalled)
    assert main(["merge", *parts, "--out", str(tmp_path / "m")]) == 143
    assert "interrupted by SIGTERM while merging" in capsys.readouterr().err
    assert json.loads(_read(os.path.join(tmp_path / "m", "run.json")))["status"] == "complete"
    assert _read(os.path.join(tmp_path / "m", "cells.csv")) == _read(os.path.join(whole, "cells.csv"))


def test_parts_from_checkouts_at_other_paths_merge_and_changed_files_do_not(sharded, tmp_path, capsys):
    """Each CI job may check the repository out elsewhere: a part's model and matrix files are
    compared by content, not by the path they lay at; a file whose content differs is refused."""
    root, whole, parts, merged, code = sharded
    moved, changed = str(tmp_path / "moved"), str(tmp_path / "changed")
    for copy, digest in ((moved, None), (changed, "0" * 64)):
        shutil.copytree(parts[1], copy)
        manifest = json.loads(_read(os.path.join(copy, "run.json")))
        manifest["sources"] = {"/elsewhere" + path: digest or value for path, value in manifest["sources"].items()}
        pathlib.Path(copy, "run.json").write_text(json.dumps(manifest))
    assert main(["merge", parts[0], moved, *parts[2:], "--out", str(tmp_path / "m")]) == 0
    assert _read(os.path.join(tmp_path / "m", "cells.csv")) == _read(os.path.join(whole, "cells.csv"))
    capsys.readouterr()
    assert main(["merge", parts[0], changed, *parts[2:], "--out", str(tmp_path / "m2")]) == 2
    assert "differ in sources" in capsys.readouterr().err
    # a matrix file at another path merges; one of another name (the merged run's title) does not (review)
    for name, code in (("/elsewhere/smoke.toml", 0), ("/elsewhere/other.toml", 2)):
        renamed = str(tmp_path / f"renamed-{code}")
        shutil.copytree(parts[1], renamed)
        manifest = json.loads(_read(os.path.join(renamed, "run.json")))
        manifest["options"]["matrix"] = name
        pathlib.Path(renamed, "run.json").write_text(json.dumps(manifest))
        assert main(["merge", parts[0], renamed, *parts[2:], "--out", str(tmp_path / f"m-{code}")]) == code
    assert "were run with different --matrix (other vs smoke)" in capsys.readouterr().err


def test_merging_over_another_runs_results_suggests_only_what_merge_has(sharded, capsys):
    root, whole, parts, merged, code = sharded
    assert main(["merge", *parts, "--out", whole]) == 2
    err = capsys.readouterr().err
    assert "holds another run's results" in err and "pass --overwrite" in err and "--resume" not in err, err
    campaign = os.path.join(str(pathlib.Path(merged).parent), "a-campaign")  # nor a run's beside a campaign's
    os.makedirs(campaign, exist_ok=True)
    pathlib.Path(campaign, "fuzz.json").write_text("{}")
    assert main(["merge", *parts, "--out", campaign]) == 2
    assert "holds a fuzz campaign's results" in capsys.readouterr().err
    # nor a run's part written into a campaign's folder: a merge read it as a campaign's (review)
    assert main(["run", "--matrix", "smoke", "-k", "fixture == 'kda' and ranks == 1", "--out", campaign,
                 "--overwrite"]) == 2
    assert "holds a fuzz campaign's results (fuzz.json); choose another --out" in capsys.readouterr().err
    assert sorted(os.listdir(campaign)) == ["fuzz.json"]


@pytest.mark.parametrize("key, value", [("cell_groups", 5), ("index", [3]), ("selection", [[1]]), ("groups", None),
                                        ("count", 0), ("digest", 7), ("cell_groups", [])])
def test_a_parts_malformed_shard_entry_is_one_line(sharded, tmp_path, capsys, key, value):
    root, whole, parts, merged, code = sharded
    bad = str(tmp_path / "bad")
    shutil.copytree(parts[2], bad)
    manifest = json.loads(pathlib.Path(bad, "run.json").read_text())
    manifest["shard"][key] = value
    pathlib.Path(bad, "run.json").write_text(json.dumps(manifest))
    assert main(["merge", parts[0], parts[1], bad, parts[3], "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run.json: shard." in err and "Traceback" not in err, err


def test_a_selection_edited_under_its_digest_is_refused(sharded, tmp_path, capsys):
    """A part's ``shard.selection`` is what the merged run must hold: one shortened by hand (its
    digest left) would merge as a smaller run. The digest is recomputed from the list."""
    root, whole, parts, merged, code = sharded
    bad = str(tmp_path / "bad")
    shutil.copytree(parts[2], bad)
    manifest = json.loads(pathlib.Path(bad, "run.json").read_text())
    manifest["shard"]["selection"] = manifest["shard"]["selection"][:-1]
    pathlib.Path(bad, "run.json").write_text(json.dumps(manifest))
    assert main(["merge", bad, parts[0], parts[1], parts[3], "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run.json: shard.selection is not the selection its digest" in err, err


@pytest.mark.parametrize("edit, said", [
    (lambda g: g + g[:1], "run.json: shard.groups names a pair group twice"),
    (lambda g: g[1:2] + g[:1] + g[2:], "record different pair-group orders (shard.groups)")])
def test_a_parts_pair_group_order_edited_or_doubled_is_refused(sharded, tmp_path, capsys, edit, said):
    """The merged ``cells.csv`` follows ``shard.groups``: a group named twice was written twice
    and gated, exit 0; a reordered list merged out of the single run's order (review)."""
    root, whole, parts, merged, code = sharded
    bad = str(tmp_path / "bad")
    shutil.copytree(parts[1], bad)
    manifest = json.loads(pathlib.Path(bad, "run.json").read_text())
    manifest["shard"]["groups"] = edit(manifest["shard"]["groups"])
    pathlib.Path(bad, "run.json").write_text(json.dumps(manifest))
    assert main(["merge", parts[0], bad, *parts[2:], "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err, err


def test_a_model_file_is_compared_by_name_and_contents_not_by_the_folder_it_lay_in():
    """Each CI job may check a ``--model`` file out elsewhere: the literal path made identical
    parts "run with different --model" (review); its contents are compared through sources."""
    from parity.report.merge import _options

    def options(*models):
        return _options({"options": {"model": list(models), "shard": "1/2", "fp64": False}})

    assert options("/ci/a/my_model.py:parity_model") == options("work/b/my_model.py:parity_model")
    assert options("/ci/a/my_model.py:parity_model") != options("/ci/a/my_model.py:other")
    assert options("/ci/a/my_model.py:f") != options("/ci/a/their_model.py:f")
    assert options("pkg.models:f") == options("pkg.models:f") != options("pkg.other:f")


def _cut(path: str, keep) -> None:
    """Rewrite ``cells.csv`` at ``path`` keeping the header and the rows ``keep(row)`` accepts."""
    with open(path, newline="") as fh:
        lines = fh.read().splitlines(keepends=True)
    with open(path, "w", newline="") as fh:
        fh.writelines(lines[:1] + [line for line in lines[1:] if keep(line)])


#: Ways a finished part's or run's cells.csv stops being what the run recorded.
EDITS = {
    "header only": lambda p: _cut(p, lambda line: False),
    "empty": lambda p: open(p, "w").close(),
    "rows appended twice": lambda p: open(p, "ab").write(open(p, "rb").read().split(b"\n", 1)[1]),
    "a torn last line": lambda p: os.truncate(p, os.path.getsize(p) - 30),
}


@pytest.mark.parametrize("edit", EDITS)
def test_a_part_whose_results_were_edited_after_it_ran_is_refused(sharded, tmp_path, capsys, edit):
    root, whole, parts, merged, code = sharded
    copies = [shutil.copytree(p, tmp_path / f"p{i}") for i, p in enumerate(parts, 1)]
    EDITS[edit](os.path.join(copies[1], "cells.csv"))
    assert main(["merge", *map(str, copies), "--out", str(tmp_path / "m"), "--gate"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "p2/cells.csv holds" in err and "rerun part 2/4" in err, err
    assert not os.path.exists(tmp_path / "m" / "cells.csv")


def test_rows_edited_in_place_are_refused_by_their_groups_digest(sharded, tmp_path, capsys):
    """An edit that keeps cells.csv's length (a row's text changed, rows removed and the file padded)
    is found by the digest ``progress.jsonl`` records of each group's bytes: merge, gate and compare
    refuse the directory naming the group."""
    root, whole, parts, merged, code = sharded
    assert all(len(json.loads(line)["sha256"]) == 64 for line in _read(os.path.join(whole, "progress.jsonl")).splitlines())
    copy = shutil.copytree(whole, tmp_path / "whole")
    data = (copy / "cells.csv").read_bytes()
    at = data.index(b"u(bfloat16)", len(data) // 2)
    (copy / "cells.csv").write_bytes(data[:at] + b"u(bfloat17)" + data[at + 11:])
    for argv in (["gate", "--from", str(copy)], ["compare", whole, str(copy)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "differ from what the run recorded" in err, err
    part = shutil.copytree(parts[1], tmp_path / "p2")
    data = (part / "cells.csv").read_bytes()
    assert main(["merge", parts[0], str(part), *parts[2:], "--out", str(tmp_path / "m")]) == 0  # untouched: merges
    (part / "cells.csv").write_bytes(data[:-1].rsplit(b"\n", 1)[0] + b"\n" + b" " * (len(data) - len(data[:-1].rsplit(b"\n", 1)[0]) - 2) + b"\n")
    assert len((part / "cells.csv").read_bytes()) == len(data)
    assert main(["merge", parts[0], str(part), *parts[2:], "--out", str(tmp_path / "m2")]) == 2
    assert "differ from what the run recorded" in capsys.readouterr().err
    # the digests dropped beside the edit: no digest, no check -- and a merge would stamp new ones on it
    lines = [json.loads(line) for line in _read(os.path.join(part, "progress.jsonl")).splitlines()]
    (part / "progress.jsonl").write_text("".join(json.dumps({k: v for k, v in e.items() if k != "sha256"}) + "\n"
                                                 for e in lines))
    for argv in (["merge", parts[0], str(part), *parts[2:], "--out", str(tmp_path / "m3")], ["gate", "--from", str(part)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "progress.jsonl line 1 is not a progress entry parity writes" in err, err


def test_a_part_whose_run_json_is_torn_is_refused_with_the_parts_fix(sharded, tmp_path, capsys):
    root, whole, parts, merged, code = sharded
    copy = shutil.copytree(parts[2], tmp_path / "p3")
    os.truncate(os.path.join(copy, "run.json"), 200)
    assert main(["merge", *parts[:2], str(copy), parts[3], "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "p3/run.json is unreadable" in err and err.endswith(
        "rerun that part (run --shard I/N)"), err


def test_a_run_missing_a_cells_records_is_refused_by_merge_and_gate(sharded, tmp_path, capsys):
    """Rows removed and progress.jsonl made to agree: only the cell list shows what is missing."""
    root, whole, parts, merged, code = sharded
    copy = shutil.copytree(parts[1], tmp_path / "p2")
    listed = set(json.loads(_read(os.path.join(copy, "run.json")))["cells"])
    with open(os.path.join(copy, "cells.csv")) as fh:  # the last group's: the earlier entries stay true
        gone = [row["cell"] for row in csv.DictReader(fh) if row["cell"] in listed][-1]
    _cut(os.path.join(copy, "cells.csv"), lambda line: not line.startswith(gone + ","))
    with open(os.path.join(copy, "progress.jsonl")) as fh:
        entries = [json.loads(line) for line in fh]
    entries[-1]["bytes"] = os.path.getsize(os.path.join(copy, "cells.csv"))
    entries[-1] = with_digests(str(copy), entries)[-1]  # as a forger would: the old digest alone refuses it
    with open(os.path.join(copy, "progress.jsonl"), "w") as fh:
        fh.writelines(json.dumps(e) + "\n" for e in entries)
    assert main(["merge", parts[0], str(copy), *parts[2:], "--out", str(tmp_path / "m")]) == 2
    assert "has no records of 1 of the" in capsys.readouterr().err
    assert main(["gate", "--from", str(copy)]) == 2
    err = capsys.readouterr().err
    assert f"e.g. {gone})" in err and not os.path.exists(os.path.join(copy, "gate.json")), err


def test_a_judged_cell_without_its_coverage_record_is_refused(sharded, tmp_path, capsys):
    """Its coverage row removed (progress.jsonl made to agree): the records that say whether the
    cell's evidence was complete are gone, so its other records prove nothing."""
    root, whole, parts, merged, code = sharded
    copy = shutil.copytree(merged, tmp_path / "merged")
    with open(os.path.join(copy, "cells.csv")) as fh:
        rows = list(csv.DictReader(fh))
    last = rows[-1]["cell"]  # the last group's: the earlier progress entries stay true
    victim = next(r["cell"] for r in rows if r["check"] == "coverage" and r["cell"].split("/")[0] == last.split("/")[0]
                  and r["cell"].replace("/legacy/", "/").replace("/native/", "/") == last.replace("/legacy/", "/")
                  .replace("/native/", "/"))
    _cut(os.path.join(copy, "cells.csv"), lambda line: not (line.startswith(victim + ",") and ",coverage," in line))
    with open(os.path.join(copy, "progress.jsonl")) as fh:
        entries = [json.loads(line) for line in fh]
    entries[-1]["bytes"] = os.path.getsize(os.path.join(copy, "cells.csv"))
    entries[-1] = with_digests(str(copy), entries)[-1]  # as a forger would: the old digest alone refuses it
    with open(os.path.join(copy, "progress.jsonl"), "w") as fh:
        fh.writelines(json.dumps(e) + "\n" for e in entries)
    assert main(["gate", "--from", str(copy)]) == 2
    err = capsys.readouterr().err
    assert "without their coverage record (e.g. " in err and err.count("\n") == 1, err


@pytest.mark.parametrize("edit", ["header only", "a torn last line"])
def test_gate_from_report_and_compare_of_a_run_whose_results_were_edited_are_refused(sharded, tmp_path, capsys, edit):
    root, whole, parts, merged, code = sharded
    copy = shutil.copytree(merged, tmp_path / "merged")
    EDITS[edit](os.path.join(copy, "cells.csv"))
    assert main(["gate", "--from", str(copy)]) == 2
    assert "merged/cells.csv holds" in capsys.readouterr().err
    assert main(["report", str(copy)]) == 2  # a page of the cells left would read as the whole run
    assert "merged/cells.csv holds" in capsys.readouterr().err
    for old, new in ((copy, merged), (merged, copy)):  # a cut baseline's missing cells are not "new"
        assert main(["compare", str(old), str(new)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("parity: compare:") and "merged/cells.csv holds" in err, err


def _fuzz_part(root, index: int, count: int = 2, **changes) -> str:
    """A fuzz part's directory as ``fuzz --shard I/N`` leaves it (its manifest, a reproducer)."""
    from parity.fuzz import write_manifest

    d = root / f"fuzz-part-{index}"
    d.mkdir()
    (d / "repro_old_1.py").write_text("# an earlier campaign's, in the same --out: not this part's\n")
    if changes.pop("reproducer", False):
        (d / "repro_gen_7.py").write_text("# a reproducer\n")
        changes["reproducers"] = ["repro_gen_7.py"]
    fields = dict(seed=2026, examples=5, fault="", device="cpu", timeout=120.0, index=index, count=count, asked=3 if index == 1 else 2,
                  ran=3 if index == 1 else 2, code=0, status="complete", interrupted="", verdicts={"PASS": 100 * index},
                  inconclusive=[], caught=None, text="")
    write_manifest(str(d), {**fields, **changes})
    return str(d)


def test_a_fuzz_campaigns_parts_merge_into_one_verdict(tmp_path, capsys):
    """``fuzz --shard I/N`` parts merge like a run's: one ``fuzz.md`` with the campaign's totals,
    every reproducer kept, exit 0 only when every part finished clean; parts of another
    campaign, a doubled or missing part, and a run's part beside them are one-line errors."""
    parts = [_fuzz_part(tmp_path, 1), _fuzz_part(tmp_path, 2)]
    assert main(["merge", *reversed(parts), "--out", str(tmp_path / "m")]) == 0
    text = (tmp_path / "m" / "fuzz.md").read_text()
    assert "fuzz: 5 runs of a campaign of 5 examples (seed 2026" in text and "every part finished" in text
    assert "records by verdict: PASS 300" in text and text.index("part 1/2") < text.index("part 2/2")
    assert json.loads((tmp_path / "m" / "fuzz.json").read_text())["code"] == 0

    bad = tmp_path / "bad"
    bad.mkdir()
    failing = [_fuzz_part(bad, 1), _fuzz_part(bad, 2, code=1, ran=1, reproducer=True)]
    assert main(["merge", *failing, "--out", str(bad / "m")]) == 1
    assert (bad / "m" / "part-2" / "repro_gen_7.py").is_file()
    assert not list((bad / "m").glob("part-*/repro_old_1.py"))  # only what the campaign wrote is its evidence
    assert "reproducers in part-1" not in (bad / "m" / "fuzz.md").read_text()
    assert "NOT every part finished clean" in (bad / "m" / "fuzz.md").read_text()
    killed = tmp_path / "killed"  # a part killed mid-way: its manifest still says it started, not what it found
    killed.mkdir()
    assert main(["merge", parts[0], _fuzz_part(killed, 2, status="running", code=None, ran=0), "--out",
                 str(killed / "m")]) == 1
    assert "part 2/2: 0 of 2 runs, never finished (killed, or still running)" in (killed / "m" / "fuzz.md").read_text()

    capsys.readouterr()
    assert main(["merge", parts[0], "--out", str(tmp_path / "m1")]) == 2
    assert "fuzz part 2/2 is missing" in capsys.readouterr().err
    assert main(["merge", *parts, parts[1], "--out", str(tmp_path / "m2")]) == 2
    other = tmp_path / "other"
    other.mkdir()
    assert main(["merge", parts[0], _fuzz_part(other, 2, seed=7), "--out", str(tmp_path / "m3")]) == 2
    assert "differ in seed" in capsys.readouterr().err
    for option, value in (("device", "cuda"), ("timeout", 30.0)):  # another option: another campaign's evidence
        elsewhere = tmp_path / f"other-{option}"
        elsewhere.mkdir()
        assert main(["merge", parts[0], _fuzz_part(elsewhere, 2, **{option: value}), "--out", str(elsewhere / "m")]) == 2
        assert f"differ in {option}" in capsys.readouterr().err
    assert main(["merge", *parts, "--out", str(tmp_path / "m4"), "--gate"]) == 2
    capsys.readouterr()
    assert main(["merge", str(tmp_path / "m"), parts[1], "--out", str(tmp_path / "m6")]) == 2  # said "index is None"
    assert "m/fuzz.json is a merged campaign, not a part; give the parts' directories" in capsys.readouterr().err
    for i, (key, value) in enumerate((("count", "2"), ("ran", None), ("verdicts", [1]), ("reproducers", ["../x.py"]),
                                      ("asked", -1), ("caught", "1"), ("interrupted", 1))):  # hand-edited: one line, not a traceback
        edited = tmp_path / f"edited-{i}"
        edited.mkdir()
        capsys.readouterr()
        assert main(["merge", parts[0], _fuzz_part(edited, 2, **{key: value}), "--out", str(edited / "m")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "fuzz.json: " in err and "rerun that fuzz part" in err, err
    assert main(["merge", parts[0], str(tmp_path / "m"), str(tmp_path / "run-part"), "--out", str(tmp_path / "m5")]) == 2
    capsys.readouterr()
    (tmp_path / "results-of-a-run").mkdir()
    (tmp_path / "results-of-a-run" / "run.json").write_text("{}")
    assert main(["merge", *parts, "--out", str(tmp_path / "results-of-a-run")]) == 2  # never beside a run's files
    assert "holds a run's results (run.json)" in capsys.readouterr().err


def test_a_fuzz_merge_refuses_short_shares_lost_reproducers_another_generator_and_a_used_out(tmp_path, capsys):
    """Review, 2026-12-06: a part claiming a smaller share, a listed reproducer gone, a part run
    with an edited generator, each merged as a whole campaign; a merge wrote beside an earlier
    campaign's report and reproducers. Each is now one line, exit 2."""
    parts = [_fuzz_part(tmp_path, 1), _fuzz_part(tmp_path, 2)]
    cases = (("short", dict(asked=1, ran=1), "asked 1 examples, its share of 5 is 2"),
             ("lost", dict(reproducers=["repro_gen_gone.py"]), "lists reproducer repro_gen_gone.py in fuzz.json, but the "
                                                               "file is not there"),
             ("generator", dict(generator="0" * 64), "differ in generator"),
             ("hypothesis", dict(hypothesis="0.0.1"), "differ in hypothesis"))  # other models from one seed (review)
    for name, changes, said in cases:
        (tmp_path / name).mkdir()
        capsys.readouterr()
        assert main(["merge", parts[0], _fuzz_part(tmp_path / name, 2, **changes), "--out", str(tmp_path / name / "m")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err
    used = tmp_path / "used"
    assert main(["merge", *parts, "--out", str(used)]) == 0
    (used / "part-9").mkdir()
    (used / "part-9" / "repro_gen_old.py").write_text("# an earlier campaign's\n")
    capsys.readouterr()
    assert main(["merge", *parts, "--out", str(used)]) == 2
    assert "holds another campaign's files (fuzz.json, fuzz.md, part-9)" in capsys.readouterr().err
    (used / "part-8").mkdir()  # a run's part kept there: never another campaign's files (review)
    (used / "part-8" / "run.json").write_text("{}")
    assert main(["merge", *parts, "--out", str(used), "--overwrite"]) == 0
    assert not (used / "part-9").exists() and (used / "part-8" / "run.json").is_file()
    inside = tmp_path / "inside"  # parts kept as out/part-I: the merge's own inputs, never removed
    inside.mkdir()
    kept = [_fuzz_part(inside, 1), _fuzz_part(inside, 2, reproducer=True)]
    for i, part in enumerate(kept, 1):
        os.rename(part, inside / f"part-{i}")
    kept = [str(inside / "part-1"), str(inside / "part-2")]
    for overwrite in ([], ["--overwrite"]):
        assert main(["merge", *kept, "--out", str(inside), *overwrite]) == 0
        assert (inside / "part-2" / "repro_gen_7.py").is_file() and (inside / "part-1" / "fuzz.json").is_file()


def test_a_fuzz_merge_into_a_file_is_one_line_and_a_new_campaign_clears_the_merges_copies(tmp_path, capsys,
                                                                                          monkeypatch):
    """Review: ``merge PARTS --out FILE`` was a FileExistsError traceback (exit 1) where a run's
    merge says one line; a campaign run into a merged campaign's --out left that merge's
    ``part-I/`` reproducers beside its own clean report. A part kept there is another campaign's
    results: left alone."""
    import parity.fuzz as fuzz

    parts = [_fuzz_part(tmp_path, 1), _fuzz_part(tmp_path, 2, reproducer=True)]
    (tmp_path / "afile").write_text("")
    for out in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        capsys.readouterr()
        assert main(["merge", *parts, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("parity: --out "), err
    merged = tmp_path / "merged"
    assert main(["merge", *parts, "--out", str(merged)]) == 0 and (merged / "part-2" / "repro_gen_7.py").is_file()
    (merged / "part-5").mkdir()
    shutil.copy(pathlib.Path(parts[0]) / "fuzz.json", merged / "part-5" / "fuzz.json")  # a part kept there
    (merged / "part-6").mkdir()  # a run's part kept there (review: deleted without --overwrite)
    (merged / "part-6" / "run.json").write_text("{}")
    (merged / "part-6" / "repro_gen_1.py").write_text("# beside a run's files: not a merge's copy\n")
    monkeypatch.setattr(fuzz, "campaign", lambda **kwargs: 0)  # what runs after the clearing is not at issue
    assert main(["fuzz", "--examples", "1", "--out", str(merged)]) == 0
    assert not (merged / "part-2").exists() and not (merged / "fuzz.md").exists()
    assert (merged / "part-5" / "fuzz.json").is_file() and (merged / "part-6" / "run.json").is_file()
    (merged / "part-7").mkdir()  # reproducer-like files where no merged campaign is recorded: left alone
    (merged / "part-7" / "repro_gen_2.py").write_text("#\n")
    assert main(["fuzz", "--examples", "1", "--out", str(merged)]) == 0 and (merged / "part-7").is_dir()


def test_a_fault_campaign_exits_1_only_when_no_example_flagged_its_fault(tmp_path):
    """A ``--fault`` campaign shows the checks can fail under the fault: a part that flagged it
    in none of its examples exits 1 (``missed``), and the merge exits 0 when some part flagged it."""
    def part(root, index, caught):
        root.mkdir(exist_ok=True)
        return _fuzz_part(root, index, fault="perturb_grad", caught=caught, missed=not caught, code=0 if caught else 1)

    some = [part(tmp_path / "some", 1, 0), part(tmp_path / "some", 2, 2)]
    assert main(["merge", *some, "--out", str(tmp_path / "some" / "m")]) == 0
    text = (tmp_path / "some" / "m" / "fuzz-perturb_grad.md").read_text()
    assert "fault perturb_grad flagged in 2 of 5 examples" in text and "its fault flagged in none" in text
    none = [part(tmp_path / "none", 1, 0), part(tmp_path / "none", 2, 0)]
    assert main(["merge", *none, "--out", str(tmp_path / "none" / "m")]) == 1
    assert "flagged in none: exit 1" in (tmp_path / "none" / "m" / "fuzz-perturb_grad.md").read_text()


def test_a_fuzz_part_replaces_an_earlier_campaigns_manifest_before_its_first_example(tmp_path, monkeypatch):
    """A part killed before it finishes leaves a manifest saying it is running, not the finished one
    an earlier campaign left in the same --out (which a merge would count as this part's)."""
    import parity.fuzz as fuzz

    earlier = _fuzz_part(tmp_path, 2)

    def killed(**kwargs):  # the part dies during its first example
        raise SystemExit(137)

    monkeypatch.setattr(fuzz, "_campaign", killed)
    with pytest.raises(SystemExit):
        fuzz.campaign(examples=5, seed=2026, out_dir=earlier, shard=(2, 2))
    manifest = json.loads((pathlib.Path(earlier) / "fuzz.json").read_text())
    assert (manifest["status"], manifest["ran"], manifest["asked"], manifest["code"]) == ("running", 0, 2, None)


def test_expected_cost_follows_the_measured_cells():
    """The cost model against what it was not computed from at run time: the median seconds of
    each kind of cell, measured on the reference machine (``fixtures/measured_cell_seconds.csv``,
    1,047 cells of six matrices, nothing overlapped). Every kind within 1.5x either way, so a
    move, a 4-rank mesh or a compiled cell weighs what it costs against a 1-rank one."""
    table = pathlib.Path(__file__).parents[1] / "fixtures" / "measured_cell_seconds.csv"
    with open(table) as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) >= 20
    for row in rows:
        cell = Cell(fixture="kda" if row["mesh"] == "fsdp" else "composed", path="native", ranks=int(row["ranks"]),
                    steps=int(row["steps"]), microbatches=int(row["microbatches"]), mesh=row["mesh"],
                    seed=0 if int(row["lifecycle"]) else 1, move=row["move"],  # seed 0, one micro-batch: lifecycle
                    compile="aot_eager" if row["compile"] == "any" else "none")
        assert cell.lifecycle == bool(int(row["lifecycle"]))
        ratio = float(row["median_seconds"]) / expected_cost(cell)
        assert 1 / 1.5 <= ratio <= 1.5, (row, expected_cost(cell))


def test_parts_that_read_a_model_otherwise_are_refused(sharded, tmp_path, capsys):
    """Each part records what run warned about every model of the selection: a part run where a
    model reads otherwise (another transformers) would give the merged gate one part's view."""
    root, whole, parts, merged, code = sharded
    other = str(tmp_path / "other")
    shutil.copytree(parts[1], other)
    manifest = json.loads(_read(os.path.join(other, "run.json")))
    manifest["model_warnings"] = {"kda": {"notes": ["a pattern selects nothing"], "fp32_unselected": True}}
    pathlib.Path(other, "run.json").write_text(json.dumps(manifest))
    assert main(["merge", parts[0], other, *parts[2:], "--out", str(tmp_path / "m")]) == 2
    assert "differ in model_warnings" in capsys.readouterr().err


def test_a_merge_keeps_the_traces_of_the_parts_failing_cells(tmp_path, capsys):
    """A failing cell's trace (``traces/<cell>.json``) lands beside ``cells.csv``: a merged run
    holds the ones its parts wrote, as a single run would."""
    picked = ["--matrix", "smoke", "-k", "ranks == 1 and microbatches == 1 and fixture == 'kda'", "--steps", "1",
              "--fault", "perturb_param"]
    parts = [str(tmp_path / f"part{i}") for i in (1, 2)]
    for i, part in enumerate(parts, 1):
        main(["run", *picked, "--shard", f"{i}/2", "--out", part])
    held = next(p for p in parts if os.path.isdir(os.path.join(p, "traces")))  # the other part is empty
    written = sorted(os.listdir(os.path.join(held, "traces")))
    assert written and all(name.endswith(".json") for name in written), written
    assert main(["merge", *parts, "--out", str(tmp_path / "merged")]) == 1
    merged = tmp_path / "merged" / "traces"
    assert sorted(os.listdir(merged)) == written
    assert all((merged / n).read_bytes() == pathlib.Path(held, "traces", n).read_bytes() for n in written)
