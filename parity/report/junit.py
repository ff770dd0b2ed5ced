"""JUnit XML: one test case per cell x check, so CI systems show parity's results like tests.

A case fails when any of its records is FAIL / INCONCLUSIVE / ERROR / TIMEOUT (the worst
record's observed / allowed / ratio and detail are the message), is skipped when all are
SKIP, and passes otherwise.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import defaultdict

from parity.judge.record import BAD, SEVERITY, Record, Verdict


def write_junit(path: str, records: list[Record], *, suite: str) -> None:
    cases: dict[tuple[str, str, str], list[Record]] = defaultdict(list)
    for r in records:
        cases[(r.cell, r.path, r.check)].append(r)
    root = ET.Element("testsuites")
    ts = ET.SubElement(root, "testsuite", name=f"parity {suite}", tests=str(len(cases)))
    failures = skipped = errors = 0
    for (cell, cell_path, check), rows in cases.items():
        case = ET.SubElement(ts, "testcase", classname=f"{cell} [{cell_path}]", name=check)
        worst = max(rows, key=lambda r: SEVERITY[r.verdict])
        message = (f"{worst.verdict} {worst.name}: observed {worst.observed}, allowed {worst.allowed}, "
                   f"ratio {worst.ratio}, dtype {worst.dtype}; {worst.detail}")
        if worst.verdict in BAD:
            kind = "error" if worst.verdict in (Verdict.ERROR, Verdict.TIMEOUT) else "failure"
            errors += kind == "error"
            failures += kind == "failure"
            el = ET.SubElement(case, kind, message=message[:1000], type=str(worst.verdict))
            el.text = "\n".join(f"{r.verdict} {r.name} step {r.step}: observed {r.observed}, allowed {r.allowed}, "
                                f"ratio {r.ratio}; {r.detail}" for r in rows if r.verdict in BAD)
        elif all(r.verdict == Verdict.SKIP for r in rows):
            skipped += 1
            ET.SubElement(case, "skipped", message=worst.detail[:1000])
    ts.set("failures", str(failures))
    ts.set("errors", str(errors))
    ts.set("skipped", str(skipped))
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
