"""JUnit XML: one test case per cell x check, so CI systems show parity's results like tests.

A case fails when any of its records is FAIL / INCONCLUSIVE / ERROR / TIMEOUT (the worst
record's observed / allowed / ratio and detail are the message), is skipped when all are
SKIP, and passes otherwise. A pair left UNPAIRED is never a pass: skipped with its reason where
the run passes with it (:data:`~parity.judge.record.NOT_ASKED`), a failure otherwise (its twin
did not finish or was not judged). A run that stopped early carries one more error case, ``run``,
saying why and which cells were not run; one whose every cell was skipped a failure case ``run``
(nothing was checked: the run exits 1); a gate adds one case per model, failing unless GO or NOT
APPLICABLE -- so the file is green exactly when the command exits 0.

The file is well-formed whatever a detail holds (an exception message from a model): ANSI escape
sequences are stripped and characters XML 1.0 cannot hold are written ``#xNN``, as pytest does;
ElementTree escapes the rest (``<``, ``&``, ``]]>``...).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections import defaultdict

from parity.judge.record import BAD, NOT_ASKED, SEVERITY, Record, Verdict
from parity.report.summary import nothing_checked

#: ANSI escape sequences (colours, cursor moves): meaningless in a CI system's test report.
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
#: What XML 1.0 cannot hold: control characters other than tab, newline and CR, lone surrogates,
#: U+FFFE and U+FFFF.
_ILLEGAL = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def xml_text(text) -> str:
    """``text`` as XML 1.0 can hold it: ANSI sequences stripped, illegal characters written ``#xNN``."""
    return _ILLEGAL.sub(lambda m: f"#x{ord(m.group()):02X}", _ANSI.sub("", str(text)))


def write_junit(path: str, records: list[Record], *, suite: str, interrupted: str = "",
                not_run: list[str] = (), decisions: list[tuple[str, str, bool, str]] = ()) -> None:
    """Write ``records`` as JUnit to ``path``. A run that stopped early (``interrupted`` says why)
    adds one error case naming it and the cells not run: its cases alone could all pass.
    ``decisions``: a gate's (model, decision, exits 0, why), one case each."""
    cases: dict[tuple[str, str, str], list[Record]] = defaultdict(list)
    for r in records:
        cases[(r.cell, r.path, r.check)].append(r)
    root = ET.Element("testsuites")
    ts = ET.SubElement(root, "testsuite", name=xml_text(f"parity {suite}"), tests=str(len(cases)))
    failures = skipped = errors = 0
    for (cell, cell_path, check), rows in cases.items():
        case = ET.SubElement(ts, "testcase", classname=xml_text(f"{cell} [{cell_path}]"), name=xml_text(check))
        worst = max(rows, key=lambda r: SEVERITY[r.verdict])
        message = xml_text(f"{worst.verdict} {worst.name}: observed {worst.observed}, allowed {worst.allowed}, "
                           f"ratio {worst.ratio}, dtype {worst.dtype}; {worst.detail}")
        unpaired = worst.verdict == Verdict.UNPAIRED
        if worst.verdict in BAD or (unpaired and worst.name not in NOT_ASKED):
            kind = "error" if worst.verdict in (Verdict.ERROR, Verdict.TIMEOUT) else "failure"
            errors += kind == "error"
            failures += kind == "failure"
            el = ET.SubElement(case, kind, message=message[:1000], type=str(worst.verdict))
            el.text = xml_text("\n".join(f"{r.verdict} {r.name} step {r.step}: observed {r.observed}, "
                                         f"allowed {r.allowed}, ratio {r.ratio}; {r.detail}"
                                         for r in rows if r.verdict in BAD or r.verdict == Verdict.UNPAIRED))
        elif unpaired or all(r.verdict == Verdict.SKIP for r in rows):
            skipped += 1
            ET.SubElement(case, "skipped", message=xml_text(worst.detail)[:1000])
    if interrupted:
        errors += 1
        case = ET.SubElement(ts, "testcase", classname=xml_text(f"parity {suite}"), name="run")
        shown = ", ".join(not_run[:3]) + (f" and {len(not_run) - 3} more" if len(not_run) > 3 else "")
        ET.SubElement(case, "error", type="INTERRUPTED", message=xml_text(
            f"the run stopped early ({interrupted}): {len(not_run)} cells not run" + (f" ({shown})" if shown else ""))[:1000])
    skipped_all = nothing_checked(records) if not interrupted else ""
    if skipped_all:
        failures += 1
        case = ET.SubElement(ts, "testcase", classname=xml_text(f"parity {suite}"), name="run")
        ET.SubElement(case, "failure", type="NOTHING CHECKED", message=xml_text(
            f"every cell was skipped ({skipped_all}); nothing was checked")[:1000])
    for model, decision, ok, why in decisions:
        case = ET.SubElement(ts, "testcase", classname=xml_text(f"parity gate {suite}"), name=xml_text(model))
        if not ok:
            failures += 1
            ET.SubElement(case, "failure", type=xml_text(decision), message=xml_text(f"{decision}: {why}")[:1000])
    ts.set("tests", str(len(cases) + bool(interrupted) + bool(skipped_all) + len(decisions)))
    ts.set("failures", str(failures))
    ts.set("errors", str(errors))
    ts.set("skipped", str(skipped))
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
