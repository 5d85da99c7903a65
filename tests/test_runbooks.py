"""Runbooks: every id the product names exists, every file is reachable, every file is complete."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from trainwatch.diagnostics.catalog import PATTERNS
from trainwatch.diagnostics.runbooks import (
    PRODUCT_RUNBOOKS,
    SECTIONS,
    get_runbook,
    list_runbooks,
    runbook_path,
    runbook_title,
)

SHIPPED = sorted(p.name[:-3] for p in resources.files("trainwatch").joinpath("runbooks").iterdir()
                 if p.name.endswith(".md"))
REFERENCED = {p.runbook for p in PATTERNS} | set(PRODUCT_RUNBOOKS)


def test_every_referenced_runbook_exists():
    assert REFERENCED - set(SHIPPED) == set()


def test_every_runbook_file_is_reachable():
    assert set(SHIPPED) - REFERENCED == set()


@pytest.mark.parametrize("runbook_id", SHIPPED)
def test_runbook_structure(runbook_id):
    text = get_runbook(runbook_id)
    assert re.match(r"^# \S", text), "first line must be '# Title'"
    assert not text.startswith("---"), "no front matter"
    headings = re.findall(r"^## (.+?)\s*$", text, flags=re.MULTILINE)
    positions = [headings.index(s) for s in SECTIONS]  # ValueError names a missing section
    assert positions == sorted(positions), f"sections out of order: {headings}"
    for section in SECTIONS:
        body = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
        assert body.strip(), f"empty section {section}"


def test_list_runbooks_sorted_with_titles():
    listed = list_runbooks()
    assert [rid for rid, _ in listed] == SHIPPED
    assert all(title for _, title in listed)
    assert dict(listed)["collective-wait"] == runbook_title(get_runbook("collective-wait"))


def test_runbook_path_points_at_the_file():
    path = runbook_path("hang")
    assert path.is_file() and path.name == "hang.md"
    assert path.read_text(encoding="utf-8") == get_runbook("hang")


@pytest.mark.parametrize("bad", ["nope", "", "../pyproject", "HANG", "hang.md", "a/b"])
def test_unknown_runbook_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=r"known runbooks: .*collective-wait"):
        get_runbook(bad)
