"""The house rules that keep docs and code apart (shared/STYLE.md 17-18), checked on the tree:
a comment's pointer into docs/performance-log.md names a row that exists, benchmarks.md stays a
reference page, tried patches do not live in the tree, and no developer tool sets an attribute
of a lorad module from outside it."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOG = REPO / "docs" / "performance-log.md"
# A pointer may wrap over comment or docstring lines: "(docs/performance-log.md: NAME)".
POINTER = re.compile(r"performance-log\.md:\s+((?:[^()]|\([^()]*\))+?)\)")
CODE_DIRS = ("lorad", "benchmarks", "scripts", "tests")


def log_rows(text: str) -> set[str]:
    """The idea names of the log's decisions table (its first column)."""
    rows = set()
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] not in ("idea", "") and not cells[0].startswith("-"):
            rows.add(cells[0])
    return rows


def pointers(text: str) -> list[str]:
    """Every row name a source file points to, its line wraps (and comment marks) joined."""
    joined = re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)
    return [" ".join(name.split()) for name in POINTER.findall(joined)]


def test_the_checks_find_what_they_look_for():
    assert log_rows("| idea | n |\n|---|---|\n| host tiles | 1 vs 2 |\n") == {"host tiles"}
    source = "x = 1  # faster (docs/performance-log.md: attention: 16 programs\n    # per (seq, head)).\n"
    assert pointers(source) == ["attention: 16 programs per (seq, head)"]


def test_every_pointer_names_a_row_of_the_log():
    rows = log_rows(LOG.read_text(encoding="utf-8"))
    assert len(rows) > 50
    found, missing = 0, []
    for folder in CODE_DIRS:
        for path in sorted((REPO / folder).rglob("*.py")):
            if path == Path(__file__).resolve():
                continue
            for name in pointers(path.read_text(encoding="utf-8")):
                found += 1
                if name not in rows:
                    missing.append(f"{path.relative_to(REPO)}: {name!r}")
    assert not missing, "pointers to no row of docs/performance-log.md:\n" + "\n".join(missing)
    assert found >= 10  # the kernels' settings point to the rows that chose them


def test_benchmarks_md_is_a_reference_page_and_tried_patches_are_gone():
    lines = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"docs/benchmarks.md has {len(lines)} lines; history goes to the log"
    assert not (REPO / "docs" / "tried").exists()
    assert not list(REPO.rglob("*.patch"))


def test_no_tool_sets_an_attribute_of_a_lorad_module():
    assignment = re.compile(r"^\s*(\w+)\.[A-Z_]+\s*=(?!=)", re.M)
    offenders = []
    for folder in ("benchmarks", "scripts"):
        for path in sorted((REPO / folder).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            modules = set(re.findall(r"from lorad\S* import (\w+)", text))
            modules |= set(re.findall(r"import lorad\S* as (\w+)", text))
            if "setattr(" in text:
                offenders.append(f"{path.relative_to(REPO)}: setattr")
            offenders += [f"{path.relative_to(REPO)}: {name}.X = ..."
                          for name in assignment.findall(text) if name in modules]
    assert not offenders, offenders
