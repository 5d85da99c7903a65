"""Runbooks: every id the product names exists, every file is reachable, every file is complete."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import pytest
import yaml

from trainwatch import kinds
from trainwatch.diagnostics import stack_groups, utilisation, verdict, xid
from trainwatch.diagnostics.catalog import PATTERNS
from trainwatch.diagnostics.findings import ERROR_CATEGORIES
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
REPO = Path(__file__).resolve().parents[1]

# A detector's own runbook for one incident (`runbook="stopped"`); the rest come from kinds.KINDS.
_RUNBOOK_ARG = re.compile(r'\brunbook="([^"]+)"(?:\s+if\s+[^\n]*?\s+else\s+"([^"]+)")?')
# The alert template that turns an incident kind into its runbook id (loss_spike -> loss-spike).
_KIND_TEMPLATE = '{{ reReplaceAll "_" "-" $labels.kind }}'


def _alert_rule_runbooks() -> list[tuple[str, str]]:
    """(runbook id, alert) for every `runbook` an alert rule names, templates expanded."""
    doc = yaml.safe_load((REPO / "dashboards" / "alert-rules.yml").read_text())
    named = []
    for group in doc["groups"]:
        for rule in group["rules"]:
            where = f"alert-rules.yml {rule['alert']}"
            for section in ("labels", "annotations"):
                value = (rule.get(section) or {}).get("runbook")
                if value is None:
                    continue
                if "{{" not in value:
                    named.append((value, where))
                    continue
                assert value == _KIND_TEMPLATE, f"{where}: teach this test the runbook template {value!r}"
                kinds = re.findall(r'kind=~"([^"]+)"', rule["expr"])
                assert kinds, f"{where}: a kind template needs a kind=~\"...\" matcher in its expr"
                named += [(kind.replace("_", "-"), where) for alts in kinds for kind in alts.split("|")]
    return named


def _runbook_ids_named_anywhere() -> list[tuple[str, str]]:
    """(runbook id, where it is named) for every runbook id the product can hand an operator."""
    named = [(p.runbook, f"catalog pattern {p.id}") for p in PATTERNS]
    named += [(rid, f"verdict.CATEGORY_RUNBOOK[{cat!r}]") for cat, rid in verdict.CATEGORY_RUNBOOK.items()]
    named += [(verdict.FALLBACK_RUNBOOK, "verdict.FALLBACK_RUNBOOK")]
    named += [(rid, f"findings.ERROR_CATEGORIES[{cat!r}]") for cat, (_, rid) in ERROR_CATEGORIES.items()]
    named += [(xid.ECC_RUNBOOK, "xid.ECC_RUNBOOK"), (xid.XID_RUNBOOK, "xid.XID_RUNBOOK")]
    named += [(stack_groups.FALLBACK_RUNBOOK, "stack_groups.FALLBACK_RUNBOOK"),
              (stack_groups.CRASH_RUNBOOK, "stack_groups.CRASH_RUNBOOK")]
    named += [(utilisation.RUNBOOK, "utilisation.RUNBOOK")]
    named += [(rid, "runbooks.PRODUCT_RUNBOOKS") for rid in PRODUCT_RUNBOOKS]
    named += [(k.runbook, f"kinds.KINDS[{k.name!r}]") for k in kinds.KINDS.values()]
    sources = [*sorted((REPO / "trainwatch" / "watchdog" / "detectors").glob("*.py")),
               REPO / "trainwatch" / "watchdog" / "hardware.py"]
    for source in sources:
        for m in _RUNBOOK_ARG.finditer(source.read_text()):
            named += [(rid, source.relative_to(REPO).as_posix()) for rid in m.groups() if rid]
    return named + _alert_rule_runbooks()


def test_every_runbook_id_named_anywhere_resolves():
    named = _runbook_ids_named_anywhere()
    assert len({rid for rid, _ in named}) >= 30  # the collection itself works
    dead = []
    for runbook_id, where in named:
        try:
            get_runbook(runbook_id)
        except ValueError:
            dead.append(f"{runbook_id!r} ({where})")
    assert not dead, "runbook ids with no runbook: " + ", ".join(dead)


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
