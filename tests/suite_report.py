"""What `make test` says after its two parts (tests/suite.sh): the tests it skipped, counted
by why, and, past its budget, which tests took longer than the durations on record.

    python tests/suite_report.py skips REPORT.xml...
    python tests/suite_report.py growth REPORT.xml...   (past the budget)
    python tests/suite_report.py record REPORT.xml...   (writes tests/durations.json)

REPORT.xml are the parts' JUnit reports (`pytest --junitxml`). The record is the durations
of a run within budget, kept in the repository so that a later run can say what grew.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from collections import Counter
from pathlib import Path

RECORD = Path(__file__).with_name("durations.json")
GREW_BY_S = 10.0  # less is the noise of two shared cores
SHOWN = 10


def cases(reports: list[str]) -> list[ElementTree.Element]:
    found = []
    for report in reports:
        if Path(report).is_file():
            found += ElementTree.parse(report).getroot().iter("testcase")
    return found


def test_id(case: ElementTree.Element) -> str:
    path = case.get("classname", "").replace(".", "/")
    return f"{path}.py::{case.get('name')}"


def durations(reports: list[str]) -> dict[str, float]:
    return {test_id(case): float(case.get("time", 0)) for case in cases(reports)}


def skips(reports: list[str]) -> str:
    """One line: how many tests were skipped, and why (`skipped` elements' messages)."""
    reasons = Counter()
    for case in cases(reports):
        skipped = case.find("skipped")
        if skipped is not None:
            reasons[skipped.get("message", "no reason given").removeprefix("Skipped: ")] += 1
    if not reasons:
        return "make test: no test skipped"
    said = "; ".join(f"{reason} ({count})" for reason, count in reasons.most_common())
    return f"make test: {sum(reasons.values())} skipped: {said}"


def growth(reports: list[str]) -> str:
    """The tests that took `GREW_BY_S` longer than on record, and the new ones, longest first."""
    if not RECORD.is_file():
        return "no tests/durations.json to compare with: `python tests/suite_report.py record` writes it"
    recorded = json.loads(RECORD.read_text())
    grown = []
    for name, seconds in durations(reports).items():
        before = recorded.get(name)
        if before is None and seconds >= GREW_BY_S:
            grown.append((seconds, f"{name}: {seconds:.0f}s, new"))
        elif before is not None and seconds - before >= GREW_BY_S:
            grown.append((seconds - before, f"{name}: {seconds:.0f}s, {before:.0f}s on record"))
    if not grown:
        return "no test grew by 10 s or more against tests/durations.json: the whole suite is slower"
    lines = [text for _, text in sorted(grown, reverse=True)[:SHOWN]]
    return "grew against tests/durations.json:\n  " + "\n  ".join(lines)


def main(argv: list[str]) -> int:
    command, reports = argv[0], argv[1:]
    if command == "skips":
        print(skips(reports))
    elif command == "growth":
        print(growth(reports))
    elif command == "record":
        recorded = {name: round(seconds, 1) for name, seconds in sorted(durations(reports).items())}
        RECORD.write_text(json.dumps(recorded, indent=0) + "\n")
        print(f"wrote {RECORD}")
    else:
        print(f"suite_report: unknown command {command!r}: skips, growth or record", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
