"""Every figure the docs state has a row in docs/development.md's table of claims, naming what
holds it: a test that measures it from outside, a command that measures it (with the date
and the value it last gave), a fact it comes from, or the file that sets it. A figure is a
number in prose (not in code) with a unit (s, ms, %, x, GiB, ...), in bold, or with
decimals; a version, a date or a bare count is not. docs/performance.md is a record of
measurements: its rows are per section, each held by the section's commands.
docs/facts.md is a record of facts read in other projects' source: each of its facts that
states a figure names where it was read (or says it was measured here)."""

from __future__ import annotations

import functools
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO

CLAIMS = REPO / "docs" / "development.md"
TABLE = "Claims and what holds them"
DOCS = [REPO / "README.md", REPO / "helm" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BY_SECTION = "docs/performance.md"  # one row per section, held by the section's commands
FACTS = "docs/facts.md"  # each fact names its source: test_every_fact_with_a_figure_names_its_source
UNIT = r"(?:ms|us|s|%|x|×|minutes?|min|hours?|GiB|MiB|GB|MB|KiB|kB|times)"
NUMBER = re.compile(r"(?<![\w.\-/:=+])\d[\d,]*(?:\.\d+)?(?![\d.]?\d|-\d|/\d)")
UNIT_AFTER = re.compile(r"\s?" + UNIT + r"(?![\w/])")
VERSIONED = re.compile(
    r"(?:torch(?:run)?|CUDA|cuDNN|NCCL|Grafana|numpy|python3?|Kubernetes|Kueue >=|v|tag|helm|kubectl)\s?$",
    re.I,
)
# a file (path.ext, or path.ext:line), an issue or pull request (#123), a URL, or "measured"
SOURCE = re.compile(r"\w\.(?:go|py|c|cpp|h|yaml|json)\b|:\d+|#\d+|https?://|measured", re.I)
QUOTED = re.compile(r"`([^`]+)`")
COMMAND = re.compile(r"(?:python -m (?P<module>[\w.]+)|make (?P<target>[\w-]+))(?: .*)?$")


@dataclass(frozen=True)
class Row:
    doc: str
    figures: tuple[str, ...]  # as the doc writes them; "§ Section" for a section of a record
    held_by: str
    date: str
    value: str


def prose(text: str) -> list[tuple[str, str]]:
    """(section heading, line) for every line outside fenced code, inline code blanked."""
    lines, fenced, section = [], False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            if line.startswith("#"):
                section = line.lstrip("#").strip()
            lines.append((section, re.sub(r"`[^`]*`", "``", line)))
    return lines


def figures(line: str) -> list[str]:
    """The quantities in `line`: a number with a unit after it, in bold, or with decimals;
    not a version (after a product's name), a date, a count or a name's digits."""
    found = []
    for match in NUMBER.finditer(line):
        unit = UNIT_AFTER.match(line, match.end())
        bold = line.startswith("**", match.end())
        if (unit or bold or "." in match.group(0)) and not VERSIONED.search(line[: match.start()]):
            found.append(match.group(0) + (unit.group(0) if unit else ""))
    return found


@functools.cache
def stated(doc: Path) -> list[tuple[str, str]]:
    """(section, figure) for every figure the doc states (the table of claims restates them);
    read once per doc, however many rows name it."""
    lines = prose(doc.read_text())
    return [(section, figure) for section, line in lines if section != TABLE for figure in figures(line)]


def claims_table() -> list[Row]:
    text = CLAIMS.read_text().split(f"## {TABLE}", 1)[1]
    rows = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 5 or cells[0] in ("doc", "---"):
            continue
        doc, figure_cell, held_by, date, value = cells
        rows.append(Row(doc, tuple(f.strip() for f in figure_cell.split(";")), held_by, date, value))
    assert rows, "docs/development.md has no table of claims"
    return rows


def section_of(figure: str, sections: set[str]) -> str | None:
    """The section a row's "§ Name" names: the one whose heading starts with Name."""
    name = figure.removeprefix("§ ")
    return next((s for s in sections if s.startswith(name)), None) if figure.startswith("§ ") else None


def test_every_figure_in_the_docs_has_a_row_in_the_table_of_claims():
    rows = claims_table()
    missing = []
    for doc in DOCS:
        name = str(doc.relative_to(REPO))
        if name == FACTS:
            continue
        mine = [row for row in rows if row.doc == name]
        listed = {figure for row in mine for figure in row.figures}
        sections = {section for section, _ in prose(doc.read_text())}
        covered = {section_of(figure, sections) for figure in listed}
        for section, figure in stated(doc):
            held = section in covered if name == BY_SECTION else figure in listed
            if not held:
                missing.append(f"{name}: {figure}" + (f" (§ {section})" if name == BY_SECTION else ""))
    assert not missing, "figures with no row in docs/development.md's claims:\n" + "\n".join(
        sorted(set(missing))
    )


def test_every_fact_with_a_figure_names_its_source():
    """A fact in docs/facts.md (a bullet, or a paragraph) that states a figure names the file,
    line, issue or URL it was read in, or says it was measured (the fact or its section)."""
    facts: list[tuple[str, str]] = []
    for section, line in prose((REPO / FACTS).read_text()):
        starts = line.startswith(("- ", "#")) or not line.strip() or not facts or facts[-1][0] != section
        if starts:
            facts.append((section, line))
        else:
            facts[-1] = (section, facts[-1][1] + " " + line.strip())
    unsourced = [
        f"§ {section[:40]}: {fact[:120]}"
        for section, fact in facts
        if figures(fact) and not SOURCE.search(fact) and "measured" not in section
    ]
    assert not unsourced, "facts with a figure and no source:\n" + "\n".join(unsourced)


def test_every_row_names_a_figure_the_doc_states_and_something_that_exists():
    """A row outlives neither its figure nor what holds it: a figure edited away, a test
    renamed, a command or a section removed fails here."""
    problems = []
    for row in claims_table():
        doc = REPO / row.doc
        if not doc.exists():
            problems.append(f"{row.doc}: no such doc")
            continue
        here = stated(doc)
        sections = {section for section, _ in here}
        for figure in row.figures:
            if not (section_of(figure, sections) or figure in {f for _, f in here} or row.doc == FACTS):
                problems.append(f"{row.doc}: {figure!r} is not stated there")
        named = QUOTED.findall(row.held_by)
        if not named:
            problems.append(f"{row.doc} {row.figures}: held by nothing named in backticks")
        for held in named:
            problems += [f"{row.doc} {row.figures}: {p}" for p in missing_holder(held, row)]
        if not row.date or not row.value:
            problems.append(f"{row.doc} {row.figures}: no date or last value")
    assert not problems, "\n".join(problems)


def missing_holder(held: str, row: Row) -> list[str]:
    """What `held` names that does not exist: a test, a command (a module or a make target),
    a doc's section, a commit that recorded a figure measured by hand, or a file that must
    hold the row's figures (a default it sets)."""
    if "::" in held:
        path, test = held.split("::", 1)
        source = REPO / path
        return [] if source.is_file() and f"def {test}(" in source.read_text() else [f"no test {held}"]
    command = COMMAND.match(held)
    if command and command["module"]:
        module = REPO / (command["module"].replace(".", "/") + ".py")
        return [] if module.is_file() else [f"no module for {held}"]
    if command:
        return (
            []
            if re.search(rf"^{command['target']}:", (REPO / "Makefile").read_text(), re.M)
            else [f"no {held}"]
        )
    if " § " in held:
        path, section = held.split(" § ", 1)
        sections = {s for s, _ in prose((REPO / path).read_text())} if (REPO / path).is_file() else set()
        return [] if section_of(f"§ {section}", sections) else [f"no section {held}"]
    if held.startswith("git show "):
        shown = subprocess.run(
            ["git", "show", "--format=%B", held.split()[2]], cwd=REPO, capture_output=True, text=True
        )
        numbers = [figure.split()[0].rstrip("x%") for figure in row.figures]
        absent = [n for n in numbers if n not in shown.stdout]
        return [f"{held} records none of {', '.join(absent)}"] if shown.returncode or absent else []
    source = REPO / held
    if not source.is_file():
        return [f"{held!r} is neither a test, a command, a doc's section, a commit nor a file"]
    text = source.read_text()
    numbers = {re.match(r"[\d.,]+", figure).group(0).replace(",", "") for figure in row.figures}
    absent = [n for n in numbers if not re.search(rf"(?<![\d.]){re.escape(n)}(?!\d)", text)]
    return [f"{held} does not set {', '.join(absent)}"] if absent else []


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("found in a median 5.7 s, and 0.5 % of bytes", ["5.7 s", "0.5 %"]),
        ("samples/s on/off **1.015** (target >= 0.99)", ["1.015", "0.99"]),
        ("torch 2.13.0's CUDA 13.0 build, on 2026-12-01, 8 GPUs, step-190, 10.0.0.0/8", []),
        ("2 x 8 GPUs, 1,200 s, 5x its time, 8x8 pixels, 1.63 times", ["2 x", "1,200 s", "5x", "1.63 times"]),
    ],
)
def test_a_figure_is_a_quantity_not_a_version_a_date_or_a_count(line, expected):
    assert figures(line) == expected
